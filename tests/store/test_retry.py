"""The one retry layer (Store._call over RetryPolicy), exercised through FaultInjectingStore over a
memory store: the wrapper's faults go through the same public methods as a real server's errors."""

from __future__ import annotations

import os
import time

import pytest

from objckpt._crc import crc32c_b64
from objckpt._retry import RetryPolicy
from objckpt.errors import (
    NotFoundError,
    PermissionDeniedError,
    TransientError,
)
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore

MiB = 1024 * 1024
FAST = RetryPolicy(deadline=10.0, max_attempts=5, initial_backoff=0.001, max_backoff=0.002)


def _faulty(*faults: Fault, retry: RetryPolicy = FAST, inner=None):
    inner = inner if inner is not None else MemoryStore("retry", retry=retry)
    store = FaultInjectingStore(inner, faults, retry=retry)
    retries: list[tuple[BaseException, int]] = []
    store.add_retry_listener(lambda exc, attempt: retries.append((exc, attempt)))
    return store, retries


@pytest.mark.parametrize("op", ["put", "open", "list_page", "upload_part", "head", "complete_upload"])
def test_transient_error_is_retried_and_the_call_succeeds(op):
    store, retries = _faulty(Fault(op=op, times=2))
    data = bytes(range(256)) * 1000
    if op in ("upload_part", "complete_upload"):
        meta = store.put_stream("k", data, part_size=64 * 1024, max_in_flight=1)
    else:
        meta = store.put("k", data)
    assert meta.crc32c == crc32c_b64(data)
    assert store.get("k") == data
    assert [m.key for m in store.list("")] == ["k"]
    assert store.head("k").size == len(data)
    assert [a for _, a in retries] == [1, 2]
    assert all(isinstance(exc, TransientError) for exc, _ in retries)
    assert [o for o, _ in store.injected] == [op, op]


@pytest.mark.parametrize("error", [PermissionDeniedError, NotFoundError])
@pytest.mark.parametrize("op", ["put", "open", "head"])
def test_permanent_error_is_raised_after_exactly_one_try(op, error):
    inner = CountingStore(MemoryStore("perm", retry=FAST))
    inner.put("k", b"data")
    inner.reset()
    store, retries = _faulty(Fault(op=op, error=error, times=None), inner=inner)
    call = {
        "put": lambda: store.put("k", b"new"),
        "open": lambda: store.get("k"),
        "head": lambda: store.head("k"),
    }[op]
    with pytest.raises(error) as info:
        call()
    assert info.value.key == "k" and info.value.location == "memory://perm"
    assert retries == []
    assert store.injected == [(op, "k")]
    assert inner.total == 0  # the fault fired before any request reached the store


def test_permanent_error_in_a_part_aborts_the_upload_after_one_try():
    store, retries = _faulty(Fault(op="upload_part", error=PermissionDeniedError, times=None))
    with pytest.raises(PermissionDeniedError):
        store.put_stream("k", bytes(300_000), part_size=100_000, max_in_flight=1)
    assert retries == []
    assert store.list_uploads("") == []
    with pytest.raises(NotFoundError):
        store.head("k")


def test_attempt_cap_is_honoured():
    policy = RetryPolicy(deadline=60.0, max_attempts=4, initial_backoff=0.001, max_backoff=0.001)
    store, retries = _faulty(Fault(op="head", times=None), retry=policy)
    with pytest.raises(TransientError):
        store.head("k")
    assert len(store.injected) == 4
    assert [a for _, a in retries] == [1, 2, 3]


def test_retry_deadline_is_honoured():
    policy = RetryPolicy(deadline=0.2, max_attempts=10_000, initial_backoff=0.02, max_backoff=0.02)
    store, _ = _faulty(Fault(op="open", times=None), retry=policy)
    started = time.monotonic()
    with pytest.raises(TransientError):
        store.get("k")
    elapsed = time.monotonic() - started
    assert elapsed < 2.0
    assert 2 <= len(store.injected) < 100


class _OffsetRecordingMemoryStore(MemoryStore):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.opened_at: list[int] = []

    def _open(self, key, start, end):
        self.opened_at.append(start)
        return super()._open(key, start, end)


def test_get_stream_resumes_from_the_right_offset_after_a_mid_stream_error():
    inner = _OffsetRecordingMemoryStore("resume", retry=FAST)
    data = os.urandom(9 * MiB + 17)
    meta = inner.put("big", data)
    cut = 4 * MiB + 12345  # inside the second 4 MiB chunk
    store, retries = _faulty(Fault(op="open", after_bytes=cut), inner=inner)
    got = b"".join(store.get_stream("big", expected_size=len(data), expected_crc32c=meta.crc32c))
    assert got == data
    assert inner.opened_at == [0, cut]
    assert len(retries) == 1
    assert store.injected == [("open", "big")]


