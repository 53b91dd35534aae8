"""Manifest, shard receipt and pointer: the protocol's metadata objects (pure: no I/O).

A **manifest** is one small JSON object per committed step (``manifests/<step>.json``); writing
it (create-if-absent) is THE commit point. It records everything needed to restore the step and
to judge whether what is in the store is what was committed: every shard's receipt (key, size,
ETag/generation, full-object CRC32C), the world size and topology, the run identity, the
training progress, the parent step, and a SHA-256 of its own canonical body.

The **pointer** (``LATEST``) names the newest committed manifest. It is only a hint that makes
resolution O(1); readers roll forward past it, so a lost pointer update loses nothing.

Everything travels as canonical JSON (sorted keys, no whitespace, UTF-8, no NaN/Infinity), so the
same content always has the same bytes and the same checksum. Decoding never executes anything
from the store: it is ``json.loads`` plus strict schema checks, and every check failure is a
:class:`ManifestError` naming the object's key and the reason.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from . import layout
from ._crc import decode_crc32c
from .errors import ManifestError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_OBJECT_SIZE",
    "POINTER_FORMAT",
    "POINTER_FORMAT_VERSION",
    "Manifest",
    "Pointer",
    "ShardReceipt",
    "canonical_json",
    "run_identity",
]

FORMAT = "objckpt.manifest"
FORMAT_VERSION = 1
POINTER_FORMAT = "objckpt.pointer"
POINTER_FORMAT_VERSION = 1

#: no shard is larger than this (1 PiB); anything bigger is a corrupt or hostile manifest
MAX_OBJECT_SIZE = 2**50
#: manifests/pointers larger than this are refused before parsing (memory safety)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
MAX_PARTS = 1_000_000
MAX_WORLD_SIZE = 100_000  # ranks are 5 digits in the layout

_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CREATED_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,6})?Z$")


class _Invalid(ValueError):
    """A field fails validation; converted to ManifestError (decode) or ValueError (create)."""


# ---------------------------------------------------------------------------------- JSON


def canonical_json(obj: Any) -> bytes:
    """The canonical encoding: sorted keys, no whitespace, UTF-8, NaN/Infinity refused.

    Raises:
        ValueError / TypeError: ``obj`` is not plain JSON data.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8"
    )


def _sha256(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _normalise(value: Any, what: str) -> dict[str, Any]:
    """A detached, JSON-clean copy of a caller's dict (what will be stored is what is kept)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _Invalid(f"{what} must be a mapping, got {type(value).__name__}")
    try:
        return json.loads(canonical_json(dict(value)))
    except (TypeError, ValueError) as exc:
        raise _Invalid(f"{what} is not plain JSON data: {exc}") from None


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Duplicate keys make a document mean different things to different parsers; refuse it.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Invalid(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> Any:
    raise _Invalid(f"non-finite number {name} is not allowed")


def _load_json(data: bytes, key: str, what: str) -> dict[str, Any]:
    """Parse untrusted bytes as one JSON object (never anything that can run code)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ManifestError(f"{what} {key!r}: expected bytes, got {type(data).__name__}", key=key)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{what} {key!r}: {len(data)} bytes is too large", key=key)
    try:
        text = bytes(data).decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant)
    except _Invalid as exc:
        raise ManifestError(f"{what} {key!r} is not valid: {exc}", key=key) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{what} {key!r} is not JSON: {exc}", key=key) from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} {key!r}: top level must be a JSON object", key=key)
    return obj


