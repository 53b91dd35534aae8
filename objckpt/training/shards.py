"""What CheckpointManager writes for one rank, and how a restore stages it back.

Shards of one save (``data/<step>-<attempt>/<rank>/``):

* ``replicated.bin`` -- this rank's part of the replicated state (see :mod:`.replicated`);
  rank 0's also holds the structure. On an object store a share of two or more of the store's
  parts is spread over ``replicated.bin``, ``replicated.1.bin``, ... written at once, each by
  one request up to ``part_size x max_in_flight`` (:func:`objckpt.writer.spread_for`, the DCP
  writer's rule too): 512 MiB on one rank is 8 PutObjects instead of a 32-part upload whose
  completion makes the server assemble the whole object. file:// keeps one ``replicated.bin``
  (``Store.cheap_multipart``). Layout ``objckpt.training/2``; ``/1`` checkpoints, one
  ``replicated.bin`` per rank, are read as before.
* ``rank.bin`` -- everything per rank: the global RNG states (Python, NumPy, torch CPU, CUDA),
  random generators, samplers, schedulers, progress, dicts. Its tensors are in a table of their
  own (``{"items": <structure>, "tensors": [...], "rng": ...}``), one entry per storage, as in
  :mod:`.replicated`, so views into one buffer keep sharing it.

Both are the pickle-free container of :mod:`.serialization`, streamed straight from tensor
memory (or from the staged copies of an asynchronous save).

Restoring at another world size (the elastic rule, :func:`stage`):

* replicated state (modules, optimizers by default) is joined from every saved rank's
  ``replicated.bin`` at any world size, bit for bit;
* per-rank objects that can re-partition themselves (``reshard_state(states, *, num_replicas,
  rank)``: :class:`~objckpt.training.sampler.ResumableDistributedSampler`,
  :class:`~objckpt.training.data.ResumableDataLoader`) get a state computed from every saved
  rank's: the samples consumed in the epoch are removed, the rest is split across the new ranks;
* other samplers and data loaders (e.g. torchdata's ``StatefulDataLoader``) are refused: their
  position means nothing at another world size;
* everything else per rank (schedulers, progress, scalers, dicts, ...): a rank that existed in
  the saved job keeps its own; a new rank (``rank >= saved world size``) gets rank 0's;
* random generators and the global RNG: a rank that existed keeps its own; a new rank gets
  fresh ones seeded from rank 0's saved state, the step and its rank (deterministic).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import layout
from .._crc import Buffer
from ..coordination.comm import Comm
from ..coordination.exchange import read_shared, reads_once_by_default
from ..errors import ManifestError, SerializationError, TrainingStateError
from ..manifest import Manifest, Reference, ShardReceipt
from ..reader import Reader
from ..store import Store
from . import dedup, replicated, serialization
from ._borrowed_decode import decode_borrowed, detach
from ._elastic_restore import apply_elastic_rule, refuse_unpartitionable_positions
from ._ranged_restore import decode_ranged, ranged_applies
from ._state_layout import (
    RANK_SHARD,
    REPLICATED_SHARD,
    STATE_LAYOUT,
    STATE_LAYOUTS,
    replicated_piece,
    replicated_receipts,
)
from ._state_write import Abandoned, write
from .codec import CompressionPolicy
from .data import check_data_position
from .state import (
    MODULE,
    OPTIMIZER,
    RNG,
    RestoreReport,
    apply_state,
    capture_global_rng,
    capture_item,
    check_restorable,
    check_step_boundary,
    classify,
    derive_global_rng,
    derive_rng_item,
    progress_of,
)

log = logging.getLogger("objckpt.training")

__all__ = [
    "RANK_SHARD",
    "REPLICATED_SHARD",
    "STATE_LAYOUT",
    "STATE_LAYOUTS",
    "Abandoned",
    "Capture",
    "Staged",
    "apply",
    "default_replicated_read",
    "capture",
    "replicated_piece",
    "replicated_receipts",
    "stage",
    "write",
]

#: ``stage(replicated_read=)``: each replicated shard downloaded by one rank and shared, or by all
READ_ONCE, READ_EVERY = "once", "every"
REPLICATED_READS = (READ_ONCE, READ_EVERY)


def default_replicated_read(store: Store) -> str:
    """``replicated_read`` when the manager is not told: the DCP reader's rule,
    :func:`~objckpt.coordination.exchange.reads_once_by_default` (once on object stores, by
    every rank on file://)."""
    return READ_ONCE if reads_once_by_default(store) else READ_EVERY


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
    #: write only what changed (shard format 3, :mod:`.dedup`); set by the manager
    dedup: bool = False
    compression: CompressionPolicy | None = None
    #: filled by :func:`write`: the ancestors' objects this rank's shards read from
    references: list[Reference] = field(default_factory=list)
    #: filled by :func:`write`: bytes of state reused from the parent instead of written
    reused_bytes: int = 0

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

    Tensors sharing a storage (tied weights, views) are laid out once (see
    :func:`.replicated.split_tensors`), in both shards.

    Raises:
        TrainingStateError: not at an optimizer-step boundary, a sampler whose position counts
            prefetched samples (:func:`.data.check_data_position`), or an unsupported value.
        UnsupportedStateError: a value inside a state dict cannot be serialised (named).
        ValueError: an invalid step.
    """
    layout.check_step(step)
    check_step_boundary(state)
    check_data_position(state, step=step, rank=rank)
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
    local_tensors: list[torch.Tensor] = []
    local_skeleton = replicated.split_tensors(local, local_tensors)
    return Capture(
        step=step,
        replicated_names=rep_names,
        local_names=[n for n in state if n not in rep_names],
        replicated_tree=rep_tree,
        local_tree={"items": local_skeleton, "tensors": local_tensors, "rng": capture_global_rng()},
        digests=digests,
        progress=progress.summary() if progress is not None else {"global_step": step},
    )


@dataclass
class Staged:
    """One rank's decoded and checked checkpoint, not applied yet."""

    items: dict[str, Any]
    rng: Any
    report: RestoreReport = field(default_factory=RestoreReport)
    strict: bool = True


def stage(
    reader: Reader,
    manifest: Manifest,
    state: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    strict: bool = True,
    comm: Comm | None = None,
    replicated_read: str = READ_ONCE,
) -> Staged:
    """Download, verify, decode and check this rank's part of ``manifest``; modifies nothing.

    At the saved world size every rank reads its own ``rank.bin``. At another world size the
    per-rank state follows the elastic rule of this module's docstring: a rank reads its own
    ``rank.bin`` if it existed (rank 0's if not), or every rank's when ``state`` holds an object
    that re-partitions itself. Every rank needs every ``replicated.bin``, at any world size:
    with ``replicated_read="once"`` (and a ``comm`` of more than one rank) each is downloaded by
    one rank and shared over ``comm`` (:func:`objckpt.coordination.exchange.read_shared`: ~1/W
    of the replicated bytes per rank, CRC32C checked on every receiving rank; then this call is
    a collective: every rank of ``comm`` must make it); ``"every"``: every rank downloads all
    of them itself. A checkpoint written through DCP (:mod:`.dcp`) is loaded through DCP's
    resharding (modules only, see :mod:`.dcp_bridge`), each rank reading what it needs.

    A shard larger than one of the store's parts is read by ranged GETs straight into freshly
    allocated tensors, every byte CRC32C-checked against its receipt before the tree is built
    (:mod:`._ranged_restore`, which states its memory); smaller shards and compressed ones are
    decoded from their verified stream; those shared over ``comm`` (held whole, verified, in a
    buffer this rank owns) are decoded in place: their tensors are views into that buffer
    (:mod:`._borrowed_decode`), not a second copy, and state other than a module's is copied
    out of it (an optimizer would keep the views, and with them the whole buffer).

    ``strict=False``: see :func:`.state.check_restorable`; what was not loaded is in the
    returned ``report``.

    Raises:
        IntegrityError (ChecksumMismatchError, ManifestError, SerializationError), NotFoundError:
            the checkpoint is damaged (the restore session falls back).
        TrainingStateError: the checkpoint does not fit ``state`` (not an objckpt checkpoint,
            other names or shapes, a sampler or loader that cannot be re-partitioned for this
            world size): fatal, no fallback. The message names the step, the rank and the key.
    """
    topo = manifest.topology
    if topo.get("layout") not in STATE_LAYOUTS and isinstance(manifest.metadata.get("dcp"), Mapping):
        from .dcp_bridge import stage_dcp

        items, report = stage_dcp(reader.store, manifest, state, rank=rank, strict=strict)
        report.step, report.saved_world_size, report.world_size = (
            manifest.step,
            manifest.world_size,
            world_size,
        )
        return Staged(items, None, report, strict)
    if str(topo.get("layout", "")).startswith("objckpt.training/") and topo["layout"] not in STATE_LAYOUTS:
        raise TrainingStateError(
            f"checkpoint step {manifest.step} has layout {topo['layout']!r}, written by a newer "
            f"objckpt than this one (which reads {list(STATE_LAYOUTS)}); upgrade objckpt to restore it"
        )
    if topo.get("layout") not in STATE_LAYOUTS:
        raise TrainingStateError(
            f"checkpoint step {manifest.step} was not written by CheckpointManager (layout "
            f"{topo.get('layout')!r}); use the API that wrote it"
        )
    if replicated_read not in REPLICATED_READS:
        raise ValueError(f"replicated_read must be one of {REPLICATED_READS}, got {replicated_read!r}")
    saved_world = manifest.world_size
    elastic = saved_world != world_size
    rep_names = list(topo.get("replicated", []))
    wanted_rep = [n for n in state if n in rep_names]
    local_names = [n for n in state if n not in rep_names]
    reshardable = [n for n in local_names if callable(getattr(state[n], "reshard_state", None))]
    rep_receipts = replicated_receipts(manifest) if wanted_rep else []
    exchange = comm is not None and comm.world_size > 1 and replicated_read == READ_ONCE
    mine = rank if rank < saved_world else 0
    ranks = list(range(saved_world)) if elastic and reshardable else [mine]
    rank_receipts: list[ShardReceipt] = []
    failed: Exception | None = None
    try:
        if elastic:
            refuse_unpartitionable_positions(
                state, local_names, reshardable, manifest.step, saved_world, world_size, rank
            )
        try:
            rank_receipts = [manifest.shard(r, RANK_SHARD) for r in ranks]
        except KeyError as exc:
            raise ManifestError(str(exc), key=manifest.key) from exc
    except Exception as exc:  # noqa: BLE001 - raised below, after the collective when there is one
        failed = exc
    shared: dict[str, Buffer] = {}
    if exchange:
        assert comm is not None
        # every rank takes part, even one that failed above (so none is left waiting)
        shared = read_shared(comm, reader, rep_receipts, f"restore(step={manifest.step})", error=failed)
    elif failed is not None:
        raise failed
    receipts = [*rank_receipts, *rep_receipts]

    resolver = dedup.resolver_for(reader.store, manifest) if manifest.references else None
    # storages of staged tensors that are views into a shard buffer (decode_borrowed)
    borrowed: set[int] = set()
    borrowed_lock = threading.Lock()

    def read(receipt: ShardReceipt) -> Any:
        body = shared.pop(receipt.key, None)  # verified already (exchange); freed once decoded

        def read_range(start: int, end: int) -> bytes:
            if body is not None:  # a footer or header: small, so a copy out of the view is cheap
                return bytes(memoryview(body)[start:end])
            return reader.store.get(receipt.key, byte_range=(start, end))

        def keep(header: dict[str, Any]) -> None:  # the next save indexes it without a request
            dedup.remember(reader.store, manifest.step, manifest.attempt, receipt.rank, receipt.name, header)

        try:
            if body is not None and not memoryview(body).readonly:
                # this rank's own buffer (its download, or the exchange's receive buffer): the
                # staged tensors become views into it instead of a second copy (issue 14)
                views: set[int] = set()
                tree = decode_borrowed(body, resolver=resolver, on_header=keep, borrowed=views)
                with borrowed_lock:
                    borrowed.update(views)
                return tree
            if body is None and ranged_applies(reader.store, receipt):
                # None: a shard this path does not read (compressed chunks), streamed below
                decoded = decode_ranged(reader.store, receipt, resolver=resolver, on_header=keep)
                if decoded is not None:
                    return decoded
            return serialization.decode_stream(
                [body] if body is not None else reader.open_shard(receipt),
                total_size=receipt.size,
                read_range=read_range,
                resolver=resolver,
                on_header=keep,
            )
        except SerializationError as exc:
            raise SerializationError(f"{receipt.key}: {exc}") from exc

    with ThreadPoolExecutor(min(8, len(receipts)), thread_name_prefix="objckpt-restore") as pool:
        decoded = list(pool.map(read, receipts))
    per_rank = {
        r: _local_items(d, receipt) for r, d, receipt in zip(ranks, decoded, rank_receipts, strict=False)
    }
    mine_items, rng = per_rank[mine]
    items = dict(mine_items)
    report = RestoreReport(step=manifest.step, saved_world_size=saved_world, world_size=world_size)
    if elastic:
        report.per_rank = apply_elastic_rule(
            state, items, per_rank, reshardable, manifest.step, rank, saved_world, world_size
        )
        if rank >= saved_world:
            for name in local_names:
                if name in items and classify(name, state[name]) == RNG:
                    items[name] = derive_rng_item(
                        name, state[name], items[name], rank=rank, step=manifest.step
                    )
            if rng is not None:
                rng = derive_global_rng(rng, rank=rank, step=manifest.step)
    if wanted_rep:
        joined = replicated.join(decoded[len(rank_receipts) :], wanted_rep)
        del decoded
        for name in wanted_rep:
            # a module's load_state_dict copies into the live parameters, so its staged tensors
            # may stay views into the shard buffers (freed once the staged state is dropped);
            # anything else may keep what it is given (an optimizer keeps its state tensors), so
            # it gets storages of its own rather than pinning a whole buffer for good
            if borrowed and name in joined and classify(name, state[name]) != MODULE:
                joined[name] = detach(joined[name], borrowed)
        items.update(joined)
    checked = check_restorable(state, items, rng=rng, strict=strict)
    report.missing_keys, report.unexpected_keys = checked.missing_keys, checked.unexpected_keys
    report.missing_entries = checked.missing_entries
    return Staged(items, rng, report, strict)


def _local_items(decoded: Any, receipt: ShardReceipt) -> tuple[Mapping[str, Any], Any]:
    """A decoded ``rank.bin``: (items with their tensors resolved, global RNG record)."""
    if not isinstance(decoded, Mapping) or not isinstance(decoded.get("items"), Mapping):
        raise ManifestError(f"{receipt.key}: the per-rank shard holds no item table", key=receipt.key)
    items = decoded["items"]
    if "tensors" in decoded:  # written since per-rank tensors have a table (older shards: inline)
        tensors = decoded["tensors"]
        if not isinstance(tensors, list):
            raise ManifestError(
                f"{receipt.key}: the per-rank shard has a malformed tensor table", key=receipt.key
            )
        try:
            items = replicated.resolve(items, tensors)
        except (ManifestError, SerializationError) as exc:
            raise ManifestError(f"{receipt.key}: {exc}", key=receipt.key) from exc
    return items, decoded.get("rng")


def apply(state: Mapping[str, Any], staged: Staged, *, rank: int) -> RestoreReport:
    """Load what :func:`stage` checked into ``state`` (RNG last); log what was not loaded or how
    per-rank state was mapped. Returns the report.

    Raises:
        TrainingStateError, or an object's own ``load_state_dict`` error.
    """
    apply_state(state, staged.items, rng=staged.rng, strict=staged.strict)
    report = staged.report
    if report.per_rank is not None:
        if rank == 0:
            log.warning(
                "restoring checkpoint step %s, written by %s rank(s), on %s: replicated state is exact, "
                "per-rank state follows the elastic rule (docs/ELASTIC.md); the run continues without "
                "repeating or skipping samples but is not bitwise the run an unchanged world would have made",
                report.step,
                report.saved_world_size,
                report.world_size,
            )
        log.info("rank %d: %s", rank, report.per_rank)
    if not report.complete:
        log.warning(
            "rank %d restored checkpoint step %s with strict=False: %s", rank, report.step, report.describe()
        )
    return report
