"""The write half of the store contract suite (:mod:`objckpt.testing.contract`), and the
vocabulary both halves share.

:class:`_WriteContract` holds the tests of create-if-absent, compare-and-swap and the streamed
multipart put (checksums, failing sources, zero and exact-multiple sizes); it is a base of
:class:`~objckpt.testing.contract.StoreContract`, which defines the fixtures these tests take
(``store``, ``make_store``, ``store_gaps``, ``counted``) and the read-side tests. The gap ids,
sizes, invalid keys and :func:`expect_gap` live here so both modules use one definition;
``objckpt.testing.contract`` re-exports them, the names third-party suites import.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest

from .._crc import crc32c_b64
from ..errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    NotFoundError,
    PreconditionFailedError,
)
from ..store.base import BytesSource, PutMode, Store
from ..store.wrappers import CountingStore

#: the server accepts a body (PutObject, UploadPart) whose CRC32C does not match it
GAP_PART_CHECKSUM = "rejects_bad_part_checksum"
#: conditional writes are honoured but not atomically under racing writers
GAP_ATOMIC_CONDITIONALS = "atomic_conditionals_under_race"
#: the precondition of a multipart completion (the composite publish) is not enforced
GAP_CONDITIONAL_COMPLETE = "conditional_complete_upload"

MiB = 1024 * 1024
PART = 5 * MiB  # S3's minimum part size (all parts but the last)
BIG = 12 * MiB + 12345  # three parts, the last one short

#: keys every store must refuse before any request (the one key rule, objckpt.store.key_problem)
INVALID_KEYS = [
    "",
    "/abs",
    "../escape",
    "a/../../escape",
    "a/./b",
    "./a",
    "a//b",
    "trailing/",
    ".",
    "..",
    "nul\x00byte",
    "back\\slash",
]


def expect_gap(request: pytest.FixtureRequest, gaps: Mapping[str, str], gap: str) -> None:
    """Mark the running test xfail(strict) when the backend is known to lack ``gap``."""
    reason = gaps.get(gap)
    if reason:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def _payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating-ish bytes (cheap to build, distinct per seed)."""
    block = bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(65536))
    reps = size // len(block) + 1
    return (block * reps)[:size]


def _chunks(data: bytes, size: int) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


