"""The simulator itself: its rate limits throttle at their rate on the virtual clock, latency and
bandwidth add up as modelled, the virtual clock never sleeps for real, the baton orders requests,
partitions split and buckets ramp as documented."""

from __future__ import annotations

import random
import threading
import time

import pytest

from objckpt._retry import RetryPolicy
from objckpt.errors import TransientError
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import Fault, FaultInjectingStore
from objckpt.testing.scale import clock
from objckpt.testing.scale.model import Network, NetworkModel, RateLimits, RateModel, StoreProfile
from objckpt.testing.scale.store import IndexedMemoryStore, SimulatedStore

NO_LATENCY = NetworkModel(request_latency_s=0.0, list_latency_s=0.0, error_latency_s=0.0)


def _store(profile: StoreProfile, network: NetworkModel = NO_LATENCY, **options: object) -> SimulatedStore:
    return SimulatedStore(
        MemoryStore("t", retry=RetryPolicy(max_attempts=1)), profile=profile, network=network, **options
    )


def test_a_partition_limit_of_n_per_second_accepts_exactly_n_per_second() -> None:
    store = _store(StoreProfile.s3(partition_limits=RateLimits(write_per_s=100, read_per_s=250)))
    tl = clock.Timeline(0.0, rank=0)
    accepted = {0: 0, 1: 0, 2: 0}
    refused = 0
    with clock.virtual_time(), clock.acting_as(tl):
        # 1,000 writes per virtual second for 3 seconds: 10x the limit
        for i in range(3000):
            tl.set(i / 1000)
            try:
                store.put(f"data/k{i:05d}", b"x")
                accepted[int(tl.now)] += 1
            except TransientError as exc:
                assert "503 SlowDown" in str(exc)
                refused += 1
        reads = 0
        tl.set(3.0)
        for i in range(1000):
            try:
                store.head(f"data/k{i % 100:05d}")
                reads += 1
            except TransientError:
                pass
    assert accepted == {0: 100, 1: 100, 2: 100}
    assert refused == 2700 and store.recorder.injected == 2700 + 750
    assert reads == 250
    (scope,) = store.rates.partitions
    peak = scope.peak_per_s(1.0)
    assert peak["write"] == 100 and peak["write_offered"] == 1000
    assert peak["read"] == 250 and peak["read_offered"] == 1000


def test_throttling_is_per_partition_and_per_key_range() -> None:
    profile = StoreProfile.s3(partition_limits=RateLimits(10, 10), initial_boundaries=("data/8",))
    store = _store(profile)
    tl = clock.Timeline(0.0, rank=0)
    ok: dict[str, int] = {"low": 0, "high": 0}
    with clock.virtual_time(), clock.acting_as(tl):
        for i in range(50):
            for side, key in (("low", f"data/1/{i}"), ("high", f"data/9/{i}")):
                try:
                    store.put(key, b"x")
                    ok[side] += 1
                except TransientError:
                    pass
    assert ok == {"low": 10, "high": 10}  # two partitions, each at its own limit


def test_a_partition_splits_after_sustained_throttling_and_a_bucket_ramps() -> None:
    profile = StoreProfile.s3(partition_limits=RateLimits(10, 10), split_after_s=30.0)
    rates = RateModel(profile)
    t = 0.0
    while t < 29.0:
        rates.admit("write", [f"data/{random.randrange(100):02d}"], t)
        t += 0.01
    assert len(rates.partitions) == 1  # throttled for 29 s: not yet
    while t < 31.0:
        rates.admit("write", [f"data/{random.randrange(100):02d}"], t)
        t += 0.01
    assert len(rates.partitions) == 2 and rates.splits
    cut = rates.splits[0][1]
    assert "data/00" < cut <= "data/99"

    gcs = RateModel(StoreProfile.gcs(ramp_period_s=1200.0))
    assert gcs.bucket is not None
    t = 0.0
    while t < 1199.0:
        gcs.admit("write", ["k"] * 600, t)  # one 600-key batch per second: above half the limit
        t += 1.0
    assert gcs.limit_of(gcs.bucket, "write") == 1000
    while t < 1201.0:
        gcs.admit("write", ["k"] * 600, t)
        t += 1.0
    assert gcs.limit_of(gcs.bucket, "write") == 2000  # doubled after 20 minutes of load


