"""How many bytes each checkpoint needs and how many it wrote (deduplication at a glance).

A checkpoint that reuses its ancestors' bytes (references, :mod:`objckpt.training.dedup`) is
*logically* as large as a full one -- a restore reads all of it -- but writes only what changed.
:func:`checkpoint_usage` reports both for one checkpoint, :func:`run_usage` for every checkpoint
on the head's line, and :func:`stored_bytes` what the run root holds for them (each shared object
once). For the CLI (``objckpt ls``/``du``); torch-free, reads only:

* from the manifest alone (``exact=False``, no request): written bytes (its own shards) and the
  size of every object it references (an upper bound of what it reads from them);
* ``exact=True`` (default): plus the byte ranges it really reads from the referenced objects,
  from the shard headers (one ranged GET of the end of each CheckpointManager shard in format 3,
  two when a header exceeds 64 KiB; one GET of a DCP checkpoint's metadata shard).

A header that cannot be read (damaged, an outage) leaves that checkpoint at the upper bound with
``exact=False``; nothing here raises for a damaged checkpoint (``objckpt verify`` judges those).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._crc import crc32c_of
from .manifest import Manifest
from .reader import Reader
from .store.base import Store

__all__ = ["CheckpointUsage", "checkpoint_usage", "run_usage", "stored_bytes"]

# The framing of a version-3 CheckpointManager shard (objckpt/training/serialization.py, which
# tests that these agree with it): the footer is the last 32 bytes.
_FOOTER = struct.Struct("<QQI4x8s")
_FOOTER_MAGIC = b"OBJCKPT\x03"
_TAIL_READ = 64 * 1024
_MAX_HEADER = 256 * 1024 * 1024


@dataclass(frozen=True)
class CheckpointUsage:
    """Bytes of one checkpoint.

    Attributes:
        timeline, step, label: which checkpoint (``label`` as the CLI names it: ``20``, ``t1:20``).
        written_bytes: bytes it wrote itself (its own shards): what this save uploaded.
        logical_bytes: bytes a restore of it reads: ``written_bytes + referenced_bytes``.
        referenced_bytes: bytes it reads from ancestors' objects (exact: the ranges its shards
            name; else the whole referenced objects, an upper bound).
        referenced_objects: how many ancestors' objects it references.
        exact: whether ``referenced_bytes`` came from the shard headers.
    """

    timeline: int
    step: int
    label: str
    written_bytes: int
    logical_bytes: int
    referenced_bytes: int
    referenced_objects: int
    exact: bool

    @property
    def written_fraction(self) -> float:
        """``written_bytes / logical_bytes`` (1.0 for a checkpoint that reuses nothing)."""
        return self.written_bytes / self.logical_bytes if self.logical_bytes else 1.0


def checkpoint_usage(store: Store, manifest: Manifest, *, exact: bool = True) -> CheckpointUsage:
    """Written vs logical bytes of ``manifest`` (see the module doc for the requests made)."""
    written = manifest.total_size
    upper = manifest.referenced_size
    referenced, is_exact = upper, not manifest.references
    if manifest.references and exact:
        try:
            got = _referenced_ranges(store, manifest)
        except Exception:  # noqa: BLE001 - usage is a report: fall back to the upper bound
            got = None
        if got is not None:
            referenced, is_exact = got, True
    return CheckpointUsage(
        timeline=manifest.timeline,
        step=manifest.step,
        label=manifest.label,
        written_bytes=written,
        logical_bytes=written + referenced,
        referenced_bytes=referenced,
        referenced_objects=len(manifest.references),
        exact=is_exact,
    )


def run_usage(store: Store, *, exact: bool = True) -> list[CheckpointUsage]:
    """:func:`checkpoint_usage` of every committed checkpoint on the head's line, oldest first
    (an unreadable manifest is left out)."""
    reader = Reader(store)
    out = []
    keys = reader.checkpoints()
    for ref in sorted(reader.line()):
        try:
            manifest = reader.fetch(keys[ref])
        except Exception:  # noqa: BLE001 - a report lists what it can read
            continue
        out.append(checkpoint_usage(store, manifest, exact=exact))
    return out


def stored_bytes(manifests: Iterable[Manifest]) -> int:
    """Bytes the run root holds for ``manifests``: every object they need, each once (a shared
    object counts once however many checkpoints reference it)."""
    sizes: dict[str, int] = {}
    for m in manifests:
        for s in m.shards:
            sizes[s.key] = s.size
        for r in m.references:
            sizes[r.key] = r.size
    return sum(sizes.values())


# ---------------------------------------------------------------------------------- internals


def _referenced_ranges(store: Store, manifest: Manifest) -> int | None:
    """Bytes ``manifest``'s shards read from referenced objects, or None when not knowable."""
    dcp = manifest.metadata.get("dcp")
    if isinstance(dcp, dict):
        return _dcp_referenced(store, manifest, dcp)
    total = 0
    for shard in manifest.shards:
        header = _v3_header(store, shard.key, shard.size)
        if header is None:
            continue
        for array in header.get("arrays") or []:
            for chunk in array.get("chunks") or [] if isinstance(array, dict) else []:
                if isinstance(chunk, dict) and "ref" in chunk and isinstance(chunk.get("n"), int):
                    total += chunk["n"]
    return total


def _dcp_referenced(store: Store, manifest: Manifest, info: dict[str, Any]) -> int | None:
    ms = info.get("metadata_shard")
    if not isinstance(ms, dict) or not isinstance(ms.get("rank"), int) or not isinstance(ms.get("name"), str):
        return None
    receipt = manifest.shard(ms["rank"], ms["name"])
    body = json.loads(Reader(store).read_shard(receipt))
    return sum(int(it.get("length", 0)) for it in body.get("items", []) if it.get("from") is not None)


def _v3_header(store: Store, key: str, size: int) -> dict[str, Any] | None:
    if size < _FOOTER.size:
        return None
    start = max(0, size - _TAIL_READ)
    tail = store.get(key, byte_range=(start, size))
    offset, length, crc, magic = _FOOTER.unpack(tail[-_FOOTER.size :])
    if magic != _FOOTER_MAGIC or length > _MAX_HEADER or offset + length + _FOOTER.size != size:
        return None
    raw = (
        tail[offset - start : offset - start + length]
        if offset >= start
        else store.get(key, byte_range=(offset, offset + length))
    )
    if crc32c_of(raw) != crc:
        return None
    header = json.loads(raw)
    return header if isinstance(header, dict) else None
