"""Helpers shared by the SDK backends (no SDK imported here)."""

from __future__ import annotations

import io
from typing import Any


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview, so a part is sent without copying it.

    boto3 and google-cloud-storage take only bytes or file objects as a body; ``bytes(view)``
    would double the memory held per in-flight part.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def __len__(self) -> int:
        return self._view.nbytes

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._view.nbytes}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._view.nbytes - self._pos))
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = self._view.nbytes if size is None or size < 0 else min(self._pos + size, self._view.nbytes)
        chunk = self._view[self._pos : end].tobytes()
        self._pos = max(self._pos, end)
        return chunk
