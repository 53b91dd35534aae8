"""The DCP ``StorageReader``: reads one committed checkpoint, verifying every item."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import logging
import math
import secrets
from collections.abc import Mapping
from typing import Any, Union

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
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

from ..._crc import Crc32c
from ...coordination.roots import open_root
from ...errors import (
    ChecksumMismatchError,
    ConfigError,
    DistributedError,
    LoadRefusedError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    is_damage,
)
from ...layout import check_step, shard_key
from ...manifest import Manifest
from ...reader import Reader
from ...store import Store
from .. import dedup
from ._metadata import (
    _COALESCE_GAP,
    _RANGE_PARTS,
    CACHE_TAG,
    MANIFEST_KEY,
    READABLE_FORMAT_VERSIONS,
    _dtype_from_name,
    _first_line,
    _ItemLocation,
    _parse_step,
    _ResolvedCheckpoint,
    _warn_fallback,
    decode_metadata,
)

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
    ) -> None:
        super().__init__()
        self.store, self._owns_store = open_root(uri_or_store, store_options)
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
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch this rank's items with coalesced ranged GETs (bounded in flight), verify each
        item's CRC32C, then hand tensors and weights-only-loaded bytes items to the planner."""
        per_index: dict[MetadataIndex, list[ReadItem]] = {}
        for req in plan.items:
            per_index.setdefault(req.storage_index, []).append(req)
        per_key: dict[str, list[tuple[_ItemLocation, list[ReadItem]]]] = {}
        for index, reqs in per_index.items():
            loc = self._locations.get(index)
            if loc is None:
                raise ManifestError(
                    f"step {self.step}: checkpoint has no data for {index.fqn} at {index.offset}"
                )
            key, _ = self._keys[_where(loc)]
            per_key.setdefault(key, []).append((loc, reqs))
        ranges = self._coalesce(per_key)
        window = max(1, self.store.max_in_flight)
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(window, max(1, len(ranges))), thread_name_prefix="objckpt-dcp-read"
        ) as pool:
            pending: list[concurrent.futures.Future[bytes]] = []
            next_submit = 0
            try:
                for i, (key, start, _end, members) in enumerate(ranges):
                    # Keep at most `window` ranges fetched ahead: memory stays bounded.
                    while next_submit < len(ranges) and next_submit < i + window:
                        k, s, e, _ = ranges[next_submit]
                        pending.append(pool.submit(self._fetch, k, s, e))
                        next_submit += 1
                    data = memoryview(pending[i].result())
                    pending[i] = None  # type: ignore[call-overload]  # free the bytes early
                    for loc, reqs in members:
                        at = loc.start - start
                        self._apply(key, loc, data[at : at + loc.length], reqs, planner)
            finally:
                for f in pending:
                    if f is not None:
                        f.cancel()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _coalesce(
        self, per_key: dict[str, list[tuple[_ItemLocation, list[ReadItem]]]]
    ) -> list[tuple[str, int, int, list[tuple[_ItemLocation, list[ReadItem]]]]]:
        cap = _RANGE_PARTS * self.store.part_size
        ranges: list[tuple[str, int, int, list[tuple[_ItemLocation, list[ReadItem]]]]] = []
        for key in sorted(per_key):
            members = sorted(per_key[key], key=lambda m: m[0].start)
            cur: list[Any] | None = None
            for loc, reqs in members:
                end = loc.start + loc.length
                if cur is not None and loc.start - cur[2] <= _COALESCE_GAP and end - cur[1] <= cap:
                    cur[2] = max(cur[2], end)
                    cur[3].append((loc, reqs))
                    continue
                if cur is not None:
                    ranges.append(tuple(cur))  # type: ignore[arg-type]
                cur = [key, loc.start, end, [(loc, reqs)]]
            if cur is not None:
                ranges.append(tuple(cur))  # type: ignore[arg-type]
        return ranges

    def _fetch(self, key: str, start: int, end: int) -> bytes:
        try:
            data = self.store.get(key, byte_range=(start, end))
        except NotFoundError as exc:
            # A shard a committed manifest names is gone: the checkpoint is damaged.
            raise ChecksumMismatchError(
                f"shard of committed step {self.step} is missing: {exc}",
                key=key,
                location=self.store.location,
            ) from exc
        if len(data) != end - start:
            raise ChecksumMismatchError(
                f"ranged read [{start}, {end}) returned {len(data)} bytes (shard truncated?)",
                key=key,
                location=self.store.location,
            )
        return data

    def _apply(
        self, key: str, loc: _ItemLocation, view: memoryview, reqs: list[ReadItem], planner: LoadPlanner
    ) -> None:
        crc = Crc32c()
        crc.update(view)
        if crc.size != loc.length or crc.b64 != loc.crc32c:
            raise ChecksumMismatchError(
                f"item {reqs[0].storage_index.fqn} bytes [{loc.start}, {loc.start + loc.length}) fail "
                f"their CRC32C ({crc.b64} != {loc.crc32c})",
                key=key,
                location=self.store.location,
            )
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                if loc.kind != "bytes":
                    raise ManifestError(f"{req.storage_index.fqn}: stored as {loc.kind}, requested as bytes")
                planner.load_bytes(req, _safe_bytes(view, key, req.storage_index.fqn))
            else:
                if loc.kind != "tensor":
                    raise ManifestError(
                        f"{req.storage_index.fqn}: stored as {loc.kind}, requested as a tensor"
                    )
                tensor = narrow_tensor_by_index(_tensor_from(view, loc), req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise ManifestError(
                        f"{req.storage_index.fqn}: stored slice {tuple(tensor.size())} does not fit "
                        f"destination {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)

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


def _tensor_from(view: memoryview, loc: _ItemLocation) -> torch.Tensor:
    dtype = _dtype_from_name(loc.dtype)
    shape = tuple(loc.shape or ())
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    # One copy into a fresh, writable, malloc-aligned buffer the tensor then owns (the GET's
    # bytes are read-only and a slice of them need not be aligned for the dtype).
    return torch.frombuffer(bytearray(view), dtype=dtype).reshape(shape)


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
