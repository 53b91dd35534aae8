"""The DCP ``StorageReader``: reads one committed checkpoint, verifying every item."""

from __future__ import annotations

import dataclasses
import io
import logging
import secrets
from collections.abc import Mapping
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ...coordination.exchange import reads_once_by_default
from ...coordination.roots import open_root
from ...errors import (
    ConfigError,
    DistributedError,
    LoadRefusedError,
    ManifestError,
    NoCheckpointError,
    is_damage,
)
from ...layout import check_step, shard_key
from ...manifest import Manifest
from ...reader import Reader
from ...store import Store
from .. import dedup
from ..dist import shared_comm
from ._load import LoadItem, narrow, plan_reads, run_reads, tensor_from
from ._metadata import (
    _COALESCE_GAP,
    _RANGE_PARTS,
    CACHE_TAG,
    MANIFEST_KEY,
    READABLE_FORMAT_VERSIONS,
    _first_line,
    _ItemLocation,
    _parse_step,
    _ResolvedCheckpoint,
    _warn_fallback,
    decode_metadata,
)
from ._read_once import ReadOncePlan, assign_owners, load_read_once, with_owners

log = logging.getLogger("objckpt.training.dcp")

StoreLike = Union[str, Store]
_KeyIndex = dict[Any, tuple[str, int]]  # (rank, shard) or (origin, rank, shard) -> (key, size)

# ---------------------------------------------------------------------------------- reader


