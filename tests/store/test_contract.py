"""The one store contract suite: every backend (memory, file, S3 on moto/LocalStack, GCS on an
emulator) runs these through the ``store``/``backend`` fixtures of tests/conftest.py.

Each test gets a fresh store rooted at a unique prefix, so keys only need to be unique within the
test. Nothing here assumes more than the contract in objckpt/store/base.py; known server gaps are
strict xfails through ``expect_gap`` (a fixed gap turns the run red).
"""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from objckpt._crc import crc32c_b64
from objckpt.errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    NotFoundError,
    ObjckptError,
    PreconditionFailedError,
)
from objckpt.store import PutMode
from objckpt.store.wrappers import CountingStore
from tests.backends import GAP_ATOMIC_CONDITIONALS, GAP_CONDITIONAL_COMPLETE, GAP_PART_CHECKSUM
from tests.conftest import expect_gap

MiB = 1024 * 1024
PART = 5 * MiB  # S3's minimum part size (all parts but the last)
BIG = 12 * MiB + 12345  # three parts, the last one short


def _payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating-ish bytes (cheap to build, distinct per seed)."""
    block = bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(65536))
    reps = size // len(block) + 1
    return (block * reps)[:size]


def _chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.fixture
def counted():
    """Wrap stores in CountingStore; the wrappers are closed, the fixture's store is not."""
    made = []

    def wrap(store):
        made.append(CountingStore(store, close_inner=False))
        return made[-1]

    yield wrap
    for wrapper in made:
        wrapper.close()


# ---------------------------------------------------------------- create-if-absent


def test_put_create_twice_raises_already_exists_and_keeps_original(store):
    first = store.put("obj", b"original", mode=PutMode.CREATE)
    with pytest.raises(AlreadyExistsError) as info:
        store.put("obj", b"intruder", mode=PutMode.CREATE)
    assert isinstance(info.value, FileExistsError)
    assert store.get("obj") == b"original"
    assert store.head("obj").version == first.version


def test_put_stream_multipart_create_twice_raises_already_exists_and_keeps_original(request, backend, store):
    expect_gap(request, backend, GAP_CONDITIONAL_COMPLETE)
    original = _payload(BIG, seed=1)
    store.put_stream("obj", original, part_size=PART)
    with pytest.raises(AlreadyExistsError):
        store.put_stream("obj", _payload(BIG, seed=2), part_size=PART)
    assert store.get("obj") == original
    assert store.list_uploads("") == []  # the losing upload was aborted


def test_create_race_has_exactly_one_winner(request, backend, store):
    expect_gap(request, backend, GAP_ATOMIC_CONDITIONALS)
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


def test_write_returns_the_version_head_reports_and_new_bytes_get_a_new_one(store):
    # (Identical bytes may keep the version: an S3 ETag is the MD5 of the body.)
    a = store.put("v", b"first")
    assert store.head("v").version == a.version
    b = store.put("v", b"second")
    assert b.version != a.version
    assert store.head("v").version == b.version
    assert [m.version for m in store.list("")] == [b.version]


def test_update_with_stale_version_fails_and_leaves_object_unchanged(store):
    old = store.put("ptr", b"1", mode=PutMode.CREATE)
    new = store.put("ptr", b"2", mode=PutMode.update(old.version))
    with pytest.raises(PreconditionFailedError):
        store.put("ptr", b"stale", mode=PutMode.update(old.version))
    assert store.get("ptr") == b"2"
    assert store.head("ptr").version == new.version


def test_update_with_current_version_succeeds_and_returns_new_version(store):
    first = store.put("ptr", b"1", mode=PutMode.CREATE)
    second = store.put("ptr", b"2", mode=PutMode.update(first.version))
    assert second.version != first.version
    assert store.get("ptr") == b"2"
    third = store.put("ptr", b"3", mode=PutMode.update(second.version))
    assert store.head("ptr").version == third.version


def test_update_of_absent_key_fails(store):
    other = store.put("exists", b"x")
    with pytest.raises((PreconditionFailedError, NotFoundError)):
        store.put("absent", b"y", mode=PutMode.update(other.version))
    with pytest.raises(NotFoundError):
        store.head("absent")


