"""Per-rank shard writing (invariants 1-4).

Each rank of a save writes its shards with one :class:`ShardWriter` under its own prefix of the
attempt, ``data/<spread>/<step>-<attempt>/<rank>/<name>`` (``key_spreading=False``: without
``<spread>``, the layout of older saves), create-if-absent: a shard is never
overwritten, and a retried save is a new attempt with new keys. Large shards stream through the
store's bounded multipart upload (peak memory ``part_size x (max_in_flight + 1)``, a CRC32C on
every part, abort on failure, transient errors retried by the store's one retry policy).
Each write returns a :class:`~objckpt.manifest.ShardReceipt` for the coordinator.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from . import layout
from ._crc import Buffer
from .errors import ChecksumMismatchError, NotSupportedError
from .manifest import ShardReceipt
from .store.base import BytesSource, PutMode, Store, StreamChecksums

__all__ = ["ShardWriter", "Spread", "pack", "spread_for"]

#: a large rank's shard, written alongside others, holds at least this many parts
SPREAD_PARTS = 4


@dataclass(frozen=True)
class Spread:
    """How one rank's bytes are spread over shards written at once (:func:`spread_for`)."""

    #: shards written at once (1: one shard)
    shards: int
    #: each shard up to this size is written by ONE request (``None``: parts, as usual)
    single_request_max: int | None

    def limit(self, total: int) -> int:
        """The bytes each shard should hold so that ``total`` bytes fill :attr:`shards` shards."""
        return -(-total // self.shards) if self.shards > 1 else max(total, 1)


def pack(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of ``sizes`` in order, grouped: a new group whenever the next one would take the
    current group past ``limit`` (a size larger than ``limit`` gets a group of its own). Pure."""
    groups: list[list[int]] = [[]]
    size = 0
    for k, n in enumerate(sizes):
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups


def spread_for(total: int, *, part_size: int, max_in_flight: int, cheap_multipart: bool = False) -> Spread:
    """How a rank writes ``total`` bytes: the one rule of the DCP writer and CheckpointManager.
    Pure.

    ``cheap_multipart`` (``Store.cheap_multipart``, file://): one shard, whatever its size; a
    multipart upload there is parallel ``pwrite`` s into one file, which measured faster than
    several files written at once. Otherwise (object stores):

    ``part_size x max_in_flight`` is the most one request sends within the memory bound (128 MiB
    by default):

    * under two parts: one shard, written by one request;
    * up to ``max_in_flight`` such requests' worth (1 GiB by default): ``min(max_in_flight,
      total / part_size)`` shards written at once, each by ONE request. As many requests are in
      flight as a multipart upload's parts would be, so nothing is lost in parallelism, but each
      shard costs one request instead of a create, its parts and a completion, and the server
      assembles nothing (512 MiB at the defaults: 8 requests, where one multipart upload of
      16 MiB parts makes 34);
    * larger: ``max_in_flight`` multipart shards written at once, each at least
      :data:`SPREAD_PARTS` parts, so the per-shard requests stay a small share.
    """
    if cheap_multipart:
        return Spread(1, None)
    one_request = part_size * max_in_flight
    if total <= max_in_flight * one_request:
        shards = max(1, min(max_in_flight, total // part_size))
        return Spread(shards, one_request if shards > 1 else None)
    return Spread(max(1, min(max_in_flight, total // (SPREAD_PARTS * part_size))), None)


class ShardWriter:
    """Writes one rank's shards for one attempt of one step. Thread-safe.

    Args:
        store: the run root's store; must enforce create-if-absent.
        step, attempt, rank: where the shards go (``layout.rank_prefix``).
        part_size, max_in_flight: override the store's multipart settings for these shards.
        sha256: also compute each shard's SHA-256 while streaming (costs CPU; off by default).
        key_spreading: put the shards under this rank's spreading prefix (``layout.spread_of``,
            invariant 16; default); ``False``: ``data/<step>-<attempt>/<rank>/`` as before.

    Raises:
        NotSupportedError: the store cannot enforce create-if-absent (shards could be
            silently overwritten by a zombie writer, so objckpt refuses to write).
        ValueError: invalid step / attempt id / rank.
    """

    def __init__(
        self,
        store: Store,
        *,
        step: int,
        attempt: str,
        rank: int,
        part_size: int | None = None,
        max_in_flight: int | None = None,
        sha256: bool = False,
        key_spreading: bool = True,
    ) -> None:
        if not store.capabilities.create_if_absent:
            raise NotSupportedError(
                "objckpt needs create-if-absent writes to guarantee shards are never "
                "overwritten; this store does not enforce them",
                location=store.location,
            )
        if part_size is not None and part_size < 1:
            raise ValueError(f"part_size must be positive, got {part_size}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.store = store
        self.step = step
        self.attempt = attempt
        self.rank = rank
        self.key_spreading = bool(key_spreading)
        self.prefix = layout.rank_prefix(
            step, attempt, rank, spread=self.key_spreading
        )  # validates all three
        self.part_size = part_size
        self.max_in_flight = max_in_flight
        self.sha256 = sha256
        self._receipts: list[ShardReceipt] = []
        self._lock = threading.Lock()

    def key_for(self, name: str) -> str:
        """The key shard ``name`` gets (``ValueError`` for a name that is not portable)."""
        return layout.shard_key(self.step, self.attempt, self.rank, name, spread=self.key_spreading)

    def write(
        self,
        name: str,
        source: BytesSource,
        *,
        progress: Callable[[int], None] | None = None,
        size: int | None = None,
        checksums: StreamChecksums | None = None,
        borrow: bool = False,
        single_request_max: int | None = None,
    ) -> ShardReceipt:
        """Stream ``source`` (bytes, an iterable of buffers, or a binary file) into shard ``name``.

        ``size``: the shard's size when the caller knows it (a bytes-like source says it
        itself): the part size then follows it (``Store.part_size_for``: S3's 10,000-part limit,
        >= 32 MiB parts for big shards), unless this writer was given a ``part_size``.
        ``checksums`` / ``borrow`` / ``single_request_max``: as :meth:`Store.put_stream` (each
        source buffer's CRC32C, from the one pass that also gives the shard's; zero-copy parts
        over live buffers; a shard up to that size written by one request).

        Atomicity: the shard appears whole or not at all; it is created only if absent, so an
        existing object is never replaced. On failure a multipart upload is aborted and the
        error re-raised; nothing is recorded in :attr:`receipts`.

        Raises:
            AlreadyExistsError: the key exists (same name twice, or a reused attempt id).
            ChecksumMismatchError: the store reports a size/CRC32C other than what was sent.
            PermissionDeniedError, NotFoundError, ...: permanent store errors, at once.
            TransientError: the retry policy's attempts/deadline ran out.
            ValueError: ``name`` is not a valid shard name.
        """
        key = self.key_for(name)
        if size is None and isinstance(source, (bytes, bytearray, memoryview)):
            size = memoryview(source).nbytes
        part_size = self.part_size or self.store.part_size_for(size)
        sums = checksums if checksums is not None else StreamChecksums()
        digest = hashlib.sha256() if self.sha256 else None

        def hashed(chunks: Iterator[Buffer]) -> Iterator[Buffer]:
            for chunk in chunks:
                assert digest is not None
                digest.update(chunk)
                yield chunk

        # put_stream hashes each byte once (CRC32C per piece, combined per part and for the
        # whole shard): nothing here hashes the bytes again
        meta = self.store.put_stream(
            key,
            hashed(_buffers(source)) if digest is not None else source,
            mode=PutMode.CREATE,  # invariant 1: never overwrite a shard
            part_size=part_size,
            max_in_flight=self.max_in_flight,
            progress=progress,
            checksums=sums,
            borrow=borrow,
            single_request_max=single_request_max,
        )
        crc_b64 = sums.b64
        # End-to-end check: what the store says it stored is what we streamed.
        if meta.size != sums.size or (meta.crc32c is not None and meta.crc32c != crc_b64):
            raise ChecksumMismatchError(
                f"store reports size {meta.size} / CRC32C {meta.crc32c} for a shard streamed as "
                f"{sums.size} bytes / {crc_b64}",
                key=key,
                location=self.store.location,
            )
        receipt = ShardReceipt(
            key=key,
            size=sums.size,
            version=meta.version,
            crc32c=crc_b64,
            rank=self.rank,
            name=name,
            parts=max(1, sums.parts),
            sha256=digest.hexdigest() if digest is not None else None,
        )
        with self._lock:
            self._receipts.append(receipt)
        return receipt

    @property
    def receipts(self) -> list[ShardReceipt]:
        """Receipts of every shard written so far, in write order (a copy)."""
        with self._lock:
            return list(self._receipts)


def _buffers(source: BytesSource) -> Iterator[Buffer]:
    """``source`` as buffers (for the optional SHA-256 pass), without re-chunking it."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        yield source
    elif hasattr(source, "read"):
        while chunk := source.read(1 << 20):
            yield chunk
    else:
        yield from source
