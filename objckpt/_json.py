"""Canonical JSON and strict field checks for the protocol's metadata objects (pure: no I/O).

Everything objckpt stores as metadata travels as canonical JSON (sorted keys, no whitespace,
UTF-8, no NaN/Infinity), so the same content always has the same bytes and the same checksum.
Decoding never executes anything from the store: it is ``json.loads`` plus strict schema checks
(duplicate keys, non-finite numbers, unknown fields and unsupported versions are refused).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from .errors import ManifestError

#: metadata objects larger than this are refused before parsing (memory safety)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
CREATED_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z$")


class Invalid(ValueError):
    """A field fails validation; converted to ManifestError (decode) or ValueError (create)."""


def canonical_json(obj: Any) -> bytes:
    """The canonical encoding: sorted keys, no whitespace, UTF-8, NaN/Infinity refused.

    Raises:
        ValueError / TypeError: ``obj`` is not plain JSON data.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def sha256_of(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(body)).hexdigest()


def normalise(value: Any, what: str) -> dict[str, Any]:
    """A detached, JSON-clean copy of a caller's dict (what will be stored is what is kept)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Invalid(f"{what} must be a mapping, got {type(value).__name__}")
    try:
        copy: dict[str, Any] = json.loads(canonical_json(dict(value)))
        return copy
    except (TypeError, ValueError) as exc:
        raise Invalid(f"{what} is not plain JSON data: {exc}") from None


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Duplicate keys make a document mean different things to different parsers; refuse it.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise Invalid(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise Invalid(f"non-finite number {name} is not allowed")


def _finite_float(text: str) -> float:
    # "1e999" is valid JSON but parses to inf, which canonical JSON (the self-checksum) cannot
    # encode: refuse it here, as NaN/Infinity are, instead of failing later with a ValueError
    value = float(text)
    if not math.isfinite(value):
        raise Invalid(f"number {text[:40]} is out of range")
    return value


def load_json(data: bytes, key: str, what: str) -> dict[str, Any]:
    """Parse untrusted bytes as one JSON object (never anything that can run code)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"{what} {key!r}: expected bytes, got {type(data).__name__}", key=key)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what} {key!r}: {len(data)} bytes is too large", key=key)
    try:
        text = bytes(data).decode("utf-8")
        obj = json.loads(
            text,
            object_pairs_hook=_reject_duplicates,
            parse_constant=_reject_constant,
            parse_float=_finite_float,
        )
    except Invalid as exc:
        raise ManifestError(f"{what} {key!r} is not valid: {exc}", key=key) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{what} {key!r} is not JSON: {exc}", key=key) from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} {key!r}: top level must be a JSON object", key=key)
    return obj


# ---------------------------------------------------------------------------------- field checks


def int_field(value: Any, what: str, lo: int, hi: int) -> int:
    # bool is an int in Python but never a valid size/step/rank
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise Invalid(f"{what} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def str_field(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"{what} must be a non-empty string, got {value!r}")
    return value


def dict_field(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Invalid(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def check_fields(obj: Mapping[str, Any], required: Iterable[str], optional: Iterable[str], what: str) -> None:
    required = set(required)
    if obj.keys() == required:  # the common case, checked at once (per shard of a manifest)
        return
    allowed = required | set(optional)
    missing = sorted(required - set(obj))
    if missing:
        raise Invalid(f"{what} lacks field(s) {missing}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        # Strict: a field this version does not know may change the meaning; a newer format
        # bumps format_version instead.
        raise Invalid(f"{what} has unknown field(s) {unknown}")


def check_format(obj: Mapping[str, Any], fmt: str, versions: int | Iterable[int], what: str) -> int:
    if obj.get("format") != fmt:
        raise Invalid(f"unknown {what} format {obj.get('format')!r} (expected {fmt!r})")
    allowed = (versions,) if isinstance(versions, int) else tuple(versions)
    v = obj.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool) or v not in allowed:
        raise Invalid(f"unsupported {what} format_version {v!r} (this objckpt reads {list(allowed)})")
    return v


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def check_created_at(value: Any) -> str:
    created_at = str_field(value, "created_at")
    if not CREATED_RE.match(created_at):
        raise Invalid(f"created_at {created_at!r} is not an ISO-8601 UTC time")
    try:
        datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    except ValueError:
        raise Invalid(f"created_at {created_at!r} is not a valid time") from None
    return created_at


def check_self_checksum(obj: Mapping[str, Any]) -> str:
    """The object's ``checksum`` field, after checking it is the SHA-256 of everything else."""
    checksum = obj.get("checksum")
    if not isinstance(checksum, str) or not SHA256_RE.match(checksum):
        raise Invalid("checksum must be 64 lowercase hex digits")
    actual = sha256_of({k: v for k, v in obj.items() if k != "checksum"})
    if actual != checksum:
        raise Invalid(f"self-checksum mismatch: body hashes to {actual}, the object says {checksum}")
    return checksum
