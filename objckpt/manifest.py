"""Manifest and shard receipt: the commit record of one checkpoint (pure: no I/O).

A **manifest** is one small JSON object per committed checkpoint, keyed by ``(timeline,
step)`` (``layout.manifest_key``); writing it (create-if-absent) is THE commit point. It records
everything needed to restore the checkpoint and to judge whether what is in the store is what was
committed: every shard's receipt (key, size, ETag/generation, full-object CRC32C), the world size
and topology, the run identity, the training progress, the parent checkpoint (on this timeline,
or the timeline's base), and a SHA-256 of its own canonical body.

Revision-1 manifests (``format_version`` 1: no timeline, an integer parent) are read as
timeline 0. The pointer and the timeline claim live in :mod:`objckpt.pointer`; the shard receipt
and the reference, with the limits they check, in :mod:`objckpt._receipts` (all re-exported here).

Decoding never executes anything from the store (:mod:`objckpt._json`); every check failure is a
:class:`ManifestError` naming the object's key and the reason.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from . import layout
from ._json import (
    MAX_MANIFEST_BYTES,
    Invalid,
    canonical_json,
    check_created_at,
    check_fields,
    check_format,
    check_self_checksum,
    dict_field,
    int_field,
    load_json,
    normalise,
    sha256_of,
    utc_now,
)
from ._receipts import MAX_OBJECT_SIZE, MAX_WORLD_SIZE, Reference, ShardReceipt
from ._receipts import MAX_PARTS as MAX_PARTS  # re-exported: it was defined here
from .errors import ManifestError
from .pointer import POINTER_FORMAT, POINTER_FORMAT_VERSION, Pointer, TimelineClaim

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_OBJECT_SIZE",
    "POINTER_FORMAT",
    "POINTER_FORMAT_VERSION",
    "Manifest",
    "Pointer",
    "Reference",
    "ShardReceipt",
    "TimelineClaim",
    "canonical_json",
    "run_identity",
]

FORMAT = "objckpt.manifest"
#: version 2 adds the timeline and a parent that names its timeline; version 1 (revision 1 of
#: the protocol: no timelines) is read as timeline 0
#: version 3 adds references (objects of ancestors this checkpoint reuses instead of rewriting)
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (1, 2, 3)


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

    out = normalise(run, "run identity")
    software = out.get("software")
    if software is None:
        software = {}
    if not isinstance(software, dict):
        raise Invalid("run identity 'software' must be a mapping of name -> version")
    software.setdefault("objckpt", __version__)
    software.setdefault("python", platform.python_version())
    for name in _FRAMEWORKS:
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None) if module is not None else None
        if isinstance(version, str):
            software.setdefault(name, version)
    out["software"] = software
    return out


# ---------------------------------------------------------------------------------- manifest

_FIELDS_V1 = (
    "format", "format_version", "step", "attempt", "world_size", "topology", "run", "shards",
    "progress", "parent", "created_at", "metadata", "checksum",
)  # fmt: skip
_FIELDS_V2 = (*_FIELDS_V1, "timeline")
_FIELDS_V3 = (*_FIELDS_V2, "references")
_FIELDS = {1: _FIELDS_V1, 2: _FIELDS_V2, 3: _FIELDS_V3}


@dataclass(frozen=True)
class Manifest:
    """One committed checkpoint (invariant 7). Build with :meth:`create`, read with :meth:`decode`.

    Attributes:
        timeline, step: which checkpoint this is; ``key`` is ``layout.manifest_key(step, timeline)``.
        attempt: every shard lies under ``data/<step>-<attempt>/``.
        world_size: ranks that took part; ``topology``: how they were laid out (free-form).
        run: run identity (config hash, software versions, dataset snapshot id when given).
        shards: every shard's receipt, sorted by key.
        progress: training-progress summary (global step, epoch, samples seen, ...).
        parent, parent_timeline: the checkpoint this one continues from: the previous commit on
            this timeline, or the timeline's base; ``None`` for the first checkpoint of a run.
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
    timeline: int = 0
    parent_timeline: int | None = None
    references: tuple[Reference, ...] = ()
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
        timeline: int = 0,
        topology: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
        progress: Mapping[str, Any] | None = None,
        parent: int | None = None,
        parent_timeline: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        created_at: str | None = None,
        references: Iterable[Reference] = (),
    ) -> Manifest:
        """A new manifest with its checksum computed; validated exactly as :meth:`decode` does.

        ``parent_timeline`` defaults to ``timeline`` when a ``parent`` is given. ``run`` gets
        objckpt/python versions filled in (:func:`run_identity`).

        Raises:
            ValueError: a field is invalid (e.g. a shard outside this attempt's prefix, a parent
                that is not older in (timeline, step) order).
        """
        try:
            shards = list(shards)
            for s in shards:
                if not isinstance(s, ShardReceipt):
                    raise Invalid(f"shards must be ShardReceipt objects, got {type(s).__name__}")
            if parent is not None and parent_timeline is None:
                parent_timeline = timeline
            body = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "timeline": timeline,
                "step": step,
                "attempt": attempt,
                "world_size": world_size,
                "topology": normalise(topology, "topology"),
                "run": run_identity(run),
                "shards": [s.to_dict() for s in sorted(shards, key=lambda s: s.key)],
                "progress": normalise(progress, "progress"),
                "parent": None if parent is None else {"timeline": parent_timeline, "step": parent},
                "created_at": created_at or utc_now(),
                "metadata": normalise(metadata, "metadata"),
                "references": [r.to_dict() for r in sorted(references, key=lambda r: r.identity)],
            }
            body["checksum"] = sha256_of(body)
            return cls._from_obj(body, expected_key=None)
        except Invalid as exc:
            raise ValueError(f"invalid manifest for step {step!r}: {exc}") from None

    # -- derived

    @property
    def key(self) -> str:
        """Where this manifest lives: ``layout.manifest_key(step, timeline)``."""
        return layout.manifest_key(self.step, self.timeline)

    @property
    def ref(self) -> tuple[int, int]:
        """``(timeline, step)``: the order checkpoints are compared in."""
        return (self.timeline, self.step)

    @property
    def parent_ref(self) -> tuple[int, int] | None:
        if self.parent is None:
            return None
        return (self.parent_timeline if self.parent_timeline is not None else self.timeline, self.parent)

    @property
    def parent_key(self) -> str | None:
        ref = self.parent_ref
        return None if ref is None else layout.manifest_key(ref[1], ref[0])

    @property
    def label(self) -> str:
        """``20`` on timeline 0, ``t1:20`` on later timelines (as the CLI names them)."""
        return str(self.step) if self.timeline == 0 else f"t{self.timeline}:{self.step}"

    @property
    def attempt_prefix(self) -> str:
        """The attempt's prefix in the layout without spreading (``data/<step>-<attempt>/``);
        its shards may lie under spread prefixes instead: see :attr:`attempt_prefixes`."""
        return layout.attempt_prefix(self.step, self.attempt)

    @property
    def attempt_prefixes(self) -> list[str]:
        """Every attempt prefix this checkpoint's own shards lie under (one per spread prefix
        used, or the one unspread prefix), sorted."""
        return sorted({p for s in self.shards if (p := layout.attempt_prefix_of(s.key)) is not None})

    @property
    def total_size(self) -> int:
        """Bytes this checkpoint wrote itself (its own shards)."""
        return sum(s.size for s in self.shards)

    @property
    def referenced_size(self) -> int:
        """Bytes of ancestors' objects this checkpoint reuses (whole objects; a shard may read
        only parts of them)."""
        return sum(r.size for r in self.references)

    @property
    def object_keys(self) -> tuple[str, ...]:
        """Every object this checkpoint needs: its shards, then its references (for GC)."""
        return tuple(s.key for s in self.shards) + tuple(r.key for r in self.references)

    def reference(self, origin: tuple[int, int], rank: int, name: str) -> Reference:
        """The reference with this identity. Raises ``KeyError``."""
        for r in self.references:
            if r.identity == (*origin, rank, name):
                return r
        raise KeyError(f"step {self.label} has no reference to {name!r} of rank {rank} at {origin}")

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
        """Every field except the checksum: what the checksum covers (in this manifest's own
        format version, so a revision-1 manifest keeps its checksum)."""
        out: dict[str, Any] = {
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
        if self.format_version >= 3:
            out["references"] = [r.to_dict() for r in self.references]
        if self.format_version >= 2:
            out["timeline"] = self.timeline
            out["parent"] = (
                None
                if self.parent_ref is None
                else dict(zip(("timeline", "step"), self.parent_ref, strict=True))
            )
        return out

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
        set and types, ``key`` is this checkpoint's manifest key, the parent is older in
        ``(timeline, step)`` order, self-checksum, and every shard key is a plain key inside the
        run root under this manifest's own attempt prefix and its own rank's prefix (so shards of
        different attempts or steps can never be mixed).

        Raises:
            ManifestError: naming ``key`` and the reason.
        """
        obj = load_json(data, key, "manifest")
        try:
            return cls._from_obj(obj, expected_key=key)
        except Invalid as exc:
            raise ManifestError(f"invalid manifest {key!r}: {exc}", key=key) from None
        except ManifestError as exc:
            raise ManifestError(f"invalid manifest {key!r}: {exc}", key=key) from None

    @classmethod
    def _from_obj(cls, obj: dict[str, Any], *, expected_key: str | None) -> Manifest:
        version = check_format(obj, FORMAT, READABLE_FORMAT_VERSIONS, "manifest")
        check_fields(obj, _FIELDS[version], (), "manifest")
        step = int_field(obj["step"], "step", 0, layout.MAX_STEP)
        timeline = 0 if version == 1 else int_field(obj["timeline"], "timeline", 0, layout.MAX_TIMELINE)
        try:
            attempt = layout.check_attempt_id(obj["attempt"])
        except ValueError as exc:
            raise Invalid(str(exc)) from None
        if expected_key is not None and expected_key != layout.manifest_key(step, timeline):
            # a manifest copied under another checkpoint's key must not be taken for it
            raise Invalid(f"it is stored at {expected_key!r} but describes timeline {timeline} step {step}")
        world_size = int_field(obj["world_size"], "world_size", 1, MAX_WORLD_SIZE)
        parent, parent_timeline = _parent(obj["parent"], version, timeline, step)
        created_at = check_created_at(obj["created_at"])
        for name in ("topology", "run", "progress", "metadata"):
            dict_field(obj[name], name)
        checksum = check_self_checksum(obj)

        raw_shards = obj["shards"]
        if not isinstance(raw_shards, list):
            raise Invalid("shards must be a JSON array")
        shards: list[ShardReceipt] = []
        seen: set[str] = set()
        for i, raw in enumerate(raw_shards):
            try:
                receipt = ShardReceipt._from_dict(raw)
            except (Invalid, ValueError) as exc:
                raise Invalid(f"shard #{i}: {exc}") from None
            # (the receipt has checked that its key is a plain key inside the run root)
            bad_part: ValueError | None = None
            try:
                own = layout.is_shard_key_of(receipt.key, step, attempt, receipt.rank, receipt.name)
            except ValueError as exc:
                own, bad_part = False, exc
            if not own:
                _refuse_shard_key(receipt, step, attempt, world_size, bad_part)
            if receipt.rank >= world_size:
                raise Invalid(f"shard {receipt.key!r} has rank {receipt.rank} >= world_size {world_size}")
            if receipt.key in seen:
                raise Invalid(f"shard key {receipt.key!r} is listed twice")
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
            parent_timeline=parent_timeline,
            created_at=created_at,
            metadata=obj["metadata"],
            checksum=checksum,
            timeline=timeline,
            references=_references(obj.get("references", []), (timeline, step), (step, attempt)),
            format_version=version,
        )


def _refuse_shard_key(
    receipt: ShardReceipt, step: int, attempt: str, world_size: int, bad_part: ValueError | None
) -> NoReturn:
    """Why ``receipt``'s key is not its own shard key in this attempt (either layout, with or
    without the spreading prefix), checked in the order the reasons are reported."""
    parsed = layout.parse_shard_key(receipt.key)
    if parsed is None or parsed[:2] != (step, attempt):
        raise Invalid(
            f"shard key {receipt.key!r} lies outside this manifest's attempt prefix "
            f"{layout.attempt_prefix(step, attempt)!r} (or a spread one)"
        )
    if receipt.rank >= world_size:
        raise Invalid(f"shard {receipt.key!r} has rank {receipt.rank} >= world_size {world_size}")
    if bad_part is not None:
        raise Invalid(f"shard {receipt.key!r}: {bad_part}")
    raise Invalid(
        f"shard key {receipt.key!r} is not rank {receipt.rank}'s key for {receipt.name!r} "
        f"({layout.shard_key(step, attempt, receipt.rank, receipt.name)!r} or its spread form)"
    )


def _parent(value: Any, version: int, timeline: int, step: int) -> tuple[int | None, int | None]:
    """The parent ``(step, timeline)``: strictly older in ``(timeline, step)`` order."""
    if value is None:
        return None, None
    if version == 1:
        p_step, p_timeline = int_field(value, "parent", 0, layout.MAX_STEP), 0
    else:
        if not isinstance(value, dict) or set(value) != {"timeline", "step"}:
            raise Invalid("parent must be null or {timeline, step}")
        p_step = int_field(value["step"], "parent step", 0, layout.MAX_STEP)
        p_timeline = int_field(value["timeline"], "parent timeline", 0, layout.MAX_TIMELINE)
    if (p_timeline, p_step) >= (timeline, step):
        raise Invalid(
            f"parent (timeline {p_timeline}, step {p_step}) is not older than (timeline {timeline}, step {step})"
        )
    if p_timeline > timeline:
        raise Invalid(f"parent timeline {p_timeline} is newer than this manifest's timeline {timeline}")
    return p_step, p_timeline


def _references(raw: Any, own: tuple[int, int], own_attempt: tuple[int, str]) -> tuple[Reference, ...]:
    if not isinstance(raw, list):
        raise Invalid("references must be a JSON array")
    out: list[Reference] = []
    seen: set[tuple[int, int, int, str]] = set()
    for i, item in enumerate(raw):
        try:
            ref = Reference._from_dict(item)
        except (Invalid, ValueError) as exc:
            raise Invalid(f"reference #{i}: {exc}") from None
        # (the reference's receipt check has rejected a key outside the run root, as Invalid,
        # so create() raises ValueError and decode() ManifestError, like every other field)
        parsed = layout.parse_shard_key(ref.key)
        if parsed is not None and parsed[:2] == own_attempt:
            raise Invalid(
                f"reference {ref.key!r} lies in this checkpoint's own attempt: it is a shard, not a reference"
            )
        if ref.origin >= own:
            raise Invalid(f"reference {ref.key!r} names checkpoint {ref.origin}, not older than {own}")
        if ref.identity in seen:
            raise Invalid(f"reference {ref.key!r} is listed twice")
        seen.add(ref.identity)
        out.append(ref)
    return tuple(out)
