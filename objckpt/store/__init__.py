"""Store backends, chosen by URI scheme.

``open_store("s3://bucket/run?endpoint_url=http://127.0.0.1:9000")`` parses the URI once,
imports the backend lazily (so ``pip install objckpt`` without extras still imports), and raises
a :class:`ConfigError` naming the extra to install when the SDK is missing. Options may come as
URI query parameters or keyword arguments (keywords win); unknown options are errors.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .._retry import RetryPolicy
from ..errors import ConfigError
from .base import (
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
    iter_parts,
)

# scheme -> (module, class, extra that provides its SDK)
_BACKENDS: dict[str, tuple[str, str, str | None]] = {
    "memory": ("objckpt.store.memory", "MemoryStore", None),
    "file": ("objckpt.store.local", "LocalStore", None),
    "s3": ("objckpt.store.s3", "S3Store", "s3"),
    "gs": ("objckpt.store.gcs", "GCSStore", "gcs"),
}

#: options every backend understands; backends declare their own in ``OPTIONS``
COMMON_OPTIONS = ("part_size", "max_in_flight", "retry", "deadline", "max_attempts")


@dataclass(frozen=True)
class ParsedURI:
    """``scheme://bucket/prefix?query``; for ``file://`` the bucket is empty and prefix is the
    absolute path."""

    scheme: str
    bucket: str
    prefix: str
    options: dict[str, str]
    uri: str


def parse_uri(uri: str) -> ParsedURI:
    """Split a run-root URI. Raises :class:`ConfigError` naming what is wrong."""
    if not isinstance(uri, str) or "://" not in uri:
        raise ConfigError(
            f"not a run-root URI: {uri!r} (expected s3://bucket/prefix, gs://bucket/prefix, "
            "file:///abs/path or memory://name)"
        )
    split = urlsplit(uri)
    scheme = split.scheme.lower()
    if scheme not in _BACKENDS:
        raise ConfigError(f"unsupported URI scheme {scheme!r} in {uri!r}; use one of {sorted(_BACKENDS)}")
    options = dict(parse_qsl(split.query, keep_blank_values=True))
    if scheme == "file":
        if split.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URIs take an absolute path (file:///path), got {uri!r}")
        path = unquote(split.path)
        if not path.startswith("/"):
            raise ConfigError(f"file:// URI needs an absolute path: {uri!r}")
        if any(seg in ("..", ".") for seg in path.split("/")):
            raise ConfigError(f"'.' and '..' are not allowed in a run root: {uri!r}")
        return ParsedURI(scheme, "", path.rstrip("/") or "/", options, uri)
    bucket = split.netloc
    if scheme in ("s3", "gs"):
        if not bucket:
            raise ConfigError(f"missing bucket name in {uri!r}")
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]", bucket):
            raise ConfigError(f"invalid bucket name {bucket!r} in {uri!r}")
    prefix = unquote(split.path).strip("/")
    if any(seg in ("..", ".") for seg in prefix.split("/")):
        raise ConfigError(f"'.' and '..' are not allowed in a run root: {uri!r}")
    return ParsedURI(scheme, bucket, prefix, options, uri)


_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1024**2,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1024**3,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1024**4,
}


def parse_size(value: str | int) -> int:
    """``"16MiB"`` -> 16777216; ints pass through."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (e.g. 16MiB, 8388608)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


def common_store_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the options every backend shares and turn them into ``Store.__init__`` kwargs.

    Raises:
        ConfigError: a value of the wrong type (``max_in_flight=many``).
    """
    kwargs: dict[str, Any] = {}

    def number(name: str, convert: Any) -> Any:
        raw = options.pop(name)
        try:
            return convert(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"option {name}={raw!r} is not a valid {convert.__name__}") from exc

    if "part_size" in options:
        kwargs["part_size"] = parse_size(options.pop("part_size"))
    if "max_in_flight" in options:
        kwargs["max_in_flight"] = number("max_in_flight", int)
    retry = options.pop("retry", None)
    deadline = number("deadline", float) if "deadline" in options else None
    attempts = number("max_attempts", int) if "max_attempts" in options else None
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigError(f"retry must be a RetryPolicy, got {type(retry).__name__}")
    if deadline is not None or attempts is not None:
        base = retry or RetryPolicy()
        retry = RetryPolicy(
            deadline=deadline if deadline is not None else base.deadline,
            max_attempts=attempts if attempts is not None else base.max_attempts,
            initial_backoff=base.initial_backoff,
            max_backoff=base.max_backoff,
        )
    if retry is not None:
        kwargs["retry"] = retry
    return kwargs


def open_store(uri: str, **options: Any) -> Store:
    """Open the store for a run root.

    Raises:
        ConfigError: malformed URI, unknown option, or the backend's extra is not installed.
    """
    parsed = parse_uri(uri)
    merged: dict[str, Any] = {**parsed.options, **options}
    module_name, class_name, extra = _BACKENDS[parsed.scheme]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install objckpt[{extra}] to use {parsed.scheme}:// URIs" if extra else ""
        raise ConfigError(f"cannot load the {parsed.scheme}:// backend: {exc}{hint}") from exc
    cls = getattr(module, class_name)
    known = set(COMMON_OPTIONS) | set(getattr(cls, "OPTIONS", ()))
    unknown = sorted(set(merged) - known)
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for {parsed.scheme}:// URIs; known: {sorted(known)}")
    return cls.from_uri(parsed, merged)


__all__ = [
    "Capabilities",
    "ObjectMeta",
    "ParsedURI",
    "PartResult",
    "PendingUpload",
    "PutMode",
    "Store",
    "UploadHandle",
    "iter_parts",
    "open_store",
    "parse_size",
    "parse_uri",
]
