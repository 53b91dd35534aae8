"""Scatter reads (``Store.get_into``) and vectored, single-CRC-pass writes, on every backend.

Counted, never timed: the bytes land in the caller's buffers in order, a read past the end is
short, and a write hashes each byte once however many buffers a part spans.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest

from objckpt._crc import crc32c_b64, crc32c_of
from objckpt.errors import NotFoundError
from objckpt.store import Store, open_store
from objckpt.store.base import StreamChecksums
from objckpt.store.local import LocalStore
from objckpt.store.wrappers import CountingStore, PrefixStore


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


# ------------------------------------------------------------------------------ writes


def client_overhead(store: Store) -> int:
    """Bytes a backend hashes besides the payload on a multipart upload."""
    return 32 if store.scheme == "gs" else 0


PART = 5 * 1024 * 1024  # S3's smallest part


@pytest.mark.parametrize("borrow", [False, True])
def test_put_stream_hashes_each_byte_once_and_reports_each_buffers_crc(
    store: Store, hashed: list[int], borrow: bool
) -> None:
    if store.scheme == "memory":
        pytest.skip("memory:// plays the server: it re-hashes every body to verify it, as S3 does")
    # buffers that straddle parts every way: inside one, across two, across three, empty
    sizes = [100, PART - 50, 0, 3 * PART + 7, 10, 1_000]
    chunks = [os.urandom(n) for n in sizes]
    sums = StreamChecksums()
    hashed[0] = 0
    meta = store.put_stream("obj", iter(chunks), part_size=PART, checksums=sums, borrow=borrow)
    total = sum(sizes)
    # parts, the whole object and each buffer: one pass (GCS also hashes its 32-byte upload
    # marker object)
    assert hashed[0] == total + client_overhead(store)
    assert sums.size == total and sums.parts == -(-total // PART)
    assert sums.b64 == crc32c_b64(b"".join(chunks))
    assert meta.crc32c in (None, sums.b64)
    assert sums.chunks == [(crc32c_of(c), len(c)) for c in chunks]
    assert store.get("obj") == b"".join(chunks)


def test_small_put_stream_and_put_hash_once(store: Store, hashed: list[int]) -> None:
    if store.scheme == "memory":
        pytest.skip("memory:// plays the server: it re-hashes every body to verify it, as S3 does")
    hashed[0] = 0
    store.put_stream("a", [b"x" * 1000, b"y" * 24], part_size=PART)
    store.put("b", b"z" * 4096)
    assert hashed[0] == 1024 + 4096


def test_borrowed_parts_are_sent_as_views_of_the_source(tmp_path: Any, monkeypatch: Any) -> None:
    # file://: a part straddling tensors is written with pwritev from the source buffers
    # themselves, never assembled in a fresh buffer
    store = open_store(f"file://{tmp_path}/s")
    sources = [bytearray(os.urandom(n)) for n in (3000, 5000, 1500)]
    seen: list[list[Any]] = []
    real = LocalStore._upload_part_buffers

    def spy(self: Any, handle: Any, number: int, offset: int, buffers: list[memoryview], crc: str) -> Any:
        seen.append([b.obj for b in buffers])
        return real(self, handle, number, offset, buffers, crc)

    monkeypatch.setattr(LocalStore, "_upload_part_buffers", spy)
    store.put_stream("obj", [memoryview(s) for s in sources], part_size=4096, borrow=True)
    assert store.get("obj") == b"".join(sources)
    assert len(seen) == 3  # 9500 bytes in 4096-byte parts
    assert all(any(obj is s for s in sources) for objs in seen for obj in objs)
    assert [len(objs) for objs in seen] == [2, 2, 1]  # straddling parts: two views each


# --------------------------------------------------------------- one request, or multipart


def _straddling(total: int) -> list[bytearray]:
    """Source buffers of ``total`` bytes whose boundaries fall inside parts (none part-aligned)."""
    sizes = itertools.cycle([PART // 3, PART, 2 * PART // 3])
    out: list[bytearray] = []
    left = total
    while left:
        n = min(next(sizes), left)
        out.append(bytearray(os.urandom(n)))
        left -= n
    return out


@pytest.mark.parametrize("borrow", [False, True])
def test_a_stream_within_single_request_max_is_one_put(store: Store, hashed: list[int], borrow: bool) -> None:
    # 3 parts and a bit, allowed in one request: no multipart upload to create, fill or complete
    counting = CountingStore(store, close_inner=False)
    sources = _straddling(3 * PART + 7)
    data = b"".join(sources)
    sums = StreamChecksums()
    hashed[0] = 0
    meta = counting.put_stream(
        "obj",
        [memoryview(s) for s in sources],
        part_size=PART,
        max_in_flight=4,
        checksums=sums,
        borrow=borrow,
        single_request_max=4 * PART,
    )
    # one pass, though the request spans every buffer (memory:// plays the server and
    # re-hashes every body)
    assert hashed[0] == len(data) or store.scheme == "memory"
    assert dict(counting.counts) == {"put": 1}
    assert sums.parts == 1 and sums.size == len(data) and sums.b64 == crc32c_b64(data)
    assert meta.size == len(data) and meta.crc32c in (None, sums.b64)
    assert store.get("obj") == data


def test_a_stream_larger_than_single_request_max_is_a_multipart_upload(store: Store) -> None:
    counting = CountingStore(store, close_inner=False)
    data = os.urandom(2 * PART + 1)
    counting.put_stream("obj", [data], part_size=PART, max_in_flight=4, single_request_max=2 * PART)
    assert counting.counts["put"] == 0
    assert counting.counts["create_upload"] == 1 and counting.counts["complete_upload"] == 1
    assert counting.counts["upload_part"] == 3
    assert store.get("obj") == data


def test_single_request_max_is_capped_by_the_memory_bound(store: Store) -> None:
    # 2 parts in flight: at most 2 parts read ahead for one request, whatever is asked
    counting = CountingStore(store, close_inner=False)
    data = os.urandom(2 * PART + 1)
    counting.put_stream("obj", [data], part_size=PART, max_in_flight=2, single_request_max=100 * PART)
    assert counting.counts["put"] == 0 and counting.counts["upload_part"] == 3
    assert store.get("obj") == data


def test_wrappers_hand_several_buffers_to_the_backend_without_joining_them(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through PrefixStore and CountingStore (every s3://bucket/prefix root is a PrefixStore), a
    # part or a single request spanning buffers reaches the backend's own vectored write: the
    # default that joins buffers into one (a copy of the object) is never used.
    if store.scheme == "memory":
        pytest.skip("memory:// keeps joined bytes as its storage: it has no vectored write")
    import objckpt.store.base as base

    joined: list[int] = []
    real = base._joined

    def counting_join(buffers: list[memoryview]) -> memoryview:
        if len(buffers) > 1:
            joined.append(len(buffers))
        return real(buffers)

    monkeypatch.setattr(base, "_joined", counting_join)
    wrapped = CountingStore(PrefixStore(store, "wrapped", close_inner=False), close_inner=False)
    sources = _straddling(3 * PART + 7)
    data = b"".join(sources)
    views = [memoryview(s) for s in sources]
    wrapped.put_stream("multi", views, part_size=PART, borrow=True)
    wrapped.put_stream("one", views, part_size=PART, borrow=True, single_request_max=4 * PART)
    assert joined == []
    assert wrapped.counts["upload_part"] == 4 and wrapped.counts["put"] == 1
    assert wrapped.get("multi") == data and wrapped.get("one") == data
