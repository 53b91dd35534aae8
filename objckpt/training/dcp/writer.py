"""The DCP ``StorageWriter``: one DCP save = one attempt committed by the save session.

This module speaks DCP's protocol (plans, the attempt, the commit, pickling for ``async_save``);
how one rank packs its items into shards and streams their bytes (with dedup reuse and the
bytes-item loadability check) is :mod:`._shard_stream`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Mapping
from functools import partial
from typing import Any, Union

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..._crc import crc32c_b64, encode_crc32c
from ..._pool import run_all
from ...coordination.comm import LocalComm
from ...coordination.roots import open_root
from ...coordination.save import SaveSession
from ...errors import (
    CommitError,
    ConfigError,
    DistributedError,
)
from ...gc import RetentionPolicy
from ...layout import check_step, new_attempt_id
from ...manifest import Reference
from ...metrics import CheckpointMetrics
from ...reader import Reader
from ...store import Store
from ...store.base import StreamChecksums
from ...writer import ShardWriter
from .. import dedup
from ._metadata import (
    _DATA_SHARD,
    _DCP_VERSION,
    CACHE_TAG,
    FORMAT_VERSION,
    MANIFEST_KEY,
    METADATA_SHARD,
    _GlobalStorageData,
    _ItemLocation,
    _LocalStorageData,
    _parse_step,
    encode_metadata,
)
from ._shard_stream import split_into_shards, stream_items

log = logging.getLogger("objckpt.training.dcp")

StoreLike = Union[str, Store]
_KeyIndex = dict[tuple[int, str], tuple[str, int]]  # (rank, shard name) -> (key, size)


# ---------------------------------------------------------------------------------- writer


class ObjckptStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` that saves one step as one committed objckpt checkpoint.

    Every save is a fresh attempt: shards go to ``data/<step>-<attempt>/<rank>/dcp-*.bin``
    (create-if-absent), and the checkpoint exists only once the coordinator's manifest is
    written. A save that fails anywhere (a rank's upload, the commit check, a lost race for the
    step) leaves no manifest and never touches any other attempt's objects, so the previously
    committed checkpoint stays loadable byte for byte.

    Args:
        uri_or_store: run root URI (opened here, closed by :meth:`close`) or a :class:`Store`.
        step: the training step this save commits; ``dcp.save(checkpoint_id=step)`` overrides.
        progress, run, metadata: passed to :meth:`Coordinator.commit` (training progress, run
            identity, extra manifest metadata; the ``"dcp"`` metadata key is reserved).
        max_shard_bytes: start a new shard file once a rank's current one holds this many bytes
            (S3 allows 10,000 parts per object); default ``8192 x store.part_size``.
        dedup: write only what changed (default): a tensor item whose bytes hash to those of
            the same item (fqn and offset) of the parent checkpoint (the one restored or last
            committed by this process) is not written again; the item table locates it in the
            parent's object, by identity, and the manifest references that object. ``False``
            writes every item.

    Atomicity: all or nothing per step, decided by the manifest's create-if-absent write.

    Errors (raised inside DCP, which reports them as its ``CheckpointException``; use
    :func:`save_sharded` to get them as objckpt errors): :class:`CommitError` when the commit
    check fails, :class:`CommitConflict` when another attempt already committed the step, store
    errors from uploads, :class:`ConfigError` for unsupported use (``use_collectives=False``,
    DCP plan caching, non-JSON planner data).

    One save at a time per instance. ``dcp.async_save`` works thread-based, and process-based
    (``AsyncCheckpointerType.PROCESS``) for a writer given a run-root URI (DCP pickles the writer;
    the checkpoint process re-opens the store from the URI and ``store_options``); a writer on a
    ``Store`` object, or with ``metrics``, refuses to be pickled with a :class:`ConfigError`.
    """

    def __init__(
        self,
        uri_or_store: StoreLike,
        step: int | None = None,
        *,
        progress: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        max_shard_bytes: int | None = None,
        retention: RetentionPolicy | None = None,
        metrics: CheckpointMetrics | None = None,
        store_options: Mapping[str, Any] | None = None,
        dedup: bool = True,
    ) -> None:
        super().__init__()
        #: write only what changed: a tensor item whose bytes (content hash) equal the same
        #: item of the parent checkpoint is recorded as located in the parent's object
        self.dedup = bool(dedup)
        self.store, self._owns_store = open_root(uri_or_store, store_options)
        # what re-opens the store in DCP's checkpoint process (async_save PROCESS): see __getstate__
        self._uri = uri_or_store if isinstance(uri_or_store, str) else None
        self._store_options = dict(store_options or {})
        self._retention, self._metrics = retention, metrics
        # DCP gathers the plans and write results itself: the session is used for its
        # decisions on the coordinator (the attempt, the commit, retention), not its collectives.
        self.session = SaveSession(
            self.store, LocalComm(), retention=retention, metrics=metrics, label="DCP save"
        )
        self.step = None if step is None else check_step(step)
        if metadata and MANIFEST_KEY in metadata:
            raise ConfigError(f"manifest metadata key {MANIFEST_KEY!r} is reserved for DCP")
        self.progress = dict(progress or {})
        self.run = dict(run or {})
        self.extra_metadata = dict(metadata or {})
        self.max_shard_bytes = max_shard_bytes or 8192 * self.store.part_size
        if self.max_shard_bytes < 1:
            raise ConfigError("max_shard_bytes must be positive")
        #: the committed manifest (coordinator, after a successful save)
        self.manifest: Any = None
        #: the attempt id of the current/last save (every rank, once planned)
        self.attempt: str | None = None
        self._reset_save_state()

    def _reset_save_state(self) -> None:
        self.is_coordinator = False
        self.rank = 0
        self.attempt = None
        self.manifest = None
        self._nonce: str | None = None
        self._parent: Any = None  # the parent manifest whose items this save may reuse
        self._candidates: dict[Any, _ItemLocation] = {}
        self._spread = 1  # shards written at once by this save (set by write_data)

    # -- DCP protocol

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new save; a ``checkpoint_id`` is the step to save (int or digit string), or
        this writer's own :attr:`checkpoint_id` (what DCP's process executor hands back)."""
        if checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            self.step = _parse_step(checkpoint_id)
        self._reset_save_state()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            _parse_step(checkpoint_id)
        except (ConfigError, ValueError):
            return False
        return True

    @property
    def checkpoint_id(self) -> str:
        return f"{self.store.location.rstrip('/')}#step={self.step}"

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP calls reset() only when given a checkpoint_id, but this runs on every rank for
        # every save: per-save state is cleared here.
        self._reset_save_state()
        if self.step is None:
            raise ConfigError("ObjckptStorageWriter needs a step (constructor or checkpoint_id)")
        if not kwargs.get("use_collectives", True):
            raise ConfigError(
                "ObjckptStorageWriter needs use_collectives=True: a checkpoint commits only "
                "once the coordinator has every rank's receipts"
            )
        self.is_coordinator = bool(is_coordinator)
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The nonce comes back from the coordinator with the attempt id; write_data checks it,
        # which detects a stale plan from DCP's plan cache (it would carry an old attempt id).
        self._nonce = secrets.token_hex(8)
        return dataclasses.replace(plan, storage_data=_LocalStorageData(self._nonce))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # One fresh attempt per save, drawn once, delivered to every rank in the plan DCP
        # scatters anyway: no extra collective.
        attempt = new_attempt_id()
        parent_items = self._parent_items() if self.dedup else {}
        out = []
        for i, plan in enumerate(plans):
            local = plan.storage_data
            nonce = local.nonce if isinstance(local, _LocalStorageData) else None
            # each rank gets only the parent's items its own plan names: no rank reads metadata
            candidates = {
                item.index: parent_items[item.index]
                for item in plan.items
                if item.type != WriteItemType.BYTE_IO and item.index in parent_items
            }
            out.append(
                dataclasses.replace(
                    plan, storage_data=_GlobalStorageData(attempt, i, len(plans), nonce, candidates or None)
                )
            )
        return out

    def _parent_items(self) -> dict[Any, _ItemLocation]:
        """Coordinator: the hashed tensor items of the checkpoint this save continues from, each
        located absolutely (``origin`` set), from this process's last commit or restore, else
        from one read of the parent's metadata shard. Empty when there is nothing to reuse."""
        parent = dedup.parent_for(self.store, self.step) if self.step is not None else None
        info = parent.metadata.get(MANIFEST_KEY) if parent is not None else None
        if parent is None or not isinstance(info, Mapping):
            return {}
        locations = dedup.recall_value(self.store, parent.step, parent.attempt, CACHE_TAG)
        if locations is None:
            try:
                from .reader import ObjckptStorageReader

                _, locations, _ = ObjckptStorageReader(self.store, manifest=parent)._decode(
                    Reader(self.store), parent
                )
            except Exception as exc:  # noqa: BLE001 - reuse is an optimisation: write everything
                log.warning(
                    "cannot read the DCP metadata of step %s to reuse its items: %s", parent.label, exc
                )
                return {}
        self._parent = parent
        out = {}
        for index, loc in locations.items():
            if loc.kind == "tensor" and (loc.hash is not None or loc.sample is not None):
                out[index] = dataclasses.replace(loc, origin=loc.origin or parent.ref, receipt=None)
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Stream this rank's items into its shards; synchronous (DCP waits on it at once).

        Raises:
            ConfigError: the plan was not made by this save (DCP plan caching).
            StoreError: an upload failed (the upload is aborted; nothing is visible).
        """
        sd = plan.storage_data
        if not isinstance(sd, _GlobalStorageData) or sd.nonce is None or sd.nonce != self._nonce:
            raise ConfigError(
                "stale DCP save plan (DefaultSavePlanner(enable_plan_caching=True) replays an "
                "old plan and its attempt id); objckpt needs a fresh plan for every save"
            )
        if sd.rank != self.rank:
            raise DistributedError(f"rank {self.rank} received the plan for rank {sd.rank}")
        self.attempt = sd.attempt
        self._candidates = dict(sd.candidates or {})
        assert self.step is not None  # set_up_storage_writer refuses a save without a step
        writer = ShardWriter(self.store, step=self.step, attempt=sd.attempt, rank=sd.rank)
        results: list[WriteResult] = []

        def write_shard(number: int, items: list[WriteItem]) -> tuple[str, Any, list[Any]]:
            name = _DATA_SHARD.format(number)
            locations: list[tuple[WriteItem, _ItemLocation]] = []
            sums = StreamChecksums()
            # borrow: the yielded buffers are the items' own memory, alive until write returns
            receipt = writer.write(
                name,
                stream_items(
                    name,
                    items,
                    planner,
                    locations,
                    rank=self.rank,
                    candidates=self._candidates,
                    dedup_enabled=self.dedup,
                ),
                checksums=sums,
                borrow=True,
                single_request_max=shard_plan.single_request_max,
            )
            # each item's CRC32C comes from the upload's one pass (each yielded buffer is one item)
            sent = iter(sums.chunks)
            for i, (item, loc) in enumerate(locations):
                if loc.origin is None:
                    crc, size = next(sent) if loc.length else (0, 0)
                    if size != loc.length:
                        raise CommitError(f"{item.index.fqn}: streamed {size} bytes, expected {loc.length}")
                    locations[i] = (item, dataclasses.replace(loc, crc32c=encode_crc32c(crc)))
            return name, receipt, locations

        shard_plan = split_into_shards(
            plan.items,
            max_shard_bytes=self.max_shard_bytes,
            part_size=self.store.part_size,
            max_in_flight=self.store.max_in_flight,
            cheap_multipart=self.store.cheap_multipart,
        )
        shards, self._spread = shard_plan.shards, shard_plan.spread
        # several shards at once (see split_into_shards): one request each up to
        # single_request_max; a failed one stops those not started (the save has failed)
        written = run_all(
            [partial(write_shard, k, shard) for k, shard in enumerate(shards)],
            self._spread,
            "objckpt-dcp-shard",
        )
        for name, receipt, locations in written:
            for item, loc in locations:
                loc = dataclasses.replace(loc, receipt=None if loc.origin is not None else receipt)
                results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
            if not any(loc.origin is None for _, loc in locations):
                # an empty shard (no items, or every item reused): proves this rank took part
                # and carries the shard's receipt (see split_into_shards)
                results.append(
                    WriteResult(
                        index=MetadataIndex(f"__objckpt_rank_{sd.rank}_{name}__"),
                        size_in_bytes=0,
                        storage_data=_ItemLocation(
                            sd.rank, name, 0, 0, crc32c_b64(b""), "none", receipt=receipt
                        ),
                    )
                )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator only, after every rank's writes succeeded: write DCP's metadata as a JSON
        shard, then commit the manifest with every rank's receipts.

        Raises:
            CommitError / CommitConflict: from :meth:`Coordinator.commit`; no manifest written
                by this attempt.
            ConfigError: metadata that cannot be stored as JSON.
        """
        if self.attempt is None:
            raise CommitError("finish() called before this rank wrote its data")
        world_size = len(results)
        locations: dict[MetadataIndex, _ItemLocation] = {}
        receipts: dict[int, dict[str, Any]] = {r: {} for r in range(world_size)}
        references: dict[int, dict[Any, Any]] = {r: {} for r in range(world_size)}
        for rank, rank_results in enumerate(results):
            for wr in rank_results:
                loc = wr.storage_data
                if not isinstance(loc, _ItemLocation):
                    raise CommitError(f"rank {rank} returned foreign write results", {rank: repr(loc)[:200]})
                if loc.origin is not None:  # reused from an ancestor's object
                    ref = self._reference(loc)
                    references[rank][ref.identity] = ref
                    locations[wr.index] = loc
                    continue
                if loc.rank != rank:
                    raise CommitError(
                        f"rank {rank} reported data of rank {loc.rank}", {rank: "rank mismatch"}
                    )
                receipts[rank][loc.shard] = loc.receipt
                if loc.kind != "none":
                    locations[wr.index] = dataclasses.replace(loc, receipt=None)
        metadata = dataclasses.replace(
            metadata,
            version=_DCP_VERSION,
            storage_data=None,  # the item table is in the JSON body
            storage_meta=StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.attempt),
        )
        body = encode_metadata(metadata, locations)
        assert self.step is not None  # set_up_storage_writer refuses a save without a step
        writer = ShardWriter(self.store, step=self.step, attempt=self.attempt, rank=0)
        receipts[0][METADATA_SHARD] = writer.write(METADATA_SHARD, body)
        manifest_metadata = dict(self.extra_metadata)
        manifest_metadata[MANIFEST_KEY] = {
            "format_version": FORMAT_VERSION,
            "metadata_shard": {"rank": 0, "name": METADATA_SHARD},
        }
        reports = [
            {
                "receipts": [r.to_dict() for r in by_name.values()],
                "references": [r.to_dict() for r in references[rank].values()],
            }
            for rank, by_name in sorted(receipts.items())
        ]
        self.manifest = self.session.commit(
            self.step,
            self.attempt,
            reports,
            progress=self.progress,
            run=self.run,
            topology={"world_size": world_size, "format": "torch-dcp"},
            metadata=manifest_metadata,
        )
        # the next save of this process indexes this table without reading it back
        dedup.remember_value(self.store, self.manifest.step, self.manifest.attempt, CACHE_TAG, locations)
        self.session.retain(self.manifest)

    def _reference(self, loc: _ItemLocation) -> Any:
        """The manifest reference for an item the parent holds (its own shard, or one it
        references itself)."""
        parent = self._parent
        if parent is None or loc.origin is None:
            raise CommitError("a rank reused an item, but this save has no parent to reuse from")
        try:
            if tuple(loc.origin) == parent.ref:
                return Reference.to(parent.shard(loc.rank, loc.shard), parent)
            return parent.reference(tuple(loc.origin), loc.rank, loc.shard)
        except KeyError as exc:
            raise CommitError(f"a reused item names an object its parent does not hold: {exc}") from None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for DCP's process-based ``async_save``: the store and session are not sent
        but re-opened in the checkpoint process from the run-root URI and ``store_options``.

        Raises:
            ConfigError: the writer was given a :class:`Store` object or ``metrics`` (neither can
                cross to another process); the message says what to pass instead.
        """
        if self._uri is None:
            raise ConfigError(
                f"ObjckptStorageWriter on a Store object ({self.store.location}) cannot be sent to "
                "DCP's checkpoint process (async_save with AsyncCheckpointerType.PROCESS): give it "
                "the run-root URI (and store_options=) instead, so the process re-opens the store, "
                "or use the thread-based async_save"
            )
        if self._metrics is not None:
            raise ConfigError(
                "ObjckptStorageWriter(metrics=...) cannot report from DCP's checkpoint process "
                "(async_save with AsyncCheckpointerType.PROCESS): drop metrics= there, or use the "
                "thread-based async_save"
            )
        state = dict(self.__dict__)
        del state["store"], state["session"]
        state["_candidates"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.store, self._owns_store = open_root(self._uri, self._store_options)  # type: ignore[arg-type]
        self.session = SaveSession(
            self.store, LocalComm(), retention=self._retention, metrics=None, label="DCP save"
        )

    def close(self) -> None:
        """Close the store if this writer opened it from a URI."""
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> ObjckptStorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
