"""Helpers shared by the SDK backends (no SDK imported here)."""

from __future__ import annotations

import bisect
import io
import itertools
from typing import Any


class BuffersReader(io.RawIOBase):
    """A seekable, read-only file over consecutive memoryviews, so a body (a part, or a part
    that spans several tensors) is sent without assembling or copying it.

    boto3 and google-cloud-storage take only bytes or file objects as a body; ``bytes(view)``
    would double the memory held per in-flight part. The SDKs read and seek bodies and size them
    by ``ContentLength`` (or ``len``) only.
    """

    def __init__(self, buffers: list[memoryview]) -> None:
        super().__init__()
        self._buffers = [b for b in buffers if b.nbytes]
        self._starts = list(itertools.accumulate((b.nbytes for b in self._buffers), initial=0))
        self._size = self._starts[-1]
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        filled = 0
        while filled < out.nbytes and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            src = self._buffers[i][self._pos - self._starts[i] :]
            n = min(src.nbytes, out.nbytes - filled)
            out[filled : filled + n] = src[:n]
            filled += n
            self._pos += n
        return filled

    def read(self, size: int | None = -1) -> bytes:
        want = self._size - self._pos if size is None or size < 0 else size
        want = max(0, min(want, self._size - self._pos))
        if not want:
            return b""
        i = bisect.bisect_right(self._starts, self._pos) - 1
        at = self._pos - self._starts[i]
        if at + want <= self._buffers[i].nbytes:  # within one buffer: one copy, no assembly
            self._pos += want
            return self._buffers[i][at : at + want].tobytes()
        buf = bytearray(want)
        n = self.readinto(buf)
        return bytes(buf[:n])


class ViewReader(BuffersReader):
    """:class:`BuffersReader` over one memoryview."""

    def __init__(self, view: memoryview) -> None:
        super().__init__([view])
