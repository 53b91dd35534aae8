"""PrefixStore specifics the contract suite cannot see: isolation on one inner store, what the
inner store receives, errors named relative to the prefix, and rules that hold through it."""

from __future__ import annotations

import pytest

from objckpt._crc import crc32c_b64
from objckpt.errors import (
    ChecksumMismatchError,
    ConfigError,
    InvalidKeyError,
    NotFoundError,
    PermissionDeniedError,
)
from objckpt.store import PrefixStore, PutMode, open_store
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore


def test_prefix_stores_on_one_inner_store_do_not_see_each_other():
    inner = MemoryStore("bucket")
    a = PrefixStore(inner, "runs/a", close_inner=False)
    b = PrefixStore(inner, "runs/b", close_inner=False)
    a.put("k", b"a")
    b.put("k", b"b")
    inner.put("runs/a-sibling/k", b"outside")  # shares the string "runs/a", not the directory
    assert (a.get("k"), b.get("k")) == (b"a", b"b")
    assert [m.key for m in a.list("")] == ["k"]
    assert a.list_prefixes("") == [] and inner.list_prefixes("runs/") == [
        "runs/a-sibling/",
        "runs/a/",
        "runs/b/",
    ]
    a._create_upload("up", PutMode.CREATE)
    assert [u.key for u in a.list_uploads("")] == ["up"] and b.list_uploads("") == []
    a.delete(["k"])
    assert b.get("k") == b"b" and inner.get("runs/a-sibling/k") == b"outside"


def test_the_inner_store_sees_full_keys_and_callers_see_relative_ones():
    inner = CountingStore(MemoryStore("bucket"))
    store = PrefixStore(inner, "/run/one/")  # slashes around the prefix are not part of it
    meta = store.put("data/x", b"payload")
    assert meta.key == "data/x" and inner.get("run/one/data/x") == b"payload"
    assert store.head("data/x").key == "data/x"
    assert [m.key for m in store.list("data/", start_after="data/a")] == ["data/x"]
    assert store.list_prefixes("") == ["data/"]
    big = store.put_stream("big", bytes(3000), part_size=1000)
    assert big.key == "big" and inner.head("run/one/big").size == 3000
    assert {key for _, key in inner.calls} >= {"run/one/data/x", "run/one/", "run/one/data/", "run/one/big"}
    assert store.location == "memory://bucket/run/one"
    assert PrefixStore(MemoryStore(), "run").location == "memory://run"  # no "memory:///run"


def test_errors_name_the_key_relative_to_the_prefix_and_the_prefixed_location():
    store = PrefixStore(MemoryStore("bucket"), "run")
    with pytest.raises(NotFoundError) as info:
        store.head("missing")
    err = info.value
    assert (err.key, err.location) == ("missing", "memory://bucket/run")
    assert "memory://bucket/run/missing" in str(err)
    with pytest.raises(ChecksumMismatchError) as bad:
        store._put("k", memoryview(b"bytes"), PutMode.CREATE, crc32c_b64(b"other"))
    assert (bad.value.key, bad.value.location) == ("k", "memory://bucket/run")
    with pytest.raises(NotFoundError) as streamed:  # raised from inside the stream
        b"".join(store.get_stream("gone"))
    assert streamed.value.key == "gone"


def test_an_error_about_the_whole_store_names_the_prefixed_location():
    faulty = FaultInjectingStore(MemoryStore("bucket"), [Fault(op="list_page", error=PermissionDeniedError)])
    store = PrefixStore(faulty, "run")
    with pytest.raises(PermissionDeniedError) as info:
        list(store.list(""))
    assert (info.value.key, info.value.location) == ("", "memory://bucket/run")
    assert str(info.value).endswith("[list_page memory://bucket/run/]")


def test_a_pending_upload_is_aborted_through_the_prefix(tmp_path):
    # GC gets PendingUploads with relative keys; the inner store needs its own key and id back
    inner = open_store(f"file://{tmp_path}/bucket")
    store = PrefixStore(inner, "run")
    handle = store._create_upload("shard", PutMode.CREATE)
    store._upload_part(handle, 1, 0, memoryview(b"abc"), crc32c_b64(b"abc"))
    (pending,) = store.list_uploads("")
    assert pending.key == "shard" and inner.list_uploads("")[0].key == "run/shard"
    store.abort_upload(pending)
    assert store.list_uploads("") == [] and inner.list_uploads("") == []


