"""The time budget reaches every path that retries on its own (issue 16, audit): a request made
while another is being retried gets what remains of that one's budget (GCS's cleanup inside a
compose), a stream's resumes share the budget of the request around them, and the pointer's
compare-and-swap rounds share one budget instead of each request getting a fresh one per round.

Counts only, never timings: a spent budget still allows exactly one try.
"""

from __future__ import annotations

import logging

import pytest

from objckpt._retry import RetryPolicy
from objckpt.commit import advance_pointer
from objckpt.errors import PreconditionFailedError, TransientError
from objckpt.layout import POINTER_KEY
from objckpt.manifest import Pointer
from objckpt.store.base import budget_remaining, time_budget
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore

#: generous per-request budget with quick retries: without a shared budget, many tries happen
POLICY = RetryPolicy(deadline=30.0, max_attempts=25, initial_backoff=0.001, max_backoff=0.002)


def _failing(**kw: object) -> tuple[MemoryStore, CountingStore]:
    """(the memory store, a store counting every try of the faulty requests made to it)."""
    memory = MemoryStore("budget")
    faulty = FaultInjectingStore(memory, [Fault(times=None, **kw)], retry=POLICY)  # type: ignore[arg-type]
    return memory, CountingStore(faulty)


def test_time_budget_nests_to_the_smaller_remainder() -> None:
    assert budget_remaining() is None
    with time_budget(100):
        outer = budget_remaining()
        assert outer is not None and 99 < outer <= 100
        with time_budget(5):
            inner = budget_remaining()
            assert inner is not None and inner <= 5
        with time_budget(1000):  # cannot extend the enclosing budget
            again = budget_remaining()
            assert again is not None and again <= 100
    assert budget_remaining() is None


def test_a_request_inside_a_spent_budget_gets_exactly_one_try() -> None:
    memory, store = _failing(op="head")
    memory.put("k", b"v")
    with pytest.raises(TransientError, match=r"gave up after 1 try over [\d.]+ s of a 0 s retry budget"):
        with time_budget(0):
            store.head("k")
    assert store.counts["head"] == 1
    with pytest.raises(TransientError, match="gave up after 25 tries"):
        store.head("k")  # outside any budget: the store's own policy (its 25-try cap here)


def test_a_request_made_while_another_is_retried_shares_its_budget() -> None:
    """The GCS shape: a primitive that makes a request of its own (cleanup after a publish) runs
    inside the publishing request's retry; it must not start a fresh budget there."""
    inner_tries = []

    class Nested(MemoryStore):
        def _head(self, key: str):  # type: ignore[no-untyped-def]
            def cleanup() -> None:
                inner_tries.append(1)
                raise TransientError("cleanup failed", key=key, location=self.location)

            with pytest.raises(TransientError):
                self._call(cleanup)
            return super()._head(key)

    store = Nested("nested", retry=POLICY)
    store.put("k", b"v")
    with time_budget(0):
        store.head("k")
    assert len(inner_tries) == 1


def test_a_stream_resumes_within_the_budget_around_it() -> None:
    memory, store = _failing(op="open", after_bytes=10)
    memory.put("obj", b"x" * 100)
    with pytest.raises(TransientError, match="gave up after 1 try"):
        with time_budget(0):
            b"".join(store.get_stream("obj"))
    assert store.counts["open"] == 1


class _AlwaysLost(MemoryStore):
    """Every compare-and-swap of LATEST loses: a competitor always moved it first."""

    def _put(self, key, data, mode, crc32c):  # type: ignore[no-untyped-def]
        if key == POINTER_KEY and mode.kind != "overwrite":
            raise PreconditionFailedError("a competitor moved it", key=key, location=self.location)
        return super()._put(key, data, mode, crc32c)


def _pointer(step: int) -> Pointer:
    from objckpt import layout

    return Pointer(step=step, manifest_key=layout.manifest_key(step), attempt="0" * 16)


def test_pointer_rounds_stop_when_the_budget_is_spent(caplog: pytest.LogCaptureFixture) -> None:
    inner = _AlwaysLost("cas", retry=RetryPolicy(deadline=0.0))
    inner.put(POINTER_KEY, _pointer(10).encode())
    store = CountingStore(inner)
    with caplog.at_level(logging.WARNING, logger="objckpt.commit"):
        assert advance_pointer(store, _pointer(20)) is False
    # one round (HEAD, GET, the losing PUT), not the 50 rounds the count alone allows
    assert store.counts["put"] == 1
    assert "after 1 compare-and-swap rounds" in caplog.text and "of a 0 s budget" in caplog.text


def test_pointer_rounds_still_end_by_count() -> None:
    inner = _AlwaysLost("cas2", retry=RetryPolicy(deadline=600.0))
    inner.put(POINTER_KEY, _pointer(10).encode())
    store = CountingStore(inner)
    assert advance_pointer(store, _pointer(20), retries=7) is False
    assert store.counts["put"] == 7


def test_pointer_requests_share_one_budget() -> None:
    """A flapping HEAD inside the rounds: with the shared budget spent, each request gets its one
    try and the rounds end, instead of every request retrying on a budget of its own."""
    memory = MemoryStore("flap")
    memory.put(POINTER_KEY, _pointer(10).encode())
    faulty = FaultInjectingStore(memory, [Fault(op="head", key=POINTER_KEY, times=None)], retry=POLICY)
    store = CountingStore(faulty)
    assert advance_pointer(store, _pointer(20), budget=0) is False
    assert store.counts["head"] == 1
