"""Scatter reads (``Store.get_into``) and vectored, single-CRC-pass writes, on every backend.

Counted, never timed: the bytes land in the caller's buffers in order, a read past the end is
short, and a write hashes each byte once however many buffers a part spans.
"""

from __future__ import annotations

import os

import pytest

from objckpt.errors import NotFoundError
from objckpt.store import Store


def test_get_into_scatters_a_range_over_buffers_in_order(store: Store) -> None:
    data = os.urandom(100_000)
    store.put("obj", data)
    bufs = [bytearray(10), bytearray(0), bytearray(40_000), bytearray(7)]
    got = store.get_into("obj", 123, [memoryview(b) for b in bufs])
    assert got == 40_017
    assert b"".join(bufs) == data[123 : 123 + 40_017]


def test_get_into_is_short_at_the_end_of_the_object(store: Store) -> None:
    store.put("obj", b"0123456789")
    buf = bytearray(b"x" * 8)
    assert store.get_into("obj", 6, [memoryview(buf)]) == 4
    assert bytes(buf[:4]) == b"6789"
    assert store.get_into("obj", 10, [memoryview(bytearray(3))]) == 0


def test_get_into_a_missing_key_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError):
        store.get_into("absent", 0, [memoryview(bytearray(4))])
