"""Replicated state written once across ranks, not once per rank.

State that data parallelism keeps identical on every rank (by default every ``nn.Module`` and
optimizer) is split by tensor: each rank writes about ``1/world_size`` of the bytes in its
``replicated.bin``, and rank 0's also holds the structure (the containers with every tensor
replaced by a :class:`~objckpt.training.serialization.TensorRef` into one table). On restore the
shards are joined back.

The split is by size, largest tensor first onto the least-loaded rank, and deterministic, so every
rank computes the same split from its own (identical) state; ranks check that with a digest of
the layout in the save handshake.

The table holds one entry per *storage*, not per tensor object (:func:`split_tensors`): tied
weights (``lm_head.weight`` and ``embed.weight`` are one parameter, but ``state_dict()`` returns
a fresh ``detach()`` for each key) are one entry, written once; views into one buffer are one
entry plus :class:`~objckpt.training.serialization.ViewRef` s, and :func:`resolve` rebuilds them
as views of one decoded tensor, so the sharing is restored too. The per-rank shard uses the same
table (see :mod:`.shards`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ManifestError, TrainingStateError
from ..tree import leaves, map_tree
from .serialization import TensorRef, ViewRef, make_view

__all__ = ["assign", "join", "layout_digest", "resolve", "split_tensors"]

_Ref = TensorRef | ViewRef


def split_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``tree`` by a reference into ``tensors`` (appended in depth-first
    order of first appearance), one entry per storage where that saves bytes:

    * the same tensor object, or another object with the same view of the same storage (dtype,
      shape, strides, offset: tied weights): one entry, :class:`TensorRef` s to it;
    * different views of one storage whose byte extent is no larger than their bytes together:
      one entry covering the extent (the view that spans it, if one is contiguous and does, else
      a ``uint8`` tensor over those bytes) and :class:`ViewRef` s into it;
    * views spread thinly over a large storage (sharing would write more bytes than the views
      themselves), conjugate/negative views and empty tensors: one entry each, as before.
    """
    # On the save path: one walk when no two tensor objects share a storage (the common case);
    # the grouping below only when some do.
    start = len(tensors)
    first: dict[Any, int] = {}
    refs: dict[int, _Ref] = {}
    shared = False

    def provisional(v: Any) -> Any:
        nonlocal shared
        if not isinstance(v, torch.Tensor):
            return v
        ref = refs.get(id(v))
        if ref is None:
            key = _storage_key(v)
            if key in first:
                shared = True
                return v
            first[key] = len(tensors)
            ref = refs[id(v)] = TensorRef(len(tensors))
            tensors.append(v)
        return ref

    skeleton = map_tree(tree, provisional)
    if not shared:
        return skeleton
    del tensors[start:]
    return _split_shared(tree, tensors)


def _split_shared(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """:func:`split_tensors` for a tree where some tensors share a storage."""
    seen: set[int] = set()
    groups: dict[Any, list[torch.Tensor]] = {}
    for v in leaves(tree):
        if isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            groups.setdefault(_storage_key(v), []).append(v)
    refs: dict[int, _Ref] = {}
    for members in groups.values():
        _share(members, tensors, refs)

    def leaf(v: Any) -> Any:
        return refs[id(v)] if isinstance(v, torch.Tensor) else v

    return map_tree(tree, leaf)


def _storage_key(t: torch.Tensor) -> Any:
    """Tensors with equal keys share a storage; a tensor that cannot share gets a key of its own."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout != torch.strided
        or t.is_meta
        or t.is_conj()
        or t.is_neg()
        or t.numel() == 0
    ):
        return id(t)
    return (t.get_device(), t.untyped_storage().data_ptr())


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last+1) bytes of ``t`` in its storage."""
    item = t.element_size()
    start = t.storage_offset() * item
    reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)) + 1
    return int(start), int(start + reach * item)


