"""The per-thread time budget that nested store requests share (:func:`time_budget`).

Its own module, with its own ``time`` global: the scale simulator replaces that global with its
virtual clock (``objckpt.testing.scale.clock.PATCHED_MODULES``), so a budget measured here runs
on the simulated clock. ``objckpt.store.base`` re-exports both functions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .._retry import RetryPolicy

#: the time budget of the request in progress on this thread (an absolute ``time.monotonic()``
#: deadline), shared by every store: a request made while another is being retried (GCS's
#: cleanup inside a compose, the pointer's compare-and-swap rounds) gets what remains of it
_budget = threading.local()


def budget_remaining() -> float | None:
    """Seconds left of the innermost :func:`time_budget` on this thread, or ``None``."""
    deadline = getattr(_budget, "deadline", None)
    return None if deadline is None else deadline - time.monotonic()


def within_budget(policy: RetryPolicy) -> RetryPolicy:
    """``policy`` with its deadline cut down to what remains of the innermost
    :func:`time_budget` on this thread (rounded to 0.1 s, never negative); ``policy`` itself when
    no budget is set or the budget leaves more than its deadline. The one place a request's (and
    a stream's resumes') retry budget is cut."""
    left = budget_remaining()
    if left is not None and left < policy.deadline:
        return dataclasses.replace(policy, deadline=round(max(0.0, left), 1))
    return policy


@contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Every store request made on this thread inside the block shares one time budget of
    ``seconds`` (or what remains of an enclosing budget, if less): each request's retry policy
    is cut down to what is left, so a loop of requests (compare-and-swap rounds, a cleanup
    inside a publish) ends within the budget however many requests it makes. A request whose
    budget is spent still gets its one first try."""
    previous = getattr(_budget, "deadline", None)
    deadline = time.monotonic() + max(0.0, seconds)
    _budget.deadline = deadline if previous is None else min(previous, deadline)
    try:
        yield
    finally:
        _budget.deadline = previous


__all__ = ["budget_remaining", "time_budget", "within_budget"]
