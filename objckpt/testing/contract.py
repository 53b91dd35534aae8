"""The store contract suite, shipped so a third-party backend runs the same tests as ours.

Every backend objckpt ships (memory, file, S3 on moto/LocalStack/any endpoint, GCS on an emulator)
and every wrapper (``PrefixStore``, ``CountingStore``, ``FaultInjectingStore``) runs these; a new
backend is correct when it passes them. Subclass :class:`StoreContract` in a test module (the
class name must start with ``Test``) and override the ``make_store`` fixture::

    import pytest
    from objckpt.testing.contract import StoreContract

    class TestMyStore(StoreContract):
        @pytest.fixture
        def make_store(self):
            # a factory of fresh, EMPTY stores (e.g. a unique prefix per call)
            return lambda: MyStore(f"bucket/t-{uuid.uuid4().hex}")

        @pytest.fixture
        def store_gaps(self):
            # known server gaps: gap id -> reason (each such test is a strict xfail)
            return {GAP_PART_CHECKSUM: "my emulator accepts any checksum"}

        @pytest.fixture
        def make_missing_bucket_store(self):
            # optional: a store on a bucket that does not exist (else those tests skip)
            return lambda: MyStore("no-such-bucket/run")

Nothing here assumes more than the contract in ``objckpt/store/base.py``. A known gap is a strict
xfail, so a gap that gets fixed turns the run red instead of passing vacuously. Multipart tests
use 5 MiB parts (S3's minimum), so the whole suite moves a few hundred MiB.

This module holds :class:`StoreContract` itself (its fixtures) and the read-side tests: reads,
listing and deleting, uploads left behind, keys and declarations. The write-side tests
(create-if-absent, compare-and-swap, streamed multipart put) and the gap ids, sizes and
:func:`expect_gap` they share are in :mod:`objckpt.testing._contract_writes`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import pytest

from .._crc import crc32c_b64
from ..errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    InvalidKeyError,
    NotFoundError,
)
from ..store.base import Capabilities, PutMode, Store
from ..store.wrappers import CountingStore
from ._contract_writes import (
    BIG,
    GAP_ATOMIC_CONDITIONALS,
    GAP_CONDITIONAL_COMPLETE,
    GAP_PART_CHECKSUM,
    INVALID_KEYS,
    PART,
    MiB,
    _payload,
    _WriteContract,
    expect_gap,
)

__all__ = [
    "BIG",
    "GAP_ATOMIC_CONDITIONALS",
    "GAP_CONDITIONAL_COMPLETE",
    "GAP_PART_CHECKSUM",
    "INVALID_KEYS",
    "PART",
    "MiB",
    "StoreContract",
    "expect_gap",
]


class StoreContract(_WriteContract):
    """The contract every Store must keep. Override the ``make_store`` fixture (and, where they
    apply, ``store_gaps`` and ``make_missing_bucket_store``); see the module doc."""

    # ---------------------------------------------------------------- hooks (fixtures)

    @pytest.fixture
    def make_store(self) -> Callable[[], Store]:
        raise NotImplementedError("override the make_store fixture: a factory of fresh, empty stores")

    @pytest.fixture
    def store_gaps(self) -> Mapping[str, str]:
        return {}

    @pytest.fixture
    def make_missing_bucket_store(self) -> Callable[[], Store] | None:
        return None

    @pytest.fixture
    def store(self, make_store: Callable[[], Store]) -> Iterator[Store]:
        store = make_store()
        yield store
        store.close()

    @pytest.fixture
    def counted(self) -> Iterator[Callable[[Store], CountingStore]]:
        """Wrap stores in CountingStore; the wrappers are closed, the wrapped store is not."""
        made: list[CountingStore] = []

        def wrap(store: Store) -> CountingStore:
            made.append(CountingStore(store, close_inner=False))
            return made[-1]

        yield wrap
        for wrapper in made:
            wrapper.close()

    # ---------------------------------------------------------------- reads

    def test_get_byte_range_returns_exactly_those_bytes(self, store: Store) -> None:
        data = _payload(1000, seed=8)
        store.put("r", data)
        assert store.get("r", byte_range=(0, 1000)) == data
        assert store.get("r", byte_range=(10, 20)) == data[10:20]
        assert store.get("r", byte_range=(999, 1000)) == data[999:]
        assert store.get("r", byte_range=(5, 5)) == b""
        assert store.get("r", byte_range=(990, 2000)) == data[990:]  # clamped at the end, like HTTP
        assert store.get("r", byte_range=(1000, 1010)) == b""  # starts at the end: nothing there
        assert store.get("r", byte_range=(2000, 3000)) == b""
        store.put("e", b"")
        assert store.get("e", byte_range=(0, 5)) == b"" and store.get("e") == b""

    def test_get_of_a_multi_part_object_and_its_ranges(self, store: Store) -> None:
        data = _payload(BIG, seed=10)
        store.put_stream("m", data, part_size=PART)
        assert store.get("m") == data
        assert store.get("m", byte_range=(PART - 3, 2 * PART + 3)) == data[PART - 3 : 2 * PART + 3]
        assert store.get("m", byte_range=(BIG - 10, BIG + 10)) == data[-10:]

    def test_get_stream_verifies_size_and_crc32c_at_the_end(self, store: Store) -> None:
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

    def test_head_and_get_of_missing_key_raise_not_found(self, store: Store) -> None:
        with pytest.raises(NotFoundError) as info:
            store.head("missing")
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(FileNotFoundError):
            store.get("missing")
        with pytest.raises(NotFoundError):
            b"".join(store.get_stream("missing"))

    def test_empty_object_put_get_head_list(self, store: Store) -> None:
        meta = store.put("empty", b"", mode=PutMode.CREATE)
        assert meta.size == 0
        assert store.get("empty") == b""
        assert store.head("empty").size == 0
        assert [(m.key, m.size) for m in store.list("")] == [("empty", 0)]

    def test_keys_with_spaces_and_unicode_roundtrip(self, store: Store) -> None:
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

    def test_list_filters_by_plain_string_prefix_in_sorted_order(self, store: Store) -> None:
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

    def test_list_start_after_resumes_after_that_key(self, store: Store) -> None:
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

    def test_list_prefixes_returns_direct_subdirectories(self, store: Store) -> None:
        for key in ["p/a/1", "p/a/2", "p/b/x/1", "p/c", "q/1"]:
            store.put(key, b"x")
        assert store.list_prefixes("") == ["p/", "q/"]
        assert store.list_prefixes("p/") == ["p/a/", "p/b/"]
        assert store.list_prefixes("p/b/") == ["p/b/x/"]
        assert store.list_prefixes("p/a/") == []
        assert store.list_prefixes("nothing/") == []

    def test_delete_ignores_absent_keys(self, store: Store) -> None:
        store.put("d/1", b"x")
        store.put("d/2", b"x")
        store.delete(["d/1", "d/never-existed", "nope/at/all"])
        assert [m.key for m in store.list("d/")] == ["d/2"]
        store.delete([])
        store.delete(["d/2", "d/2"])
        assert list(store.list("")) == []

    def test_list_paginates_over_1000_keys_and_delete_batches_over_1000(
        self, store: Store, counted: Callable[[Store], CountingStore]
    ) -> None:
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

    # ---------------------------------------------------------------- uploads left behind (GC)

    def test_pending_upload_is_listed_and_aborted_through_its_pending_record(self, store: Store) -> None:
        handle = store._create_upload("gc/me", PutMode.CREATE)
        store._upload_part(handle, 1, 0, memoryview(b"abc"), crc32c_b64(b"abc"))
        pending = store.list_uploads("gc/")
        assert [(u.key, u.upload_id) for u in pending] == [("gc/me", handle.upload_id)]
        assert store.list_uploads("other/") == []
        # GC holds only the PendingUpload (e.g. another process's): abort through it, twice
        store.abort_upload(pending[0])
        store.abort_upload(pending[0])
        assert store.list_uploads("") == []
        assert [m.key for m in store.list("")] == []
        with pytest.raises(NotFoundError):
            store.head("gc/me")

    # ---------------------------------------------------------------- keys and declarations

    @pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
    def test_invalid_keys_are_refused_before_any_request(
        self, store: Store, counted: Callable[[Store], CountingStore], key: str
    ) -> None:
        counting = counted(store)
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: counting.put(key, b"x"),
            "put_stream": lambda: counting.put_stream(key, bytes(3000), part_size=1000),
            "get": lambda: counting.get(key),
            "get_stream": lambda: counting.get_stream(key),  # refused when called, not iterated
            "head": lambda: counting.head(key),
            "delete": lambda: counting.delete(["fine", key]),
        }
        for name, call in calls.items():
            with pytest.raises(InvalidKeyError) as info:
                call()
            assert isinstance(info.value, ValueError), name
            assert info.value.location == store.location, name
        assert counting.total == 0
        # the store's own methods refuse it too, whatever wraps it
        with pytest.raises(InvalidKeyError):
            store.put(key, b"x")
        with pytest.raises(InvalidKeyError):
            store.get(key)
        assert [m.key for m in store.list("")] == []

    def test_capabilities_are_declared_in_full(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps, Capabilities)
        # what the protocol needs to commit; a backend lacking it must say so (NotSupportedError)
        if not caps.create_if_absent:
            with pytest.raises(NotImplementedError):
                store.put("k", b"x", mode=PutMode.CREATE)

    def test_missing_bucket_is_bucket_not_found_on_every_call(
        self, make_missing_bucket_store: Callable[[], Store] | None
    ) -> None:
        if make_missing_bucket_store is None:
            pytest.skip("this backend has no bucket that can be missing")
        store = make_missing_bucket_store()
        try:
            calls: dict[str, Callable[[], object]] = {
                "head": lambda: store.head("k"),
                "get": lambda: store.get("k"),
                "get_stream": lambda: b"".join(store.get_stream("k")),
                "put": lambda: store.put("k", b"x"),
                "put create": lambda: store.put("k", b"x", mode=PutMode.CREATE),
                "put_stream": lambda: store.put_stream("k", _payload(PART + 1), part_size=PART),
                "list": lambda: list(store.list("")),
                "list_prefixes": lambda: store.list_prefixes(""),
                "list_uploads": lambda: store.list_uploads(""),
                "delete": lambda: store.delete(["k"]),
            }
            for name, call in calls.items():
                with pytest.raises(BucketNotFoundError) as info:
                    call()
                # a configuration problem, never a missing checkpoint: exactly this class
                assert type(info.value) is BucketNotFoundError, name
                assert store.location in str(info.value), name
        finally:
            store.close()