class ObjckptStorageReader(StorageReader):
    """DCP ``StorageReader`` for a committed objckpt checkpoint, with DCP's resharding.

    ``step=None`` resolves the newest valid committed checkpoint through
    :class:`~objckpt.reader.Reader` (pointer, then ``manifests/``; never a scan of ``data/``);
    if its DCP metadata fails validation it falls back to the parent with a warning. An explicit
    ``step`` (or ``dcp.load(checkpoint_id=step)``) never falls back.

    Every rank resolves on its own; rank 0 checks in ``prepare_global_plan`` that all ranks
    resolved the same checkpoint (:class:`DistributedError` otherwise).

    ``read_once`` (default: on for object stores, off on file://, where a read is a page-cache
    copy and measured faster than the exchange, ``Store.cheap_reads``): when every rank of the
    default process group loads, the items every rank requests (a replicated model or optimizer
    state) are read from the store by one rank each and sent to the others over gloo,
    CRC32C-checked on receipt (invariant 16; see :mod:`._read_once`); a load on a subgroup, or
    with ``read_once=False``, reads every item on every rank that requests it. A damaged item
    then fails the load on every rank with the same error.

    Errors (inside ``dcp.load`` they reach you wrapped in DCP's ``CheckpointException``;
    :func:`load_sharded` unwraps them): :class:`NoCheckpointError` when nothing valid is
    committed (or the step does not exist), :class:`ManifestError` for bad metadata,
    :class:`ChecksumMismatchError` when an item's bytes fail their CRC32C or a shard is missing,
    :class:`IntegrityError` for a bytes item that ``torch.load(weights_only=True)`` refuses,
    :class:`ConfigError` when the checkpoint was not written by :class:`ObjckptStorageWriter`.

    A load that fails part-way may have filled some tensors of ``state_dict``; a successful one
    filled every requested item from this one checkpoint.
    """

    def __init__(
        self,
        uri_or_store: StoreLike,
        step: int | None = None,
        *,
        manifest: Manifest | None = None,
        store_options: Mapping[str, Any] | None = None,
        read_once: bool | None = None,
    ) -> None:
        super().__init__()
        #: items every rank loads are read from the store by one rank and sent to the others
        #: (:mod:`._read_once`); only when every rank of the default group takes part. Default:
        #: on object stores, not where reads are cheap copies (``Store.cheap_reads``: file://)
        self.read_once = read_once
        self.store, self._owns_store = open_root(uri_or_store, store_options)
        # what re-opens the store after unpickling (see __getstate__)
        self._uri = uri_or_store if isinstance(uri_or_store, str) else None
        self._store_options = dict(store_options or {})
        self.requested_step = None if step is None else check_step(step)
        #: a checkpoint resolved beforehand (by the restore session on rank 0): this reader then
        #: reads exactly it, without resolving (no LIST, no manifest GET)
        self.resolved = manifest
        self.manifest: Any = None
        self.metadata_error: BaseException | None = None
        self._locations: dict[MetadataIndex, _ItemLocation] = {}
        self._keys: _KeyIndex = {}
        self.rank = 0

    @property
    def step(self) -> int | None:
        """The step being (or last) loaded."""
        return None if self.manifest is None else self.manifest.step

    @property
    def checkpoint_id(self) -> str:
        which = "latest" if self.requested_step is None else self.requested_step
        return f"{self.store.location.rstrip('/')}#step={which}"

    def reset(self, checkpoint_id: Any = None) -> None:
        """A ``checkpoint_id`` is the step to load (int or digit string); no fallback then."""
        if checkpoint_id is not None:
            self.requested_step = _parse_step(checkpoint_id)
        self.manifest = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            _parse_step(checkpoint_id)
        except (ConfigError, ValueError):
            return False
        return True

    # The parameter is deliberately not called ``kwargs``: DCP retries a failed read_metadata
    # with ``rank=`` ("rank-local metadata") only when it sees one, which would hide our error.
    def read_metadata(self, *args: Any, **_options: Any) -> Metadata:
        """Resolve the checkpoint and decode its DCP metadata (JSON, validated)."""
        self.metadata_error = None
        try:
            self.manifest, metadata, self._locations, self._keys = self._resolve()
        except BaseException as exc:
            # DCP turns this into an AssertionError carrying only the text; keep the original so
            # load_sharded can raise it as itself.
            self.metadata_error = exc
            raise
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = secrets.token_hex(8)
        return metadata

    def _resolve(self) -> tuple[Any, Metadata, dict[MetadataIndex, _ItemLocation], _KeyIndex]:
        reader = Reader(self.store)
        if self.resolved is not None:
            return (self.resolved, *self._decode(reader, self.resolved))
        if self.requested_step is not None:
            manifest = reader.load(self.requested_step)
            return (manifest, *self._decode(reader, manifest))
        for manifest in reader.candidates():
            try:
                return (manifest, *self._decode(reader, manifest))
            except Exception as exc:
                if not is_damage(exc):  # the one damage rule: an outage never falls back
                    raise
                _warn_fallback(manifest, exc)
        raise NoCheckpointError(f"no valid committed DCP checkpoint under {self.store.location}")

    def _decode(
        self, reader: Reader, manifest: Any
    ) -> tuple[Metadata, dict[MetadataIndex, _ItemLocation], _KeyIndex]:
        info = (manifest.metadata or {}).get(MANIFEST_KEY)
        if not isinstance(info, Mapping):
            # Not corruption: a checkpoint of another kind. Falling back past it would silently
            # restore older state, so refuse instead.
            raise ConfigError(
                f"checkpoint step {manifest.step} under {self.store.location} was not written "
                "by ObjckptStorageWriter (no DCP metadata in its manifest)"
            )
        if info.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise ManifestError(
                f"step {manifest.step}: unsupported DCP format {info.get('format_version')!r}"
            )
        world_size = manifest.world_size
        by_key = {r.key: r for r in manifest.shards}

        def receipt_for(rank: Any, name: Any, origin: Any = None) -> Any:
            if origin is not None:  # an item reused from an ancestor's object (deduplication)
                try:
                    return manifest.reference(tuple(origin), rank, name)
                except KeyError:  # only objects the (validated) manifest references are read
                    raise ManifestError(
                        f"step {manifest.step}: DCP data names shard {name!r} of rank {rank!r} of "
                        f"checkpoint {tuple(origin)}, which the manifest does not reference"
                    ) from None
            if not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ManifestError(f"step {manifest.step}: DCP data names rank {rank!r} of {world_size}")
            try:
                key = shard_key(manifest.step, manifest.attempt, rank, name)
            except (ValueError, TypeError) as exc:
                raise ManifestError(f"step {manifest.step}: bad shard name {name!r}: {exc}") from None
            # either layout: the manifest's keys may carry the spreading prefix (layout.py)
            receipt = by_key.get(key) or by_key.get(
                shard_key(manifest.step, manifest.attempt, rank, name, spread=True)
            )
            if receipt is None:  # only keys the (validated) manifest lists are ever read
                raise ManifestError(
                    f"step {manifest.step}: DCP data names shard {key!r}, not in the manifest"
                )
            return receipt

        ms = info.get("metadata_shard")
        if not isinstance(ms, Mapping):
            raise ManifestError(f"step {manifest.step}: DCP manifest entry has no metadata shard")
        raw = reader.read_shard(receipt_for(ms.get("rank"), ms.get("name")))  # size + CRC32C
        metadata, locations = decode_metadata(raw)
        keys: _KeyIndex = {}
        for index, loc in locations.items():
            where = _where(loc)
            if where not in keys:
                receipt = receipt_for(loc.rank, loc.shard, loc.origin)
                keys[where] = (receipt.key, int(receipt.size))
            key, size = keys[where]
            if loc.start + loc.length > size:
                raise ManifestError(
                    f"step {manifest.step}: item {index.fqn} [{loc.start}, {loc.start + loc.length}) "
                    f"lies beyond shard {key} ({size} bytes)"
                )
        # a save that continues from this checkpoint indexes its items without reading them
        dedup.remember_value(self.store, manifest.step, manifest.attempt, CACHE_TAG, locations)
        return metadata, locations, keys

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        rank = kwargs.get("rank")
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        if self.manifest is None:
            raise ConfigError("set_up_storage_reader before read_metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(
            plan, storage_data=_ResolvedCheckpoint(self.manifest.step, self.manifest.attempt)
        )

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Invariant 13, on the plans DCP gathers anyway: every rank resolved one checkpoint."""
        seen = {i: p.storage_data for i, p in enumerate(plans)}
        mine = _ResolvedCheckpoint(self.manifest.step, self.manifest.attempt)
        differ = {i: s for i, s in seen.items() if s != mine}
        if differ:
            detail = ", ".join(
                f"rank {i}: step {getattr(s, 'step', '?')} attempt {getattr(s, 'attempt', '?')}"
                for i, s in sorted(differ.items())
            )
            raise DistributedError(
                f"ranks resolved different checkpoints (rank 0: step {mine.step} attempt "
                f"{mine.attempt}; {detail}); retry the load or pass an explicit step"
            )
        if not self._reads_once(len(plans)):
            return plans
        owners = assign_owners(plans, self._locations)
        return with_owners(plans, owners, mine) if owners else plans

    def _reads_once(self, ranks: int) -> bool:
        """Whether this load of ``ranks`` ranks reads shared items once: wanted (``read_once``,
        by default where reads are not cheap copies) and spanning every rank of the default
        group (read-once needs a communicator every rank of the load creates; a subgroup's load
        reads per rank)."""
        wanted = reads_once_by_default(self.store) if self.read_once is None else self.read_once
        return (
            wanted
            and ranks > 1
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() == ranks
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch this rank's items with parallel, bounded ranged reads straight into their
        destination tensors (``_load``), verify each item's CRC32C, then hand tensors and
        weights-only-loaded bytes items to the planner. In a read-once load (the plan carries a
        :class:`ReadOncePlan`) a collective of every rank: the shared items another rank reads
        arrive over the process group instead."""
        per_index: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            per_index.setdefault(req.storage_index, []).append(req)
        items: list[LoadItem] = []
        for index, reqs in per_index.items():
            loc = self._locations.get(index)
            if loc is None:
                raise ManifestError(
                    f"step {self.step}: checkpoint has no data for {index.fqn} at {index.offset}"
                )
            key, _ = self._keys[_where(loc)]
            items.append(LoadItem(key, loc, reqs))
        window = max(1, self.store.max_in_flight)

        def finish(item: LoadItem, data: memoryview) -> None:
            self._apply(item, data, planner)

        if isinstance(plan.storage_data, ReadOncePlan):
            load_read_once(
                shared_comm(),
                self.store,
                plan,
                items,
                planner,
                cap=self.read_cap,
                gap=_COALESCE_GAP,
                window=window,
                finish=finish,
                step=self.step,
            )
        else:
            reads = plan_reads(items, cap=self.read_cap, gap=_COALESCE_GAP)
            run_reads(self.store, items, reads, planner, window=window, finish=finish, step=self.step)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @property
    def read_cap(self) -> int:
        """The most bytes one ranged read fetches (coalesced items, or a piece of a big one)."""
        return _RANGE_PARTS * self.store.part_size

    def _apply(self, item: LoadItem, view: memoryview, planner: LoadPlanner) -> None:
        """Hand one verified item to the planner: in place (already in its tensor), copied once
        from its scratch into each destination, or as a weights-only-loaded bytes item."""
        loc, key = item.loc, item.key
        for req in item.reqs:
            if req.type == LoadItemType.BYTE_IO:
                if loc.kind != "bytes":
                    raise ManifestError(f"{req.storage_index.fqn}: stored as {loc.kind}, requested as bytes")
                planner.load_bytes(req, _safe_bytes(view, key, req.storage_index.fqn))
                continue
            if loc.kind != "tensor":
                raise ManifestError(f"{req.storage_index.fqn}: stored as {loc.kind}, requested as a tensor")
            if item.direct:
                assert item.target is not None
                planner.commit_tensor(req, item.target)
                continue
            tensor = narrow(tensor_from(item, view), req)
            target = item.target if item.target is not None else planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ManifestError(
                    f"{req.storage_index.fqn}: stored slice {tuple(tensor.size())} does not fit "
                    f"destination {tuple(target.size())}"
                )
            target.copy_(tensor)
            planner.commit_tensor(req, target)

    def __getstate__(self) -> dict[str, Any]:
        """Picklable when opened from a run-root URI: the store is re-opened from the URI and
        ``store_options`` on unpickling (the resolved checkpoint travels with it).

        Raises:
            ConfigError: the reader was given a :class:`Store` object, which cannot cross to
                another process; the message says to pass the URI instead.
        """
        if self._uri is None:
            raise ConfigError(
                f"ObjckptStorageReader on a Store object ({self.store.location}) cannot be pickled "
                "into another process: give it the run-root URI (and store_options=) instead"
            )
        state = dict(self.__dict__)
        del state["store"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.store, self._owns_store = open_root(self._uri, self._store_options)  # type: ignore[arg-type]

    def close(self) -> None:
        """Close the store if this reader opened it from a URI."""
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> ObjckptStorageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _where(loc: _ItemLocation) -> Any:
    """Which object holds an item: its checkpoint's own shard, or an ancestor's (by identity)."""
    return (loc.rank, loc.shard) if loc.origin is None else (tuple(loc.origin), loc.rank, loc.shard)


def _safe_bytes(view: memoryview, key: str, fqn: str) -> io.BytesIO:
    """A bytes item, loaded with ``torch.load(weights_only=True)`` only (invariant 12).

    DCP's default planner ``torch.load``s what we hand it with ``weights_only=False``; so it
    never sees the store's bytes, only our own re-serialisation of the object the restricted
    unpickler produced."""
    try:
        obj = torch.load(io.BytesIO(view.tobytes()), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, or anything a hostile stream provokes
        # The bytes passed their CRC32C: they are what was committed. The policy refuses them,
        # which is not damage (falling back would restore older state though nothing is broken).
        raise LoadRefusedError(
            f"refusing bytes item {fqn!r} in {key}: not loadable with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {_first_line(exc)}); allow its classes with "
            "torch.serialization.add_safe_globals([...]) if you trust this checkpoint"
        ) from None
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out