class _WriteContract:
    """The conditional-write and multipart tests of :class:`~objckpt.testing.contract.StoreContract`
    (not collected by itself: the name does not start with ``Test``)."""

    # ---------------------------------------------------------------- create-if-absent

    def test_put_create_twice_raises_already_exists_and_keeps_original(self, store: Store) -> None:
        first = store.put("obj", b"original", mode=PutMode.CREATE)
        with pytest.raises(AlreadyExistsError) as info:
            store.put("obj", b"intruder", mode=PutMode.CREATE)
        assert isinstance(info.value, FileExistsError)
        assert store.get("obj") == b"original"
        assert store.head("obj").version == first.version

    def test_put_stream_multipart_create_twice_raises_already_exists_and_keeps_original(
        self, request: pytest.FixtureRequest, store_gaps: Mapping[str, str], store: Store
    ) -> None:
        expect_gap(request, store_gaps, GAP_CONDITIONAL_COMPLETE)
        original = _payload(BIG, seed=1)
        store.put_stream("obj", original, part_size=PART)
        with pytest.raises(AlreadyExistsError):
            store.put_stream("obj", _payload(BIG, seed=2), part_size=PART)
        assert store.get("obj") == original
        assert store.list_uploads("") == []  # the losing upload was aborted

    def test_create_race_has_exactly_one_winner(
        self, request: pytest.FixtureRequest, store_gaps: Mapping[str, str], store: Store
    ) -> None:
        expect_gap(request, store_gaps, GAP_ATOMIC_CONDITIONALS)
        n = 8
        barrier = threading.Barrier(n)

        def attempt(i: int) -> int | None:
            barrier.wait()
            try:
                store.put("race", f"writer-{i}".encode(), mode=PutMode.CREATE)
                return i
            except AlreadyExistsError:
                return None

        with ThreadPoolExecutor(n) as pool:
            winners = [i for i in pool.map(attempt, range(n)) if i is not None]
        assert len(winners) == 1
        assert store.get("race") == f"writer-{winners[0]}".encode()

    # ---------------------------------------------------------------- compare-and-swap

    def test_write_returns_the_version_head_reports_and_new_bytes_get_a_new_one(self, store: Store) -> None:
        # (Identical bytes may keep the version: an S3 ETag is the MD5 of the body.)
        a = store.put("v", b"first")
        assert store.head("v").version == a.version
        b = store.put("v", b"second")
        assert b.version != a.version
        assert store.head("v").version == b.version
        assert [m.version for m in store.list("")] == [b.version]

    def test_update_with_stale_version_fails_and_leaves_object_unchanged(self, store: Store) -> None:
        old = store.put("ptr", b"1", mode=PutMode.CREATE)
        new = store.put("ptr", b"2", mode=PutMode.update(old.version))
        with pytest.raises(PreconditionFailedError):
            store.put("ptr", b"stale", mode=PutMode.update(old.version))
        assert store.get("ptr") == b"2"
        assert store.head("ptr").version == new.version

    def test_update_with_current_version_succeeds_and_returns_new_version(self, store: Store) -> None:
        first = store.put("ptr", b"1", mode=PutMode.CREATE)
        second = store.put("ptr", b"2", mode=PutMode.update(first.version))
        assert second.version != first.version
        assert store.get("ptr") == b"2"
        third = store.put("ptr", b"3", mode=PutMode.update(second.version))
        assert store.head("ptr").version == third.version

    def test_update_of_absent_key_fails(self, store: Store) -> None:
        other = store.put("exists", b"x")
        with pytest.raises((PreconditionFailedError, NotFoundError)):
            store.put("absent", b"y", mode=PutMode.update(other.version))
        with pytest.raises(NotFoundError):
            store.head("absent")

    def test_cas_race_of_concurrent_increments_loses_no_update(
        self, request: pytest.FixtureRequest, store_gaps: Mapping[str, str], store: Store
    ) -> None:
        expect_gap(request, store_gaps, GAP_ATOMIC_CONDITIONALS)
        threads, increments = 5, 10
        store.put("counter", b"0", mode=PutMode.CREATE)
        barrier = threading.Barrier(threads)

        def worker() -> int:
            conflicts = 0
            barrier.wait()
            for _ in range(increments):
                while True:
                    meta = store.head("counter")
                    value = int(store.get("counter"))
                    try:
                        store.put("counter", str(value + 1).encode(), mode=PutMode.update(meta.version))
                        break
                    except PreconditionFailedError:
                        conflicts += 1
            return conflicts

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: worker(), range(threads)))
        assert int(store.get("counter")) == threads * increments

    # ---------------------------------------------------------------- streamed multipart put

    @pytest.mark.parametrize("shape", ["bytes", "odd_chunks", "file"])
    def test_put_stream_multipart_roundtrips_bytes_and_full_object_crc32c(
        self, store: Store, counted: Callable[[Store], CountingStore], shape: str
    ) -> None:
        data = _payload(BIG, seed=3)
        sources: dict[str, Callable[[], BytesSource]] = {
            "bytes": lambda: data,
            "odd_chunks": lambda: _chunks(data, MiB + 7),  # parts span source chunks
            "file": lambda: io.BytesIO(data),
        }
        source = sources[shape]()
        counting = counted(store)
        meta = counting.put_stream("big", source, part_size=PART, max_in_flight=2)
        assert counting.counts["upload_part"] >= 3  # really multipart
        assert meta.size == len(data)
        assert meta.crc32c == crc32c_b64(data)
        assert store.get("big") == data
        head = store.head("big")
        assert head.size == len(data)
        assert head.version == meta.version
        if head.crc32c is not None:
            assert head.crc32c == crc32c_b64(data)

    def test_put_stream_source_failing_mid_stream_propagates_and_leaves_nothing(self, store: Store) -> None:
        class Boom(RuntimeError):
            pass

        def source() -> Iterator[bytes]:
            yield _payload(PART, seed=4)
            yield _payload(PART, seed=5)
            raise Boom("source broke")

        with pytest.raises(Boom):
            store.put_stream("broken", source(), part_size=PART)
        with pytest.raises(NotFoundError):
            store.head("broken")
        assert [m.key for m in store.list("")] == []
        assert store.list_uploads("") == []

    def test_upload_part_with_wrong_checksum_is_rejected_as_checksum_mismatch(
        self, request: pytest.FixtureRequest, store_gaps: Mapping[str, str], store: Store
    ) -> None:
        expect_gap(request, store_gaps, GAP_PART_CHECKSUM)
        data = memoryview(_payload(PART, seed=6))
        handle = store._create_upload("bad-part", PutMode.CREATE)
        try:
            with pytest.raises(ChecksumMismatchError) as info:
                store._upload_part(handle, 1, 0, data, crc32c_b64(b"not these bytes"))
        finally:
            store._abort_upload(handle)
        # the same class on every backend, whatever the server's own words for it
        assert type(info.value) is ChecksumMismatchError
        assert "bad-part" in str(info.value)
        with pytest.raises(NotFoundError):
            store.head("bad-part")

    def test_put_with_wrong_checksum_is_rejected_as_checksum_mismatch(
        self, request: pytest.FixtureRequest, store_gaps: Mapping[str, str], store: Store
    ) -> None:
        expect_gap(request, store_gaps, GAP_PART_CHECKSUM)
        with pytest.raises(ChecksumMismatchError) as info:
            store._put("bad", memoryview(b"these bytes"), PutMode.CREATE, crc32c_b64(b"other bytes"))
        assert type(info.value) is ChecksumMismatchError
        assert "bad" in str(info.value) and store.location in str(info.value)
        with pytest.raises(NotFoundError):
            store.head("bad")
        assert [m.key for m in store.list("")] == []

    @pytest.mark.parametrize(
        "make_source", [lambda: b"", lambda: iter(()), lambda: io.BytesIO(b"")], ids=["bytes", "iter", "file"]
    )
    def test_put_stream_of_zero_bytes_makes_an_empty_object(
        self, store: Store, make_source: Callable[[], BytesSource]
    ) -> None:
        meta = store.put_stream("empty", make_source(), part_size=PART)
        assert meta.size == 0
        assert meta.crc32c == crc32c_b64(b"")
        assert store.get("empty") == b""
        assert store.head("empty").size == 0

    @pytest.mark.parametrize("shape", ["bytes", "chunks"])
    def test_put_stream_exact_multiple_of_part_size_uploads_no_empty_part(
        self, store: Store, counted: Callable[[Store], CountingStore], shape: str
    ) -> None:
        data = _payload(2 * PART, seed=7)
        source = data if shape == "bytes" else _chunks(data, PART)
        counting = counted(store)
        meta = counting.put_stream("exact", source, part_size=PART)
        assert counting.counts["upload_part"] == 2
        assert meta.crc32c == crc32c_b64(data)
        assert store.get("exact") == data
