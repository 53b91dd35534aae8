"""Part size from the object's size, and AIMD pacing of a store's requests on throttling
(``objckpt.store.pacing``; docs/DESIGN.md "Scale"). Counts, never timings."""

from __future__ import annotations

import threading

import pytest

from objckpt._retry import RetryPolicy
from objckpt.errors import TransientError
from objckpt.store.base import MiB
from objckpt.store.memory import MemoryStore
from objckpt.store.pacing import Pacer, is_throttling
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from objckpt.writer import ShardWriter

FAST = RetryPolicy(deadline=30.0, max_attempts=50, initial_backoff=0.0001, max_backoff=0.001)
GiB = 1024 * MiB


# -- part size


def test_part_size_follows_the_object_size():
    store = MemoryStore("p", part_size=16 * MiB)
    assert store.part_size_for(None) == 16 * MiB
    assert store.part_size_for(100 * MiB) == 16 * MiB
    assert store.part_size_for(2 * GiB) == 32 * MiB  # big shards: >= 32 MiB parts
    huge = 1024 * GiB
    part = store.part_size_for(huge)
    assert -(-huge // part) <= 10_000 and part % MiB == 0  # S3's part limit
    store.min_part_size = 64 * MiB
    assert store.part_size_for(100 * MiB) == 64 * MiB  # never below the server's minimum
    store.auto_part_size = False
    assert store.part_size_for(huge) == 16 * MiB  # the switch: today's fixed part size


@pytest.mark.parametrize("auto", [True, False])
def test_the_writer_keeps_a_shard_within_10000_parts(auto: bool):
    inner = MemoryStore("w", part_size=1024, retry=FAST)
    store = CountingStore(inner)
    store.auto_part_size = auto
    data = bytes(range(256)) * (11 * MiB // 256)  # 11 MiB at 1 KiB parts: 11,264 parts
    receipt = ShardWriter(store, step=1, attempt="0" * 16, rank=0).write("big.bin", data)
    assert receipt.size == len(data)
    parts = store.counts["upload_part"]
    if auto:
        assert parts == 11  # 1 MiB parts (the 10,000-part bound, rounded up to MiB)
    else:
        assert parts == 11 * 1024  # what the fixed part size costs: over S3's limit
    assert inner.get(receipt.key) == data


# -- pacing


def test_throttling_is_told_apart_from_other_transient_errors():
    assert is_throttling(TransientError("server error, retryable; SlowDown (HTTP 503): Please reduce"))
    assert is_throttling(TransientError("server error, retryable; HTTP 429: rateLimitExceeded"))
    assert is_throttling(TransientError("injected 503 SlowDown"))
    assert not is_throttling(TransientError("server error, retryable; InternalError (HTTP 500)"))
    assert not is_throttling(ValueError("SlowDown"))


def test_one_overload_cuts_the_limit_once_from_the_requests_in_flight():
    pacer = Pacer(limit=64)
    epochs = [pacer.acquire() for _ in range(8)]  # 8 in flight
    for e in epochs:  # all 8 come back SlowDown: one decrease, from 8 in flight, not from 64
        pacer.release(e, throttled=True)
    assert pacer.decreases == 1 and pacer.throttled == 8
    assert pacer.limit == 4.0
    e = pacer.acquire()  # a request sent after the cut that is throttled cuts again
    pacer.release(e, throttled=True)
    assert pacer.limit == 1.0  # halved from the 1 in flight, floored at the minimum
    assert pacer.decreases == 2


def test_a_caller_counting_its_own_requests_in_flight_gets_the_same_arithmetic():
    # the scale simulator's hook: it counts a rank's (virtual) requests in flight itself
    real, told = Pacer(limit=64), Pacer(limit=64)
    epochs = [real.acquire() for _ in range(8)]
    for e in epochs:
        real.release(e, throttled=True)
    for flight in range(8, 0, -1):  # the same 8 answers, from 8 in flight down to 1
        told.feedback(0, throttled=True, in_flight=flight)
    assert (told.limit, told.decreases, told.throttled, told.epoch) == (real.limit, 1, 8, 1) == (4.0, 1, 8, 1)
    told.feedback(told.epoch, throttled=False, in_flight=1)
    assert told.limit == 4.25 and told.waits == 0
    with pytest.raises(ValueError):
        told.feedback(told.epoch, throttled=True, in_flight=0)


def test_successes_raise_the_limit_additively_up_to_its_maximum():
    pacer = Pacer(limit=8)
    pacer.release(pacer.acquire(), throttled=True)  # from 1 in flight: down to the floor
    assert pacer.limit == 1.0
    for _ in range(10):
        pacer.release(pacer.acquire(), throttled=False)
    assert 4.0 < pacer.limit < 5.0  # +1/limit per success: about sqrt(2 * 10)
    for _ in range(1000):
        pacer.release(pacer.acquire(), throttled=False)
    assert pacer.limit == 8.0


def test_requests_wait_for_a_slot_at_the_limit():
    pacer = Pacer(limit=2)
    first, second = pacer.acquire(), pacer.acquire()
    entered = threading.Event()

    def third() -> None:
        pacer.release(pacer.acquire(), throttled=False)
        entered.set()

    t = threading.Thread(target=third)
    t.start()
    assert not entered.wait(0.2)  # blocked: two in flight, limit 2
    pacer.release(first, throttled=False)
    t.join(10)
    assert entered.is_set() and pacer.waits == 1
    pacer.release(second, throttled=False)


def test_the_store_cuts_the_whole_ranks_concurrency_on_slowdown():
    """Eight concurrent writers on one store (one rank's requests): SlowDowns cut the store's
    shared limit (the other writers' requests wait on it too), and every request still succeeds
    through its retries."""
    inner = MemoryStore("s", retry=FAST)
    store = FaultInjectingStore(
        inner,
        [Fault(op="put", error=TransientError("SlowDown (HTTP 503): reduce your request rate"), times=6)],
    )
    store.retry = FAST
    barrier = threading.Barrier(8)

    def writer(i: int) -> None:
        barrier.wait()
        for j in range(5):
            store.put(f"k/{i}/{j}", b"x" * 10)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(list(inner.list("k/"))) == 40  # every request succeeded
    assert store.pacing is not None and store.pacing.throttled == 6
    assert 1 <= store.pacing.decreases <= 6
    # cut to at most half of the 8 in flight, then +1/limit for each of the 34 successes since
    assert store.pacing.limit < 16 < store.pacing.maximum


def test_pacing_off_keeps_only_the_retries():
    store = FaultInjectingStore(
        MemoryStore("o", retry=FAST), [Fault(op="put", error=TransientError("SlowDown (HTTP 503)"), times=2)]
    )
    store.retry = FAST
    store.pacing = None
    store.put("k", b"x")
    assert store.injected == [("put", "k"), ("put", "k")]


def test_a_throttled_download_cuts_the_limit_without_holding_a_slot():
    inner = MemoryStore("d", retry=FAST)
    inner.put("obj", b"y" * 1000)
    store = FaultInjectingStore(
        inner, [Fault(op="open", error=TransientError("SlowDown (HTTP 503)"), times=1)]
    )
    store.retry = FAST
    assert b"".join(store.get_stream("obj", expected_size=1000)) == b"y" * 1000
    assert store.pacing is not None and store.pacing.throttled == 1 and store.pacing.decreases == 1
