"""What CheckpointManager writes for one rank, and how a restore stages it back.

Shards of one save (``data/<step>-<attempt>/<rank>/``):

* ``replicated.bin`` -- this rank's part of the replicated state (see :mod:`.replicated`);
  rank 0's also holds the structure.
* ``rank.bin`` -- everything per rank: the global RNG states (Python, NumPy, torch CPU, CUDA),
  random generators, samplers, schedulers, progress, dicts.

Both are the pickle-free container of :mod:`.serialization`, streamed straight from tensor
memory (or from the staged copies of an asynchronous save).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import layout
from ..errors import ManifestError, SerializationError, TrainingStateError
from ..manifest import Manifest, ShardReceipt
from ..reader import Reader
from ..writer import ShardWriter
from . import replicated, serialization
from .state import (
    MODULE,
    OPTIMIZER,
    capture_global_rng,
    capture_item,
    check_restorable,
    check_step_boundary,
    classify,
    progress_of,
)

__all__ = [
    "RANK_SHARD",
    "REPLICATED_SHARD",
    "STATE_LAYOUT",
    "Abandoned",
    "Capture",
    "capture",
    "stage",
    "write",
]

STATE_LAYOUT = "objckpt.training/1"
REPLICATED_SHARD = "replicated.bin"
RANK_SHARD = "rank.bin"


class Abandoned(Exception):
    """This rank stopped writing an abandoned save (internal: becomes ``ticket.abandon()``)."""


@dataclass
class Capture:
    """References to everything one rank saves (no copies), laid out for writing."""

    step: int
    replicated_names: list[str]
    local_names: list[str]
    replicated_tree: dict[str, Any] | None
    local_tree: dict[str, Any]
    digests: dict[str, str]
    progress: dict[str, Any]
    bytes_written: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def trees(self) -> list[Any]:
        return [self.replicated_tree, self.local_tree]

    def topology(self) -> dict[str, Any]:
        return {"layout": STATE_LAYOUT, "replicated": self.replicated_names, "per_rank": self.local_names}


def capture(
    step: int,
    state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    replicated_names: Iterable[str] | None,
) -> Capture:
    """Capture references to ``state`` for a save; nothing is copied, nothing is written.

    Raises:
        TrainingStateError: not at an optimizer-step boundary, or an unsupported value.
        UnsupportedStateError: a value inside a state dict cannot be serialised (named).
        ValueError: an invalid step.
    """
    layout.check_step(step)
    check_step_boundary(state)
    kinds = {name: classify(name, obj) for name, obj in state.items()}
    if replicated_names is None:
        rep_names = [n for n in state if kinds[n] in (MODULE, OPTIMIZER)]
    else:
        wanted = set(replicated_names)
        rep_names = [n for n in state if n in wanted]
    rep = {n: capture_item(n, state[n], kinds[n]) for n in rep_names}
    local = {n: capture_item(n, state[n], kinds[n]) for n in state if n not in rep_names}
    # Refuse unserialisable values now, naming them, before any rank writes anything.
    serialization.validate(rep)
    serialization.validate(local)
    tensors: list[torch.Tensor] = []
    skeleton = replicated.split_tensors(rep, tensors)
    digests = {n: replicated.layout_digest(skeleton[n], tensors) for n in rep_names}
    mine = replicated.assign(tensors, world_size)[rank]
    rep_tree: dict[str, Any] | None = None
    if rep_names and (mine or rank == 0):
        rep_tree = {"index": mine, "tensors": [tensors[i] for i in mine]}
        if rank == 0:
            rep_tree["skeleton"] = skeleton
            rep_tree["count"] = len(tensors)
    progress = progress_of(state)
    return Capture(
        step=step,
        replicated_names=rep_names,
        local_names=[n for n in state if n not in rep_names],
        replicated_tree=rep_tree,
        local_tree={"items": local, "rng": capture_global_rng()},
        digests=digests,
        progress=progress.summary() if progress is not None else {"global_step": step},
    )


def write(writer: ShardWriter, cap: Capture, abandon: threading.Event | None = None) -> list[ShardReceipt]:
    """Stream this rank's shards of ``cap`` through ``writer``; returns their receipts.

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

    written = 0
    for name, tree in ((REPLICATED_SHARD, cap.replicated_tree), (RANK_SHARD, cap.local_tree)):
        if tree is None:
            continue
        encoded = serialization.encode(tree)
        source: Iterable[memoryview] = encoded.buffers()
        if abandon is not None:
            source = _abortable(source, abandon)
        writer.write(name, source, progress=progress)
        written += encoded.size
    cap.bytes_written = written
    return writer.receipts


def _abortable(buffers: Iterable[memoryview], abandon: threading.Event) -> Iterator[memoryview]:
    for buf in buffers:
        if abandon.is_set():
            raise Abandoned()
        yield buf


@dataclass
class Staged:
    """One rank's decoded and checked checkpoint, not applied yet."""

    items: dict[str, Any]
    rng: Any


def stage(
    reader: Reader, manifest: Manifest, state: Mapping[str, Any], *, rank: int, world_size: int
) -> Staged:
    """Download, verify, decode and check this rank's part of ``manifest``; modifies nothing.

    Raises:
        IntegrityError (ChecksumMismatchError, ManifestError, SerializationError), NotFoundError:
            the checkpoint is damaged (the restore session falls back).
        TrainingStateError: the checkpoint does not fit ``state`` (not a CheckpointManager
            checkpoint, another world size, other names or shapes): fatal, no fallback.
    """
    topo = manifest.topology
    if topo.get("layout") != STATE_LAYOUT:
        raise TrainingStateError(
            f"checkpoint step {manifest.step} was not written by CheckpointManager (layout "
            f"{topo.get('layout')!r}); use the API that wrote it"
        )
    if manifest.world_size != world_size:
        raise TrainingStateError(
            f"checkpoint step {manifest.step} was written by {manifest.world_size} rank(s), this job has "
            f"{world_size}: per-rank state (RNG, samplers) cannot be mapped"
        )
    rep_names = list(topo.get("replicated", []))
    wanted_rep = [n for n in state if n in rep_names]
    try:
        rank_receipt = manifest.shard(rank, RANK_SHARD)
    except KeyError as exc:
        raise ManifestError(str(exc), key=manifest.key) from exc
    rep_receipts = [s for s in manifest.shards if s.name == REPLICATED_SHARD] if wanted_rep else []
    receipts = [rank_receipt, *rep_receipts]

    def read(receipt: ShardReceipt) -> Any:
        try:
            return serialization.decode_stream(reader.open_shard(receipt), total_size=receipt.size)
        except SerializationError as exc:
            raise SerializationError(f"{receipt.key}: {exc}") from exc

    with ThreadPoolExecutor(min(8, len(receipts)), thread_name_prefix="objckpt-restore") as pool:
        decoded = list(pool.map(read, receipts))
    local = decoded[0]
    if not isinstance(local, Mapping) or not isinstance(local.get("items"), Mapping):
        raise ManifestError(
            f"{rank_receipt.key}: the per-rank shard holds no item table", key=rank_receipt.key
        )
    items: dict[str, Any] = dict(local["items"])
    if wanted_rep:
        items.update(replicated.join(decoded[1:], wanted_rep))
    check_restorable(state, items, rng=local.get("rng"))
    return Staged(items, local.get("rng"))
