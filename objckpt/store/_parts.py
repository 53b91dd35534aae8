"""Byte sources cut into parts, and buffers filled or advanced in place: the stream helpers
of the store's write and read paths.

``put_stream`` sends what :func:`_cut_parts` yields (each byte CRC32C-hashed once, a part inside
one source buffer a view of it); :func:`iter_parts` is the plain re-chunker, :class:`_Scatter`
copies a stream of chunks into caller buffers (the default ``get_into``) and :func:`advance`
drops what a short vectored read or write already moved. No request is made here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import IO, cast

from .._crc import Buffer, crc32c_combine, crc32c_of
from ._types import BytesSource, StreamChecksums


def iter_parts(source: BytesSource, part_size: int) -> Iterator[memoryview]:
    """Re-chunk ``source`` into ``part_size`` views (the last may be shorter).

    Zero-copy where a part lies inside one source buffer (e.g. a tensor's memory); a part that
    spans buffers is assembled in a fresh bytearray, so at most one part is held here.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source).cast("B")
        for start in range(0, view.nbytes, part_size):
            yield view[start : start + part_size]
        return
    if hasattr(source, "readinto") or hasattr(source, "read"):
        # Duck-typed file object: mypy cannot narrow the union to IO[bytes] by attribute.
        yield from _iter_file_parts(cast("IO[bytes]", source), part_size)
        return
    pending: bytearray | None = None
    for chunk in source:
        view = memoryview(chunk).cast("B")
        pos = 0
        if pending is not None:
            take = min(part_size - len(pending), view.nbytes)
            pending += view[:take]
            pos = take
            if len(pending) < part_size:
                continue
            yield memoryview(pending)
            pending = None
        while view.nbytes - pos >= part_size:
            yield view[pos : pos + part_size]
            pos += part_size
        if pos < view.nbytes:
            pending = bytearray(view[pos:])
    if pending:
        yield memoryview(pending)


def _iter_file_parts(fileobj: IO[bytes], part_size: int) -> Iterator[memoryview]:
    while True:
        buf = bytearray(part_size)
        filled = 0
        while filled < part_size:
            if hasattr(fileobj, "readinto"):
                n = fileobj.readinto(memoryview(buf)[filled:])
            else:
                data = fileobj.read(part_size - filled)
                n = len(data)
                buf[filled : filled + n] = data
            if not n:
                break
            filled += n
        if filled:
            yield memoryview(buf)[:filled]
        if filled < part_size:
            return


class _Scatter:
    """Copies a stream of chunks into consecutive buffers (the default ``get_into``)."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self._buffers = [b for b in buffers if b.nbytes]
        self._index = 0
        self._pos = 0
        self.filled = 0

    def write(self, chunk: memoryview) -> None:
        taken = 0
        while taken < chunk.nbytes and self._index < len(self._buffers):
            dest = self._buffers[self._index]
            n = min(dest.nbytes - self._pos, chunk.nbytes - taken)
            dest[self._pos : self._pos + n] = chunk[taken : taken + n]
            taken += n
            self._pos += n
            self.filled += n
            if self._pos == dest.nbytes:
                self._index += 1
                self._pos = 0


def advance(buffers: list[memoryview], n: int) -> list[memoryview]:
    """``buffers`` with their first ``n`` bytes dropped (after a short vectored read/write)."""
    out = list(buffers)
    while n and out:
        if n >= out[0].nbytes:
            n -= out[0].nbytes
            out.pop(0)
        else:
            out[0] = out[0][n:]
            n = 0
    return [b for b in out if b.nbytes]


class _Part:
    """One part as it is sent: consecutive buffers, their total size and CRC32C."""

    __slots__ = ("buffers", "size", "crc", "_assembly")

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.size = 0
        self.crc = 0
        self._assembly: bytearray | None = None  # copied pieces (not borrowing)

    def add(self, piece: memoryview, crc: int, *, copy: bool) -> None:
        if copy:
            if self._assembly is None:
                self._assembly = bytearray()
            self._assembly += piece
        else:
            self._seal()
            self.buffers.append(piece)
        self.crc = crc32c_combine(self.crc, crc, piece.nbytes)
        self.size += piece.nbytes

    def _seal(self) -> None:
        if self._assembly is not None:
            self.buffers.append(memoryview(self._assembly))
            self._assembly = None

    def done(self) -> _Part:
        self._seal()
        return self


def _source_buffers(source: BytesSource, part_size: int) -> Iterator[Buffer]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        yield source
    elif hasattr(source, "readinto") or hasattr(source, "read"):
        yield from _iter_file_parts(source, part_size)  # type: ignore[arg-type]
    else:
        yield from source


def _cut_parts(source: BytesSource, part_size: int, borrow: bool, sums: StreamChecksums) -> Iterator[_Part]:
    """``source`` as parts of ``part_size`` bytes (the last may be shorter), hashing each byte
    once: per piece (one buffer's share of one part), combined into the part's, the buffer's
    and the whole object's CRC32C in ``sums``. A part inside one buffer is a view of it; a
    piece of a straddling part is copied into the part unless ``borrow``."""
    # one caller buffer, or the fresh buffers read from a file: views of them are always safe
    borrow = borrow or isinstance(source, (bytes, bytearray, memoryview)) or hasattr(source, "read")
    part = _Part()
    for chunk in _source_buffers(source, part_size):
        view = memoryview(chunk).cast("B")
        chunk_crc, pos = 0, 0
        while pos < view.nbytes:
            n = min(part_size - part.size, view.nbytes - pos)
            piece = view[pos : pos + n]
            crc = crc32c_of(piece)  # the one pass over these bytes
            whole_part_here = part.size == 0 and n == part_size
            part.add(piece, crc, copy=not (borrow or whole_part_here))
            chunk_crc = crc32c_combine(chunk_crc, crc, n)
            sums.crc = crc32c_combine(sums.crc, crc, n)
            sums.size += n
            pos += n
            if part.size == part_size:
                sums.parts += 1
                yield part.done()
                part = _Part()
        sums.chunks.append((chunk_crc, view.nbytes))
    if part.size:
        sums.parts += 1
        yield part.done()


def _joined(buffers: list[memoryview]) -> memoryview:
    if len(buffers) == 1:
        return buffers[0]
    return memoryview(b"".join(buffers))


__all__ = ["advance", "iter_parts"]
