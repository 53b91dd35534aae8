"""Replicated state written once across ranks, not once per rank.

State that data parallelism keeps identical on every rank (by default every ``nn.Module`` and
optimizer) is split by tensor: each rank writes about ``1/world_size`` of the bytes in its
``replicated.bin``, and rank 0's also holds the structure (the containers with every tensor
replaced by a :class:`~objckpt.training.serialization.TensorRef` into one table). On restore the
shards are joined back.

The split is by size, largest tensor first onto the least-loaded rank, and deterministic, so every
rank computes the same split from its own (identical) state; ranks check that with a digest of
the layout in the save handshake.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ManifestError, TrainingStateError
from ..tree import map_tree
from .serialization import TensorRef

__all__ = ["assign", "join", "layout_digest", "split_tensors"]


def split_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``tree`` by a :class:`TensorRef` into ``tensors`` (appended in
    depth-first order, one entry per tensor object: a tied weight is one entry)."""
    seen: dict[int, int] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            idx = seen.get(id(v))
            if idx is None:
                idx = seen[id(v)] = len(tensors)
                tensors.append(v)
            return TensorRef(idx)
        return v

    return map_tree(tree, leaf)


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

    def leaf(v: Any) -> Any:
        if isinstance(v, TensorRef):
            if v.index not in table:
                raise ManifestError(f"replicated tensor {v.index} is in no shard")
            return table[v.index]
        return v

    skeleton = _mapping(skeleton, "replicated structure")
    missing = [n for n in names if n not in skeleton]
    if missing:
        raise TrainingStateError(f"the checkpoint has no replicated state for {missing}")
    return {n: map_tree(skeleton[n], leaf) for n in names}
