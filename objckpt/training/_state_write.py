"""How one rank writes its CheckpointManager shards (:func:`write`; what they hold: :mod:`.shards`).

The replicated share is spread over pieces by :func:`objckpt.writer.spread_for`, the DCP
writer's rule, and the pieces are written at once; ``rank.bin`` follows. Each shard is encoded
as it streams (plain, or in chunks for deduplication and compression), its buffers borrowed from
the captured (or staged) tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from .._pool import run_all
from ..manifest import ShardReceipt
from ..writer import ShardWriter, Spread, pack, spread_for
from . import dedup, serialization
from ._state_layout import RANK_SHARD, REPLICATED_SHARD, STATE_LAYOUTS

if TYPE_CHECKING:
    from .shards import Capture

__all__ = ["Abandoned", "write"]


class Abandoned(Exception):
    """This rank stopped writing an abandoned save (internal: becomes ``ticket.abandon()``)."""


def write(writer: ShardWriter, cap: Capture, abandon: threading.Event | None = None) -> list[ShardReceipt]:
    """Stream this rank's shards of ``cap`` through ``writer``; returns their receipts.

    The replicated share is spread over pieces written at once (:func:`_shards_to_write`); a
    piece that fails stops the pieces not started yet, and the save fails (nothing is committed:
    what was written is an uncommitted attempt's, collected by ``gc``).

    Raises:
        Abandoned: ``abandon`` was set (the upload in progress is aborted).
        StoreError, ...: as :meth:`ShardWriter.write`.
    """
    progress = None
    if abandon is not None:

        def progress(_: int) -> None:
            # called after every uploaded part: raising here aborts the multipart upload
            if abandon.is_set():
                raise Abandoned()

    chunked = cap.dedup or (cap.compression is not None and cap.compression.enabled)
    index = None
    if cap.dedup:
        parent = dedup.parent_for(writer.store, cap.step)
        if parent is not None:
            index = dedup.build_index(
                writer.store,
                parent,
                rank=writer.rank,
                names=[s.name for s in parent.shards if s.rank == writer.rank],
                layouts=STATE_LAYOUTS,
            )

    todo, spread = _shards_to_write(writer, cap)

    def one(name: str, tree: Any) -> tuple[str, int, Any]:
        if chunked:
            encoded: Any = serialization.encode_chunked(tree, _chunk_options(writer, cap, index))
        else:
            encoded = serialization.encode(tree)
        source: Iterable[memoryview] = encoded.buffers()
        if abandon is not None:
            source = _abortable(source, abandon)
        # a chunked shard's layout follows the writer's part size: only a plain one tells its size.
        # borrow: every buffer the encoder yields stays alive and unchanged until the write
        # returns (views of the captured tensors, fresh header and compressed bytes), so parts
        # that straddle them are sent as views instead of being assembled by copying
        receipt = writer.write(
            name,
            source,
            progress=progress,
            size=None if chunked else encoded.size,
            borrow=True,
            single_request_max=spread.single_request_max,
        )
        return name, receipt.size, encoded if chunked else None

    # the replicated pieces at once, rank.bin after them (a failed one cancels those not
    # started: the save has failed)
    at_once = min(spread.shards, len(todo) - 1)
    written = run_all([partial(one, name, tree) for name, tree in todo], at_once, "objckpt-shard")
    used: set[serialization.Identity] = set()
    cap.reused_bytes = 0
    cap.bytes_written = sum(size for _, size, _ in written)
    for _, _, encoded in written:
        if encoded is not None:
            used |= encoded.used
            cap.reused_bytes += encoded.reused_bytes
    cap.references = index.references_used(used) if index is not None else []
    for name, _, encoded in written:  # the next save indexes these without a request
        if encoded is not None:
            dedup.remember(writer.store, writer.step, writer.attempt, writer.rank, name, encoded.header)
    return writer.receipts


def _shards_to_write(writer: ShardWriter, cap: Capture) -> tuple[list[tuple[str, Any]], Spread]:
    """The shards of ``cap`` as (name, tree), and how they are spread: the replicated share over
    pieces of about equal size by :func:`objckpt.writer.spread_for` (tensors in table order;
    rank 0's first piece keeps the structure), then ``rank.bin``. A compressed save keeps one
    piece: its bytes are fresh buffers, not views of the tensors, and a one-request piece holds
    all of them at once."""
    tree = cap.replicated_tree
    if tree is None:
        return [(RANK_SHARD, cap.local_tree)], Spread(1, None)
    sizes = [t.numel() * t.element_size() for t in tree["tensors"]]
    spread = Spread(1, None)
    if cap.compression is None or not cap.compression.enabled:
        spread = spread_for(
            sum(sizes),
            part_size=writer.part_size or writer.store.part_size,
            max_in_flight=writer.max_in_flight or writer.store.max_in_flight,
            cheap_multipart=writer.store.cheap_multipart,
        )
    todo: list[tuple[str, Any]] = []
    for number, ks in enumerate(pack(sizes, spread.limit(sum(sizes)))):
        piece = {"index": [tree["index"][k] for k in ks], "tensors": [tree["tensors"][k] for k in ks]}
        if number == 0:  # the structure (rank 0), in the shard a /1 reader would look for
            piece.update((k, v) for k, v in tree.items() if k not in piece)
        todo.append((REPLICATED_SHARD if number == 0 else f"replicated.{number}.bin", piece))
    todo.append((RANK_SHARD, cap.local_tree))
    return todo, spread


def _never(sample: bytes, length: int) -> bool:
    return False  # compression without deduplication: no chunk needs its full hash


def _chunk_options(
    writer: ShardWriter, cap: Capture, index: dedup.ChunkIndex | None
) -> serialization.ChunkOptions:
    policy = cap.compression if cap.compression is not None and cap.compression.enabled else None
    return serialization.ChunkOptions(
        chunk_size=dedup.CHUNK_SIZE,
        hash_name=dedup.HASH_NAME,
        hash_fn=dedup.chunk_hash,
        min_bytes=dedup.MIN_BYTES,
        lookup=index.lookup if index is not None else None,
        sample_fn=dedup.chunk_sample,
        # hash only chunks whose sample the parent has; everything when there is nothing to
        # compare with (no parent, or one written without samples)
        candidate=(index.has_sample if index is not None and index.samples else None)
        if cap.dedup
        else _never,
        codec=policy.codec if policy is not None else None,
        compress=policy.try_compress if policy is not None else None,
        part_size=writer.part_size or writer.store.part_size,
    )


def _abortable(buffers: Iterable[memoryview], abandon: threading.Event) -> Iterator[memoryview]:
    for buf in buffers:
        if abandon.is_set():
            raise Abandoned()
        yield buf