def test_the_inner_backends_stricter_key_rules_hold_through_the_prefix(tmp_path):
    inner = open_store(f"file://{tmp_path}/bucket")
    with pytest.raises(InvalidKeyError, match="reserved"):  # file:// reserves .objckpt-* at its root
        PrefixStore(inner, "").put(".objckpt-x", b"no")
    PrefixStore(inner, "run").put(".objckpt-x", b"fine")  # below the prefix it is a plain name
    assert inner.get("run/.objckpt-x") == b"fine"


@pytest.mark.parametrize("prefix", ["a//b", "a/../b", "./a", "nul\x00"])
def test_a_prefix_that_breaks_the_key_rule_is_a_config_error(prefix):
    with pytest.raises(ConfigError):
        PrefixStore(MemoryStore(), prefix)


def test_wrappers_inherit_the_capabilities_of_the_store_they_wrap():
    from objckpt.store import Capabilities

    weak = MemoryStore(
        capabilities=Capabilities(create_if_absent=True, compare_and_swap=True, atomic_conditionals=False)
    )
    assert PrefixStore(weak, "run").capabilities == weak.capabilities
    assert CountingStore(weak).capabilities == weak.capabilities


class _ReadIntoCounting(MemoryStore):
    """A MemoryStore that counts its own ``_read_into`` (the path a restore's ``get_into`` takes
    on backends with a scatter read) and its ``_open``."""

    def __init__(self) -> None:
        super().__init__("bucket")
        self.read_into_calls = 0
        self.open_calls = 0

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        self.read_into_calls += 1
        return super()._read_into(key, start, buffers)

    def _open(self, key: str, start: int, end: int | None):  # type: ignore[no-untyped-def]
        self.open_calls += 1
        return super()._open(key, start, end)


def _wrapped(kind: str, inner: MemoryStore) -> CountingStore | FaultInjectingStore:
    return CountingStore(inner) if kind == "counting" else FaultInjectingStore(inner)


@pytest.mark.parametrize("kind", ["counting", "faults"])
def test_get_into_through_a_wrapper_uses_the_inner_stores_read_into(kind):
    inner = _ReadIntoCounting()
    inner.put("k", b"0123456789")
    store = _wrapped(kind, inner)
    buf = bytearray(4)
    assert store.get_into("k", 3, [memoryview(buf)]) == 4 and bytes(buf) == b"3456"
    # the inner store's own scatter read, once (its _open is its own default's business: one call)
    assert (inner.read_into_calls, inner.open_calls) == (1, 1)
    if isinstance(store, CountingStore):
        assert store.counts == {"open": 1}  # one ranged GET, counted as the op "open"


def test_faults_on_open_fire_on_get_into_and_are_retried():
    inner = _ReadIntoCounting()
    inner.put("k", b"0123456789")
    store = FaultInjectingStore(inner, [Fault(op="open", key="k", times=2)])
    buf = bytearray(10)
    assert store.get_into("k", 0, [memoryview(buf)]) == 10 and bytes(buf) == b"0123456789"
    assert store.injected == [("open", "k"), ("open", "k")]
    assert inner.read_into_calls == 1  # the two failed tries never reached the inner store


def test_a_mid_stream_fault_on_get_into_lands_the_bytes_before_it_then_retries():
    inner = _ReadIntoCounting()
    inner.put("k", b"0123456789")
    store = FaultInjectingStore(inner, [Fault(op="open", key="k", after_bytes=4)])
    counting = CountingStore(store)
    buf = bytearray(10)
    assert counting.get_into("k", 0, [memoryview(buf)]) == 10 and bytes(buf) == b"0123456789"
    assert store.injected == [("open", "k")] and counting.counts == {"open": 2}
    # the broken try streamed through the inner _open; the retry used the inner _read_into
    assert inner.read_into_calls == 1
