"""Helpers for the integration tests: damaging a committed shard of a file:// run root."""

from __future__ import annotations

import os
from pathlib import Path


def bitrot(root: Path, key: str, offset: int = -1) -> None:
    """Flip one byte of ``key`` in place, keeping size and mtime: HEAD still matches the
    receipt, only the CRC32C check while downloading can tell."""
    path = root / key
    st = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset % st.st_size)
        b = fh.read(1)
        fh.seek(offset % st.st_size)
        fh.write(bytes([b[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def truncate(root: Path, key: str) -> None:
    """Cut ``key`` short (HEAD sees the wrong size)."""
    path = root / key
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