def test_get_stream_gives_up_after_max_attempts_of_mid_stream_errors():
    inner = MemoryStore("resume", retry=FAST)
    inner.put("big", bytes(5 * MiB))
    store, _ = _faulty(Fault(op="open", after_bytes=1000, times=None), inner=inner)
    with pytest.raises(TransientError):
        b"".join(store.get_stream("big"))
    assert len(store.injected) == FAST.max_attempts


def test_list_resumes_from_the_failed_page_only():
    inner = CountingStore(MemoryStore("pages", retry=FAST))
    keys = [f"k/{i:04d}" for i in range(2500)]
    for key in keys:
        inner.put(key, b"")
    inner.reset()
    store, retries = _faulty(Fault(op="list_page", times=1), inner=inner)
    # Let the first page through, then fail the second once.
    store.faults[0].times = 0
    pages = store.list("k/")
    first = [next(pages) for _ in range(1000)]
    store.faults[0].times = 1
    rest = list(pages)
    assert [m.key for m in first + rest] == keys
    assert len(retries) == 1
    assert inner.counts["list_page"] == 3  # the failed request never reached the store


def test_fault_probability_is_seeded_and_times_none_fails_every_match():
    def run(seed: int) -> list[tuple[str, str]]:
        no_retry = RetryPolicy(max_attempts=1)
        fault = Fault(op="put", key="a/*", probability=0.5, times=None)
        store = FaultInjectingStore(MemoryStore("p"), [fault], seed=seed, retry=no_retry)
        for i in range(20):
            try:
                store.put(f"a/{i}", b"x")
            except TransientError:
                pass
        store.put("b/untouched", b"x")
        return store.injected

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert all(key.startswith("a/") for _, key in run(3))


def test_counting_store_counts_each_try_and_records_calls_in_order():
    counting = CountingStore(FaultInjectingStore(MemoryStore("c", retry=FAST), [Fault(op="put", times=2)]))
    counting.put("x", b"1")
    counting.get("x")
    counting.delete(["x", "y"])
    assert counting.counts["put"] == 3
    assert counting.counts["delete_batch"] == 1
    assert counting.calls == [("put", "x")] * 3 + [
        ("open", "x"),
        ("delete_batch", "x"),
        ("delete_batch", "y"),
    ]
    assert counting.total == 5
    counting.reset()
    assert counting.total == 0 and counting.calls == []


def test_create_whose_response_was_lost_is_recognised_as_our_own_write():
    """A CREATE that landed but whose response was lost must not fail the retry with
    AlreadyExistsError when the object holds exactly our bytes; different bytes still conflict."""
    from objckpt import AlreadyExistsError, PutMode, RetryPolicy
    from objckpt.store.memory import MemoryStore
    from objckpt.store.wrappers import Fault, FaultInjectingStore

    inner = MemoryStore("lost")
    store = FaultInjectingStore(
        inner,
        [Fault(op="put", key="shard", after=True)],
        retry=RetryPolicy(initial_backoff=0.001, max_backoff=0.001),
    )
    meta = store.put("shard", b"payload", mode=PutMode.CREATE)
    assert meta.size == 7 and inner.get("shard") == b"payload"
    assert store.injected == [("put", "shard")]

    store.add(Fault(op="put", key="other", after=True))
    inner.put("other", b"someone else's bytes")  # a genuine conflict: different content
    with pytest.raises(AlreadyExistsError):
        store.put("other", b"payload", mode=PutMode.CREATE)


def test_get_retries_a_read_broken_mid_stream_from_the_start():
    # get() reads through the one ranged primitive: a stream cut half-way is read again whole
    inner = _OffsetRecordingMemoryStore("whole", retry=FAST)
    data = os.urandom(5 * MiB)
    inner.put("big", data)
    store, retries = _faulty(Fault(op="open", after_bytes=MiB), inner=inner)
    assert store.get("big") == data
    assert inner.opened_at == [0, 0]
    assert len(retries) == 1


def test_a_fault_naming_no_primitive_is_refused():
    # "get" was a primitive once; a rule that can never match would make its test vacuous
    with pytest.raises(ValueError, match="not a primitive"):
        Fault(op="get")
    with pytest.raises(ValueError, match="after_bytes"):
        Fault(op="put", after_bytes=10)
    Fault(op="*")
    Fault(op="open", after_bytes=10)


def test_a_broken_stream_fault_is_used_up_only_by_reads_that_reach_it():
    inner = MemoryStore("reach", retry=FAST)
    inner.put("small", b"x" * 100)
    inner.put("big", bytes(300_000))
    store, retries = _faulty(Fault(op="open", after_bytes=70_000, times=1), inner=inner)
    assert store.get("small") == b"x" * 100  # ends before the fault point: not failed
    assert store.injected == []
    assert store.get("big") == bytes(300_000)  # this one is broken once, then retried
    assert store.injected == [("open", "big")] and len(retries) == 1
