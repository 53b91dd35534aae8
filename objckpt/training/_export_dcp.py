"""Planning the export of a DCP checkpoint: DCP's metadata shard turned into the tensors and
pieces of the file.

Each exported tensor is assembled at its global shape from the chunks the saving ranks held
(:func:`_plan_dcp`; every chunk is read by ranged GETs and checked against the CRC32C recorded for
it in the CRC32C-verified metadata shard), and those chunks must tile it exactly
(:func:`_check_cover`).

Separate from :mod:`._export_plan` (the objckpt container layouts: CheckpointManager and Lightning
shards, whose headers are parsed and flattened; this module shares only its naming helpers) because
DCP's layout is a different thing to read: an item table of chunks per tensor, not container
headers. Like it, this only reads metadata and produces :class:`~._export_io._Tensor` /
:class:`~._export_io._Piece` / :class:`~._export_io._Source` lists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .. import layout
from ..errors import ManifestError
from ..manifest import Manifest, ShardReceipt
from ..reader import Reader
from ..store import Store
from ._export_io import _Piece, _Source, _Tensor
from ._export_plan import _choose_entry, _out_dtype, _rename


def _plan_dcp(
    store: Store,
    reader: Reader,
    manifest: Manifest,
    entry: str | None,
    cast: torch.dtype | None,
    strip: str | None,
    add: str | None,
) -> tuple[list[_Tensor], list[_Source], list[str], str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp import MANIFEST_KEY, decode_metadata

    info = manifest.metadata[MANIFEST_KEY]
    by_key = {r.key: r for r in manifest.shards}

    def receipt_for(rank: Any, name: Any) -> ShardReceipt:
        if not isinstance(rank, int) or not 0 <= rank < manifest.world_size:
            raise ManifestError(f"step {manifest.label}: DCP data names rank {rank!r}", key=manifest.key)
        try:
            key = layout.shard_key(manifest.step, manifest.attempt, rank, name)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"step {manifest.label}: bad shard name {name!r}: {exc}") from None
        # either layout: the manifest's keys may carry the spreading prefix (layout.py)
        receipt = by_key.get(key) or by_key.get(
            layout.shard_key(manifest.step, manifest.attempt, rank, name, spread=True)
        )
        if receipt is None:
            raise ManifestError(f"step {manifest.label}: DCP data names {key!r}, not in the manifest")
        return receipt

    ms = info.get("metadata_shard")
    if not isinstance(ms, Mapping):
        raise ManifestError(f"step {manifest.label}: the DCP entry names no metadata shard", key=manifest.key)
    metadata, locations = decode_metadata(reader.read_shard(receipt_for(ms.get("rank"), ms.get("name"))))
    fqns = metadata.state_dict_metadata
    tops = sorted({f.split(".", 1)[0] for f in fqns if "." in f})
    entry = _choose_entry(entry, tops, "model", manifest, store)
    prefix = f"{entry}."
    chunks_of: dict[str, list[tuple[Any, Any]]] = {}
    for index, loc in locations.items():
        if index.fqn.startswith(prefix):
            chunks_of.setdefault(index.fqn, []).append((index, loc))
    mine = [f for f in fqns if f.startswith(prefix)]
    names = _rename(
        [f[len(prefix) :] for f in mine if isinstance(fqns[f], TensorStorageMetadata)], strip, add
    )
    skipped = [f[len(prefix) :] for f in mine if not isinstance(fqns[f], TensorStorageMetadata)]
    sources: dict[str, _Source] = {}
    tensors: list[_Tensor] = []
    for fqn in mine:
        md = fqns[fqn]
        if not isinstance(md, TensorStorageMetadata):
            continue
        name = fqn[len(prefix) :]
        dtype = md.properties.dtype
        shape = tuple(int(s) for s in md.size)
        t = _Tensor(names[name], dtype, _out_dtype(name, dtype, cast), shape)
        strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
        boxes = []
        covered = 0
        first: tuple[int, int] | None = None
        for index, loc in chunks_of.get(fqn, []):
            if loc.kind != "tensor" or loc.dtype != str(dtype).removeprefix("torch."):
                raise ManifestError(f"step {manifest.label}: item {fqn} is stored as {loc.kind} {loc.dtype}")
            offsets = tuple(index.offset or (0,) * len(shape))
            sizes = tuple(loc.shape or ())
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o + s > g for o, s, g in zip(offsets, sizes, shape, strict=True))
            ):
                raise ManifestError(
                    f"step {manifest.label}: chunk {list(sizes)} at {list(offsets)} of {fqn} lies outside "
                    f"its shape {list(shape)}"
                )
            boxes.append((offsets, sizes))
            covered += math.prod(sizes)
            receipt = receipt_for(loc.rank, loc.shard)
            src = sources.setdefault(receipt.key, _Source(receipt, whole=False))
            # runs: the innermost dimensions the chunk covers fully, plus one partial dimension
            d = max(len(shape) - 1, 0)
            while d > 0 and sizes[d] == shape[d]:
                d -= 1
            run = math.prod(sizes[d:])
            base = sum(o * s for o, s in zip(offsets, strides, strict=True))
            piece = _Piece(
                loc.start,
                loc.length,
                t,
                run=run if math.prod(sizes) else 0,
                base=base,
                outer=tuple(sizes[:d]),
                strides=tuple(strides[:d]),
                crc32c=loc.crc32c,
                what=f"item {fqn} chunk at {list(offsets)}",
            )
            if piece.run == 0 and piece.length:
                raise ManifestError(f"step {manifest.label}: empty chunk of {fqn} holds {loc.length} bytes")
            src.pieces.append(piece)
            order = (list(sources).index(receipt.key), loc.start)
            first = order if first is None or order < first else first
        _check_cover(fqn, shape, boxes, covered, manifest)
        t.order = first or (0, 0)
        tensors.append(t)
    return tensors, list(sources.values()), skipped, entry


def _check_cover(
    fqn: str,
    shape: tuple[int, ...],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    covered: int,
    m: Manifest,
) -> None:
    """The chunks of a tensor tile it exactly: no two overlap and together they hold every element."""
    nonempty = [(o, s) for o, s in boxes if all(n > 0 for n in s)]
    for i, (oa, sa) in enumerate(nonempty):
        for ob, sb in nonempty[i + 1 :]:
            if all(a < b + nb and b < a + na for a, na, b, nb in zip(oa, sa, ob, sb, strict=True)):
                raise ManifestError(f"step {m.label}: chunks of {fqn} overlap", key=m.key)
    total = 1
    for n in shape:
        total *= n
    if covered != total:
        raise ManifestError(
            f"step {m.label}: the chunks of {fqn} hold {covered} of its {total} elements", key=m.key
        )
