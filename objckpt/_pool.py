"""Run a few calls at once on threads, results in order, and stop what has not started at the
first failure (the writers' pieces, the exchange's downloads)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["run_all"]

T = TypeVar("T")


def run_all(calls: Sequence[Callable[[], T]], at_once: int, name: str) -> list[T]:
    """The results of ``calls``, in order, ``at_once`` at a time on threads named ``name`` (on
    the calling thread, one after another, when ``at_once`` is 1).

    Raises the first failing call's error (in order); the calls not started by then are
    cancelled and those running are waited for, so nothing is left running."""
    if at_once <= 1 or len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(min(at_once, len(calls)), thread_name_prefix=name) as pool:
        futures = [pool.submit(call) for call in calls]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
