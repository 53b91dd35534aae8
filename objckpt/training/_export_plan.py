"""Planning the export of a container checkpoint (CheckpointManager, Lightning): the shards'
metadata turned into the tensors and pieces of the file.

:func:`_plan_manager` and :func:`_plan_lightning` read, for their layout, the container headers
(:func:`_read_container`, by ranged reads; a version-3 shard's chunks checked against the receipts
with :func:`_read_chunked_container`), stood in for by meta tensors so that nothing is allocated,
then flattened and renamed (:func:`_plan_containers`, :func:`_plan_chunked_tensor` for
deduplicated chunks here or in an ancestor's object). The naming helpers (:func:`_choose_entry`,
:func:`_rename`, :func:`_out_dtype`) serve DCP's planning too (:mod:`._export_dcp`).

Separate from :mod:`.export` (the public API, :class:`~.export.ExportPlan`, and
:func:`~.export.plan_export`, which picks the layout and calls these), from :mod:`._export_dcp`
(DCP's metadata shard, a different layout to read) and from :mod:`._export_io` (the byte routing
and writing): these helpers only read metadata and produce :class:`~._export_io._Tensor` /
:class:`~._export_io._Piece` / :class:`~._export_io._Source` lists.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import layout
from ..errors import ChecksumMismatchError, ConfigError, ManifestError, SerializationError
from ..manifest import Manifest, Reference, ShardReceipt
from ..reader import Reader
from ..store import Store
from . import serialization
from ._export_io import SAFETENSORS_DTYPES, _Gather, _Piece, _Source, _Tensor
from ._state_decode import check_array_table
from .serialization import TensorRef, ViewRef

_PREFIX = struct.Struct("<8sQ")


@dataclass
class _Container:
    """The parsed header of one objckpt container shard (no array bytes read)."""

    receipt: ShardReceipt
    raw: bytes  # prefix + JSON header, as read
    data_start: int
    arrays: list[dict[str, Any]]
    placeholders: list[Any]
    tree: Any
    # version 3: every array's chunks (``serialization._Local`` / ``_Remote``), and the header
    # offset (the trailer from there to the end is checked again against the verified stream)
    chunks: dict[int, list[Any]] | None = None
    trailer_at: int = 0
    trailer: bytes = b""


def _choose_entry(
    entry: str | None, names: Sequence[str], default: str, manifest: Manifest, store: Store
) -> str:
    if entry is None:
        if default in names:
            return default
        if len(names) == 1:
            return names[0]
        raise ConfigError(
            f"step {manifest.label} under {store.location} has no {default!r} entry; its state entries "
            f"are {sorted(names)}: choose one (entry=, --entry)"
        )
    if entry not in names:
        raise ConfigError(
            f"step {manifest.label} under {store.location} has no state entry {entry!r}; its entries "
            f"are {sorted(names)}"
        )
    return entry


def _read_container(
    store: Store, receipt: ShardReceipt, resolver: serialization.Resolver | None = None
) -> _Container:
    """The header of an objckpt container shard, by ranged reads (checked again against the
    verified stream when the shard is read)."""
    layout.validate_key_in_root(receipt.key)
    key = receipt.key
    prefix = store.get(key, byte_range=(0, _PREFIX.size))
    if len(prefix) != _PREFIX.size:
        raise SerializationError(f"{key}: truncated container ({len(prefix)} bytes)")
    try:
        header_len = serialization._parse_prefix(prefix, receipt.size)
        raw = store.get(key, byte_range=(_PREFIX.size, _PREFIX.size + header_len))
        if len(raw) != header_len:
            raise serialization._fail(f"header ended after {len(raw)} of {header_len} bytes")
        header = serialization._parse_header(raw)
        if header.get("version") == serialization.CHUNKED_FORMAT_VERSION:
            return _read_chunked_container(store, receipt, prefix + raw, resolver)
        data_start = serialization._align(_PREFIX.size + header_len)
        data_size = header["data_size"]
        if not isinstance(data_size, int) or data_start + data_size != receipt.size:
            raise serialization._fail(
                f"header describes {data_start}+{data_size!r} bytes, the shard has {receipt.size}"
            )
        arrays, placeholders = _placeholders(header["arrays"], data_size)
        tree = serialization._Decoder(placeholders, header["version"]).node(header["tree"], 0)
    except (SerializationError, ChecksumMismatchError) as exc:
        # Say what is really wrong: bytes that fail the object's CRC32C (read to its end, as a
        # restore would), or, when they pass it, the malformed header itself.
        for _ in Reader(store).open_shard(receipt):
            pass
        if isinstance(exc, ChecksumMismatchError):
            raise
        raise SerializationError(f"{key}: {exc}") from exc
    return _Container(receipt, prefix + raw, data_start, arrays, placeholders, tree)


def _read_chunked_container(
    store: Store, receipt: ShardReceipt, stub: bytes, resolver: serialization.Resolver | None
) -> _Container:
    """A version-3 container (written with deduplication or compression): its trailer header by
    ranged reads (checked against the footer's CRC32C), every chunk checked against the receipts
    (this shard's size, the referenced objects' sizes) before anything is planned."""
    key = receipt.key

    def read_range(start: int, end: int) -> bytes:
        return store.get(key, byte_range=(start, end))

    got = serialization.read_header(read_range, receipt.size)
    if got is None:
        raise serialization._fail("version-3 shard without a footer")
    header, header_at = got
    data_start = len(stub)
    _, local, remote = serialization._plan_chunked(header, data_start, header_at, resolver)
    placeholders = [
        _placeholder(*serialization._check_entry(i, e)[:3]) for i, e in enumerate(header["arrays"])
    ]
    chunks: dict[int, list[Any]] = {}
    every: list[Any] = [*local, *remote]  # serialization._Local | serialization._Remote
    for c in every:
        chunks.setdefault(c.array, []).append(c)
    for members in chunks.values():
        members.sort(key=lambda c: c.offset if isinstance(c, serialization._Local) else c.at)
    trailer = read_range(header_at, receipt.size)
    tree = serialization._Decoder(placeholders, serialization.CHUNKED_FORMAT_VERSION).node(header["tree"], 0)
    return _Container(
        receipt,
        stub,
        data_start,
        header["arrays"],
        placeholders,
        tree,
        chunks=chunks,
        trailer_at=header_at,
        trailer=trailer,
    )


def _placeholder(kind: str, dt: Any, shape: list[int]) -> Any:
    """A stand-in for one checked array: a meta tensor, or for numpy (never exported) a 0-byte
    array of its dtype; no memory allocated."""
    if kind == "torch":
        return torch.empty(shape, dtype=dt, device="meta")
    np: Any = getattr(serialization, "np", None)  # _check_entry refused numpy without it
    return np.zeros((), dtype=dt) if not shape else np.empty(0, dtype=dt)


def _placeholders(entries: Any, data_size: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """Validate the array table as decoding does (:func:`._state_decode.check_array_table`) and
    stand in :func:`_placeholder` for each array."""
    checked = check_array_table(entries, data_size)
    return entries, [_placeholder(kind, dt, shape) for kind, dt, shape, _, _ in checked]


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted name, leaf)`` of a nested state (dicts with string keys, lists, tuples)."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        for i, v in enumerate(tree):
            yield from _flatten(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _rename(names: Iterable[str], strip: str | None, add: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        new = name[len(strip) :] if strip and name.startswith(strip) else name
        new = f"{add or ''}{new}"
        if not new or new == "__metadata__":
            raise ConfigError(f"key {name!r} becomes {new!r} after the prefix options")
        if new in seen:
            raise ConfigError(f"keys {seen[new]!r} and {name!r} both become {new!r} after the prefix options")
        seen[new] = name
        out[name] = new
    return out


def _out_dtype(name: str, dtype: torch.dtype, cast: torch.dtype | None) -> torch.dtype:
    out = cast if cast is not None and dtype.is_floating_point and dtype.itemsize >= 2 else dtype
    if out not in SAFETENSORS_DTYPES:
        raise ConfigError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold")
    return out


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _plan_containers(
    containers: list[_Container],
    tree: Any,
    table: Mapping[int, Any],
    cast: torch.dtype | None,
    strip: str | None,
    add: str | None,
    references: Sequence[Reference] = (),
) -> tuple[list[_Tensor], list[_Source], list[str]]:
    where = {id(p): (ci, ai) for ci, c in enumerate(containers) for ai, p in enumerate(c.placeholders)}
    sources = [
        _Source(c.receipt, whole=True, header=c.raw, trailer_at=c.trailer_at, trailer=c.trailer)
        for c in containers
    ]
    referenced = _ReferencedSources(references)
    leaves = list(_flatten(tree))
    names = _rename([n for n, v in leaves if isinstance(v, (torch.Tensor, TensorRef, ViewRef))], strip, add)
    tensors: list[_Tensor] = []
    skipped: list[str] = []
    for name, leaf in leaves:
        if name not in names:
            skipped.append(name)
            continue
        ref = leaf if isinstance(leaf, ViewRef) else None
        base = table.get(leaf.index) if isinstance(leaf, (TensorRef, ViewRef)) else leaf
        loc = where.get(id(base)) if isinstance(base, torch.Tensor) else None
        if loc is None:
            raise ManifestError(f"tensor {name!r} refers to a tensor that is in no shard")
        assert isinstance(base, torch.Tensor)
        ci, ai = loc
        c = containers[ci]
        array = c.arrays[ai]
        out_name = names[name]
        if c.chunks is not None:  # version 3: the tensor's bytes are chunks, here or referenced
            tensors.append(
                _plan_chunked_tensor(c, ci, ai, base, ref, name, out_name, cast, sources, referenced)
            )
            continue
        start = c.data_start + int(array["offset"])
        if ref is None:
            t = _Tensor(out_name, base.dtype, _out_dtype(name, base.dtype, cast), tuple(base.shape))
            piece = _Piece(start, int(array["nbytes"]), t, run=t.numel, what=f"tensor {name!r}")
        else:
            t = _Tensor(out_name, ref.dtype, _out_dtype(name, ref.dtype, cast), tuple(ref.shape))
            nbytes = t.numel * ref.dtype.itemsize
            if _contiguous(ref.shape, ref.stride):
                if ref.offset + nbytes > int(array["nbytes"]):
                    raise SerializationError(f"{c.receipt.key}: view {name!r} reaches past its tensor")
                piece = _Piece(start + ref.offset, nbytes, t, run=t.numel, what=f"tensor {name!r}")
            else:  # gathered from the whole base tensor
                piece = _Piece(start, int(array["nbytes"]), t, view=ref, what=f"tensor {name!r}")
        t.order = (ci, piece.start)
        tensors.append(t)
        sources[ci].pieces.append(piece)
    # the first container is always read: it holds the structure (rank 0's replicated.bin, or
    # the only container), which its verified stream must confirm
    kept = [s for s in sources if s.pieces or s is sources[0]]
    return tensors, kept + referenced.sources(), skipped


class _ReferencedSources:
    """The objects a version-3 checkpoint references (its manifest's ``references``), each read
    by ranges: only the chunks an exported tensor needs, each checked against its own CRC32C."""

    def __init__(self, references: Sequence[Reference]) -> None:
        self.by_identity = {r.identity: r for r in references}
        self._sources: dict[Any, _Source] = {}

    def source(self, identity: Any, what: str) -> _Source:
        got = self._sources.get(identity)
        if got is None:
            ref = self.by_identity.get(identity)
            if ref is None:  # checked when the header was read; kept as a guard
                raise ManifestError(f"{what} references {identity}, which the manifest does not reference")
            receipt = ShardReceipt(ref.key, ref.size, ref.version, ref.crc32c, ref.rank, ref.name)
            got = self._sources[identity] = _Source(receipt, whole=False)
        return got

    def sources(self) -> list[_Source]:
        return list(self._sources.values())


def _plan_chunked_tensor(
    c: _Container,
    ci: int,
    ai: int,
    base: torch.Tensor,
    ref: ViewRef | None,
    name: str,
    out_name: str,
    cast: torch.dtype | None,
    sources: list[_Source],
    referenced: _ReferencedSources,
) -> _Tensor:
    """The pieces of one tensor of a version-3 container: for every chunk of its array that
    holds some of its bytes, a piece of this shard's stream (a local chunk) or of a referenced
    object's ranged reads (a reused chunk, checked against its CRC32C)."""
    what = f"tensor {name!r}"
    dtype = base.dtype if ref is None else ref.dtype
    shape = tuple(base.shape) if ref is None else tuple(ref.shape)
    t = _Tensor(out_name, dtype, _out_dtype(name, dtype, cast), shape)
    nbytes = int(c.arrays[ai]["nbytes"])
    gather: _Gather | None = None
    if ref is None:
        lo, hi = 0, nbytes
    elif _contiguous(ref.shape, ref.stride):
        lo, hi = ref.offset, ref.offset + t.numel * ref.dtype.itemsize
        if hi > nbytes:
            raise SerializationError(f"{c.receipt.key}: view {name!r} reaches past its tensor")
    else:  # gathered from the whole base tensor (at most one tensor in memory)
        lo, hi = 0, nbytes
        gather = _Gather(_Piece(0, nbytes, t, view=ref, what=what), nbytes)
    item = dtype.itemsize
    assert c.chunks is not None
    first: tuple[int, int] | None = None
    for chunk in c.chunks.get(ai, []):
        local = isinstance(chunk, serialization._Local)
        at = chunk.offset if local else chunk.at  # where the chunk's bytes lie in the array
        a, b = max(lo, at), min(hi, at + chunk.length)
        if a >= b:
            continue
        if gather is None and ((a - lo) % item or (b - a) % item):
            raise SerializationError(f"{c.receipt.key}: a chunk of {what} ends inside an element")
        whole = chunk.codec is not None or not local
        piece = _Piece(
            (chunk.at if local else chunk.offset) + (0 if whole else a - at),
            chunk.stored if whole else b - a,
            t,
            run=(b - a) // item,
            base=(a - lo) // item,
            crc32c=None if local else chunk.crc,
            what=what,
            codec=chunk.codec,
            decoded=chunk.length,
            keep=(a - at, b - at) if whole and (a, b) != (at, at + chunk.length) else None,
            gather=gather,
            gather_at=a - lo,
        )
        if chunk.codec is not None and piece.keep is None:
            piece.keep = (0, chunk.length)  # decoded whole, all of it kept
        if local:
            sources[ci].pieces.append(piece)
            first = first or (ci, piece.start)
        else:
            referenced.source(chunk.identity, what).pieces.append(piece)
    t.order = first or (ci, c.receipt.size)
    return t


# ------------------------------------------------------------------------- the container layouts


def _plan_manager(
    store: Store,
    manifest: Manifest,
    entry: str | None,
    rank: int,
    cast: torch.dtype | None,
    strip_prefix: str | None,
    add_prefix: str | None,
    resolver: serialization.Resolver | None,
) -> tuple[list[_Tensor], list[_Source], list[str], str]:
    """A CheckpointManager checkpoint's entry: a replicated one joined from every rank's
    replicated shards (the structure from the skeleton, the tensors from each rank's table), a
    per-rank one from ``rank``'s ``rank.bin``. Returns the tensors, sources, skipped names and the
    entry chosen; reads only the container headers."""
    from .shards import RANK_SHARD, replicated_receipts

    topo = manifest.topology
    replicated = list(topo.get("replicated", []))
    per_rank = list(topo.get("per_rank", []))
    entry = _choose_entry(entry, replicated + per_rank, "model", manifest, store)
    if entry in replicated:
        receipts = replicated_receipts(manifest)  # rank 0's first piece, with the structure, first
        containers = [_read_container(store, r, resolver) for r in receipts]
        for c in containers:
            if not isinstance(c.tree, Mapping):
                raise ManifestError(f"{c.receipt.key}: not a replicated shard", key=c.receipt.key)
        skeleton = next((c.tree.get("skeleton") for c in containers if "skeleton" in c.tree), None)
        if not isinstance(skeleton, Mapping) or entry not in skeleton:
            raise ManifestError(
                f"step {manifest.label}: no replicated shard holds the structure of {entry!r}",
                key=manifest.key,
            )
        table: dict[int, Any] = {}
        for c in containers:
            index, tensors = c.tree.get("index"), c.tree.get("tensors")
            if not isinstance(index, list) or not isinstance(tensors, list) or len(index) != len(tensors):
                raise ManifestError(f"{c.receipt.key}: malformed replicated tensor table", key=c.receipt.key)
            for i, t in zip(index, tensors, strict=True):
                if not isinstance(i, int) or i in table:
                    raise ManifestError(f"{c.receipt.key}: bad tensor index {i!r}", key=c.receipt.key)
                table[i] = t
        tree = skeleton[entry]
    else:
        try:
            receipt = manifest.shard(rank, RANK_SHARD)
        except KeyError as exc:
            raise ConfigError(f"step {manifest.label} has no per-rank shard of rank {rank}") from exc
        containers = [_read_container(store, receipt, resolver)]
        root = containers[0].tree
        items = root.get("items") if isinstance(root, Mapping) else None
        if not isinstance(items, Mapping) or entry not in items:
            raise ManifestError(f"{receipt.key}: the per-rank shard holds no {entry!r}", key=receipt.key)
        raw_table = root.get("tensors", [])
        table = dict(enumerate(raw_table)) if isinstance(raw_table, list) else {}
        tree = items[entry]
    planned = _plan_containers(containers, tree, table, cast, strip_prefix, add_prefix, manifest.references)
    return (*planned, entry)


def _plan_lightning(
    store: Store,
    receipt: ShardReceipt,
    manifest: Manifest,
    entry: str | None,
    cast: torch.dtype | None,
    strip_prefix: str | None,
    add_prefix: str | None,
    resolver: serialization.Resolver | None,
) -> tuple[list[_Tensor], list[_Source], list[str], str]:
    """A Lightning checkpoint's entry (default ``"state_dict"``) from its one container shard
    ``receipt``. Returns the tensors, sources, skipped names and the entry chosen."""
    container = _read_container(store, receipt, resolver)
    names = (
        [k for k, v in container.tree.items() if isinstance(v, Mapping)]
        if isinstance(container.tree, Mapping)
        else []
    )
    entry = _choose_entry(entry, names, "state_dict", manifest, store)
    planned = _plan_containers([container], container.tree[entry], {}, cast, strip_prefix, add_prefix)
    return (*planned, entry)