# ---------------------------------------------------------------------------------- field checks


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    # bool is an int in Python but never a valid size/step/rank
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _Invalid(f"{what} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"{what} must be a non-empty string, got {value!r}")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _fields(obj: Mapping[str, Any], required: Iterable[str], optional: Iterable[str], what: str) -> None:
    required = set(required)
    allowed = required | set(optional)
    missing = sorted(required - set(obj))
    if missing:
        raise _Invalid(f"{what} lacks field(s) {missing}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        # Strict: a field this version does not know may change the meaning; a newer format
        # bumps format_version instead.
        raise _Invalid(f"{what} has unknown field(s) {unknown}")


def _check_format(obj: Mapping[str, Any], fmt: str, version: int, what: str) -> None:
    if obj.get("format") != fmt:
        raise _Invalid(f"unknown {what} format {obj.get('format')!r} (expected {fmt!r})")
    v = obj.get("format_version")
    if not isinstance(v, int) or isinstance(v, bool) or v != version:
        raise _Invalid(f"unsupported {what} format_version {v!r} (this objckpt reads {version})")


# ---------------------------------------------------------------------------------- receipts


@dataclass(frozen=True)
class ShardReceipt:
    """What a rank reports for one shard it wrote (invariant 4).

    Attributes:
        key: the shard's key relative to the run root (``data/<step>-<attempt>/<rank>/<name>``).
        size: bytes.
        version: ETag (S3), generation (GCS), per-write token (file/memory) of the write.
        crc32c: base64 of the full-object CRC32C (big-endian), as S3/GCS report it.
        rank: the rank that wrote it.
        name: the shard's name inside the rank's prefix.
        parts: how many parts it was uploaded in (1 for a single request).
        sha256: optional hex SHA-256 of the content.

    Construction validates every field (``ValueError``); :meth:`from_dict` raises
    :class:`ManifestError` instead, for data read from a store.
    """

    key: str
    size: int
    version: str
    crc32c: str
    rank: int
    name: str
    parts: int = 1
    sha256: str | None = None

    def __post_init__(self) -> None:
        try:
            self._validate()
        except _Invalid as exc:
            raise ValueError(f"invalid shard receipt {self.key!r}: {exc}") from None

    def _validate(self) -> None:
        _str(self.key, "key")
        try:
            layout.validate_key_in_root(self.key)
        except ManifestError as exc:
            raise _Invalid(str(exc)) from None
        _int(self.size, "size", 0, MAX_OBJECT_SIZE)
        _str(self.version, "version")
        if len(self.version) > 1024:
            raise _Invalid("version token is absurdly long")
        _str(self.crc32c, "crc32c")
        try:
            decode_crc32c(self.crc32c)
        except (ValueError, TypeError):
            raise _Invalid(f"crc32c {self.crc32c!r} is not a base64 CRC32C digest") from None
        _int(self.rank, "rank", 0, MAX_WORLD_SIZE - 1)
        _str(self.name, "name")
        _int(self.parts, "parts", 1, MAX_PARTS)
        if self.sha256 is not None and (
            not isinstance(self.sha256, str) or not _SHA256_RE.match(self.sha256)
        ):
            raise _Invalid(f"sha256 {self.sha256!r} is not 64 lowercase hex digits")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "key": self.key,
            "size": self.size,
            "version": self.version,
            "crc32c": self.crc32c,
            "rank": self.rank,
            "name": self.name,
            "parts": self.parts,
        }
        if self.sha256 is not None:
            d["sha256"] = self.sha256
        return d

    @classmethod
    def from_dict(cls, d: Any, *, key: str = "") -> ShardReceipt:
        """Rebuild a receipt from :meth:`to_dict` output.

        Raises:
            ManifestError: wrong fields or values (``key`` names the object it came from).
        """
        try:
            return cls._from_dict(d)
        except (_Invalid, ValueError) as exc:
            raise ManifestError(f"invalid shard receipt in {key!r}: {exc}", key=key) from None

    @classmethod
    def _from_dict(cls, d: Any) -> ShardReceipt:
        _dict(d, "shard receipt")
        _fields(
            d, ("key", "size", "version", "crc32c", "rank", "name", "parts"), ("sha256",), "shard receipt"
        )
        return cls(
            key=d["key"],
            size=d["size"],
            version=d["version"],
            crc32c=d["crc32c"],
            rank=d["rank"],
            name=d["name"],
            parts=d["parts"],
            sha256=d.get("sha256"),
        )


# ---------------------------------------------------------------------------------- run identity


#: frameworks whose version the run identity records when they are loaded (never imported here)
_FRAMEWORKS = ("torch", "numpy", "lightning", "transformers", "deepspeed", "accelerate")


def run_identity(run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """THE run-identity record (invariant 7), with software versions filled in.

    ``run`` may carry ``config_hash``, ``dataset_snapshot`` (when the data set has a snapshot
    id), ``software`` (name -> version) and anything else JSON-clean. Added unless given:
    ``software.objckpt``, ``software.python``, and the version of every framework in
    ``_FRAMEWORKS`` that this process has already imported (nothing is imported to find out).
    """
    import sys

    from ._version import __version__

    out = _normalise(run, "run identity")
    software = out.get("software")
    if software is None:
        software = {}
    if not isinstance(software, dict):
        raise _Invalid("run identity 'software' must be a mapping of name -> version")
    software.setdefault("objckpt", __version__)
    software.setdefault("python", platform.python_version())
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if isinstance(version, str):
            software.setdefault(name, version)
    out["software"] = software
    return out


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# ---------------------------------------------------------------------------------- manifest

_MANIFEST_FIELDS = (
    "format",
    "format_version",
    "step",
    "attempt",
    "world_size",
    "topology",
    "run",
    "shards",
    "progress",
    "parent",
    "created_at",
    "metadata",
    "checksum",
)


@dataclass(frozen=True)
class Manifest:
    """One committed step (invariant 7). Build with :meth:`create`, read with :meth:`decode`.

    Attributes:
        step, attempt: what was committed; every shard lies under ``data/<step>-<attempt>/``.
        world_size: ranks that took part; ``topology``: how they were laid out (free-form).
        run: run identity (config hash, software versions, dataset snapshot id when given).
        shards: every shard's receipt, sorted by key.
        progress: training-progress summary (global step, epoch, samples seen, ...).
        parent: the step that was the committed latest when this one was committed, or None.
        created_at: ISO-8601 UTC time of the commit.
        metadata: free-form JSON from the caller.
        checksum: SHA-256 (hex) of the canonical JSON of every other field.
    """

    step: int
    attempt: str
    world_size: int
    shards: tuple[ShardReceipt, ...]
    topology: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    parent: int | None = None
    created_at: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    checksum: str = ""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    # -- construction

    @classmethod
    def create(
        cls,
        *,
        step: int,
        attempt: str,
        world_size: int,
        shards: Iterable[ShardReceipt],
        topology: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
        progress: Mapping[str, Any] | None = None,
        parent: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        created_at: str | None = None,
    ) -> Manifest:
        """A new manifest with its checksum computed; validated exactly as :meth:`decode` does.

        ``run`` gets objckpt/python versions filled in (:func:`run_identity`).

        Raises:
            ValueError: a field is invalid (e.g. a shard outside this attempt's prefix).
        """
        try:
            shards = list(shards)
            for s in shards:
                if not isinstance(s, ShardReceipt):
                    raise _Invalid(f"shards must be ShardReceipt objects, got {type(s).__name__}")
            body = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "step": step,
                "attempt": attempt,
                "world_size": world_size,
                "topology": _normalise(topology, "topology"),
                "run": run_identity(run),
                "shards": [s.to_dict() for s in sorted(shards, key=lambda s: s.key)],
                "progress": _normalise(progress, "progress"),
                "parent": parent,
                "created_at": created_at or _utc_now(),
                "metadata": _normalise(metadata, "metadata"),
            }
            body["checksum"] = _sha256(body)
            return cls._from_obj(body, expected_key=None)
        except _Invalid as exc:
            raise ValueError(f"invalid manifest for step {step!r}: {exc}") from None

    # -- derived

    @property
    def key(self) -> str:
        """Where this manifest lives: ``manifests/<step:020d>.json``."""
        return layout.manifest_key(self.step)

    @property
    def attempt_prefix(self) -> str:
        return layout.attempt_prefix(self.step, self.attempt)

    @property
    def total_size(self) -> int:
        return sum(s.size for s in self.shards)

    def shards_of(self, rank: int) -> tuple[ShardReceipt, ...]:
        """The shards written by ``rank``."""
        return tuple(s for s in self.shards if s.rank == rank)

    def shard(self, rank: int, name: str) -> ShardReceipt:
        """The shard ``name`` of ``rank``. Raises ``KeyError``."""
        for s in self.shards:
            if s.rank == rank and s.name == name:
                return s
        raise KeyError(f"step {self.step} has no shard {name!r} for rank {rank}")

    def body(self) -> dict[str, Any]:
        """Every field except the checksum: what the checksum covers."""
        return {
            "format": self.format,
            "format_version": self.format_version,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "topology": json.loads(canonical_json(self.topology)),
            "run": json.loads(canonical_json(self.run)),
            "shards": [s.to_dict() for s in self.shards],
            "progress": json.loads(canonical_json(self.progress)),
            "parent": self.parent,
            "created_at": self.created_at,
            "metadata": json.loads(canonical_json(self.metadata)),
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.body(), "checksum": self.checksum}

    def encode(self) -> bytes:
        """Canonical JSON bytes, the form written to the store."""
        return canonical_json(self.to_dict())

    # -- decoding untrusted bytes

    @classmethod
    def decode(cls, data: bytes, *, key: str) -> Manifest:
        """Parse and validate a manifest read from ``key`` (invariant 11).

        Checks: JSON object (no code is ever executed), known format and version, exact field
        set and types, ``key`` is this step's manifest key, self-checksum, and every shard key
        is a plain key inside the run root that lies under this manifest's own attempt prefix
        and its own rank's prefix (so shards of different attempts or steps can never be mixed).

        Raises:
            ManifestError: naming ``key`` and the reason.
        """
        obj = _load_json(data, key, "manifest")
        try:
            return cls._from_obj(obj, expected_key=key)
        except _Invalid as exc:
            raise ManifestError(f"invalid manifest {key!r}: {exc}", key=key) from None
        except ManifestError as exc:
            raise ManifestError(f"invalid manifest {key!r}: {exc}", key=key) from None

    @classmethod
    def _from_obj(cls, obj: dict[str, Any], *, expected_key: str | None) -> Manifest:
        _fields(obj, _MANIFEST_FIELDS, (), "manifest")
        _check_format(obj, FORMAT, FORMAT_VERSION, "manifest")
        step = _int(obj["step"], "step", 0, layout.MAX_STEP)
        try:
            attempt = layout.check_attempt_id(obj["attempt"])
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
        if expected_key is not None and expected_key != layout.manifest_key(step):
            # a manifest copied under another step's key must not be taken for that step
            raise _Invalid(f"it is stored at {expected_key!r} but describes step {step}")
        world_size = _int(obj["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        parent = obj["parent"]
        if parent is not None:
            _int(parent, "parent", 0, layout.MAX_STEP)
            if parent >= step:
                raise _Invalid(f"parent step {parent} is not older than step {step}")
        created_at = _str(obj["created_at"], "created_at")
        if not _CREATED_RE.match(created_at):
            raise _Invalid(f"created_at {created_at!r} is not an ISO-8601 UTC time")
        try:
            datetime.fromisoformat(created_at.replace("Z", "+00:00"))
        except ValueError:
            raise _Invalid(f"created_at {created_at!r} is not a valid time") from None
        for name in ("topology", "run", "progress", "metadata"):
            _dict(obj[name], name)
        checksum = obj["checksum"]
        if not isinstance(checksum, str) or not _SHA256_RE.match(checksum):
            raise _Invalid("checksum must be 64 lowercase hex digits")
        body = {k: v for k, v in obj.items() if k != "checksum"}
        actual = _sha256(body)
        if actual != checksum:
            raise _Invalid(f"self-checksum mismatch: body hashes to {actual}, manifest says {checksum}")

        raw_shards = obj["shards"]
        if not isinstance(raw_shards, list):
            raise _Invalid("shards must be a JSON array")
        prefix = layout.attempt_prefix(step, attempt)
        shards: list[ShardReceipt] = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_shards):
            try:
                receipt = ShardReceipt._from_dict(raw)
            except (_Invalid, ValueError) as exc:
                raise _Invalid(f"shard #{i}: {exc}") from None
            # validate_key_in_root raises ManifestError naming the key
            layout.validate_key_in_root(receipt.key)
            if not receipt.key.startswith(prefix):
                raise _Invalid(
                    f"shard key {receipt.key!r} lies outside this manifest's attempt prefix {prefix!r}"
                )
            if receipt.rank >= world_size:
                raise _Invalid(f"shard {receipt.key!r} has rank {receipt.rank} >= world_size {world_size}")
            try:
                own = layout.shard_key(step, attempt, receipt.rank, receipt.name)
            except ValueError as exc:
                raise _Invalid(f"shard {receipt.key!r}: {exc}") from None
            if receipt.key != own:
                raise _Invalid(
                    f"shard key {receipt.key!r} is not rank {receipt.rank}'s key for {receipt.name!r} ({own!r})"
                )
            if receipt.key in seen:
                raise _Invalid(f"shard key {receipt.key!r} is listed twice")
            seen.add(receipt.key)
            shards.append(receipt)
        return cls(
            step=step,
            attempt=attempt,
            world_size=world_size,
            shards=tuple(shards),
            topology=obj["topology"],
            run=obj["run"],
            progress=obj["progress"],
            parent=parent,
            created_at=created_at,
            metadata=obj["metadata"],
            checksum=checksum,
        )


# ---------------------------------------------------------------------------------- pointer

_POINTER_FIELDS = ("format", "format_version", "step", "manifest", "attempt", "checksum")


@dataclass(frozen=True)
class Pointer:
    """``LATEST``: names the newest committed manifest. A hint, never the source of truth."""

    step: int
    manifest_key: str
    attempt: str

    def __post_init__(self) -> None:
        try:
            self._validate()
        except _Invalid as exc:
            raise ValueError(f"invalid pointer: {exc}") from None

    def _validate(self) -> None:
        _int(self.step, "step", 0, layout.MAX_STEP)
        try:
            layout.check_attempt_id(self.attempt)
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
        if self.manifest_key != layout.manifest_key(self.step):
            raise _Invalid(f"manifest key {self.manifest_key!r} is not step {self.step}'s manifest key")

    @classmethod
    def for_manifest(cls, manifest: Manifest) -> Pointer:
        return cls(step=manifest.step, manifest_key=manifest.key, attempt=manifest.attempt)

    def encode(self) -> bytes:
        body = {
            "format": POINTER_FORMAT,
            "format_version": POINTER_FORMAT_VERSION,
            "step": self.step,
            "manifest": self.manifest_key,
            "attempt": self.attempt,
        }
        return canonical_json({**body, "checksum": _sha256(body)})

    @classmethod
    def decode(cls, data: bytes, *, key: str = layout.POINTER_KEY) -> Pointer:
        """Parse and validate a pointer.

        Raises:
            ManifestError: not JSON, unknown format/version, bad field, or checksum mismatch.
        """
        obj = _load_json(data, key, "pointer")
        try:
            _fields(obj, _POINTER_FIELDS, (), "pointer")
            _check_format(obj, POINTER_FORMAT, POINTER_FORMAT_VERSION, "pointer")
            checksum = obj["checksum"]
            body = {k: v for k, v in obj.items() if k != "checksum"}
            if not isinstance(checksum, str) or checksum != _sha256(body):
                raise _Invalid("self-checksum mismatch")
            if not isinstance(obj["manifest"], str):
                raise _Invalid("manifest must be a string")
            layout.validate_key_in_root(obj["manifest"])
            p = cls.__new__(cls)
            object.__setattr__(p, "step", obj["step"])
            object.__setattr__(p, "manifest_key", obj["manifest"])
            object.__setattr__(p, "attempt", obj["attempt"])
            p._validate()
            return p
        except (_Invalid, ManifestError) as exc:
            raise ManifestError(f"invalid pointer {key!r}: {exc}", key=key) from None
