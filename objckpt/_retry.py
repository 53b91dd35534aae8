"""The one retry policy: only :class:`TransientError` is retried, with jittered exponential
backoff, under a **time budget** (invariant 3): a burst of throttling or an outage shorter than the
budget never fails a request. Backends never retry on their own (SDK retries are turned off), so a
request is retried by exactly one layer and the deadline means what it says.

The attempt count is only a safety cap: by default it is far above what the deadline allows, so
it never ends the budget early (with at most ``max_backoff`` between tries, the default 120 s
budget takes about 50 tries; the cap is 1,000).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from .errors import TransientError

T = TypeVar("T")
log = logging.getLogger("objckpt.retry")


@dataclass(frozen=True)
class RetryPolicy:
    """How transient store errors are retried.

    Attributes:
        deadline: the time budget: seconds after a request's first try after which no new try
            starts. The default survives a 60 s outage of the store.
        max_attempts: a safety cap on the tries of one request, the first included; the default
            never ends the time budget early.
        initial_backoff: the first wait's upper bound (full jitter), doubling each retry.
        max_backoff: cap on one wait.
    """

    deadline: float = 120.0
    max_attempts: int = 1000
    initial_backoff: float = 0.1
    max_backoff: float = 5.0

    def exhausted(self, exc: BaseException, tries: int, elapsed: float) -> BaseException:
        """``exc`` with the spent budget in its message: what a user needs to judge an outage."""
        note = (
            f" (gave up after {tries} tr{'y' if tries == 1 else 'ies'} over {elapsed:.1f} s "
            f"of a {self.deadline:g} s retry budget; raise deadline= to ride out longer outages)"
        )
        if isinstance(exc, TransientError) and note not in str(exc):
            exc._set_message(str(exc) + note)
        return exc

    def backoff(self, attempt: int) -> float:
        """A full-jitter wait before retry number ``attempt`` (1-based)."""
        return random.uniform(0, min(self.max_backoff, self.initial_backoff * 2 ** (attempt - 1)))

    def call(
        self,
        fn: Callable[..., T],
        *args: object,
        on_retry: Callable[[BaseException, int], None] | None = None,
        **kwargs: object,
    ) -> T:
        """Run ``fn(*args, **kwargs)``, retrying on :class:`TransientError` only.

        Raises the last error once the time budget (or the safety cap on attempts) runs out, with
        the spent budget in its message; any other exception propagates at once.
        """

        def before_sleep(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.info("retrying after transient error (try %d): %s", state.attempt_number, exc)
            if on_retry is not None and exc is not None:
                on_retry(exc, state.attempt_number)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(TransientError),
            wait=tenacity.wait_random_exponential(multiplier=self.initial_backoff, max=self.max_backoff),
            stop=tenacity.stop_after_attempt(self.max_attempts) | tenacity.stop_after_delay(self.deadline),
            before_sleep=before_sleep,
            reraise=True,
        )
        started = time.monotonic()
        try:
            return retrying(fn, *args, **kwargs)
        except TransientError as exc:
            tries = retrying.statistics.get("attempt_number", 1)
            # keep the error's own cause (the SDK exception it was mapped from), not tenacity's
            raise self.exhausted(exc, tries, time.monotonic() - started) from exc.__cause__
