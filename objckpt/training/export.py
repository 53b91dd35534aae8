"""Export the model weights of a committed checkpoint as one ``.safetensors`` (or ``torch.save``)
file, streamed with bounded memory.

::

    from objckpt.training.export import export_safetensors

    export_safetensors("s3://bucket/runs/eta", "model.safetensors", step=2000, dtype="bfloat16")

    # safetensors.torch.load_file("model.safetensors") / AutoModel.from_pretrained(dir) read it

What is exported: one state entry (``entry=``, default ``"model"``) of

* a :class:`~objckpt.training.manager.CheckpointManager` checkpoint written at any world size --
  replicated entries are joined from every rank's ``replicated.bin``, per-rank entries read from
  rank 0's ``rank.bin`` (``rank=``);
* a DCP checkpoint (:func:`~objckpt.training.dcp.save_sharded`, e.g. by a 4-rank FSDP2 job) --
  every tensor is assembled at its global shape from the chunks the saving ranks held;
* a Lightning checkpoint (:class:`~objckpt.integrations.lightning.ObjckptCheckpointIO`),
  entry ``"state_dict"``.

Nested dicts are flattened with ``.`` (a module's ``state_dict`` keys stay as they are); values
that are not tensors are left out and listed in :attr:`ExportResult.skipped`.

**Bounded memory.** Nothing is materialised: the safetensors header is computed from the
checkpoint's metadata alone (the JSON headers of the objckpt containers, DCP's metadata shard),
written first, and then every tensor's bytes are copied from the store's byte stream to their
place in the file, chunk by chunk (``--dtype`` casts each chunk on the way). Peak memory is the
store's read window (a few chunks) plus the metadata, whatever the model's size; the one
exception is a tensor saved as a *non-contiguous view* into another tensor's storage (a
transposed slice of a fused buffer), which is gathered from its whole base tensor in memory.

**Verified.** CheckpointManager and Lightning shards are streamed whole through
:meth:`Reader.open_shard <objckpt.reader.Reader.open_shard>` (size and CRC32C of the whole object
checked at its end; the container header read up front must equal the verified one), so the
bytes read include the entries not exported (the optimizer's). DCP items are read with ranged
GETs of the model's items only, each checked against its own CRC32C recorded in the
(CRC32C-verified) metadata shard. The file is written under a temporary name next to ``out`` and
renamed into place only once every byte has been verified: a failed export leaves no file.

The ``torch`` format (:func:`export_torch`) goes through the same streamed safetensors file
(temporary, next to ``out``), memory-mapped, so ``torch.save`` reads the tensors from the page
cache rather than from the process's memory; it needs twice the disk space for a moment.
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import secrets
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import layout
from .._crc import Crc32c
from ..coordination.roots import open_root
from ..errors import (
    ChecksumMismatchError,
    ConfigError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    SerializationError,
)
from ..manifest import Manifest, ShardReceipt
from ..reader import Reader
from ..store import Store
from . import serialization
from .serialization import TensorRef, ViewRef

__all__ = ["ExportResult", "SAFETENSORS_DTYPES", "export", "export_safetensors", "export_torch"]

log = logging.getLogger("objckpt.training.export")

#: torch dtype -> safetensors dtype name (what ``safetensors.torch`` reads back)
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _st in (
    ("uint64", "U64"),
    ("uint32", "U32"),
    ("uint16", "U16"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _st

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}
_CASTABLE = ("float64", "float32", "float16", "bfloat16")

#: bytes per ranged GET of a DCP item, and the largest gap between two items read by one GET
DEFAULT_CHUNK = 8 * 1024 * 1024
_COALESCE_GAP = 256 * 1024
_PREFIX = struct.Struct("<8sQ")
#: the layouts this module reads
LAYOUT_MANAGER, LAYOUT_DCP, LAYOUT_LIGHTNING = "CheckpointManager", "DCP", "Lightning"
_LIGHTNING_SHARD = "lightning.ckpt"


@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote.

    Attributes:
        path: the file written.
        step, timeline, attempt: the checkpoint exported.
        layout: ``"CheckpointManager"``, ``"DCP"`` or ``"Lightning"``.
        entry: the state entry exported.
        world_size: ranks of the job that saved it.
        tensors: tensors written; ``data_bytes``: their bytes (the file is the header larger).
        read_bytes: bytes read from the store (verified).
        skipped: names of values in the entry that are not tensors (left out).
        format: ``"safetensors"`` or ``"torch"``.
    """

    path: str
    step: int
    timeline: int
    attempt: str
    layout: str
    entry: str
    world_size: int
    tensors: int
    data_bytes: int
    read_bytes: int
    skipped: list[str] = field(default_factory=list)
    format: str = "safetensors"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ------------------------------------------------------------------------------------ public API