def _share(members: list[torch.Tensor], tensors: list[torch.Tensor], refs: dict[int, _Ref]) -> None:
    by_view: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for t in members:
        by_view.setdefault(_signature(t), []).append(t)
    views = list(by_view.values())

    def entry(t: torch.Tensor) -> int:
        tensors.append(t)
        return len(tensors) - 1

    def same(group: list[torch.Tensor], ref: _Ref) -> None:
        for t in group:
            refs[id(t)] = ref

    if len(views) > 1:
        spans = [_byte_span(g[0]) for g in views]
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        own_bytes = sum(g[0].numel() * g[0].element_size() for g in views)
        if hi - lo <= own_bytes:
            anchor = next(
                (
                    g
                    for g, span in zip(views, spans, strict=True)
                    if span == (lo, hi) and g[0].is_contiguous()
                ),
                None,
            )
            if anchor is not None:
                base = entry(anchor[0])
                same(anchor, TensorRef(base))
            else:
                first = views[0][0]
                raw = torch.empty(0, dtype=torch.uint8, device=first.device)
                base = entry(raw.set_(first.untyped_storage(), lo, (hi - lo,), (1,)))
            for g, (start, _) in zip(views, spans, strict=True):
                if g is not anchor:
                    t = g[0]
                    same(g, ViewRef(base, t.dtype, tuple(t.shape), t.stride(), start - lo))
            return
    for g in views:  # one view of the storage, or views too sparse to be worth sharing
        same(g, TensorRef(entry(g[0])))


def resolve(skeleton: Any, table: Mapping[int, Any] | Sequence[Any]) -> Any:
    """``skeleton`` with every :class:`TensorRef` replaced by its tensor in ``table`` and every
    :class:`ViewRef` by a view into its tensor (sharing its storage).

    Raises:
        ManifestError: a reference to a tensor that is not in the table.
        SerializationError: a view that does not fit its tensor (damage).
    """

    def lookup(i: int) -> Any:
        try:
            return table[i]
        except (KeyError, IndexError):
            raise ManifestError(f"replicated tensor {i} is in no shard") from None

    def leaf(v: Any) -> Any:
        if isinstance(v, TensorRef):
            return lookup(v.index)
        if isinstance(v, ViewRef):
            return make_view(lookup(v.index), v)
        return v

    return map_tree(skeleton, leaf)


def layout_digest(skeleton: Any, tensors: Sequence[torch.Tensor]) -> str:
    """A digest of the tensor layout of one replicated item (paths, dtypes, shapes), so ranks
    can check they split the same list the same way."""
    h = hashlib.sha256()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k!r}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(node, TensorRef):
            t = tensors[node.index]
            h.update(f"{path}:{node.index}:{t.dtype}:{tuple(t.shape)};".encode())
        elif isinstance(node, ViewRef):
            t = tensors[node.index]
            h.update(f"{path}:{node.index}:{t.dtype}:{tuple(t.shape)}:{node}".encode())

    walk(skeleton, "")
    return h.hexdigest()


def assign(tensors: Sequence[torch.Tensor], world_size: int) -> list[list[int]]:
    """Split tensor indices across ranks by size: largest first onto the least-loaded rank
    (ties to the lower rank). Deterministic, so every rank computes the same split."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel() * tensors[i].element_size(), i))
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        out[r].append(i)
        loads[r] += tensors[i].numel() * tensors[i].element_size()
    for lst in out:
        lst.sort()
    return out


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"checkpoint {what} is a {type(value).__name__}, not a mapping")
    return value


def join(parts: Sequence[Any], names: Sequence[str]) -> dict[str, Any]:
    """Rebuild the replicated items ``names`` from every rank's decoded ``replicated.bin``.

    Raises:
        ManifestError: the shards do not fit together (damage: a missing or malformed part).
        TrainingStateError: the checkpoint holds no replicated state for some of ``names``.
    """
    skeleton = None
    count = None
    table: dict[int, Any] = {}
    for part in parts:
        part = _mapping(part, "replicated shard")
        index, tensors = part.get("index"), part.get("tensors")
        if not isinstance(index, list) or not isinstance(tensors, list) or len(index) != len(tensors):
            raise ManifestError("replicated shard has a malformed tensor table")
        for i, t in zip(index, tensors, strict=True):
            if not isinstance(i, int) or not isinstance(t, torch.Tensor) or i in table:
                raise ManifestError(f"replicated shard has a bad or duplicate tensor entry {i!r}")
            table[i] = t
        if "skeleton" in part:
            skeleton, count = part["skeleton"], part.get("count")
    if skeleton is None:
        raise ManifestError("no replicated shard holds the structure (rank 0's shard is missing)")
    if count != len(table):
        raise ManifestError(f"replicated shards hold {len(table)} tensors, the structure names {count}")

    skeleton = _mapping(skeleton, "replicated structure")
    missing = [n for n in names if n not in skeleton]
    if missing:
        raise TrainingStateError(f"the checkpoint has no replicated state for {missing}")
    return {n: resolve(skeleton[n], table) for n in names}
