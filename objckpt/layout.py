"""Where objckpt puts things under a run root (pure: no I/O).

    <root>/LATEST                                         pointer, compare-and-swap updated
    <root>/timelines/<timeline:010d>.json                 claim of a timeline (its base), create-if-absent
    <root>/manifests/<step:020d>.json                     a committed step of timeline 0
    <root>/manifests/t<timeline:010d>-<step:020d>.json    a committed step of timeline >= 1
    <root>/quarantine/<timeline:010d>-<step:020d>.json    a checkpoint set aside (restore skips it)
    <root>/data/<spread>/<step:020d>-<attempt>/<rank:05d>/NAME   shards, create-if-absent
    <root>/data/<step:020d>-<attempt>/<rank:05d>/NAME     shards of older saves (no spreading)

Manifest keys sort exactly as ``(timeline, step)``: timeline 0 keeps the revision-1 key (so a
revision-1 run root *is* timeline 0, and stays readable and writable), and every later timeline's
keys start with ``t``, which sorts after every digit. "Manifests newer than the pointer's" is
therefore one ``start_after`` LIST, never a scan of shard prefixes.

``<spread>`` (invariant 16) is two hex digits derived from the rank (:func:`spread_of`): one
save's shards, and one restore's reads, fall on up to 256 key prefixes, evenly, and they are the
same prefixes for every save (S3 partitions them once, not per save), while one rank's shards
stay under one prefix. Keys without it (revision-1/2 run roots, or
``key_spreading=False``) stay valid: every parser here accepts both forms, a spread key only
with the digits :func:`spread_of` gives.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from .errors import ManifestError

POINTER_KEY = "LATEST"
MANIFEST_PREFIX = "manifests/"
TIMELINE_PREFIX = "timelines/"
QUARANTINE_PREFIX = "quarantine/"
DATA_PREFIX = "data/"

_MANIFEST_RE = re.compile(r"^manifests/(?:t(\d{10})-)?(\d{20})\.json\Z", re.ASCII)
_TIMELINE_RE = re.compile(r"^timelines/(\d{10})\.json\Z", re.ASCII)
_QUARANTINE_RE = re.compile(r"^quarantine/(\d{10})-(\d{20})\.json\Z", re.ASCII)
MAX_TIMELINE = 10**10 - 1
_ATTEMPT_RE = re.compile(r"^data/(\d{20})-([0-9a-f]{16})/\Z", re.ASCII)
_ATTEMPT_ID_RE = re.compile(r"^[0-9a-f]{16}\Z", re.ASCII)
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


def check_timeline(timeline: int) -> int:
    if not isinstance(timeline, int) or isinstance(timeline, bool) or not 0 <= timeline <= MAX_TIMELINE:
        raise ValueError(f"timeline must be an int in [0, {MAX_TIMELINE}], got {timeline!r}")
    return timeline


def manifest_key(step: int, timeline: int = 0) -> str:
    """Key of the manifest of ``step`` on ``timeline`` (timeline 0: the revision-1 key)."""
    if check_timeline(timeline) == 0:
        return f"{MANIFEST_PREFIX}{check_step(step):020d}.json"
    return f"{MANIFEST_PREFIX}t{timeline:010d}-{check_step(step):020d}.json"


def timeline_manifest_prefix(timeline: int) -> str:
    """The key prefix every manifest of ``timeline`` (>= 1) starts with."""
    if check_timeline(timeline) == 0:
        raise ValueError("timeline 0's manifests have no prefix of their own (they are manifests/<step>)")
    return f"{MANIFEST_PREFIX}t{timeline:010d}-"


def parse_manifest_key(key: str) -> tuple[int, int] | None:
    """``(timeline, step)`` a manifest key names, or None if ``key`` is not a manifest key."""
    m = _MANIFEST_RE.match(key)
    if not m:
        return None
    if m.group(1) is not None and int(m.group(1)) == 0:
        # timeline 0's key has no 't' part: 'manifests/t0000000000-<step>.json' is not a
        # manifest key (it would name the same checkpoint as 'manifests/<step>.json' and, sorting
        # after it, replace it in a listing)
        return None
    return (int(m.group(1)) if m.group(1) is not None else 0, int(m.group(2)))


def step_of_manifest_key(key: str) -> int | None:
    """The step a manifest key names (on whatever timeline), or None."""
    parsed = parse_manifest_key(key)
    return parsed[1] if parsed else None


def timeline_key(timeline: int) -> str:
    """Key of the claim of ``timeline`` (>= 1; timeline 0 is implicit and has none)."""
    if check_timeline(timeline) == 0:
        raise ValueError("timeline 0 is implicit: it has no claim object")
    return f"{TIMELINE_PREFIX}{timeline:010d}.json"


def parse_timeline_key(key: str) -> int | None:
    m = _TIMELINE_RE.match(key)
    return int(m.group(1)) if m else None


def quarantine_key(timeline: int, step: int) -> str:
    """Key of the marker that sets checkpoint ``(timeline, step)`` aside."""
    return f"{QUARANTINE_PREFIX}{check_timeline(timeline):010d}-{check_step(step):020d}.json"


def parse_quarantine_key(key: str) -> tuple[int, int] | None:
    m = _QUARANTINE_RE.match(key)
    return (int(m.group(1)), int(m.group(2))) if m else None


#: the spreading component of a shard key: this many hex digits (16 ** 2 = 256 prefixes)
SPREAD_DIGITS = 2  # the regular expressions below spell it out: {2}
_SPREAD_RE = re.compile(r"^[0-9a-f]{2}\Z", re.ASCII)


#: odd, so ``rank * _SPREAD_STRIDE mod 256`` is a permutation of the 256 residues
_SPREAD_STRIDE = 167


def spread_of(rank: int) -> str:
    """The spreading component of ``rank``'s shard keys: ``rank * 167 mod 256`` in two hex
    digits. A permutation of the residues: ``W`` ranks take ``min(W, 256)`` distinct prefixes,
    as evenly as they can (``ceil(W / 256)`` ranks at most on one), consecutive ranks far apart
    in key order (no hot key range), and every save uses the same prefixes -- their partitions
    stay split between saves, and GC, verification and every other count is the same for every
    save, whatever the history (flat, deterministic)."""
    return _spread_digits(_check_rank(rank))


def _spread_digits(rank: int) -> str:
    # unchecked: callers have validated ``rank``
    return f"{rank * _SPREAD_STRIDE % 16**SPREAD_DIGITS:0{SPREAD_DIGITS}x}"


def spread_prefix(spread: str) -> str:
    """``data/<spread>/``: one of the 256 prefixes spread shard keys lie under."""
    if not isinstance(spread, str) or not _SPREAD_RE.match(spread):
        raise ValueError(f"spread must be {SPREAD_DIGITS} lowercase hex digits, got {spread!r}")
    return f"{DATA_PREFIX}{spread}/"


def attempt_prefix(step: int, attempt: str, spread: str | None = None) -> str:
    """``data/<step>-<attempt>/``, or with ``spread`` ``data/<spread>/<step>-<attempt>/`` (one of
    the prefixes a spread attempt's shards lie under)."""
    base = DATA_PREFIX if spread is None else spread_prefix(spread)
    return f"{base}{check_step(step):020d}-{check_attempt_id(attempt)}/"


_SPREAD_ATTEMPT_RE = re.compile(r"^data/([0-9a-f]{2})/(\d{20})-([0-9a-f]{16})/\Z", re.ASCII)


def parse_attempt_prefix(prefix: str) -> tuple[int, str] | None:
    """``(step, attempt)`` for a ``data/<step>-<attempt>/`` or ``data/<spread>/<step>-<attempt>/``
    prefix, else None."""
    m = _ATTEMPT_RE.match(prefix)
    if m:
        return (int(m.group(1)), m.group(2))
    m = _SPREAD_ATTEMPT_RE.match(prefix)
    return (int(m.group(2)), m.group(3)) if m else None


def is_spread_prefix(prefix: str) -> bool:
    """Is ``prefix`` one of the ``data/<spread>/`` prefixes (GC walks one level below them)?"""
    return len(prefix) == len(DATA_PREFIX) + SPREAD_DIGITS + 1 and bool(
        prefix.startswith(DATA_PREFIX) and prefix.endswith("/") and _SPREAD_RE.match(prefix[5:-1])
    )


def _check_rank(rank: int) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= 99999:
        raise ValueError(f"rank must be an int in [0, 99999], got {rank!r}")
    return rank


def rank_prefix(step: int, attempt: str, rank: int, *, spread: bool = False) -> str:
    """The prefix of ``rank``'s shards in this attempt; ``spread``: under its spreading prefix."""
    _check_rank(rank)
    where = spread_of(rank) if spread else None
    return f"{attempt_prefix(step, attempt, where)}{rank:05d}/"


_NAME_RE = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*\Z", re.ASCII)


def shard_key(step: int, attempt: str, rank: int, name: str, *, spread: bool = False) -> str:
    """Key of shard ``name`` written by ``rank`` in this attempt (``spread``: under its
    spreading prefix, :func:`spread_of`).

    ``name`` may contain ``/`` but no empty, ``.`` or ``..`` segments and only
    ``[A-Za-z0-9._-]`` characters, so keys are portable across S3, GCS and file systems.
    """
    return rank_prefix(step, attempt, rank, spread=spread) + _check_name(name)


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or _has_dot_segment(f"/{name}/"):
        raise ValueError(f"invalid shard name {name!r}: use [A-Za-z0-9._-] segments joined by '/'")
    return name


_SHARD_RE = re.compile(r"^data/(?:([0-9a-f]{2})/)?(\d{20})-([0-9a-f]{16})/(\d{5})/(.+)\Z", re.ASCII)


def parse_shard_key(key: str) -> tuple[int, str, int, str] | None:
    """``(step, attempt, rank, name)`` of a shard key, spread or not, or None if ``key`` is not
    one (a spread key whose digits are not :func:`spread_of` its step, attempt and rank is not)."""
    m = _SHARD_RE.match(key)
    if not m:
        return None
    step, attempt, rank, name = int(m.group(2)), m.group(3), int(m.group(4)), m.group(5)
    if m.group(1) is not None and m.group(1) != spread_of(rank):
        return None
    return (step, attempt, rank, name)


def is_shard_key_of(key: str, step: int, attempt: str, rank: int, name: str) -> bool:
    """Is ``key`` the key of shard ``name`` of ``rank`` in this attempt, in either layout?

    Raises:
        ValueError: an invalid step, attempt id, rank or name.
    """
    # the keys shard_key() makes, built here without its per-part calls: a manifest decode
    # asks this once per shard (tens of thousands of times at scale)
    tail = f"{check_step(step):020d}-{check_attempt_id(attempt)}/{_check_rank(rank):05d}/{_check_name(name)}"
    return key == DATA_PREFIX + tail or key == f"{DATA_PREFIX}{_spread_digits(rank)}/{tail}"


def attempt_prefix_of(key: str) -> str | None:
    """The attempt prefix a shard key lies under (``data/[<spread>/]<step>-<attempt>/``): what
    one LIST covers when checking it. None if ``key`` is not a shard key."""
    parsed = parse_shard_key(key)
    if parsed is None:
        return None
    spread = (
        key[len(DATA_PREFIX) : len(DATA_PREFIX) + SPREAD_DIGITS]
        if key[len(DATA_PREFIX) + SPREAD_DIGITS] == "/"
        else None
    )
    return attempt_prefix(parsed[0], parsed[1], spread)


#: ``verification_slices`` without spreading: this many consecutive ranks' keys per LIST slice
#: (8 shards a rank: ~500 keys, one LIST page)
RANKS_PER_SLICE = 64


@dataclass(frozen=True)
class ListingSlice:
    """One part of an attempt's keys that one rank LISTs to verify a commit (``verify="ranks"``):
    the keys under ``prefix`` greater than ``after`` and at most ``upto`` (``None``: unbounded).

    The slices of :func:`verification_slices` are disjoint and together cover every key under
    the attempt's prefixes, including keys under no rank's own prefix (a stray)."""

    lister: int
    prefix: str
    after: str | None = None
    upto: str | None = None

    def holds(self, key: str) -> bool:
        """Is ``key`` one of this slice's keys?"""
        return (
            key.startswith(self.prefix)
            and (self.after is None or key > self.after)
            and (self.upto is None or key <= self.upto)
        )


def verification_slices(step: int, attempt: str, world_size: int, *, spread: bool) -> list[ListingSlice]:
    """Who LISTs what to verify a commit of ``attempt`` (``verify="ranks"``), the same on every rank.

    ``spread``: rank ``r < min(W, 256)`` LISTs the whole spread attempt prefix of
    :func:`spread_of` ``(r)``, which holds every rank sharing it (``r``, ``r + 256``, ...): the
    ``min(W, 256)`` prefixes the ranks write to, one LIST each (one page up to 1,000 keys), none
    on the coordinator. Without spreading, the one attempt prefix is cut into ranges of
    :data:`RANKS_PER_SLICE` ranks (``start_after`` a rank prefix, up to the next slice's), the first
    from the prefix's start and the last to its end. Every slice must be listed *after every
    rank's writes*: it holds other ranks' keys.

    Raises:
        ValueError: invalid step, attempt id or world size.
    """
    count = _slice_count(world_size, spread)
    return [_slice(step, attempt, world_size, spread, i) for i in range(count)]


def verification_slice(
    step: int, attempt: str, world_size: int, rank: int, *, spread: bool
) -> ListingSlice | None:
    """``rank``'s slice of :func:`verification_slices`, or None if it lists none (O(1))."""
    if not 0 <= _check_rank(rank) < _slice_count(world_size, spread):
        return None
    return _slice(step, attempt, world_size, spread, rank)


def _slice_count(world_size: int, spread: bool) -> int:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return min(world_size, 16**SPREAD_DIGITS) if spread else -(-world_size // RANKS_PER_SLICE)


def _slice(step: int, attempt: str, world_size: int, spread: bool, i: int) -> ListingSlice:
    if spread:
        return ListingSlice(i, attempt_prefix(step, attempt, spread_of(i)))
    prefix = attempt_prefix(step, attempt)
    after = f"{prefix}{i * RANKS_PER_SLICE:05d}/" if i > 0 else None
    last = (i + 1) * RANKS_PER_SLICE >= world_size
    upto = None if last else f"{prefix}{(i + 1) * RANKS_PER_SLICE:05d}/"
    return ListingSlice(i, prefix, after=after, upto=upto)


def _has_dot_segment(slashed: str) -> bool:
    """Does ``/<path>/`` have a ``.`` or ``..`` segment? (Substring tests: a manifest decode
    checks every shard's key and name, tens of thousands of times at scale.)"""
    return "/./" in slashed or "/../" in slashed


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
        or "//" in f"/{key}/"  # an empty segment (also a leading or trailing "/")
        or _has_dot_segment(f"/{key}/")
    ):
        raise ManifestError(f"key {key!r} is not a plain key inside the run root", key=str(key))
    return key