def test_cas_race_of_concurrent_increments_loses_no_update(request, backend, store):
    expect_gap(request, backend, GAP_ATOMIC_CONDITIONALS)
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
def test_put_stream_multipart_roundtrips_bytes_and_full_object_crc32c(store, counted, shape):
    data = _payload(BIG, seed=3)
    source = {
        "bytes": lambda: data,
        "odd_chunks": lambda: _chunks(data, MiB + 7),  # parts span source chunks
        "file": lambda: io.BytesIO(data),
    }[shape]()
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


def test_put_stream_source_failing_mid_stream_propagates_and_leaves_nothing(store):
    class Boom(RuntimeError):
        pass

    def source():
        yield _payload(PART, seed=4)
        yield _payload(PART, seed=5)
        raise Boom("source broke")

    with pytest.raises(Boom):
        store.put_stream("broken", source(), part_size=PART)
    with pytest.raises(NotFoundError):
        store.head("broken")
    assert [m.key for m in store.list("")] == []
    assert store.list_uploads("") == []


def test_upload_part_with_wrong_checksum_is_rejected(request, backend, store):
    expect_gap(request, backend, GAP_PART_CHECKSUM)
    data = memoryview(_payload(PART, seed=6))
    handle = store._create_upload("bad-part", PutMode.CREATE)
    try:
        with pytest.raises(ObjckptError):
            store._upload_part(handle, 1, 0, data, crc32c_b64(b"not these bytes"))
    finally:
        store._abort_upload(handle)
    with pytest.raises(NotFoundError):
        store.head("bad-part")


@pytest.mark.parametrize(
    "make_source", [lambda: b"", lambda: iter(()), lambda: io.BytesIO(b"")], ids=["bytes", "iter", "file"]
)
def test_put_stream_of_zero_bytes_makes_an_empty_object(store, make_source):
    meta = store.put_stream("empty", make_source(), part_size=PART)
    assert meta.size == 0
    assert meta.crc32c == crc32c_b64(b"")
    assert store.get("empty") == b""
    assert store.head("empty").size == 0


@pytest.mark.parametrize("shape", ["bytes", "chunks"])
def test_put_stream_exact_multiple_of_part_size_uploads_no_empty_part(store, counted, shape):
    data = _payload(2 * PART, seed=7)
    source = data if shape == "bytes" else _chunks(data, PART)
    counting = counted(store)
    meta = counting.put_stream("exact", source, part_size=PART)
    assert counting.counts["upload_part"] == 2
    assert meta.crc32c == crc32c_b64(data)
    assert store.get("exact") == data


# ---------------------------------------------------------------- reads


def test_get_byte_range_returns_exactly_those_bytes(store):
    data = _payload(1000, seed=8)
    store.put("r", data)
    assert store.get("r", byte_range=(0, 1000)) == data
    assert store.get("r", byte_range=(10, 20)) == data[10:20]
    assert store.get("r", byte_range=(999, 1000)) == data[999:]
    assert store.get("r", byte_range=(5, 5)) == b""
    assert store.get("r", byte_range=(990, 2000)) == data[990:]  # clamped at the end, like HTTP


def test_get_stream_verifies_size_and_crc32c_at_the_end(store):
    data = _payload(3 * MiB + 5, seed=9)
    meta = store.put("s", data)
    got = b"".join(store.get_stream("s", expected_size=len(data), expected_crc32c=meta.crc32c))
    assert got == data
    assert store.get_verified("s", expected_size=len(data), expected_crc32c=crc32c_b64(data)) == data
    with pytest.raises(ChecksumMismatchError):
        b"".join(store.get_stream("s", expected_crc32c=crc32c_b64(b"other")))
    with pytest.raises(ChecksumMismatchError):
        b"".join(store.get_stream("s", expected_size=len(data) + 1))
    with pytest.raises(ChecksumMismatchError):
        b"".join(store.get_stream("s", expected_size=len(data) - 1))


def test_head_and_get_of_missing_key_raise_not_found(store):
    with pytest.raises(NotFoundError) as info:
        store.head("missing")
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(FileNotFoundError):
        store.get("missing")
    with pytest.raises(NotFoundError):
        b"".join(store.get_stream("missing"))


