"""Run-root URIs: ``scheme://bucket/prefix?option=value``, split once into a :class:`ParsedURI`.

Only the shape is checked here (scheme registered, bucket name, no ``.``/``..`` in the root);
options are checked by the backend's declared :class:`~objckpt.store._options.Option` specs in
``open_store``. Messages show a URI without its query string: options may hold credentials.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from ..errors import ConfigError
from ._registry import known_schemes

#: schemes whose netloc is a bucket that must follow the S3/GCS naming rules
_BUCKET_SCHEMES = ("s3", "gs")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")


@dataclass(frozen=True)
class ParsedURI:
    """``scheme://bucket/prefix?query``; for ``file://`` the bucket is empty and prefix is the
    absolute path.

    ``repr`` shows the option names only, never their values (they may be credentials).
    """

    scheme: str
    bucket: str
    prefix: str
    options: dict[str, str] = field(repr=False)
    uri: str = field(repr=False)

    def __repr__(self) -> str:
        return (
            f"ParsedURI(scheme={self.scheme!r}, bucket={self.bucket!r}, prefix={self.prefix!r}, "
            f"options={sorted(self.options)})"
        )


def shown(uri: object) -> str:
    """``uri`` fit for a message: without its query string (options may hold credentials)."""
    if not isinstance(uri, str):
        return repr(uri)
    try:
        split = urlsplit(uri)
    except ValueError:
        return repr(uri.split("?", 1)[0])
    return repr(urlunsplit((split.scheme, split.netloc, split.path, "", "")))


def parse_uri(uri: str) -> ParsedURI:
    """Split a run-root URI. Raises :class:`ConfigError` naming what is wrong."""
    if not isinstance(uri, str) or "://" not in uri:
        raise ConfigError(
            f"not a run-root URI: {shown(uri)} (expected s3://bucket/prefix, gs://bucket/prefix, "
            "file:///abs/path or memory://name)"
        )
    split = urlsplit(uri)
    scheme = split.scheme.lower()
    schemes = known_schemes()
    if scheme not in schemes:
        raise ConfigError(
            f"unsupported URI scheme {scheme!r} in {shown(uri)}; use one of {', '.join(schemes)} "
            "(or register a backend for it: objckpt.store.register_backend)"
        )
    options = dict(parse_qsl(split.query, keep_blank_values=True))
    if scheme == "file":
        if split.netloc not in ("", "localhost"):
            raise ConfigError(f"file:// URIs take an absolute path (file:///path), got {shown(uri)}")
        path = unquote(split.path)
        if not path.startswith("/"):
            raise ConfigError(f"file:// URI needs an absolute path: {shown(uri)}")
        if any(seg in ("..", ".") for seg in path.split("/")):
            raise ConfigError(f"'.' and '..' are not allowed in a run root: {shown(uri)}")
        return ParsedURI(scheme, "", path.rstrip("/") or "/", options, uri)
    bucket = split.netloc
    if scheme in _BUCKET_SCHEMES:
        if not bucket:
            raise ConfigError(f"missing bucket name in {shown(uri)}")
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(f"invalid bucket name {bucket!r} in {shown(uri)}")
    prefix = unquote(split.path).strip("/")
    if any(seg in ("..", ".") for seg in prefix.split("/")):
        raise ConfigError(f"'.' and '..' are not allowed in a run root: {shown(uri)}")
    return ParsedURI(scheme, bucket, prefix, options, uri)


__all__ = ["ParsedURI", "parse_uri", "shown"]
