"""One rank's DCP write path below the ``StorageWriter`` protocol: how its planned items are
packed into shard files, and how each item becomes the bytes streamed into its shard.

Separate from :mod:`.writer`, which speaks DCP's protocol (plans, the attempt, the commit,
pickling for ``async_save``): nothing here knows of attempts or manifests, only items, their
bytes, and where each landed. That includes the two per-item decisions made while streaming:
dedup (an item unchanged since the parent is located in the parent's object, not sent) and the
loadability check (a bytes item the load policy would refuse fails the save before anything is
committed).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator, Mapping
from concurrent.futures import Future as HashFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from ...errors import LoadRefusedError
from ...writer import pack, spread_for
from .. import dedup
from ._metadata import _dtype_name, _first_line, _ItemLocation


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How one rank writes its items: the shards, how many are written at once (``spread``),
    and the size up to which each is written by a single request (``None``: one part)."""

    shards: list[list[WriteItem]]
    spread: int
    single_request_max: int | None


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order; zero-copy for contiguous CPU tensors.

    Copies only what must be copied: device tensors to host, non-contiguous views, and lazily
    conjugated/negated tensors (whose memory does not hold the values)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    # A uint8 view works for every dtype (numpy has no bfloat16); the memoryview keeps the
    # tensor alive for as long as the upload holds parts of it.
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def split_into_shards(
    items: list[WriteItem],
    *,
    max_shard_bytes: int,
    part_size: int,
    max_in_flight: int,
    cheap_multipart: bool = False,
) -> ShardPlan:
    """Pack items into shards: bytes items first (small, like DCP's writer), then tensors in
    plan order, a new shard whenever one would exceed ``max_shard_bytes`` or the rank's share
    per shard. A rank with no items still writes one empty shard so its receipt shows it took
    part in the save. Pure.

    How many shards are written at once, and which by one request: :func:`objckpt.writer.spread_for`,
    the rule CheckpointManager's replicated shards follow too. A shard that comes out larger
    than one request (a single big tensor) is written as a multipart upload all the same:
    ``put_stream`` decides by the bytes it reads."""
    ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
        i for i in items if i.type != WriteItemType.BYTE_IO
    ]
    total = sum(item.tensor_storage_size() or 0 for item in ordered)
    spread = spread_for(
        total, part_size=part_size, max_in_flight=max_in_flight, cheap_multipart=cheap_multipart
    )
    limit = min(max_shard_bytes, spread.limit(total)) if spread.shards > 1 else max_shard_bytes
    groups = pack([item.tensor_storage_size() or 0 for item in ordered], limit)
    shards = [[ordered[k] for k in group] for group in groups]
    return ShardPlan(shards, spread.shards, spread.single_request_max)


def stream_items(
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    out: list[tuple[WriteItem, _ItemLocation]],
    *,
    rank: int,
    candidates: Mapping[Any, _ItemLocation],
    dedup_enabled: bool,
) -> Iterator[memoryview]:
    """Yield each item's bytes, resolving items lazily (resolve_data may allocate), and
    record where each landed with its CRC32C. Runs in the uploading thread, so ``out`` is
    complete when ``ShardWriter.write`` returns.

    ``candidates`` are the parent's items this rank may reuse (by item index); with
    ``dedup_enabled`` each tensor is sampled and hashed so an unchanged one is reused, not sent.

    Raises:
        LoadRefusedError: a bytes item the load policy would refuse (see :func:`_check_loadable`).
        TypeError / ValueError: the planner resolved an item to the wrong type or shape.
    """
    offset = 0
    hashing: list[tuple[int, HashFuture[bytes]]] = []  # (index in out, hash) computed while uploading
    pool = ThreadPoolExecutor(1, thread_name_prefix="objckpt-dcp-hash") if dedup_enabled else None
    try:
        yield from _stream_items(name, items, planner, out, offset, hashing, pool, rank, candidates)
        for i, fut in hashing:
            item, loc = out[i]
            out[i] = (item, dataclasses.replace(loc, hash=fut.result().hex()))
    finally:
        if pool is not None:
            pool.shutdown(wait=True)


def _stream_items(
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    out: list[tuple[WriteItem, _ItemLocation]],
    offset: int,
    hashing: list[tuple[int, HashFuture[bytes]]],
    pool: ThreadPoolExecutor | None,
    rank: int,
    candidates: Mapping[Any, _ItemLocation],
) -> Iterator[memoryview]:
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise TypeError(f"{item.index.fqn}: planner resolved a bytes item to {type(data).__name__}")
            view = data.getbuffer()
            _check_loadable(view, item.index.fqn)
            loc = _ItemLocation(rank, name, offset, view.nbytes, "", "bytes")
        else:
            if not isinstance(data, torch.Tensor):
                raise TypeError(f"{item.index.fqn}: planner resolved a tensor item to {type(data).__name__}")
            expected = tuple(item.tensor_data.chunk.sizes) if item.tensor_data else tuple(data.shape)
            if tuple(data.shape) != expected:
                raise ValueError(
                    f"{item.index.fqn}: resolved tensor has shape {tuple(data.shape)}, plan says {expected}"
                )
            view = _tensor_bytes(data)
            cand = candidates.get(item.index)
            sample = digest = None
            if pool is not None:
                sample = dedup.chunk_sample(view).hex()
                # hashed in full only when it may be unchanged (its sample is the parent's)
                # or is new (nothing to compare it with): a changed item is never hashed
                if cand is not None and cand.length == view.nbytes and cand.sample in (None, sample):
                    digest = dedup.chunk_hash(view).hex()
                    if digest == cand.hash and cand.dtype == _dtype_name(data.dtype):
                        # unchanged since the parent: located in the parent's object, not sent
                        out.append((item, dataclasses.replace(cand, receipt=None)))
                        continue
            loc = _ItemLocation(
                rank,
                name,
                offset,
                view.nbytes,
                "",
                "tensor",
                _dtype_name(data.dtype),
                tuple(int(s) for s in data.shape),
            )
        # the CRC32C is filled in from the upload's own pass (write_data): not hashed here
        out.append((item, loc))
        if pool is not None and loc.kind == "tensor":
            loc = dataclasses.replace(loc, sample=sample, hash=digest)
            out[-1] = (item, loc)
            if digest is None and (cand is None or cand.length != view.nbytes):
                hashing.append((len(out) - 1, pool.submit(dedup.chunk_hash, view)))
        offset += view.nbytes
        if view.nbytes:
            yield view


def _check_loadable(view: memoryview, fqn: str) -> None:
    """Refuse, before anything is committed, a bytes item that the load policy would refuse.

    DCP pickles non-tensor values (``torch.save``) into bytes items; objckpt loads them only with
    ``torch.load(weights_only=True)`` (invariant 12). A value that policy cannot rebuild (an
    ``io.BytesIO``, a custom class) would make a checkpoint that saves but never loads, so the save
    fails here instead, naming the item.

    Raises:
        LoadRefusedError: naming the item and the allow-list mechanism.
    """
    try:
        torch.load(io.BytesIO(view), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - whatever the restricted unpickler refuses
        raise LoadRefusedError(
            f"DCP item {fqn!r} would be saved as a pickle that torch.load(weights_only=True) refuses "
            f"({type(exc).__name__}: {_first_line(exc)}); objckpt never loads unrestricted pickles, so "
            "this checkpoint could not be restored. Store it as a tensor or plain data, or allow its "
            "classes with torch.serialization.add_safe_globals([...]) on every rank (before saving and "
            "loading)"
        ) from None
