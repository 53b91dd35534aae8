"""Adaptive concurrency for one store object (one rank): additive increase, multiplicative
decrease (AIMD) on throttling (invariants 3 and 16).

Per-request retries (``_retry.RetryPolicy``) make one request survive a 503 SlowDown; they do
not make a rank send fewer requests. At thousands of ranks every rank retrying at full
concurrency keeps the partition overloaded. A :class:`Pacer` limits how many requests of this
store are in flight at once:

* a throttling answer (:func:`is_throttling`: S3 ``SlowDown``/503, 429, GCS 429/503) halves the
  limit, from the number of requests actually in flight then (so the first SlowDown bites at
  once, whatever the starting limit); requests that were already in flight when the limit was
  cut do not cut it again (one decrease per "round trip", as in TCP), so a burst of 503s from one
  overload halves the limit once, not once per request;
* every other outcome adds ``1/limit`` (about +1 per limit's worth of requests);
* a request waits for a free slot before each try (the retry's backoff sleeps hold no slot).

A stream (a download) does not hold a slot while its consumer reads it: it is admitted (waits
for a free slot) before each open and reports a throttling answer like any request.

Off: ``store.pacing = None`` (every request only retries, as before).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ..errors import TransientError

__all__ = ["Pacer", "is_throttling"]

T = TypeVar("T")

#: how S3, GCS (and the scale simulator's store) say "slow down", as the backends' error
#: messages carry them (``SlowDown (HTTP 503)``, ``HTTP 429: ...``)
_THROTTLING_MARKS = (
    "slowdown",
    "http 503",
    "http 429",
    "throttl",
    "toomanyrequests",
    "requestlimitexceeded",
    "ratelimitexceeded",
    "503 slow down",
)


def is_throttling(exc: BaseException) -> bool:
    """Is ``exc`` the store telling this client to send fewer requests (not any 5xx)?"""
    if not isinstance(exc, TransientError):
        return False
    text = str(exc).lower()
    return any(mark in text for mark in _THROTTLING_MARKS)


class Pacer:
    """An AIMD limit on concurrent requests. Thread-safe.

    Args:
        limit: the starting (and highest) limit: high enough not to slow an unthrottled rank.
        minimum: the limit never drops below this.
        decrease: factor applied on a throttling answer.

    Attributes (counts, for metrics and tests):
        throttled: throttling answers seen.
        decreases: times the limit was cut.
        waits: requests that had to wait for a slot.
    """

    def __init__(self, *, limit: float = 64.0, minimum: float = 1.0, decrease: float = 0.5) -> None:
        if not 1 <= minimum <= limit or not 0 < decrease < 1:
            raise ValueError(
                f"need 1 <= minimum <= limit and 0 < decrease < 1, got {minimum}, {limit}, {decrease}"
            )
        self.maximum = float(limit)
        self.minimum = float(minimum)
        self.decrease = decrease
        self._limit = float(limit)
        self._in_flight = 0
        self._epoch = 0  # bumped by every decrease
        self._cond = threading.Condition()
        self.throttled = 0
        self.decreases = 0
        self.waits = 0

    @property
    def limit(self) -> float:
        with self._cond:
            return self._limit

    def acquire(self) -> int:
        """Wait for a slot; returns the epoch the request starts in (for :meth:`release`)."""
        with self._cond:
            if self._in_flight >= int(self._limit):
                self.waits += 1
            while self._in_flight >= int(self._limit):
                self._cond.wait()
            self._in_flight += 1
            return self._epoch

    def release(self, epoch: int, *, throttled: bool) -> None:
        with self._cond:
            self._in_flight -= 1
            self._feedback(epoch, throttled, self._in_flight + 1)
            self._cond.notify_all()

    def admit(self) -> int:
        """Wait until a slot is free without holding it (a stream's open); returns the epoch."""
        with self._cond:
            if self._in_flight >= int(self._limit):
                self.waits += 1
            while self._in_flight >= int(self._limit):
                self._cond.wait()
            return self._epoch

    def report(self, epoch: int, *, throttled: bool) -> None:
        """The outcome of an admitted (not slot-holding) request."""
        with self._cond:
            self._feedback(epoch, throttled, self._in_flight + 1)
            self._cond.notify_all()

    @property
    def epoch(self) -> int:
        """The epoch a request starting now begins in (bumped by every decrease)."""
        with self._cond:
            return self._epoch

    def feedback(self, epoch: int, *, throttled: bool, in_flight: int) -> None:
        """The outcome of a request that the caller admitted itself: a caller that keeps its own
        count of requests in flight and its own clock (the scale simulator, whose concurrent
        requests of one rank are virtual lanes of one thread) reads :attr:`limit` and
        :attr:`epoch`, waits for a slot on its own clock, and reports here with the number of
        its requests in flight then (this one included). The AIMD arithmetic is the one
        :meth:`release` applies to requests of real threads."""
        if in_flight < 1:
            raise ValueError(f"in_flight counts the request itself, got {in_flight}")
        with self._cond:
            self._feedback(epoch, throttled, in_flight)
            self._cond.notify_all()

    def _feedback(self, epoch: int, throttled: bool, flight: int) -> None:
        if throttled:
            self.throttled += 1
            if epoch == self._epoch:  # requests sent before the last cut do not cut again
                self._limit = max(self.minimum, min(self._limit, float(flight)) * self.decrease)
                self._epoch += 1
                self.decreases += 1
        else:
            self._limit = min(self.maximum, self._limit + 1.0 / self._limit)

    def wrap(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` holding a slot for each call (each try of a retried request)."""

        def paced(*args: object) -> T:
            epoch = self.acquire()
            throttled = False
            try:
                return fn(*args)
            except BaseException as exc:
                throttled = is_throttling(exc)
                raise
            finally:
                self.release(epoch, throttled=throttled)

        return paced
