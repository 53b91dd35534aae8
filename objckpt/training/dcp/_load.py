"""The DCP reader's load engine: parallel, bounded ranged reads straight into the destination.

What one rank's ``read_data`` does, in three steps:

* **Plan** (:func:`plan_reads`, pure): per shard, items whose bytes lie close together
  (gap <= ``gap``) are coalesced into one read of at most ``cap`` bytes, and an item larger than
  ``cap`` is split into several reads, so one big tensor is fetched by parallel requests too.
  Each read is a list of segments: a piece of one item, or a gap whose bytes are skipped.
* **Read** (worker threads, at most ``window`` reads in flight): one ``Store.get_into`` per read,
  a scatter read into the segments' memory, then the CRC32C of every segment, computed there
  (off the main thread; the C CRC releases the GIL).
* **Finish** (main thread, in plan order): once all of an item's segments arrived, their CRCs are
  combined (:func:`~objckpt._crc.crc32c_combine`, no byte read again) and checked against the
  item's recorded CRC32C; only then is the item committed to the planner.

Where bytes land: a tensor item that fills one contiguous CPU destination tensor of its dtype
as is (the usual load, same sharding) is read *into that tensor's memory*: no copy at all. Any
other item (resharded slices, another dtype or device, bytes items) is read into one scratch
buffer and copied once into its destinations after verification.

Memory: scratch buffers exist only for items being read (at most ``window`` reads ahead).
Failure: a failed or mismatching read raises :class:`ChecksumMismatchError` and stops the load;
tensors filled in place by then may hold unverified bytes, which is why a load that raised must
not be used (``load_sharded`` falls back, overwriting them, or raises).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ... import _crc
from ...errors import ChecksumMismatchError, ManifestError, NotFoundError
from ...store import Store
from ._metadata import _dtype_from_name, _ItemLocation

__all__ = ["LoadItem", "Read", "Segment", "plan_reads", "run_reads"]


@dataclasses.dataclass(eq=False)
class LoadItem:
    """One stored item this rank reads, and the requests it serves."""

    key: str
    loc: _ItemLocation
    reqs: list[ReadItem]
    #: the destination tensor of a single-request tensor item, resolved once when prepared
    target: torch.Tensor | None = None
    #: whether the bytes are read into ``target``'s memory (no copy)
    direct: bool = False
    #: where the item's bytes are read: the target's memory or a scratch buffer
    buffer: memoryview | None = None
    scratch: Any = None  # keeps the scratch buffer alive
    pieces: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (offset, size, crc)
    received: int = 0
    #: keep ``buffer`` once finished: a read-once load sends its bytes to the other ranks next
    keep: bool = False


@dataclasses.dataclass(frozen=True)
class Segment:
    """``size`` bytes of a read: item bytes ``[offset, offset + size)``, or a gap (``item=None``)."""

    item: LoadItem | None
    offset: int
    size: int


@dataclasses.dataclass(frozen=True)
class Read:
    """One ranged request: bytes ``[start, end)`` of ``key``, split into segments in order."""

    key: str
    start: int
    end: int
    segments: tuple[Segment, ...]


def plan_reads(items: list[LoadItem], *, cap: int, gap: int) -> list[Read]:
    """Coalesce and split ``items`` into reads of at most ``cap`` bytes (see module doc).

    Items are grouped per key in offset order; a group takes the next item while it starts at
    or after the group's end, within ``gap`` bytes of it, and the group stays within ``cap``.
    Empty items need no read and appear in none."""
    if cap < 1:
        raise ValueError(f"cap must be positive, got {cap}")
    by_key: dict[str, list[LoadItem]] = {}
    for item in items:
        if item.loc.length:
            by_key.setdefault(item.key, []).append(item)
    reads: list[Read] = []
    for key in sorted(by_key):
        members = sorted(by_key[key], key=lambda i: i.loc.start)
        group: list[LoadItem] = []
        for item in members:
            if group:
                end = _end(group[-1])
                if not (end <= item.loc.start <= end + gap and _end(item) - group[0].loc.start <= cap):
                    reads.extend(_split(key, group, cap))
                    group = []
            group.append(item)
        if group:
            reads.extend(_split(key, group, cap))
    return reads


def _end(item: LoadItem) -> int:
    return item.loc.start + item.loc.length


def _split(key: str, group: list[LoadItem], cap: int) -> list[Read]:
    """The group's extent as consecutive reads of at most ``cap`` bytes."""
    pieces: list[Segment] = []  # the whole extent, items and gaps, in order
    pos = group[0].loc.start
    for item in group:
        if item.loc.start > pos:
            pieces.append(Segment(None, 0, item.loc.start - pos))
        pieces.append(Segment(item, 0, item.loc.length))
        pos = _end(item)
    reads: list[Read] = []
    start = group[0].loc.start
    current: list[Segment] = []
    room = cap
    for piece in pieces:
        offset, left = piece.offset, piece.size
        while left:
            n = min(left, room)
            current.append(Segment(piece.item, offset, n))
            offset, left, room = offset + n, left - n, room - n
            if not room:
                size = sum(s.size for s in current)
                reads.append(Read(key, start, start + size, tuple(current)))
                start, current, room = start + size, [], cap
    if current:
        size = sum(s.size for s in current)
        reads.append(Read(key, start, start + size, tuple(current)))
    return reads


# ------------------------------------------------------------------------------- engine