def export_safetensors(
    uri_or_store: str | Store,
    out: str | os.PathLike[str],
    step: int | None = None,
    timeline: int | None = None,
    *,
    entry: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    rank: int = 0,
    metadata: Mapping[str, str] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    progress: Callable[[int], None] | None = None,
    store_options: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Write the weights of checkpoint ``step`` (default: the newest valid one) under the run root
    to ``out`` as a safetensors file (see the module docstring).

    Args:
        uri_or_store: run-root URI or :class:`~objckpt.store.Store`.
        out: the file to write (replaced atomically if it exists).
        step, timeline: the checkpoint; ``timeline`` picks one on another (abandoned) timeline.
        entry: the state entry holding the model (default ``"model"``, or ``"state_dict"`` for a
            Lightning checkpoint).
        strip_prefix: removed from every key that starts with it (``"_orig_mod."``, ``"model."``).
        add_prefix: put before every key (after ``strip_prefix``).
        dtype: cast floating-point tensors to this dtype (``"bfloat16"``, ``"float16"``, ...);
            integer and bool tensors are written as they are.
        rank: whose ``rank.bin`` holds a per-rank entry (CheckpointManager with ``replicated=()``).
        metadata: extra string pairs for the safetensors ``__metadata__``.
        chunk_size: bytes per ranged GET of DCP items.
        progress: called with the byte count of every chunk read from the store.
        store_options: options for :func:`~objckpt.store.open_store` when a URI is given.

    Raises:
        NoCheckpointError: no committed checkpoint (or not that step).
        ConfigError: no such entry, a dtype safetensors cannot hold, keys that collide after the
            prefix options, a checkpoint layout this function does not read.
        ChecksumMismatchError, ManifestError, SerializationError: the checkpoint is damaged;
            nothing is written.
        StoreError: the store could not be read (after the retry budget).
    """
    store, owned = open_root(uri_or_store, store_options)
    try:
        plan = plan_export(
            store,
            step,
            timeline,
            entry=entry,
            strip_prefix=strip_prefix,
            add_prefix=add_prefix,
            dtype=dtype,
            rank=rank,
            chunk_size=chunk_size,
        )
        return plan.write_safetensors(out, metadata=metadata, progress=progress)
    finally:
        if owned:
            store.close()


def export_torch(
    uri_or_store: str | Store,
    out: str | os.PathLike[str],
    step: int | None = None,
    timeline: int | None = None,
    **options: Any,
) -> ExportResult:
    """As :func:`export_safetensors`, but ``out`` is a ``torch.save`` file of the flat state
    dict (``torch.load(out, weights_only=True)`` reads it). Same arguments."""
    store_options = options.pop("store_options", None)
    metadata = options.pop("metadata", None)
    progress = options.pop("progress", None)
    store, owned = open_root(uri_or_store, store_options)
    try:
        plan = plan_export(store, step, timeline, **options)
        return plan.write_torch(out, metadata=metadata, progress=progress)
    finally:
        if owned:
            store.close()


def export(
    uri_or_store: str | Store,
    out: str | os.PathLike[str],
    step: int | None = None,
    timeline: int | None = None,
    *,
    format: str = "safetensors",  # noqa: A002 - the CLI's --format
    **options: Any,
) -> ExportResult:
    """:func:`export_safetensors` (``format="safetensors"``) or :func:`export_torch` (``"torch"``)."""
    if format == "safetensors":
        return export_safetensors(uri_or_store, out, step, timeline, **options)
    if format == "torch":
        return export_torch(uri_or_store, out, step, timeline, **options)
    raise ConfigError(f"unknown export format {format!r}; use 'safetensors' or 'torch'")


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` -> ``torch.bfloat16``; None stays None.

    Raises:
        ConfigError: not a floating-point dtype safetensors can hold.
    """
    if value is None or isinstance(value, torch.dtype):
        dt = value
    else:
        name = str(value).strip().lower().removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        dt = getattr(torch, name) if name in _CASTABLE else None
    if dt is not None and (dt not in SAFETENSORS_DTYPES or not dt.is_floating_point):
        dt = None
    if value is not None and dt is None:
        raise ConfigError(f"cannot cast to dtype {value!r}: use one of {', '.join(_CASTABLE)}")
    return dt


# ------------------------------------------------------------------------------------- planning


@dataclass
class _Tensor:
    """One tensor of the output file."""

    name: str
    dtype: torch.dtype  # as stored
    out_dtype: torch.dtype  # as written
    shape: tuple[int, ...]
    offset: int = 0  # of its bytes in the data section
    order: tuple[int, int] = (0, 0)  # (source, byte) of its first piece: the write order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.out_dtype.itemsize


@dataclass
class _Piece:
    """Bytes ``[start, start + length)`` of a source object, copied into one output tensor.

    The bytes are ``runs`` runs of ``run`` elements; run ``k`` lands at element
    ``base + sum(i_j * strides[j])`` of the output tensor, ``(i_j)`` being ``k`` unravelled over
    ``outer``. A CheckpointManager tensor is one run; a DCP chunk of a tensor sharded along a
    later dimension is one run per row. ``view``: a non-contiguous view into the source bytes
    (gathered in memory). ``crc32c``: the bytes' own checksum (DCP items).
    """

    start: int
    length: int
    tensor: _Tensor
    run: int = 0
    base: int = 0
    outer: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    view: ViewRef | None = None
    crc32c: str | None = None
    what: str = ""


@dataclass
class _Source:
    """One shard to read, and what it feeds."""

    receipt: ShardReceipt
    whole: bool  # streamed whole (CRC32C of the object) or read by ranges (per-item CRC32C)
    header: bytes = b""  # whole: the container prefix + header read up front, checked again
    pieces: list[_Piece] = field(default_factory=list)

    def spans(self, gap: int, chunk: int) -> list[tuple[int, int]]:
        """Byte ranges to GET (ranged sources): pieces closer than ``gap`` merged, split into
        ``chunk``-sized requests."""
        merged: list[list[int]] = []
        for p in sorted(self.pieces, key=lambda p: p.start):
            if p.length == 0:
                continue
            end = p.start + p.length
            if merged and p.start - merged[-1][1] <= gap:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([p.start, end])
        out: list[tuple[int, int]] = []
        for a, b in merged:
            out.extend((s, min(s + chunk, b)) for s in range(a, b, chunk))
        return out


@dataclass
class _Container:
    """The parsed header of one objckpt container shard (no array bytes read)."""

    receipt: ShardReceipt
    raw: bytes  # prefix + JSON header, as read
    data_start: int
    arrays: list[dict[str, Any]]
    placeholders: list[Any]
    tree: Any


class ExportPlan:
    """The layout of the output file, computed from the checkpoint's metadata (nothing big is
    read): :func:`plan_export` builds it, :meth:`write_safetensors` streams it."""

    def __init__(
        self,
        store: Store,
        manifest: Manifest,
        layout_name: str,
        entry: str,
        tensors: list[_Tensor],
        sources: list[_Source],
        skipped: list[str],
        chunk_size: int,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.layout = layout_name
        self.entry = entry
        self.tensors = tensors
        self.sources = sources
        self.skipped = skipped
        self.chunk_size = chunk_size
        self.tensors.sort(key=lambda t: (t.order, t.name))
        offset = 0
        for t in self.tensors:
            t.offset = offset
            offset += t.nbytes
        self.data_bytes = offset

    @property
    def read_bytes(self) -> int:
        """Bytes this export reads from the store."""
        total = 0
        for s in self.sources:
            if s.whole:
                total += s.receipt.size
            else:
                total += sum(b - a for a, b in s.spans(_COALESCE_GAP, self.chunk_size))
        return total

    def header(self, metadata: Mapping[str, str] | None = None) -> bytes:
        """The safetensors prefix: 8-byte little-endian length, then the JSON header padded with
        spaces to a multiple of 8 bytes."""
        m = self.manifest
        meta = {
            "format": "pt",
            "objckpt.run": self.store.location,
            "objckpt.step": str(m.step),
            "objckpt.timeline": str(m.timeline),
            "objckpt.attempt": m.attempt,
            "objckpt.entry": self.entry,
        }
        for k, v in (metadata or {}).items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"safetensors metadata must map strings to strings, got {k!r}: {v!r}")
            meta[k] = v
        body: dict[str, Any] = {"__metadata__": meta}
        for t in self.tensors:
            body[t.name] = {
                "dtype": SAFETENSORS_DTYPES[t.out_dtype],
                "shape": list(t.shape),
                "data_offsets": [t.offset, t.offset + t.nbytes],
            }
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw

    def result(self, path: str, fmt: str) -> ExportResult:
        m = self.manifest
        return ExportResult(
            path=path,
            step=m.step,
            timeline=m.timeline,
            attempt=m.attempt,
            layout=self.layout,
            entry=self.entry,
            world_size=m.world_size,
            tensors=len(self.tensors),
            data_bytes=self.data_bytes,
            read_bytes=self.read_bytes,
            skipped=list(self.skipped),
            format=fmt,
        )

    # ---------------------------------------------------------------------------------- writing

    def write_safetensors(
        self,
        out: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportResult:
        """Stream the tensors into ``out`` (atomically: a temporary file renamed at the end)."""
        path = os.fspath(out)
        tmp = _temp_path(path)
        try:
            self._write_file(tmp, metadata, progress)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        log.info(
            "exported step %s (%s, entry %r) of %s to %s: %d tensors, %d bytes",
            self.manifest.label,
            self.layout,
            self.entry,
            self.store.location,
            path,
            len(self.tensors),
            self.data_bytes,
        )
        return self.result(path, "safetensors")

    def write_torch(
        self,
        out: str | os.PathLike[str],
        *,
        metadata: Mapping[str, str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ExportResult:
        """``torch.save`` of the flat state dict, from a memory-mapped streamed safetensors file."""
        path = os.fspath(out)
        staged = _temp_path(path) + ".safetensors"
        tmp = _temp_path(path)
        try:
            self._write_file(staged, metadata, progress)
            header_len = len(self.header(metadata))
            with open(staged, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self.data_bytes else None
            try:
                state: dict[str, torch.Tensor] = {}
                for t in sorted(self.tensors, key=lambda t: t.name):
                    if t.numel == 0 or mm is None:
                        state[t.name] = torch.empty(t.shape, dtype=t.out_dtype)
                    else:
                        state[t.name] = torch.frombuffer(
                            mm, dtype=t.out_dtype, count=t.numel, offset=header_len + t.offset
                        ).reshape(t.shape)
                torch.save(state, tmp)
                del state
            finally:
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:  # a tensor still references it: closed when collected
                        pass
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        finally:
            _remove(staged)
        return self.result(path, "torch")

    def _write_file(
        self, path: str, metadata: Mapping[str, str] | None, progress: Callable[[int], None] | None
    ) -> None:
        if sys.byteorder != "little":
            raise ConfigError("safetensors export needs a little-endian machine")
        head = self.header(metadata)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, len(head) + self.data_bytes)
            _pwrite_all(fd, memoryview(head), 0)
            written = [0]

            def write(pos: int, data: memoryview) -> None:
                _pwrite_all(fd, data, len(head) + pos)
                written[0] += data.nbytes

            for source in self.sources:
                self._copy(source, write, progress)
            if written[0] != self.data_bytes:  # every byte of the file is written exactly once
                raise SerializationError(
                    f"export of step {self.manifest.label}: wrote {written[0]} bytes of {self.data_bytes}"
                )
            os.fsync(fd)
        finally:
            os.close(fd)

    def _copy(
        self,
        source: _Source,
        write: Callable[[int, memoryview], None],
        progress: Callable[[int], None] | None,
    ) -> None:
        router = _Router(source, write, self.store.location)
        key = source.receipt.key
        if source.whole:
            reader = Reader(self.store)
            pos = 0
            head = bytearray()
            for chunk in reader.open_shard(source.receipt):
                view = memoryview(chunk).cast("B")
                if progress is not None:
                    progress(view.nbytes)
                if len(head) < len(source.header):
                    take = min(len(source.header) - len(head), view.nbytes)
                    head += view[:take]
                    if len(head) == len(source.header) and bytes(head) != source.header:
                        raise ChecksumMismatchError(
                            "the container header changed between the planning read and the verified stream",
                            key=key,
                            location=self.store.location,
                        )
                router.feed(pos, view)
                pos += view.nbytes
        else:
            for a, b in source.spans(_COALESCE_GAP, self.chunk_size):
                try:
                    data = self.store.get(key, byte_range=(a, b))
                except NotFoundError as exc:
                    raise ChecksumMismatchError(
                        f"a shard of committed step {self.manifest.label} is missing: {exc}",
                        key=key,
                        location=self.store.location,
                    ) from exc
                if len(data) != b - a:
                    raise ChecksumMismatchError(
                        f"ranged read [{a}, {b}) returned {len(data)} bytes (shard truncated?)",
                        key=key,
                        location=self.store.location,
                    )
                if progress is not None:
                    progress(len(data))
                router.feed(a, memoryview(data).cast("B"))
        router.finish()


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while data.nbytes:
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def _temp_path(path: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.objckpt-{secrets.token_hex(4)}.tmp")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Sink:
    """Turns one piece's source bytes (arriving in order) into writes at their output offsets,
    casting whole elements (a partial element waits for the next chunk)."""

    def __init__(self, piece: _Piece, write: Callable[[int, memoryview], None]) -> None:
        self.piece = piece
        self.write = write
        t = piece.tensor
        self.cast = t.out_dtype != t.dtype and piece.view is None
        self.in_item = t.dtype.itemsize
        self.out_item = t.out_dtype.itemsize
        self.run_out = piece.run * self.out_item
        self.carry = b""
        self.emitted = 0
        self.fed = 0
        self.crc = Crc32c() if piece.crc32c is not None else None
        self.buffer = bytearray(piece.length) if piece.view is not None else None

    def feed(self, data: memoryview) -> None:
        if self.crc is not None:
            self.crc.update(data)
        if self.buffer is not None:
            self.buffer[self.fed : self.fed + data.nbytes] = data
            self.fed += data.nbytes
            return
        self.fed += data.nbytes
        if not self.cast:
            self._emit(data)
            return
        block = self.carry + bytes(data) if self.carry else data
        whole = len(block) - len(block) % self.in_item
        self.carry = bytes(block[whole:])
        if whole:
            t = self.piece.tensor
            src = torch.frombuffer(bytearray(block[:whole]), dtype=t.dtype)
            converted = src.to(t.out_dtype)
            self._emit(converted.view(torch.uint8).numpy().data.cast("B"))

    def _emit(self, out: memoryview) -> None:
        p = self.piece
        while out.nbytes:
            k, within = divmod(self.emitted, self.run_out)
            n = min(self.run_out - within, out.nbytes)
            self.write(p.tensor.offset + self._element(k) * self.out_item + within, out[:n])
            out = out[n:]
            self.emitted += n

    def _element(self, k: int) -> int:
        p = self.piece
        pos = p.base
        for size, stride in zip(reversed(p.outer), reversed(p.strides), strict=True):
            k, i = divmod(k, size)
            pos += i * stride
        return pos

    def finish(self, key: str, location: str) -> None:
        p = self.piece
        if self.fed != p.length or self.carry:
            raise SerializationError(f"{key}: {p.what} ended after {self.fed} of its {p.length} bytes")
        if self.crc is not None and self.crc.b64 != p.crc32c:
            raise ChecksumMismatchError(
                f"{p.what} bytes [{p.start}, {p.start + p.length}) fail their CRC32C "
                f"({self.crc.b64} != {p.crc32c})",
                key=key,
                location=location,
            )
        if self.buffer is not None:
            assert p.view is not None
            base = (
                torch.frombuffer(self.buffer, dtype=torch.uint8)
                if p.length
                else torch.empty(0, dtype=torch.uint8)
            )
            try:
                view = serialization.make_view(base, p.view)
            except SerializationError as exc:
                raise SerializationError(f"{key}: {p.what}: {exc}") from exc
            flat = view.contiguous().to(p.tensor.out_dtype).reshape(-1)
            self.write(p.tensor.offset, flat.view(torch.uint8).numpy().data.cast("B"))
            self.buffer = None


class _Router:
    """Hands each chunk of a source to the pieces it overlaps (pieces sorted by start; chunks
    arrive in increasing order)."""

    def __init__(self, source: _Source, write: Callable[[int, memoryview], None], location: str) -> None:
        self.key = source.receipt.key
        self.location = location
        self.pending = sorted(source.pieces, key=lambda p: p.start)
        self.next = 0
        self.active: list[tuple[_Piece, _Sink]] = []
        self.write = write

    def feed(self, pos: int, chunk: memoryview) -> None:
        end = pos + chunk.nbytes
        while self.next < len(self.pending) and self.pending[self.next].start < end:
            p = self.pending[self.next]
            self.active.append((p, _Sink(p, self.write)))
            self.next += 1
        keep = []
        for p, sink in self.active:
            a, b = max(pos, p.start + sink.fed), min(end, p.start + p.length)
            if a < b:
                sink.feed(chunk[a - pos : b - pos])
            if p.start + p.length <= end:
                sink.finish(self.key, self.location)
            else:
                keep.append((p, sink))
        self.active = keep

    def finish(self) -> None:
        while self.next < len(self.pending):  # zero-length pieces past the last byte read
            p = self.pending[self.next]
            self.active.append((p, _Sink(p, self.write)))
            self.next += 1
        for _, sink in self.active:
            sink.finish(self.key, self.location)
        self.active = []


# ------------------------------------------------------------------------------------- the plan


def plan_export(
    store: Store,
    step: int | None = None,
    timeline: int | None = None,
    *,
    entry: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    rank: int = 0,
    chunk_size: int = DEFAULT_CHUNK,
) -> ExportPlan:
    """Resolve the checkpoint and lay out the output file from its metadata (reads the manifest,
    the container headers or DCP's metadata shard; no tensor bytes)."""
    if chunk_size < 1:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    cast = parse_dtype(dtype)
    reader = Reader(store)
    if step is None:
        manifest = reader.latest_valid()
        if manifest is None:
            raise NoCheckpointError(f"no valid committed checkpoint under {store.location}")
    else:
        manifest = reader.load(step, timeline)
    from .shards import RANK_SHARD, REPLICATED_SHARD, STATE_LAYOUT

    topo = manifest.topology
    if topo.get("layout") == STATE_LAYOUT:
        layout_name = LAYOUT_MANAGER
        replicated = list(topo.get("replicated", []))
        per_rank = list(topo.get("per_rank", []))
        entry = _choose_entry(entry, replicated + per_rank, "model", manifest, store)
        if entry in replicated:
            receipts = sorted(
                (s for s in manifest.shards if s.name == REPLICATED_SHARD), key=lambda s: s.rank
            )
            containers = [_read_container(store, r) for r in receipts]
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
                    raise ManifestError(
                        f"{c.receipt.key}: malformed replicated tensor table", key=c.receipt.key
                    )
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
            containers = [_read_container(store, receipt)]
            root = containers[0].tree
            items = root.get("items") if isinstance(root, Mapping) else None
            if not isinstance(items, Mapping) or entry not in items:
                raise ManifestError(f"{receipt.key}: the per-rank shard holds no {entry!r}", key=receipt.key)
            raw_table = root.get("tensors", [])
            table = dict(enumerate(raw_table)) if isinstance(raw_table, list) else {}
            tree = items[entry]
        tensors, sources, skipped = _plan_containers(containers, tree, table, cast, strip_prefix, add_prefix)
    elif isinstance(manifest.metadata.get("dcp"), Mapping):
        layout_name = LAYOUT_DCP
        tensors, sources, skipped, entry = _plan_dcp(
            store, reader, manifest, entry, cast, strip_prefix, add_prefix
        )
    elif any(s.name == _LIGHTNING_SHARD for s in manifest.shards):
        layout_name = LAYOUT_LIGHTNING
        receipt = next(s for s in manifest.shards if s.name == _LIGHTNING_SHARD)
        container = _read_container(store, receipt)
        names = (
            [k for k, v in container.tree.items() if isinstance(v, Mapping)]
            if isinstance(container.tree, Mapping)
            else []
        )
        entry = _choose_entry(entry, names, "state_dict", manifest, store)
        tensors, sources, skipped = _plan_containers(
            [container], container.tree[entry], {}, cast, strip_prefix, add_prefix
        )
    else:
        raise ConfigError(
            f"step {manifest.label} under {store.location} was not written by CheckpointManager, "
            f"save_sharded or the Lightning plug-in (layout {topo.get('layout') or topo.get('format')!r}); "
            "export reads those"
        )
    if not tensors:
        raise ConfigError(f"state entry {entry!r} of step {manifest.label} holds no tensors")
    return ExportPlan(store, manifest, layout_name, entry, tensors, sources, skipped, chunk_size)


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


def _read_container(store: Store, receipt: ShardReceipt) -> _Container:
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
        data_start = serialization._align(_PREFIX.size + header_len)
        data_size = header["data_size"]
        if not isinstance(data_size, int) or data_start + data_size != receipt.size:
            raise serialization._fail(
                f"header describes {data_start}+{data_size!r} bytes, the shard has {receipt.size}"
            )
        arrays, placeholders = _placeholders(header["arrays"], data_size)
        tree = serialization._Decoder(placeholders, header["version"]).node(header["tree"], 0)
    except SerializationError as exc:
        raise SerializationError(f"{key}: {exc}") from exc
    return _Container(receipt, prefix + raw, data_start, arrays, placeholders, tree)


def _placeholders(entries: Any, data_size: int) -> tuple[list[dict[str, Any]], list[Any]]:
    """Validate the array table (as decoding does) and stand in a meta tensor (or a 0-byte numpy
    array) for each array: no memory allocated."""
    if not isinstance(entries, list):
        raise serialization._fail("bad array table")
    out: list[Any] = []
    end = 0
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise serialization._fail(f"array {i}: entry is not an object")
        kind, dtype, shape = e.get("kind"), e.get("dtype"), e.get("shape")
        offset, nbytes = e.get("offset"), e.get("nbytes")
        if (
            not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= end and nbytes >= 0)
            or offset + nbytes > data_size
        ):
            raise serialization._fail(f"array {i}: bad offset/nbytes ({offset!r}, {nbytes!r})")
        if (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
            or len(shape) > 64
        ):
            raise serialization._fail(f"array {i}: bad shape {shape!r}")
        if kind == "torch":
            td = serialization._TORCH_DTYPES.get(dtype) if isinstance(dtype, str) else None
            if td is None:
                raise serialization._fail(f"array {i}: dtype {dtype!r} is not allowed")
            if math.prod(shape) * td.itemsize != nbytes:
                raise serialization._fail(f"array {i}: {nbytes} bytes do not fit shape {shape} of {dtype}")
            out.append(torch.empty(shape, dtype=td, device="meta"))
        elif kind == "numpy":
            np = getattr(serialization, "np", None)
            if np is None or not isinstance(dtype, str) or not serialization._NUMPY_DTYPE_RE.match(dtype):
                raise serialization._fail(f"array {i}: numpy dtype {dtype!r} is not allowed")
            out.append(
                np.zeros((), dtype=np.dtype(dtype)) if not shape else np.empty(0, dtype=np.dtype(dtype))
            )
        else:
            raise serialization._fail(f"array {i}: unknown kind {kind!r}")
        end = offset + nbytes
    return entries, out


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
) -> tuple[list[_Tensor], list[_Source], list[str]]:
    where = {id(p): (ci, ai) for ci, c in enumerate(containers) for ai, p in enumerate(c.placeholders)}
    sources = [_Source(c.receipt, whole=True, header=c.raw) for c in containers]
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
        start = c.data_start + int(array["offset"])
        out_name = names[name]
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
    return tensors, [s for s in sources if s.pieces or s is sources[0]], skipped


def _plan_dcp(
    store: Store,
    reader: Reader,
    manifest: Manifest,
    entry: str | None,
    cast: torch.dtype | None,
    strip: str | None,
    add: str | None,
) -> tuple[list[_Tensor], list[_Source], list[str], str]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .dcp import MANIFEST_KEY, decode_metadata

    info = manifest.metadata[MANIFEST_KEY]
    by_key = {r.key: r for r in manifest.shards}

    def receipt_for(rank: Any, name: Any) -> ShardReceipt:
        if not isinstance(rank, int) or not 0 <= rank < manifest.world_size:
            raise ManifestError(f"step {manifest.label}: DCP data names rank {rank!r}", key=manifest.key)
        try:
            key = layout.shard_key(manifest.step, manifest.attempt, rank, name)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"step {manifest.label}: bad shard name {name!r}: {exc}") from None
        # either layout: the manifest's keys may carry the spreading prefix (layout.py)
        receipt = by_key.get(key) or by_key.get(
            layout.shard_key(manifest.step, manifest.attempt, rank, name, spread=True)
        )
        if receipt is None:
            raise ManifestError(f"step {manifest.label}: DCP data names {key!r}, not in the manifest")
        return receipt

    ms = info.get("metadata_shard")
    if not isinstance(ms, Mapping):
        raise ManifestError(f"step {manifest.label}: the DCP entry names no metadata shard", key=manifest.key)
    metadata, locations = decode_metadata(reader.read_shard(receipt_for(ms.get("rank"), ms.get("name"))))
    fqns = metadata.state_dict_metadata
    tops = sorted({f.split(".", 1)[0] for f in fqns if "." in f})
    entry = _choose_entry(entry, tops, "model", manifest, store)
    prefix = f"{entry}."
    chunks_of: dict[str, list[tuple[Any, Any]]] = {}
    for index, loc in locations.items():
        if index.fqn.startswith(prefix):
            chunks_of.setdefault(index.fqn, []).append((index, loc))
    mine = [f for f in fqns if f.startswith(prefix)]
    names = _rename(
        [f[len(prefix) :] for f in mine if isinstance(fqns[f], TensorStorageMetadata)], strip, add
    )
    skipped = [f[len(prefix) :] for f in mine if not isinstance(fqns[f], TensorStorageMetadata)]
    sources: dict[str, _Source] = {}
    tensors: list[_Tensor] = []
    for fqn in mine:
        md = fqns[fqn]
        if not isinstance(md, TensorStorageMetadata):
            continue
        name = fqn[len(prefix) :]
        dtype = md.properties.dtype
        shape = tuple(int(s) for s in md.size)
        t = _Tensor(names[name], dtype, _out_dtype(name, dtype, cast), shape)
        strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
        boxes = []
        covered = 0
        first: tuple[int, int] | None = None
        for index, loc in chunks_of.get(fqn, []):
            if loc.kind != "tensor" or loc.dtype != str(dtype).removeprefix("torch."):
                raise ManifestError(f"step {manifest.label}: item {fqn} is stored as {loc.kind} {loc.dtype}")
            offsets = tuple(index.offset or (0,) * len(shape))
            sizes = tuple(loc.shape or ())
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o + s > g for o, s, g in zip(offsets, sizes, shape, strict=True))
            ):
                raise ManifestError(
                    f"step {manifest.label}: chunk {list(sizes)} at {list(offsets)} of {fqn} lies outside "
                    f"its shape {list(shape)}"
                )
            boxes.append((offsets, sizes))
            covered += math.prod(sizes)
            receipt = receipt_for(loc.rank, loc.shard)
            src = sources.setdefault(receipt.key, _Source(receipt, whole=False))
            # runs: the innermost dimensions the chunk covers fully, plus one partial dimension
            d = max(len(shape) - 1, 0)
            while d > 0 and sizes[d] == shape[d]:
                d -= 1
            run = math.prod(sizes[d:])
            base = sum(o * s for o, s in zip(offsets, strides, strict=True))
            piece = _Piece(
                loc.start,
                loc.length,
                t,
                run=run if math.prod(sizes) else 0,
                base=base,
                outer=tuple(sizes[:d]),
                strides=tuple(strides[:d]),
                crc32c=loc.crc32c,
                what=f"item {fqn} chunk at {list(offsets)}",
            )
            if piece.run == 0 and piece.length:
                raise ManifestError(f"step {manifest.label}: empty chunk of {fqn} holds {loc.length} bytes")
            src.pieces.append(piece)
            order = (list(sources).index(receipt.key), loc.start)
            first = order if first is None or order < first else first
        _check_cover(fqn, shape, boxes, covered, manifest)
        t.order = first or (0, 0)
        tensors.append(t)
    return tensors, list(sources.values()), skipped, entry


def _check_cover(
    fqn: str,
    shape: tuple[int, ...],
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    covered: int,
    m: Manifest,
) -> None:
    """The chunks of a tensor tile it exactly: no two overlap and together they hold every element."""
    nonempty = [(o, s) for o, s in boxes if all(n > 0 for n in s)]
    for i, (oa, sa) in enumerate(nonempty):
        for ob, sb in nonempty[i + 1 :]:
            if all(a < b + nb and b < a + na for a, na, b, nb in zip(oa, sa, ob, sb, strict=True)):
                raise ManifestError(f"step {m.label}: chunks of {fqn} overlap", key=m.key)
    total = 1
    for n in shape:
        total *= n
    if covered != total:
        raise ManifestError(
            f"step {m.label}: the chunks of {fqn} hold {covered} of its {total} elements", key=m.key
        )
