"""``torch.distributed.checkpoint`` (DCP) storage on an objckpt store, through the commit protocol.

::

    from objckpt.training.dcp import ObjckptStorageWriter, ObjckptStorageReader

    dcp.save(state_dict, storage_writer=ObjckptStorageWriter("s3://bucket/run", step=200))
    dcp.load(state_dict, storage_reader=ObjckptStorageReader("s3://bucket/run"))  # latest step

    save_sharded(state_dict, "s3://bucket/run", step=200)   # same, errors as objckpt errors
    step = load_sharded(state_dict, "s3://bucket/run")      # latest valid step, with fallback

How a DCP save maps onto the protocol (``docs/PROTOCOL.md``):

* **One attempt id on every rank, no extra collective.** The coordinator draws a fresh id in
  ``prepare_global_plan`` and hands it to every rank inside its ``SavePlan.storage_data``, which
  DCP scatters anyway. A retried save is a new attempt with new keys (invariant 1), so a failed
  save can never touch the shards of a committed checkpoint, whatever the step.
* **Shards.** Each rank streams its items into ``dcp-NNNNN.bin`` shards under its own attempt
  prefix with :class:`~objckpt.writer.ShardWriter` (create-if-absent, multipart, bounded memory).
  Tensors are written as their raw bytes, zero-copy from contiguous CPU tensors; bytes items are
  the ``torch.save`` output DCP's planner produces. Every item's ``WriteResult.storage_data``
  records shard, offset, length, dtype, shape and the item's own CRC32C, plus the shard receipt.
* **Commit.** ``finish`` (coordinator only, called by DCP only after *every* rank's writes
  succeeded) writes DCP's ``Metadata`` as a JSON shard of rank 0 and calls
  :meth:`Coordinator.commit <objckpt.commit.Coordinator.commit>` with every rank's receipts: the
  manifest (create-if-absent) is the commit point, then the pointer moves by compare-and-swap.
* **Load.** Resolution goes through :class:`~objckpt.reader.Reader` (pointer + ``manifests/``,
  never a scan of ``data/``). DCP's metadata is decoded from JSON, never unpickled (invariant 12);
  bytes items are loaded with ``torch.load(weights_only=True)``. All ranks' resolved step is
  compared in ``prepare_global_plan`` (invariant 13) on the plans DCP gathers anyway.

Integrity of ranged reads: a shard's CRC32C covers the whole object, so it can only be checked on a
whole-shard read, and a rank resharding a checkpoint needs only some items of each shard (reading
whole shards would multiply traffic by up to the world size). So each item records its own CRC32C
in the (CRC32C-verified, manifest-referenced) metadata shard, and every item is fetched with a
ranged GET (adjacent items coalesced) and verified before use: manifest self-checksum -> metadata
shard CRC32C -> per-item CRC32C. An item's bytes are never used unverified.

Errors: DCP reports failures as ``CheckpointException``, a ``BaseException`` that ``except
Exception`` does not catch. :func:`save_sharded` / :func:`async_save_sharded` turn it into
:class:`~objckpt.errors.CommitError` (:class:`~objckpt.errors.CommitConflict` when another attempt
won the step), raised identically on every rank; :func:`load_sharded` re-raises the failing rank's
own exception. Calling ``dcp.save``/``dcp.load`` directly gives DCP's ``CheckpointException``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import logging
import math
import secrets
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .._crc import Crc32c, crc32c_b64
from ..commit import Coordinator
from ..errors import (
    ChecksumMismatchError,
    CommitConflict,
    CommitError,
    ConfigError,
    DistributedError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    ObjckptError,
)
from ..layout import check_step, new_attempt_id, shard_key
from ..reader import Reader
from ..store import Store, open_store
from ..writer import ShardWriter

__all__ = [
    "ObjckptStorageReader",
    "ObjckptStorageWriter",
    "async_save_sharded",
    "commit_error_from",
    "load_sharded",
    "save_sharded",
]

log = logging.getLogger(__name__)

StoreLike = Union[str, Store]
_KeyIndex = dict[tuple[int, str], tuple[str, int]]  # (rank, shard name) -> (key, size)

#: manifest ``metadata`` key under which a DCP checkpoint describes itself
MANIFEST_KEY = "dcp"
#: version of the JSON encoding of DCP's Metadata (bump on incompatible change)
FORMAT_VERSION = 1
METADATA_SHARD = "dcp-metadata.json"
_DATA_SHARD = "dcp-{:05d}.bin"
_FORMAT_NAME = "objckpt-dcp-metadata"
_DCP_VERSION = "1.0.0"  # what torch's FileSystemWriter records in Metadata.version

# Reads: items of one shard closer than this are fetched with one ranged GET (fewer requests
# beat a few wasted bytes), and one GET covers at most this many part sizes (bounds memory).
_COALESCE_GAP = 256 * 1024
_RANGE_PARTS = 2


# ---------------------------------------------------------------------------------------- types


@dataclass(frozen=True)
class _ItemLocation:
    """Where one DCP item lives: shard ``name`` of ``rank``, bytes ``[start, start+length)``.

    ``receipt`` is the shard's receipt (writer side only; it rides in ``WriteResult.storage_data``
    so the coordinator gets every rank's receipts without another collective). Many items share
    one receipt object, so DCP's pickled gather carries it once per rank.
    """

    rank: int
    shard: str
    start: int
    length: int
    crc32c: str
    kind: str  # "tensor" | "bytes"
    dtype: str | None = None  # torch dtype name, e.g. "float32" (tensors)
    shape: tuple[int, ...] | None = None  # the stored chunk's shape (tensors)
    receipt: Any = dataclasses.field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class _LocalStorageData:
    """``SavePlan.storage_data`` of a local plan: lets the coordinator echo a per-save nonce."""

    nonce: str


@dataclass(frozen=True)
class _GlobalStorageData:
    """``SavePlan.storage_data`` the coordinator scatters: the attempt every rank writes under."""

    attempt: str
    rank: int
    world_size: int
    nonce: str | None


@dataclass(frozen=True)
class _ResolvedCheckpoint:
    """``LoadPlan.storage_data``: which checkpoint this rank resolved (compared on rank 0)."""

    step: int
    attempt: str


# ----------------------------------------------------------------------------------- helpers


def _open(uri_or_store: StoreLike) -> tuple[Store, bool]:
    """The store, and whether we opened it (and so close it)."""
    if isinstance(uri_or_store, Store):
        return uri_or_store, False
    if isinstance(uri_or_store, str):
        return open_store(uri_or_store), True
    raise ConfigError(f"expected a run-root URI or a Store, got {type(uri_or_store).__name__}")


def _parse_step(checkpoint_id: Any) -> int:
    """DCP's ``checkpoint_id`` names a step here (an int or a string of digits)."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return check_step(checkpoint_id)
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return check_step(int(checkpoint_id))
    raise ConfigError(f"objckpt DCP storage takes the step number as checkpoint_id, got {checkpoint_id!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: Any) -> torch.dtype:
    # Allowlist: only attributes of ``torch`` that are dtypes; a JSON string never names code.
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown tensor dtype {name!r} in DCP metadata")
    return dtype


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _warn_fallback(manifest: Any, exc: BaseException) -> None:
    # Loud on purpose (invariant 11): restoring an older step than the newest committed one is
    # something an operator must see, in logs and in warnings-as-errors test runs.
    msg = (
        f"objckpt: checkpoint step {manifest.step} (attempt {manifest.attempt}) is unusable "
        f"({type(exc).__name__}: {exc}); falling back to its parent"
    )
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _unwrap(wrapped: Any) -> BaseException:
    """DCP stores each rank's failure as ``(exception, traceback summary)``."""
    if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
        return wrapped[0]
    if isinstance(wrapped, BaseException):
        return wrapped
    return RuntimeError(str(wrapped))


def _failures(cpe: CheckpointException) -> dict[int, BaseException]:
    return {int(rank): _unwrap(w) for rank, w in sorted(cpe.failures.items())}


def commit_error_from(cpe: CheckpointException, *, step: int, location: str) -> CommitError:
    """Translate DCP's ``CheckpointException`` (a ``BaseException``) from a save into a
    :class:`CommitError` (``CommitConflict`` if any rank lost the step to another attempt).

    Built only from what every rank holds identically (failing ranks, exception types and
    messages), so every rank raises the same error."""
    fails = _failures(cpe)
    cls = CommitConflict if any(isinstance(e, CommitConflict) for e in fails.values()) else CommitError
    reasons = {rank: f"{type(e).__name__}: {e}" for rank, e in fails.items()}
    return cls(f"DCP save of step {step} to {location} was not committed", reasons)


# ------------------------------------------------------------------------- metadata as JSON


def _encode_value(value: Any, where: str) -> Any:
    """Tagged JSON for planner data: primitives as is, containers as one-key objects, so tuples
    and non-string dict keys survive the round trip. Anything else is refused at save time."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [_encode_value(v, where) for v in value]}
    if isinstance(value, list):
        return {"list": [_encode_value(v, where) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode_value(k, where), _encode_value(v, where)] for k, v in value.items()]}
    raise ConfigError(
        f"DCP {where} holds a {type(value).__name__}, which objckpt does not store (only "
        "JSON-like values: metadata is never pickled)"
    )


def _decode_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((tag, body),) = value.items()
        if tag in ("tuple", "list") and isinstance(body, list):
            items = [_decode_value(v) for v in body]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and isinstance(body, list):
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ManifestError("malformed dict entry in DCP planner data")
                key = _decode_value(pair[0])
                if isinstance(key, (list, dict)):
                    raise ManifestError("unhashable key in DCP planner data")
                out[key] = _decode_value(pair[1])
            return out
    raise ManifestError(f"malformed value in DCP planner data: {str(value)[:80]!r}")


def _encode_index(index: MetadataIndex) -> dict[str, Any]:
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else [int(o) for o in index.offset],
        "index": index.index,
    }


def encode_metadata(metadata: Metadata, locations: Mapping[MetadataIndex, _ItemLocation]) -> bytes:
    """DCP ``Metadata`` plus every item's location, as canonical JSON (never pickle).

    Raises:
        ConfigError: the metadata holds something JSON cannot represent (e.g. a custom
            planner's arbitrary ``planner_data``); raised before anything is committed.
    """
    sd_md: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            sd_md[fqn] = {"type": "bytes"}
        elif isinstance(md, TensorStorageMetadata):
            props = md.properties
            if props.layout != torch.strided:
                raise ConfigError(f"{fqn}: only strided tensors are supported, got {props.layout}")
            sd_md[fqn] = {
                "type": "tensor",
                "dtype": _dtype_name(props.dtype),
                "requires_grad": bool(props.requires_grad),
                "size": [int(s) for s in md.size],
                "chunks": [
                    {"offsets": [int(o) for o in c.offsets], "sizes": [int(s) for s in c.sizes]}
                    for c in md.chunks
                ],
            }
        else:
            raise ConfigError(f"{fqn}: unsupported DCP storage metadata {type(md).__name__}")
    sm = metadata.storage_meta
    items = []
    for index, loc in locations.items():
        items.append(
            {
                "index": _encode_index(index),
                "rank": loc.rank,
                "shard": loc.shard,
                "start": loc.start,
                "length": loc.length,
                "crc32c": loc.crc32c,
                "kind": loc.kind,
                "dtype": loc.dtype,
                "shape": None if loc.shape is None else list(loc.shape),
            }
        )
    items.sort(key=lambda it: (it["rank"], it["shard"], it["start"]))
    body = {
        "format": _FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "dcp_version": metadata.version,
        "byteorder": sys.byteorder,
        "torch_version": torch.__version__,
        "state_dict_metadata": sd_md,
        "planner_data": _encode_value(metadata.planner_data, "planner_data"),
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
            "save_id": sm.save_id,
            "modules": _encode_value(list(sm.modules or []), "storage_meta.modules"),
        },
        "items": items,
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _ints(value: Any, what: str, *, nonneg: bool = True) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and (v >= 0 or not nonneg) for v in value
    ):
        raise ManifestError(f"DCP metadata: {what} must be a list of non-negative ints")
    return tuple(value)


def _chunk(c: Any, fqn: str) -> ChunkStorageMetadata:
    if not isinstance(c, dict):
        raise ManifestError(f"DCP metadata: a chunk of {fqn!r} is malformed")
    return ChunkStorageMetadata(
        offsets=torch.Size(_ints(c.get("offsets"), f"{fqn} offsets")),
        sizes=torch.Size(_ints(c.get("sizes"), f"{fqn} sizes")),
    )


def decode_metadata(raw: bytes) -> tuple[Metadata, dict[MetadataIndex, _ItemLocation]]:
    """Parse the JSON written by :func:`encode_metadata`, validating every field.

    Raises:
        ManifestError: not our JSON (a pickle, say: it is never unpickled), or malformed.
        ConfigError: written on a machine of the other byte order.
    """
    try:
        body = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"DCP metadata shard is not JSON ({exc}); refusing it") from None
    if not isinstance(body, dict) or body.get("format") != _FORMAT_NAME:
        raise ManifestError("DCP metadata shard is not objckpt DCP metadata")
    if body.get("format_version") != FORMAT_VERSION:
        raise ManifestError(
            f"DCP metadata format version {body.get('format_version')!r} is not supported "
            f"(this objckpt reads {FORMAT_VERSION})"
        )
    if body.get("byteorder") != sys.byteorder:
        raise ConfigError(
            f"checkpoint was written on a {body.get('byteorder')}-endian machine; this one is "
            f"{sys.byteorder}-endian"
        )
    sd_md: dict[str, Any] = {}
    raw_md = body.get("state_dict_metadata")
    if not isinstance(raw_md, dict):
        raise ManifestError("DCP metadata: state_dict_metadata missing")
    for fqn, md in raw_md.items():
        if not isinstance(md, dict):
            raise ManifestError(f"DCP metadata: entry {fqn!r} malformed")
        if md.get("type") == "bytes":
            sd_md[fqn] = BytesStorageMetadata()
        elif md.get("type") == "tensor":
            chunks = md.get("chunks")
            if not isinstance(chunks, list):
                raise ManifestError(f"DCP metadata: {fqn!r} has no chunk list")
            sd_md[fqn] = TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=_dtype_from_name(md.get("dtype")),
                    requires_grad=bool(md.get("requires_grad", False)),
                ),
                size=torch.Size(_ints(md.get("size"), f"{fqn} size")),
                chunks=[_chunk(c, fqn) for c in chunks],
            )
        else:
            raise ManifestError(f"DCP metadata: entry {fqn!r} has unknown type")
    locations: dict[MetadataIndex, _ItemLocation] = {}
    items = body.get("items")
    if not isinstance(items, list):
        raise ManifestError("DCP metadata: item list missing")
    for it in items:
        try:
            idx = it["index"]
            if not isinstance(idx.get("fqn"), str):
                raise TypeError("fqn")
            offset = None if idx.get("offset") is None else _ints(idx["offset"], "index offset")
            hint = idx.get("index")
            if hint is not None and not isinstance(hint, int):
                raise TypeError("index hint")
            index = MetadataIndex(idx["fqn"], offset, hint)
            kind = it["kind"]
            if kind not in ("tensor", "bytes"):
                raise TypeError("kind")
            rank, start, length = it["rank"], it["start"], it["length"]
            if not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (rank, start, length)
            ):
                raise TypeError("rank/start/length")
            if not isinstance(it["shard"], str) or not isinstance(it["crc32c"], str):
                raise TypeError("shard/crc32c")
            dtype = shape = None
            if kind == "tensor":
                dtype = _dtype_name(_dtype_from_name(it["dtype"]))
                shape = _ints(it["shape"], "shape")
                if math.prod(shape) * _element_size(_dtype_from_name(dtype)) != length:
                    raise ManifestError(
                        f"DCP metadata: item {index.fqn} length {length} does not match its "
                        f"shape {list(shape)} and dtype {dtype}"
                    )
            loc = _ItemLocation(rank, it["shard"], start, length, it["crc32c"], kind, dtype, shape)
        except ManifestError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ManifestError(f"DCP metadata: malformed item ({exc})") from None
        locations[index] = loc
    sm_raw = body.get("storage_meta")
    storage_meta = None
    if isinstance(sm_raw, dict):
        modules = _decode_value(sm_raw.get("modules"))
        storage_meta = StorageMeta(
            checkpoint_id=sm_raw.get("checkpoint_id"),
            save_id=sm_raw.get("save_id"),
            modules=list(modules) if isinstance(modules, list) else [],
        )
    metadata = Metadata(
        state_dict_metadata=sd_md,
        planner_data=_decode_value(body.get("planner_data")),
        storage_data=dict(locations),
        storage_meta=storage_meta,
        version=body.get("dcp_version") if isinstance(body.get("dcp_version"), str) else None,
    )
    return metadata, locations


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

    Atomicity: all or nothing per step, decided by the manifest's create-if-absent write.

    Errors (raised inside DCP, which reports them as its ``CheckpointException``; use
    :func:`save_sharded` to get them as objckpt errors): :class:`CommitError` when the commit
    check fails, :class:`CommitConflict` when another attempt already committed the step, store
    errors from uploads, :class:`ConfigError` for unsupported use (``use_collectives=False``,
    DCP plan caching, non-JSON planner data).

    One save at a time per instance; thread-based ``dcp.async_save`` is supported.
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
    ) -> None:
        super().__init__()
        self.store, self._owns_store = _open(uri_or_store)
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

    # -- DCP protocol

    def reset(self, checkpoint_id: Any = None) -> None:
        """Start a new save; a ``checkpoint_id`` is the step to save (int or digit string)."""
        if checkpoint_id is not None:
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
        out = []
        for i, plan in enumerate(plans):
            local = plan.storage_data
            nonce = local.nonce if isinstance(local, _LocalStorageData) else None
            out.append(
                dataclasses.replace(plan, storage_data=_GlobalStorageData(attempt, i, len(plans), nonce))
            )
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
        writer = ShardWriter(self.store, step=self.step, attempt=sd.attempt, rank=sd.rank)
        results: list[WriteResult] = []
        for number, items in enumerate(self._split(plan.items)):
            name = _DATA_SHARD.format(number)
            locations: list[tuple[WriteItem, _ItemLocation]] = []
            receipt = writer.write(name, self._stream(name, items, planner, locations))
            for item, loc in locations:
                loc = dataclasses.replace(loc, receipt=receipt)
                results.append(WriteResult(index=item.index, size_in_bytes=loc.length, storage_data=loc))
            if not items:  # an empty shard: proves this rank took part (see _split)
                results.append(
                    WriteResult(
                        index=MetadataIndex(f"__objckpt_rank_{sd.rank}__"),
                        size_in_bytes=0,
                        storage_data=_ItemLocation(
                            sd.rank, name, 0, 0, crc32c_b64(b""), "none", receipt=receipt
                        ),
                    )
                )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _split(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        """Pack items into shards: bytes items first (small, like DCP's writer), then tensors in
        plan order, a new shard whenever one would exceed ``max_shard_bytes``. A rank with no
        items still writes one empty shard so its receipt shows it took part in the save."""
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + [
            i for i in items if i.type != WriteItemType.BYTE_IO
        ]
        shards: list[list[WriteItem]] = [[]]
        size = 0
        for item in ordered:
            n = item.tensor_storage_size() or 0
            if shards[-1] and size + n > self.max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(item)
            size += n
        return shards

    def _stream(
        self,
        name: str,
        items: list[WriteItem],
        planner: SavePlanner,
        out: list[tuple[WriteItem, _ItemLocation]],
    ) -> Iterator[memoryview]:
        """Yield each item's bytes, resolving items lazily (resolve_data may allocate), and
        record where each landed with its CRC32C. Runs in the uploading thread, so ``out`` is
        complete when ``ShardWriter.write`` returns."""
        offset = 0
        for item in items:
            data = planner.resolve_data(item)
            crc = Crc32c()
            if item.type == WriteItemType.BYTE_IO:
                if not isinstance(data, io.BytesIO):
                    raise TypeError(
                        f"{item.index.fqn}: planner resolved a bytes item to {type(data).__name__}"
                    )
                view = data.getbuffer()
                loc = _ItemLocation(self.rank, name, offset, view.nbytes, "", "bytes")
            else:
                if not isinstance(data, torch.Tensor):
                    raise TypeError(
                        f"{item.index.fqn}: planner resolved a tensor item to {type(data).__name__}"
                    )
                expected = tuple(item.tensor_data.chunk.sizes) if item.tensor_data else tuple(data.shape)
                if tuple(data.shape) != expected:
                    raise ValueError(
                        f"{item.index.fqn}: resolved tensor has shape {tuple(data.shape)}, "
                        f"plan says {expected}"
                    )
                view = _tensor_bytes(data)
                loc = _ItemLocation(
                    self.rank,
                    name,
                    offset,
                    view.nbytes,
                    "",
                    "tensor",
                    _dtype_name(data.dtype),
                    tuple(int(s) for s in data.shape),
                )
            crc.update(view)
            out.append((item, dataclasses.replace(loc, crc32c=crc.b64)))
            offset += view.nbytes
            if view.nbytes:
                yield view

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
        for rank, rank_results in enumerate(results):
            for wr in rank_results:
                loc = wr.storage_data
                if not isinstance(loc, _ItemLocation):
                    raise CommitError(f"rank {rank} returned foreign write results", {rank: repr(loc)[:200]})
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
        writer = ShardWriter(self.store, step=self.step, attempt=self.attempt, rank=0)
        receipts[0][METADATA_SHARD] = writer.write(METADATA_SHARD, body)
        manifest_metadata = dict(self.extra_metadata)
        manifest_metadata[MANIFEST_KEY] = {
            "format_version": FORMAT_VERSION,
            "metadata_shard": {"rank": 0, "name": METADATA_SHARD},
        }
        self.manifest = Coordinator(self.store, world_size=world_size).commit(
            step=self.step,
            attempt=self.attempt,
            receipts={r: list(by_name.values()) for r, by_name in receipts.items()},
            progress=self.progress,
            run=self.run,
            topology={"world_size": world_size, "format": "torch-dcp"},
            metadata=manifest_metadata,
        )

    def close(self) -> None:
        """Close the store if this writer opened it from a URI."""
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> ObjckptStorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    def __init__(self, uri_or_store: StoreLike, step: int | None = None) -> None:
        super().__init__()
        self.store, self._owns_store = _open(uri_or_store)
        self.requested_step = None if step is None else check_step(step)
        #: (step, attempt) pairs to skip when resolving the latest (set by load_sharded after
        #: a data shard of that checkpoint failed verification)
        self.skip: set[tuple[int, str]] = set()
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
        return ObjckptStorageWriter.validate_checkpoint_id(checkpoint_id)

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
        if self.requested_step is not None:
            manifest = reader.load(self.requested_step)
            return (manifest, *self._decode(reader, manifest))
        for manifest in reader.candidates():
            if (manifest.step, manifest.attempt) in self.skip:
                continue
            try:
                return (manifest, *self._decode(reader, manifest))
            except IntegrityError as exc:
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
        if info.get("format_version") != FORMAT_VERSION:
            raise ManifestError(
                f"step {manifest.step}: unsupported DCP format {info.get('format_version')!r}"
            )
        world_size = manifest.world_size
        by_key = {r.key: r for r in manifest.shards}

        def receipt_for(rank: Any, name: Any) -> Any:
            if not isinstance(rank, int) or not 0 <= rank < world_size:
                raise ManifestError(f"step {manifest.step}: DCP data names rank {rank!r} of {world_size}")
            try:
                key = shard_key(manifest.step, manifest.attempt, rank, name)
            except (ValueError, TypeError) as exc:
                raise ManifestError(f"step {manifest.step}: bad shard name {name!r}: {exc}") from None
            receipt = by_key.get(key)
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
            if (loc.rank, loc.shard) not in keys:
                receipt = receipt_for(loc.rank, loc.shard)
                keys[(loc.rank, loc.shard)] = (receipt.key, int(receipt.size))
            key, size = keys[(loc.rank, loc.shard)]
            if loc.start + loc.length > size:
                raise ManifestError(
                    f"step {manifest.step}: item {index.fqn} [{loc.start}, {loc.start + loc.length}) "
                    f"lies beyond shard {key} ({size} bytes)"
                )
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
            key, _ = self._keys[(loc.rank, loc.shard)]
            per_key.setdefault(key, []).append((loc, reqs))
        ranges = self._coalesce(per_key)
        window = max(1, self.store.max_in_flight)
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=min(window, max(1, len(ranges))), thread_name_prefix="objckpt-dcp-read"
        ) as pool:
            pending: list[concurrent.futures.Future[bytes]] = []
            next_submit = 0
            try:
                for i, (key, start, end, members) in enumerate(ranges):
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
    except Exception as exc:  # UnpicklingError, or anything a hostile stream provokes
        raise IntegrityError(
            f"refusing bytes item {fqn!r} in {key}: not loadable with torch.load(weights_only=True) "
            f"({type(exc).__name__}: {str(exc)[:300]})"
        ) from None
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


# ------------------------------------------------------------------------------ convenience


def save_sharded(
    state_dict: dict[str, Any],
    uri_or_store: StoreLike,
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    progress: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> int:
    """``dcp.save`` ``state_dict`` as committed step ``step`` on every rank of the group.

    Call on every rank (with no process group initialized: a single-process save). Returns the
    committed step on every rank.

    Atomicity: the step is committed whole (manifest + pointer) or not at all; a failure never
    modifies any other checkpoint.

    Raises:
        CommitError: the save was not committed; ``failures`` names every failing rank, and every
            rank raises the same error. :class:`CommitConflict` when another attempt already
            committed this step. Never DCP's ``CheckpointException`` (a ``BaseException``).
    """
    step = check_step(step)
    writer = ObjckptStorageWriter(uri_or_store, step, progress=progress, run=run, metadata=metadata)
    try:
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)
    except CheckpointException as cpe:
        raise commit_error_from(cpe, step=step, location=writer.store.location) from cpe
    finally:
        writer.close()
    return step


def async_save_sharded(
    state_dict: dict[str, Any],
    uri_or_store: StoreLike,
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    progress: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> concurrent.futures.Future[int]:
    """``dcp.async_save`` (thread executor) to committed step ``step``.

    Returns once ``state_dict`` is staged (copied to CPU); the future resolves to ``step`` when
    committed, or raises :class:`CommitError` (never DCP's ``CheckpointException``).
    """
    step = check_step(step)
    writer = ObjckptStorageWriter(uri_or_store, step, progress=progress, run=run, metadata=metadata)
    try:
        response = dcp.async_save(state_dict, storage_writer=writer, process_group=process_group)
    except CheckpointException as cpe:
        writer.close()
        raise commit_error_from(cpe, step=step, location=writer.store.location) from cpe
    upload = getattr(response, "upload_completion", response)
    outcome: concurrent.futures.Future[int] = concurrent.futures.Future()

    def done(f: Any) -> None:
        try:
            f.result()
        except CheckpointException as cpe:
            err = commit_error_from(cpe, step=step, location=writer.store.location)
            err.__cause__ = cpe
            outcome.set_exception(err)
        except BaseException as exc:
            outcome.set_exception(exc)
        else:
            outcome.set_result(step)
        finally:
            writer.close()

    upload.add_done_callback(done)
    return outcome


def load_sharded(
    state_dict: dict[str, Any],
    uri_or_store: StoreLike,
    step: int | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
) -> int:
    """``dcp.load`` into ``state_dict`` (in place, resharding as needed); returns the step loaded.

    ``step=None`` loads the newest valid committed checkpoint; if its metadata or any of its
    data fails verification, the load is retried from its parent (loudly), all ranks together
    (they see the same failure). An explicit ``step`` never falls back.

    Raises:
        NoCheckpointError: nothing valid is committed, or ``step`` is not committed.
        IntegrityError: (explicit step) the checkpoint's metadata or data fails verification.
        DistributedError: ranks resolved different checkpoints (a commit landed mid-resolution).
        Other exceptions as the failing rank raised them (e.g. DCP's ``RuntimeError`` for a key
        missing from the checkpoint), never DCP's ``CheckpointException``.
    """
    reader = ObjckptStorageReader(uri_or_store, step)
    try:
        while True:
            try:
                dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)
                return int(reader.step)
            except CheckpointException as cpe:
                fails = _failures(cpe)
                bad_data = any(isinstance(e, IntegrityError) for e in fails.values())
                if step is None and bad_data and reader.manifest is not None:
                    # Every rank gets the same failure set, so all take this branch together and
                    # skip the same checkpoint (rank 0 verified they had resolved the same one).
                    why = next(e for e in fails.values() if isinstance(e, IntegrityError))
                    _warn_fallback(reader.manifest, why)
                    reader.skip.add((reader.manifest.step, reader.manifest.attempt))
                    continue
                raise _load_error(fails, reader) from cpe
    finally:
        reader.close()


def _load_error(fails: dict[int, BaseException], reader: ObjckptStorageReader) -> BaseException:
    # Resolution errors: DCP reduces them to an AssertionError with the text; this rank's reader
    # kept the original (e.g. NoCheckpointError), which is what the caller can act on.
    first_rank, first = next(iter(fails.items()))
    err: BaseException = reader.metadata_error if reader.metadata_error is not None else first
    if not isinstance(err, Exception):  # e.g. a KeyboardInterrupt on another rank
        err = ObjckptError(f"DCP load failed on rank {first_rank}: {type(err).__name__}: {err}")
    if len(fails) > 1 or first_rank != reader.rank or err is not first:
        err.add_note(
            "DCP load failed on ranks "
            + ", ".join(f"{r} ({type(e).__name__}: {str(e)[:200]})" for r, e in fails.items())
        )
    return err