def run_reads(
    store: Store,
    items: list[LoadItem],
    reads: list[Read],
    planner: LoadPlanner,
    *,
    window: int,
    finish: Callable[[LoadItem, memoryview], None],
    step: Any,
) -> None:
    """Fetch every read (``window`` in flight, finished in plan order), verify each item once
    all its bytes arrived, then ``finish(item, bytes)`` it on this thread. Empty items are
    verified and finished first. Raises what the reads or ``finish`` raise; nothing is left
    running on return."""
    for item in items:
        if not item.loc.length:
            _verify(item, store, step)
            finish(item, memoryview(b""))
    if not reads:
        return
    pending: deque[tuple[Read, Future[list[tuple[LoadItem, int, int, int]]]]] = deque()
    with ThreadPoolExecutor(
        max_workers=min(window, len(reads)), thread_name_prefix="objckpt-dcp-read"
    ) as pool:
        try:
            for read in reads:
                for seg in read.segments:
                    if seg.item is not None and seg.item.buffer is None:
                        _prepare(seg.item, planner)
                pending.append((read, pool.submit(_fetch, store, read, step)))
                if len(pending) >= window:
                    _land(*pending.popleft(), store, step, finish)
            while pending:
                _land(*pending.popleft(), store, step, finish)
        finally:
            for _, fut in pending:
                fut.cancel()


def _land(
    read: Read,
    fut: Future[list[tuple[LoadItem, int, int, int]]],
    store: Store,
    step: Any,
    finish: Callable[[LoadItem, memoryview], None],
) -> None:
    for item, offset, size, crc in fut.result():
        item.pieces.append((offset, size, crc))
        item.received += size
        if item.received == item.loc.length:
            _verify(item, store, step)
            assert item.buffer is not None
            finish(item, item.buffer)
            if not item.keep:
                item.buffer = item.scratch = None  # scratch freed as soon as it is copied out


def _verify(item: LoadItem, store: Store, step: Any) -> None:
    """The item's CRC32C, combined from its pieces' CRCs, must be the one recorded for it."""
    pieces = sorted(item.pieces)
    crc, size = _crc.crc32c_concat((c, n) for _, n, c in pieces)
    got = _crc.encode_crc32c(crc)
    if size != item.loc.length or got != item.loc.crc32c:
        loc = item.loc
        raise ChecksumMismatchError(
            f"item {item.reqs[0].storage_index.fqn} bytes [{loc.start}, {loc.start + loc.length}) of "
            f"step {step} fail their CRC32C ({got} != {loc.crc32c})",
            key=item.key,
            location=store.location,
        )


def _fetch(store: Store, read: Read, step: Any) -> list[tuple[LoadItem, int, int, int]]:
    """Worker: one scatter read, then each item segment's CRC32C."""
    views: list[memoryview] = []
    for seg in read.segments:
        if seg.item is None:
            views.append(memoryview(bytearray(seg.size)))  # a gap: read and dropped
        else:
            assert seg.item.buffer is not None
            views.append(seg.item.buffer[seg.offset : seg.offset + seg.size])
    try:
        got = store.get_into(read.key, read.start, views)
    except NotFoundError as exc:
        # A shard a committed manifest names is gone: the checkpoint is damaged.
        raise ChecksumMismatchError(
            f"shard of committed step {step} is missing: {exc}", key=read.key, location=store.location
        ) from exc
    if got != read.end - read.start:
        raise ChecksumMismatchError(
            f"ranged read [{read.start}, {read.end}) returned {got} bytes (shard truncated?)",
            key=read.key,
            location=store.location,
        )
    return [
        (seg.item, seg.offset, seg.size, _crc.crc32c_of(view))
        for seg, view in zip(read.segments, views, strict=True)
        if seg.item is not None
    ]


def _prepare(item: LoadItem, planner: LoadPlanner) -> None:
    """Decide where the item's bytes land: its destination tensor's memory, or a scratch."""
    loc = item.loc
    if loc.kind == "tensor":
        item.target, item.direct = _destination(item, planner)
        if item.direct:
            assert item.target is not None
            item.buffer = _bytes_of(item.target)
            return
        # aligned for every dtype (the allocator's alignment), so it can be viewed as the dtype
        item.scratch = torch.empty(loc.length, dtype=torch.uint8)
        item.buffer = _bytes_of(item.scratch)
        return
    item.scratch = bytearray(loc.length)
    item.buffer = memoryview(item.scratch)


def _destination(item: LoadItem, planner: LoadPlanner) -> tuple[torch.Tensor | None, bool]:
    """The destination of a single-request tensor item (resolved here, once), and whether the
    item fills it exactly as stored, so its bytes can be read straight into it."""
    if len(item.reqs) != 1 or item.reqs[0].type != LoadItemType.TENSOR:
        return None, False
    req, loc = item.reqs[0], item.loc
    shape = list(loc.shape or ())
    target = planner.resolve_tensor(req).detach()
    if any(req.storage_offsets) or list(req.lengths) != shape:
        return target, False
    fits = not (
        target.device.type != "cpu"
        or target.dtype != _dtype_from_name(loc.dtype)
        or list(target.shape) != shape
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.numel() * target.element_size() != loc.length
    )
    return target, fits


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray exports the buffer protocol


def tensor_from(item: LoadItem, data: memoryview) -> torch.Tensor:
    """The stored chunk as a tensor over ``data`` (the item's scratch); no copy."""
    loc = item.loc
    dtype = _dtype_from_name(loc.dtype)
    shape = tuple(loc.shape or ())
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(item.scratch, torch.Tensor):
        return item.scratch.view(dtype).reshape(shape)
    raise ManifestError(f"{item.reqs[0].storage_index.fqn}: tensor item without a tensor buffer")


def narrow(tensor: torch.Tensor, req: ReadItem) -> torch.Tensor:
    return narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
