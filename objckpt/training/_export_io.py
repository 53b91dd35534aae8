"""The output side of an export: which bytes land where in the file, and how they get there.

:class:`_Tensor`, :class:`_Piece` and :class:`_Source` are what a plan is made of (a tensor of the
output file; bytes of a shard copied into it, with their run layout, cast, checksum and codec; one
shard and the pieces it feeds). :class:`_Router` hands each chunk read from a shard to the pieces
it overlaps, each :class:`_Sink` turns a piece's bytes into positioned writes (casting whole
elements, checking the piece's CRC32C, decoding a compressed chunk, gathering a non-contiguous
view from its base with :class:`_Gather`), :func:`_copy_source` reads a source from the store
(streamed whole, or by coalesced ranged GETs) into its router, and
``_pwrite_all``/``_temp_path``/``_remove`` write the file under a temporary name.
``SAFETENSORS_DTYPES`` is the output format's dtype table.

Separate from :mod:`.export` (the public API, :class:`~.export.ExportPlan` and
:func:`~.export.plan_export`) and :mod:`._export_plan` / :mod:`._export_dcp` (reading the metadata into
pieces) because this is the byte-level machinery: it knows nothing of manifests or layouts, only of
pieces, the store's byte streams and file offsets.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._crc import Crc32c, crc32c_of, encode_crc32c
from ..errors import ChecksumMismatchError, ConfigError, NotFoundError, SerializationError
from ..manifest import ShardReceipt
from ..reader import Reader
from ..store import Store
from . import serialization
from .serialization import ViewRef

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
    # A chunk of a version-3 (deduplicated) shard that cannot be routed byte by byte: it is
    # gathered whole (at most one chunk, a few MiB), decoded (``codec``: compressed, ``decoded``
    # bytes once decompressed; ``crc32c`` is then of the decoded bytes), cut to ``keep`` (the
    # bytes of this tensor, when a view covers part of the chunk) and written, or handed to
    # ``gather`` (a non-contiguous view assembled from its whole base tensor).
    codec: str | None = None
    decoded: int = 0
    keep: tuple[int, int] | None = None
    gather: _Gather | None = None
    gather_at: int = 0


@dataclass
class _Source:
    """One shard to read, and what it feeds."""

    receipt: ShardReceipt
    whole: bool  # streamed whole (CRC32C of the object) or read by ranges (per-item CRC32C)
    header: bytes = b""  # whole: the container prefix + header read up front, checked again
    pieces: list[_Piece] = field(default_factory=list)
    trailer_at: int = 0  # whole, version 3: where the trailer header read up front starts...
    trailer: bytes = b""  # ...and its bytes (header + footer), checked again against the stream

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


class _Gather:
    """A non-contiguous view of a version-3 tensor: its whole base tensor, assembled from the
    chunks that hold it (each piece hands over its bytes), then cut and written once complete."""

    def __init__(self, piece_template: _Piece, nbytes: int) -> None:
        self.template = piece_template  # tensor and view of the output
        self.buffer = bytearray(nbytes)
        self.missing = nbytes

    def put(self, at: int, data: memoryview, write: Callable[[int, memoryview], None], key: str) -> None:
        self.buffer[at : at + data.nbytes] = data
        self.missing -= data.nbytes
        if self.missing == 0:
            _write_view(self.template, self.buffer, write, key)
            self.buffer = bytearray()


def _write_view(p: _Piece, buffer: bytearray, write: Callable[[int, memoryview], None], key: str) -> None:
    assert p.view is not None
    base = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    try:
        view = serialization.make_view(base, p.view)
    except SerializationError as exc:
        raise SerializationError(f"{key}: {p.what}: {exc}") from exc
    flat = view.contiguous().to(p.tensor.out_dtype).reshape(-1)
    write(p.tensor.offset, flat.view(torch.uint8).numpy().data.cast("B"))


class _Sink:
    """Turns one piece's source bytes (arriving in order) into writes at their output offsets,
    casting whole elements (a partial element waits for the next chunk). A piece that must be
    seen whole first (a view gathered from its base, a compressed or partly used chunk) is
    buffered: at most one base tensor (views) or one chunk."""

    def __init__(self, piece: _Piece, write: Callable[[int, memoryview], None]) -> None:
        self.piece = piece
        self.write = write
        t = piece.tensor
        self.cast = t.out_dtype != t.dtype and piece.view is None and piece.gather is None
        self.in_item = t.dtype.itemsize
        self.out_item = t.out_dtype.itemsize
        self.run_out = piece.run * self.out_item
        self.carry = b""
        self.emitted = 0
        self.fed = 0
        # a compressed chunk's CRC32C is of its decoded bytes (checked in finish)
        self.crc = Crc32c() if piece.crc32c is not None and piece.codec is None else None
        whole = piece.view is not None or piece.codec is not None or piece.keep is not None
        self.buffer = bytearray(piece.length) if whole or piece.gather is not None else None

    def feed(self, data: memoryview) -> None:
        if self.crc is not None:
            self.crc.update(data)
        if self.buffer is not None:
            self.buffer[self.fed : self.fed + data.nbytes] = data
            self.fed += data.nbytes
            return
        self.fed += data.nbytes
        self._out(data)

    def _out(self, data: memoryview) -> None:
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
        if self.buffer is None:
            return
        data, self.buffer = self.buffer, None
        if p.codec is not None:
            from .codec import decompress

            out = bytearray(p.decoded)
            decompress(data, p.codec, p.decoded, memoryview(out))
            if p.crc32c is not None and encode_crc32c(crc32c_of(out)) != p.crc32c:
                raise ChecksumMismatchError(
                    f"{p.what}: compressed chunk at [{p.start}, {p.start + p.length}) fails its CRC32C",
                    key=key,
                    location=location,
                )
            data = out
        if p.view is not None and p.gather is None:
            _write_view(p, data, self.write, key)
            return
        view = memoryview(data)
        if p.keep is not None:
            view = view[p.keep[0] : p.keep[1]]
        if p.gather is not None:
            p.gather.put(p.gather_at, view, self.write, key)
            return
        self._out(view)
        if self.carry:
            raise SerializationError(f"{key}: {p.what}: a chunk ends inside an element")


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


#: the largest gap between two pieces of a ranged source read by one GET
_COALESCE_GAP = 256 * 1024


def _copy_source(
    store: Store,
    source: _Source,
    write: Callable[[int, memoryview], None],
    progress: Callable[[int], None] | None,
    chunk_size: int,
    label: str,
) -> None:
    """Read one source of the export (of checkpoint ``label``) from ``store`` and route its bytes
    to the pieces they land in: a whole shard streamed through ``Reader.open_shard`` (size and
    CRC32C of the object checked at its end; the container header and trailer read at planning
    must equal the verified stream's), or ranged GETs of ``chunk_size`` bytes at most (each piece
    then checks its own CRC32C).

    Raises:
        ChecksumMismatchError: the header changed since planning, a shard is missing or
            truncated, or bytes fail their checksum.
        StoreError: the store could not be read (after the retry budget).
    """
    router = _Router(source, write, store.location)
    key = source.receipt.key
    if source.whole:
        reader = Reader(store)
        pos = 0
        head = bytearray()
        tail = bytearray()
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
                        location=store.location,
                    )
            if source.trailer and pos + view.nbytes > source.trailer_at:
                tail += view[max(0, source.trailer_at - pos) :]
            router.feed(pos, view)
            pos += view.nbytes
        if source.trailer and bytes(tail) != source.trailer:
            raise ChecksumMismatchError(
                "the container header changed between the planning read and the verified stream",
                key=key,
                location=store.location,
            )
    else:
        for a, b in source.spans(_COALESCE_GAP, chunk_size):
            try:
                data = store.get(key, byte_range=(a, b))
            except NotFoundError as exc:
                raise ChecksumMismatchError(
                    f"a shard of committed step {label} is missing: {exc}",
                    key=key,
                    location=store.location,
                ) from exc
            if len(data) != b - a:
                raise ChecksumMismatchError(
                    f"ranged read [{a}, {b}) returned {len(data)} bytes (shard truncated?)",
                    key=key,
                    location=store.location,
                )
            if progress is not None:
                progress(len(data))
            router.feed(a, memoryview(data).cast("B"))
    router.finish()


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