def test_latency_and_bandwidth_add_up_as_modelled() -> None:
    net = NetworkModel(
        request_latency_s=0.05,
        list_latency_s=0.2,
        connection_bandwidth=1e6,
        host_bandwidth=10e6,
        ranks_per_host=100,
        byte_scale=2.0,
    )
    store = _store(StoreProfile.unlimited(), net)
    tl = clock.Timeline(0.0, rank=0)
    with clock.virtual_time(), clock.acting_as(tl):
        store.put("data/a", b"x" * 250_000)  # 0.05 s + 500,000 modelled bytes at 1 MB/s
        assert tl.now == pytest.approx(0.55)
        assert store.get_verified("data/a") == b"x" * 250_000  # again
        assert tl.now == pytest.approx(1.10)
        list(store.list(""))
        assert tl.now == pytest.approx(1.30)
        store.head("data/a")
        assert tl.now == pytest.approx(1.35)
        # outside data/ (a manifest, the pointer) bytes are their real size: 250,000 at 1 MB/s
        store.put("manifests/m", b"x" * 250_000)
        assert tl.now == pytest.approx(1.65)

    # 20 connections of one host at 1 MB/s each share its 10 MB/s NIC
    nic = Network(NetworkModel(connection_bandwidth=1e6, host_bandwidth=10e6, bandwidth_slot_s=0.01))
    ends = sorted(nic.transfer(0, "up", 0.0, 1_000_000) for _ in range(20))
    assert ends[0] == pytest.approx(1.0) and ends[9] == pytest.approx(1.0)
    assert ends[-1] == pytest.approx(2.0, abs=0.02)
    assert nic.transfer(1, "up", 0.0, 1_000_000) == pytest.approx(1.0)  # another host: its own NIC
    assert nic.transfer(0, "down", 0.0, 1_000_000) == pytest.approx(1.0)  # other direction


def test_the_virtual_clock_never_sleeps_for_real(monkeypatch: pytest.MonkeyPatch) -> None:
    real_sleep = time.sleep
    slept_in_simulation: list[float] = []

    def guarded_sleep(seconds: float) -> None:
        if clock.current() is not None:
            slept_in_simulation.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", guarded_sleep)
    # every put fails transiently; the policy backs off 0..2 s per try, for 300 s
    inner = FaultInjectingStore(MemoryStore("t"), [Fault(op="put", times=None, error=TransientError)])
    policy = RetryPolicy(deadline=300.0, max_attempts=10**6, initial_backoff=2.0, max_backoff=2.0)
    store = SimulatedStore(inner, profile=StoreProfile.unlimited(), network=NO_LATENCY, retry=policy)
    tl = clock.Timeline(0.0, rank=0)
    started = time.perf_counter()
    with clock.virtual_time(), clock.acting_as(tl):
        with pytest.raises(TransientError):
            store.put("k", b"x")
        # the shims inside the patched modules read the timeline
        import tenacity.nap

        import objckpt.store._budget as budget
        import objckpt.store._reads as reads

        before = tl.now
        tenacity.nap.time.sleep(1000.0)
        assert tl.now == pytest.approx(before + 1000.0)
        # the store's own clock reads: get_stream's resume loop and the shared time budget
        assert reads.time.monotonic() == tl.now
        assert budget.time.monotonic() == tl.now
    real = time.perf_counter() - started
    assert slept_in_simulation == []
    assert 300.0 <= tl.now - 1000.0 <= 303.0  # the policy's deadline held on the virtual clock
    assert real < 30.0  # hundreds of virtual seconds, without waiting them
    # outside the simulation everything is real again
    import tenacity.nap

    assert tenacity.nap.time is time


