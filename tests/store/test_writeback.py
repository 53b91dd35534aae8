"""file:// streamed parts are written back to disk from the thread that wrote them
(:mod:`objckpt.store._writeback`), and the object is the same whether or not that happens."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import pytest

from objckpt.store import _writeback
from objckpt.store.local import LocalStore

PART = 4096


def _source(size: int) -> list[bytes]:
    data = os.urandom(size)
    return [data[i : i + 1000] for i in range(0, size, 1000)]  # buffers that straddle parts


def test_each_streamed_part_is_written_back_once_from_its_part_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int, str]] = []

    def record(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length, flags, threading.current_thread().name))
        return 0

    monkeypatch.setattr(_writeback, "_sync_file_range", record)
    store = LocalStore(tmp_path)
    chunks = _source(3 * PART + 123)
    store.put_stream("obj", chunks, part_size=PART, max_in_flight=2)
    assert store.get("obj") == b"".join(chunks)
    # every part, once, covering the object exactly; write-out and wait (flags 1|2|4)
    assert sorted((off, n) for off, n, _, _ in calls) == [
        (0, PART),
        (PART, PART),
        (2 * PART, PART),
        (3 * PART, 123),
    ]
    assert {flags for _, _, flags, _ in calls} == {7}
    assert all(name != threading.main_thread().name for *_, name in calls)


def test_a_single_put_is_not_written_back_separately(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(_writeback, "_sync_file_range", lambda *a: calls.append(1) or 0)
    LocalStore(tmp_path).put_stream("small", [b"x" * 100], part_size=PART)
    assert calls == []  # its one fsync at sealing is all there is


def test_without_the_call_uploads_are_unchanged(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_writeback, "_sync_file_range", None)
    assert _writeback.write_back(0, 0, 10) is False
    store = LocalStore(tmp_path)
    chunks = _source(2 * PART + 7)
    meta = store.put_stream("obj", chunks, part_size=PART)
    assert store.get("obj") == b"".join(chunks)
    assert meta.size == 2 * PART + 7


def test_a_refusing_filesystem_is_not_an_error(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_writeback, "_sync_file_range", lambda *a: -1)
    store = LocalStore(tmp_path)
    chunks = _source(2 * PART)
    store.put_stream("obj", chunks, part_size=PART)
    assert store.get("obj") == b"".join(chunks)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_the_binding_calls_the_kernel(tmp_path: Any) -> None:
    # the real ctypes binding: a wrong signature would fail or crash here, not in a save
    assert _writeback._sync_file_range is not None
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.pwrite(fd, b"y" * 8192, 0)
        assert _writeback.write_back(fd, 0, 8192) is True
        assert _writeback.write_back(fd, 0, 0) is False
        assert _writeback.write_back(-1, 0, 10) is False  # EBADF: refused, not raised
    finally:
        os.close(fd)
