"""Where objckpt puts things under a run root (pure: no I/O).

    <root>/LATEST                                      pointer, compare-and-swap updated
    <root>/manifests/<step:020d>.json                  one per committed step, create-if-absent
    <root>/data/<step:020d>-<attempt>/<rank:05d>/NAME  shards, create-if-absent

Zero-padded steps keep keys sortable by step, so "manifests after the pointer's" is one
``start_after`` LIST and never a scan of shard prefixes.
"""

from __future__ import annotations

import re
import secrets

from .errors import ManifestError

POINTER_KEY = "LATEST"
MANIFEST_PREFIX = "manifests/"
DATA_PREFIX = "data/"

_MANIFEST_RE = re.compile(r"^manifests/(\d{20})\.json$")
_ATTEMPT_RE = re.compile(r"^data/(\d{20})-([0-9a-f]{16})/$")
_ATTEMPT_ID_RE = re.compile(r"^[0-9a-f]{16}$")
MAX_STEP = 10**20 - 1


def new_attempt_id() -> str:
    """A fresh random attempt id (64 bits, hex). A retried save always gets a new one."""
    return secrets.token_hex(8)


def check_step(step: int) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return step


def check_attempt_id(attempt: str) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT_ID_RE.match(attempt):
        raise ValueError(f"attempt id must be 16 lowercase hex digits, got {attempt!r}")
    return attempt


def manifest_key(step: int) -> str:
    return f"{MANIFEST_PREFIX}{check_step(step):020d}.json"


def step_of_manifest_key(key: str) -> int | None:
    """The step a manifest key names, or None if ``key`` is not a manifest key."""
    m = _MANIFEST_RE.match(key)
    return int(m.group(1)) if m else None


def attempt_prefix(step: int, attempt: str) -> str:
    return f"{DATA_PREFIX}{check_step(step):020d}-{check_attempt_id(attempt)}/"


def parse_attempt_prefix(prefix: str) -> tuple[int, str] | None:
    """``(step, attempt)`` for a ``data/<step>-<attempt>/`` prefix, else None."""
    m = _ATTEMPT_RE.match(prefix)
    return (int(m.group(1)), m.group(2)) if m else None


def rank_prefix(step: int, attempt: str, rank: int) -> str:
    if not isinstance(rank, int) or not 0 <= rank <= 99999:
        raise ValueError(f"rank must be an int in [0, 99999], got {rank!r}")
    return f"{attempt_prefix(step, attempt)}{rank:05d}/"


_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")


def shard_key(step: int, attempt: str, rank: int, name: str) -> str:
    """Key of shard ``name`` written by ``rank`` in this attempt.

    ``name`` may contain ``/`` but no empty, ``.`` or ``..`` segments and only
    ``[A-Za-z0-9._-]`` characters, so keys are portable across S3, GCS and file systems.
    """
    if not _NAME_RE.match(name) or any(seg in (".", "..") for seg in name.split("/")):
        raise ValueError(f"invalid shard name {name!r}: use [A-Za-z0-9._-] segments joined by '/'")
    return rank_prefix(step, attempt, rank) + name


def validate_key_in_root(key: str) -> str:
    """Reject keys that could escape the run root: absolute, ``..``, schemes, backslashes.

    Raises:
        ManifestError: naming the bad key.
    """
    if (
        not isinstance(key, str)
        or not key
        or key.startswith("/")
        or "\\" in key
        or "://" in key
        or "\x00" in key
        or any(seg in ("", ".", "..") for seg in key.split("/"))
    ):
        raise ManifestError(f"key {key!r} is not a plain key inside the run root", key=str(key))
    return key