def test_the_baton_keeps_requests_in_virtual_time_order() -> None:
    store = _store(StoreProfile.unlimited(), NetworkModel(request_latency_s=0.01))
    order: list[float] = []
    lock = threading.Lock()
    original = store._invoke

    def record(op: str, key: str, keys: object, fn: object, *args: object) -> object:
        result = original(op, key, keys, fn, *args)  # type: ignore[arg-type]
        tl = clock.current()
        with lock:
            order.append(tl.now if tl else -1.0)
        return result

    store._invoke = record  # type: ignore[method-assign]
    timelines = [clock.Timeline(0.0, rank=r, host=r) for r in range(4)]

    def body(tl: clock.Timeline) -> None:
        with clock.acting_as(tl):
            for i in range(100):
                store.put(f"k{tl.rank}-{i}", b"x")

    with clock.virtual_time(lag=0.05) as baton:
        assert baton is not None
        # hold the baton while the threads start, so all of them queue for it (in a scenario a
        # collective lines them up the same way)
        with clock.acting_as(clock.Timeline(0.0)):
            threads = [threading.Thread(target=body, args=(tl,)) for tl in timelines]
            for t in threads:
                t.start()
            while len(baton._ready) < len(threads):
                time.sleep(0.001)
        for t in threads:
            t.join()
    assert len(order) == 400
    # every request happened within the lag of every earlier one (plus one request's latency)
    worst = max(max(order[:i]) - order[i] for i in range(1, len(order)))
    assert worst <= 0.05 + 0.01 + 1e-9


def test_the_indexed_memory_store_lists_like_memory_store() -> None:
    rng = random.Random(7)
    plain, indexed = MemoryStore("a"), IndexedMemoryStore("b")
    keys = {f"{rng.choice('abc')}/{rng.randrange(50):02d}/{rng.randrange(9)}" for _ in range(400)}

    def same_listings() -> None:
        for prefix in ("", "a/", "b/1", "c/49/", "zz"):
            for start_after in (None, "", "a", "b/20", "c/49/8"):
                for limit in (1, 7, 1000):
                    a = plain._list_page(prefix, start_after, limit)
                    b = indexed._list_page(prefix, start_after, limit)
                    assert [m.key for m in a[0]] == [m.key for m in b[0]] and a[1] == b[1]

    # the index is kept up to date between LISTs: puts (new keys and overwrites) and deletes
    for i, key in enumerate(sorted(keys, key=lambda _: rng.random())):
        plain.put(key, b"x")
        indexed.put(key, b"x")
        if i % 97 == 0:
            indexed.put(key, b"y")
            plain.put(key, b"y")
            same_listings()
    same_listings()
    plain.delete(list(keys)[:50])
    indexed.delete(list(keys)[:50])
    same_listings()


def test_tenacitys_thread_locals_stay_per_thread_under_the_cheap_stand_in() -> None:
    import tenacity

    with clock.virtual_time():
        assert tenacity.threading.local is not threading.local  # the stand-in (see clock)
        retrying = tenacity.Retrying(stop=tenacity.stop_after_attempt(3), reraise=True)
        calls = []

        def flaky() -> int:
            calls.append(1)
            if len(calls) < 2:
                raise ValueError("once")
            return 7

        assert retrying(flaky) == 7
        seen: list[object] = []
        other = threading.Thread(target=lambda: seen.append(retrying.statistics))
        other.start()
        other.join()
        # this thread's statistics are its own; another thread starts with none
        assert retrying.statistics["attempt_number"] == 2
        assert seen == [{}]
        local = tenacity.threading.local()
        local.x = 1
        assert hasattr(local, "x") and not hasattr(local, "y")
        del local.x
        assert not hasattr(local, "x")
    assert tenacity.threading is threading
