"""The one retry policy: only :class:`TransientError` is retried, with jittered exponential
backoff, under an overall deadline. Backends never retry on their own (SDK retries are turned
off), so a request is retried by exactly one layer and the deadline means what it says."""

from __future__ import annotations

import logging
import random
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
        deadline: seconds after the first try after which no new try starts.
        max_attempts: total tries of one request, the first included.
        initial_backoff: the first wait's upper bound (full jitter), doubling each retry.
        max_backoff: cap on one wait.
    """

    deadline: float = 120.0
    max_attempts: int = 10
    initial_backoff: float = 0.1
    max_backoff: float = 5.0

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

        Raises the last error once the attempts or the deadline run out; any other exception
        propagates at once.
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
        return retrying(fn, *args, **kwargs)
