"""DCP's ``Metadata`` as JSON (never pickle), and the location of every item in the shards.

Decoding validates every field: a size or count declared inside the stored metadata is checked
before anything is allocated from it, and a pickle is refused, never unpickled (invariants 11,
12).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import (
    ConfigError,
    ManifestError,
)
from ...layout import check_step
from ...store import Store

log = logging.getLogger("objckpt.training.dcp")

StoreLike = Union[str, Store]
_KeyIndex = dict[tuple[int, str], tuple[str, int]]  # (rank, shard name) -> (key, size)

#: manifest ``metadata`` key under which a DCP checkpoint describes itself
MANIFEST_KEY = "dcp"
#: version of the JSON encoding of DCP's Metadata (bump on incompatible change); version 2 adds
#: each tensor item's content hash and items located in an ancestor's shard (deduplication)
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
#: DCP metadata kept in-process per checkpoint (``dedup.remember_value``)
CACHE_TAG = "dcp-items"
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
    #: ``(timeline, step)`` of the ancestor whose shard ``(rank, shard)`` holds the bytes (None:
    #: this checkpoint's own shard): an unchanged item is not written again (deduplication)
    origin: tuple[int, int] | None = None
    #: content hash of the item's bytes (``dedup.HASH_NAME``), so the next save can reuse them;
    #: only computed when the item may be unchanged or is new (see ``sample``)
    hash: str | None = None
    #: ``dedup.chunk_sample`` of its bytes: the next save hashes an item in full only when the
    #: live item's sample equals this
    sample: str | None = None


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
    #: items of the parent checkpoint this rank may reuse, by index (deduplication)
    candidates: dict[Any, _ItemLocation] | None = None


@dataclass(frozen=True)
class _ResolvedCheckpoint:
    """``LoadPlan.storage_data``: which checkpoint this rank resolved (compared on rank 0)."""

    step: int
    attempt: str


# ----------------------------------------------------------------------------------- helpers
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
        if loc.origin is not None:
            items[-1]["from"] = [int(loc.origin[0]), int(loc.origin[1])]
        if loc.hash is not None:
            items[-1]["hash"] = loc.hash
        if loc.sample is not None:
            items[-1]["sample"] = loc.sample
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
    if body.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise ManifestError(
            f"DCP metadata format version {body.get('format_version')!r} is not supported "
            f"(this objckpt reads {', '.join(map(str, READABLE_FORMAT_VERSIONS))})"
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
            origin = it.get("from")
            if origin is not None:
                origin = _ints(origin, "item origin")
                if len(origin) != 2:
                    raise TypeError("origin")
            digest, sample = it.get("hash"), it.get("sample")
            for v in (digest, sample):
                if v is not None and (not isinstance(v, str) or len(v) > 128):
                    raise TypeError("hash/sample")
            loc = _ItemLocation(
                rank, it["shard"], start, length, it["crc32c"], kind, dtype, shape,
                origin=origin, hash=digest, sample=sample,
            )  # fmt: skip
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


def _warn_fallback(manifest: Any, exc: BaseException) -> None:
    # Loud on purpose (invariant 11): restoring an older step than the newest committed one is
    # something an operator must see, in logs and in warnings-as-errors test runs.
    msg = (
        f"objckpt: checkpoint step {manifest.step} (attempt {manifest.attempt}) is unusable "
        f"({type(exc).__name__}: {exc}); falling back to its parent"
    )
    log.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _first_line(exc: BaseException) -> str:
    """The first line of an error's message without terminal escapes (torch's weights_only
    refusal is a multi-line, bold-faced essay)."""
    text = str(exc).replace("\x1b[1m", "").replace("\x1b[0m", "")
    return text.splitlines()[0][:200] if text else ""