def test_empty_object_put_get_head_list(store):
    meta = store.put("empty", b"", mode=PutMode.CREATE)
    assert meta.size == 0
    assert store.get("empty") == b""
    assert store.head("empty").size == 0
    assert [(m.key, m.size) for m in store.list("")] == [("empty", 0)]


def test_keys_with_spaces_and_unicode_roundtrip(store):
    keys = ["with space/file name.bin", "ünïcödé/日本語/ключ", "emoji-🚀.pt"]
    for i, key in enumerate(keys):
        store.put(key, f"v{i}".encode(), mode=PutMode.CREATE)
    for i, key in enumerate(keys):
        assert store.get(key) == f"v{i}".encode()
        assert store.head(key).key == key
    assert [m.key for m in store.list("")] == sorted(keys)
    assert [m.key for m in store.list("ünïcödé/")] == ["ünïcödé/日本語/ключ"]
    assert store.list_prefixes("") == sorted(["with space/", "ünïcödé/"])


# ---------------------------------------------------------------- listing and deleting


def test_list_filters_by_plain_string_prefix_in_sorted_order(store):
    keys = ["a/1", "a/2", "a-b", "a0", "ab/x", "b/1", "a/sub/3"]
    for key in keys:
        store.put(key, b"x")
    assert [m.key for m in store.list("")] == sorted(keys)
    assert [m.key for m in store.list("a/")] == ["a/1", "a/2", "a/sub/3"]
    assert [m.key for m in store.list("a")] == sorted(k for k in keys if k.startswith("a"))
    assert [m.key for m in store.list("ab")] == ["ab/x"]
    assert [m.key for m in store.list("zzz")] == []
    sizes = {m.key: m.size for m in store.list("")}
    assert set(sizes.values()) == {1}


def test_list_start_after_resumes_after_that_key(store):
    # (no key is also a "directory" of others: file:// cannot hold both "a" and "a/b")
    keys = sorted([f"k/{i:03d}" for i in range(10)] + ["k/005x/deeper", "k/005x/z"])
    for key in keys:
        store.put(key, b"x")
    assert [m.key for m in store.list("k/", start_after="k/004")] == keys[5:]
    assert [m.key for m in store.list("k/", start_after="k/005")] == keys[6:]
    assert [m.key for m in store.list("k/", start_after="k/005x/deeper")] == keys[7:]
    assert [m.key for m in store.list("k/", start_after="k/005x/")] == keys[6:]
    assert [m.key for m in store.list("", start_after="k/009")] == []
    assert [m.key for m in store.list("k/", start_after="a")] == keys


def test_list_prefixes_returns_direct_subdirectories(store):
    for key in ["p/a/1", "p/a/2", "p/b/x/1", "p/c", "q/1"]:
        store.put(key, b"x")
    assert store.list_prefixes("") == ["p/", "q/"]
    assert store.list_prefixes("p/") == ["p/a/", "p/b/"]
    assert store.list_prefixes("p/b/") == ["p/b/x/"]
    assert store.list_prefixes("p/a/") == []
    assert store.list_prefixes("nothing/") == []


def test_delete_ignores_absent_keys(store):
    store.put("d/1", b"x")
    store.put("d/2", b"x")
    store.delete(["d/1", "d/never-existed", "nope/at/all"])
    assert [m.key for m in store.list("d/")] == ["d/2"]
    store.delete([])
    store.delete(["d/2", "d/2"])
    assert list(store.list("")) == []


def test_list_paginates_over_1000_keys_and_delete_batches_over_1000(store, counted):
    # Slow on HTTP servers: the only test that makes more than a handful of objects.
    keys = [f"many/{i:05d}" for i in range(1050)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, k.encode(), mode=PutMode.CREATE), keys))
    counting = counted(store)
    listed = [m.key for m in counting.list("many/")]
    assert listed == keys
    assert counting.counts["list_page"] >= 2
    assert [m.key for m in counting.list("many/", start_after=keys[999])] == keys[1000:]

    counting.reset()
    counting.delete(keys + ["many/absent"])
    assert counting.counts["delete_batch"] == 2
    assert list(store.list("many/")) == []
