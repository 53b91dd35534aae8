"""Invariant 3: the retry budget is a time budget. A total outage of the store shorter than it
never fails a save or a restore -- with the DEFAULT options (the user changes nothing).

Before the fix ten attempts ran out first: against an unreachable server a save raised after
about 11 s and a restore after 8-17 s, although the documented budget was 120 s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from objckpt._retry import RetryPolicy
from objckpt.coordination import LocalComm, RestoreSession, SaveSession
from objckpt.errors import TransientError
from objckpt.reader import Reader
from objckpt.store import open_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

OUTAGE_S = 20.0


@pytest.fixture(scope="module")
def moto() -> Iterator[Any]:
    from objckpt.testing.s3_servers import MotoServer, ServerStartError, create_bucket

    try:
        srv = MotoServer().start()
    except ServerStartError as exc:
        pytest.skip(f"moto server unavailable: {exc}")
    try:
        create_bucket(srv.endpoint_url, "outage")
        yield srv
    finally:
        srv.stop()


def _outage(proxy: Any, seconds: float) -> threading.Thread:
    """Every request fails (503 SlowDown or a reset, before reaching the server) for ``seconds``."""

    def run() -> None:
        proxy.set_fault_rate({"slowdown": 0.5, "reset": 0.5})
        time.sleep(seconds)
        proxy.set_fault_rate(0.0)

    t = threading.Thread(target=run)
    t.start()
    return t


def _fewest_tries(policy: RetryPolicy, seconds: float) -> int:
    """The fewest tries that fail inside an outage of ``seconds``: every wait at its upper
    bound (``initial_backoff`` doubling up to ``max_backoff``), no time spent in requests."""
    tries, elapsed = 1, 0.0
    while True:
        elapsed += min(policy.max_backoff, policy.initial_backoff * 2 ** (tries - 1))
        if elapsed >= seconds:
            return tries
        tries += 1


def test_the_default_retry_budget_is_time_not_attempts() -> None:
    policy = RetryPolicy()
    # at most max_backoff between tries: the cap on attempts cannot end the budget early
    assert policy.deadline / policy.max_backoff < policy.max_attempts / 10
    assert policy.deadline >= 60  # survives a 60 s outage


def test_a_save_and_a_restore_survive_a_20_second_total_outage(moto: Any) -> None:
    from objckpt.testing.chaos_proxy import ChaosProxy

    with ChaosProxy(moto.endpoint_url, fault_rate=0.0, seed=7, flavor="s3", phases=("before",)) as proxy:
        # default options: only where the server is and how to address it
        store = open_store("s3://outage/run", **{**moto.store_options, "endpoint_url": proxy.endpoint_url})
        assert store.retry == RetryPolicy()
        session = SaveSession(store, LocalComm())

        outage = _outage(proxy, OUTAGE_S)
        started = time.monotonic()
        manifest = session.save(10, lambda t: t.writer.write("state.bin", b"weights " * 1000))
        saved_after = time.monotonic() - started
        outage.join()
        assert manifest.step == 10 and Reader(store).latest().step == 10
        assert saved_after >= OUTAGE_S * 0.9  # it really waited the outage out...
        # ...through real failures: at least as many as the retry schedule allows with every
        # full-jitter wait at its cap (9 for 20 s; a run here once saw exactly 10, so a fixed
        # "> 10" failed by chance)
        assert proxy.stats["slowdown"] + proxy.stats["reset"] >= _fewest_tries(store.retry, OUTAGE_S * 0.9)

        outage = _outage(proxy, OUTAGE_S)
        restored = RestoreSession(store, LocalComm()).restore(
            lambda m: Reader(store).read_shard(m.shard(0, "state.bin"))
        )
        outage.join()
        assert restored is not None and restored.step == 10 and restored.fallbacks == []


def test_an_outage_longer_than_the_budget_fails_naming_the_spent_budget(moto: Any) -> None:
    from objckpt.testing.chaos_proxy import ChaosProxy

    with ChaosProxy(moto.endpoint_url, fault_rate=1.0, seed=7, flavor="s3", kinds=("slowdown",),
                    phases=("before",)) as proxy:  # fmt: skip
        store = open_store(
            "s3://outage/short", **{**moto.store_options, "endpoint_url": proxy.endpoint_url}, deadline=3
        )
        with pytest.raises(
            TransientError, match=r"gave up after \d+ tries over [\d.]+ s of a 3 s retry budget"
        ):
            store.put("x", b"y")
