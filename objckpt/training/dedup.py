"""Write only what changed: reuse of unchanged bytes of the parent checkpoint (content-addressed).

A save with deduplication cuts every array into ``CHUNK_SIZE`` chunks, hashes each (xxh3-128,
a 128-bit hash with no known collisions on non-adversarial data; blake2b-128 where xxhash is not
installed) and writes a chunk whose hash the **parent** checkpoint holds as a reference to the
parent's byte range instead of its bytes (shard format version 3, :mod:`.serialization`).

Index = the parent only. The next save continues from ``lineage.position(store).base`` (what was
restored or last committed: the coordinator's parent, :func:`parent_for`); it may reuse bytes
that checkpoint stores itself or references -- exactly what the coordinator accepts
(``Coordinator._check_references``) and what keeps garbage collection safe (an object is live
while a retained manifest references it). The index is built from the parent's shard headers,
which this process keeps from its last commit or restore (:func:`remember`, no request), or
else reads with one ranged GET of each header (two when a header exceeds 64 KiB); a rank reads
only its own shards' headers then (tensors that moved to another rank are written again).

Each rank reports in ``ticket.references`` the :class:`~objckpt.manifest.Reference` of every
ancestor object its shards read from (built from the parent manifest's own receipts or its
references, :meth:`ChunkIndex.references_used`); the coordinator verifies them.

What a save costs (measured in ``benchmarks/DEDUP.md``): every chunk gets a 64-bit *sample*
(:func:`chunk_sample`, 65 words spread over it: microseconds); the full 128-bit hash is computed
only for a chunk whose sample equals one of the parent's (it may be unchanged) or when there is
no parent to compare with (the first save). A save where everything changed therefore hashes
nothing; a chunk that stops changing is written once more (its parent has no full hash to
confirm it by) and reused from the save after. The CRC32C of a chunk is recorded where it is
needed, on references (the restore checks the referenced range against it), computed from the
live bytes (equal to the origin's, by the hash); a local chunk is covered by its object's CRC32C.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

try:  # optional, as in serialization: the sample is then gathered in Python
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

from ..coordination import lineage
from ..errors import is_damage
from ..manifest import Manifest, Reference
from ..store.base import Store
from .serialization import ChunkTarget, Identity, Resolver, index_entries, read_header

__all__ = [
    "CHUNK_SIZE",
    "HASH_NAME",
    "MIN_BYTES",
    "ChunkIndex",
    "build_index",
    "chunk_hash",
    "chunk_sample",
    "parent_for",
    "recall",
    "remember",
    "resolver_for",
]

log = logging.getLogger("objckpt.training")

#: chunk size: small enough that a partly changed tensor reuses most of itself, large enough
#: that the per-chunk header entry (~110 bytes) and hash call are negligible (benchmarks/DEDUP.md)
CHUNK_SIZE = 4 * 1024 * 1024
#: arrays smaller than this are always written (a reference would cost more than the bytes)
MIN_BYTES = 4096

try:
    import xxhash as _xxhash

    HASH_NAME = "xxh3-128"

    def chunk_hash(data: Any) -> bytes:
        """The 128-bit content hash of a chunk (releases the GIL: chunks hash in parallel)."""
        return _xxhash.xxh3_128_digest(data)

    def _digest64(data: Any) -> bytes:
        return _xxhash.xxh3_64_digest(data)

except ImportError:  # pragma: no cover - exercised where xxhash is not installed
    HASH_NAME = "blake2b-128"

    def chunk_hash(data: Any) -> bytes:
        return hashlib.blake2b(data, digest_size=16).digest()

    def _digest64(data: Any) -> bytes:
        return hashlib.blake2b(data, digest_size=8).digest()


#: words sampled across a chunk (plus its last word): what tells a changed chunk from a maybe
#: unchanged one without reading all of it
SAMPLE_WORDS = 64


def chunk_sample(data: Any) -> bytes:
    """A 64-bit digest of ``SAMPLE_WORDS`` 8-byte words spread evenly over ``data`` and its last
    word: equal for equal chunks, and, for a chunk where most values changed (a training step),
    different with near certainty. It only decides whether a chunk is worth hashing in full;
    reuse is decided by the full 128-bit hash alone."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    if n <= 16 * SAMPLE_WORDS:
        return _digest64(view)
    stride = n // SAMPLE_WORDS
    if np is not None and stride % 8 == 0 and n % 8 == 0:  # one strided gather in C
        words = np.frombuffer(view, dtype=np.uint64)[:: stride // 8][:SAMPLE_WORDS].tobytes()
        return _digest64(words + bytes(view[n - 8 :]))
    parts = [view[i * stride : i * stride + 8] for i in range(SAMPLE_WORDS)]
    parts.append(view[n - 8 :])
    return _digest64(b"".join(parts))


def parent_for(store: Store, step: int) -> Manifest | None:
    """The checkpoint a save of ``step`` continues from, as the coordinator will find it: the
    base of this process's position on ``store`` when the save follows it (a later step, or a
    re-save after a restore, which branches a new timeline from it); None when this process
    knows nothing (a fresh start) or saves an earlier step than it last committed (its parent
    is then some older checkpoint: no reuse rather than a reference the commit would refuse)."""
    pos = lineage.position(store)
    if pos is None:
        return None
    base = pos.base
    if step > base.step or (pos.restored and step <= base.step):
        return base
    return None


# ---------------------------------------------------------------------------------- header cache

_Entry = tuple[bytes | None, bytes | None, int, Identity | None, int, int, str | None, str | None]
_KEEP = 2  # checkpoints' headers kept per run root: the last commit and the one before


class _Cache:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_location: dict[str, OrderedDict[tuple[int, str], dict[tuple[int, str], list[_Entry]]]] = {}
        self.by_object: weakref.WeakKeyDictionary[Store, OrderedDict[Any, Any]] = weakref.WeakKeyDictionary()

    def slot(self, store: Store) -> OrderedDict[tuple[int, str], dict[tuple[int, str], list[_Entry]]]:
        inner = store
        # a wrapper that keeps its store's run root (counting, faults) shares its entry; one that
        # names another root (a PrefixStore: every s3:// run root over one bucket client) does not
        while getattr(inner, "inner", None) is not None and inner.inner.location == inner.location:  # type: ignore[attr-defined]
            inner = inner.inner  # type: ignore[attr-defined]
        location = str(inner.location)
        if location.startswith("memory://"):  # memory stores share names: keyed by the object
            return self.by_object.setdefault(inner, OrderedDict())
        return self.by_location.setdefault(location, OrderedDict())


_cache = _Cache()


def remember(store: Store, step: int, attempt: str, rank: int, name: str, header: Mapping[str, Any]) -> None:
    """Keep the chunk table of shard ``name`` of ``rank`` of attempt ``attempt`` (just written,
    or just restored), so the next save indexes it without a request."""
    entries = index_entries(header) if header.get("hash") == HASH_NAME else []
    remember_entries(store, step, attempt, (rank, name), entries)


def recall(store: Store, step: int, attempt: str) -> dict[tuple[int, str], list[_Entry]]:
    with _cache.lock:
        return dict(_cache.slot(store).get((step, attempt), {}))


def remember_value(store: Store, step: int, attempt: str, tag: str, value: Any) -> None:
    """Keep ``value`` (e.g. a DCP checkpoint's item table) for checkpoint ``(step, attempt)``."""
    remember_entries(store, step, attempt, (-1, tag), value)


def recall_value(store: Store, step: int, attempt: str, tag: str) -> Any:
    return recall(store, step, attempt).get((-1, tag))


def remember_entries(store: Store, step: int, attempt: str, shard: tuple[int, str], value: Any) -> None:
    with _cache.lock:
        slot = _cache.slot(store)
        slot.setdefault((step, attempt), {})[shard] = value
        slot.move_to_end((step, attempt))
        while len(slot) > _KEEP:
            slot.popitem(last=False)


def forget(store: Store) -> None:
    with _cache.lock:
        _cache.slot(store).clear()


# ---------------------------------------------------------------------------------- the index


@dataclass
class ChunkIndex:
    """Chunks of the parent checkpoint by ``(hash, length)``, and how each object holding them
    is referenced from the new checkpoint."""

    parent: Manifest
    hash_name: str = HASH_NAME
    chunks: dict[tuple[bytes, int], ChunkTarget] = field(default_factory=dict)
    #: samples of the parent's chunks: a live chunk is hashed in full only when its sample is here
    samples: set[tuple[bytes, int]] = field(default_factory=set)
    objects: dict[Identity, Reference] = field(default_factory=dict)
    #: shard headers read from the store to build it (0 when kept in-process)
    requests: int = 0

    def lookup(self, digest: bytes, length: int) -> ChunkTarget | None:
        return self.chunks.get((digest, length))

    def has_sample(self, sample: bytes, length: int) -> bool:
        return (sample, length) in self.samples

    def references_used(self, identities: Iterable[Identity]) -> list[Reference]:
        return [self.objects[i] for i in sorted(set(identities))]

    def add(self, own: Identity, entries: Iterable[_Entry]) -> None:
        for digest, sample, length, ref, offset, stored, codec, crc in entries:
            ident = own if ref is None else ref
            if ident not in self.objects:
                continue  # the parent neither holds nor references it: not reusable
            if offset + stored > self.objects[ident].size:
                continue
            if sample is not None:
                self.samples.add((sample, length))
            if digest is not None:
                self.chunks.setdefault((digest, length), ChunkTarget(ident, offset, stored, codec, crc))


def build_index(
    store: Store,
    parent: Manifest,
    *,
    rank: int,
    names: Iterable[str],
    layouts: Collection[str] | None = None,
) -> ChunkIndex | None:
    """The index of ``parent`` for ``rank``: every shard header of ``parent`` this process
    keeps (:func:`remember`), plus the headers of ``rank``'s own shards ``names`` read from the
    store when not kept (one ranged GET each, two for headers over 64 KiB). None when ``parent``
    is not a checkpoint of one of ``layouts``. A header that cannot be read is logged and left out
    (those bytes are simply written again); an outage is not damage and is not hidden either:
    it is logged the same way, since the save itself will meet it.
    """
    if layouts is not None and parent.topology.get("layout") not in layouts:
        return None
    index = ChunkIndex(parent)
    for s in parent.shards:
        index.objects[(*parent.ref, s.rank, s.name)] = Reference.to(s, parent)
    for r in parent.references:
        index.objects[r.identity] = r
    kept = recall(store, parent.step, parent.attempt)
    for rank_name in [(rank, n) for n in names]:
        if rank_name in kept:
            continue
        try:
            receipt = parent.shard(*rank_name)
        except KeyError:
            continue
        key = receipt.key

        def read_range(start: int, end: int, key: str = key) -> bytes:
            return store.get(key, byte_range=(start, end))

        try:
            got = read_header(read_range, receipt.size)
            index.requests += 1
        except Exception as exc:  # noqa: BLE001 - an index is an optimisation; the save goes on
            log.warning(
                "cannot read the header of %s to reuse its bytes (%s): %s; writing them again",
                receipt.key,
                "damaged" if is_damage(exc) else "store error",
                exc,
            )
            continue
        if got is not None:
            kept[rank_name] = index_entries(got[0]) if got[0].get("hash") == HASH_NAME else []
            remember(store, parent.step, parent.attempt, rank_name[0], rank_name[1], got[0])
    for (shard_rank, name), entries in kept.items():
        if shard_rank >= 0:  # negative ranks hold other kinds of tables (remember_value)
            index.add((*parent.ref, shard_rank, name), entries)
    return index


def resolver_for(store: Store, manifest: Manifest) -> Resolver:
    """How a restore of ``manifest`` reads the byte ranges its shards reference: ranged GETs of
    the objects its manifest references (and only those), sized by their receipts."""
    refs = {r.identity: r for r in manifest.references}

    def read(identity: Identity, start: int, end: int) -> bytes:
        return store.get(refs[identity].key, byte_range=(start, end))

    return Resolver({i: r.size for i, r in refs.items()}, read, workers=max(1, min(4, store.max_in_flight)))
