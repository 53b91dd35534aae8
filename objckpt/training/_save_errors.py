"""``on_save_error``: what a save that did not commit does to the training loop.

:class:`SaveErrorPolicy` is separate from :class:`~objckpt.training.manager.CheckpointManager`
because the decision spans four places -- ``save``, the background thread of ``save_async``, the
next save that settles the one in flight, and ``close`` -- and must be made the same way in
each: ``"raise"`` passes the error on; ``"warn"`` logs it loudly (with the last valid checkpoint
and how long ago it was committed, which is the one piece of state the policy keeps) and
training goes on. Only save
failures the next checkpoint can overcome are tolerated (:func:`is_save_failure`); errors in the
state itself, disagreeing or missing ranks and abandons are raised either way.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..errors import CommitError, SaveAbandonedError, StoreError
from ..manifest import Manifest

if TYPE_CHECKING:
    from .background import BackgroundSaver

__all__ = ["ON_SAVE_ERROR", "RAISE", "WARN", "SaveErrorPolicy", "commit_time", "is_save_failure"]

log = logging.getLogger("objckpt.training")

#: what a failed save does to the training loop (``on_save_error``)
RAISE, WARN = "raise", "warn"
ON_SAVE_ERROR = (RAISE, WARN)


def is_save_failure(exc: BaseException) -> bool:
    """A save that did not commit for a reason the next checkpoint can overcome (a store error,
    a failed rank upload, commit checks); not a programming error, a dead rank or an abandon."""
    return isinstance(exc, (CommitError, StoreError)) and not isinstance(exc, SaveAbandonedError)


def commit_time(manifest: Manifest) -> float:
    """Epoch seconds of ``manifest``'s commit (now, when it does not say)."""
    from datetime import datetime

    try:
        return datetime.fromisoformat(manifest.created_at.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


class SaveErrorPolicy:
    """Applies ``on_save_error`` (``"raise"`` or ``"warn"``, validated by the caller) on one rank.

    Every rank gets the same save outcome, so every rank decides alike and all go on (or raise)
    together. Nothing here issues a collective or raises.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        #: (step, epoch seconds of its commit) of the last checkpoint known valid on this rank
        self.last_valid: tuple[int, float] | None = None

    def tolerates(self, exc: BaseException) -> bool:
        """``exc`` is logged, not raised: ``on_save_error="warn"`` and a save failure."""
        return self.mode == WARN and is_save_failure(exc)

    def settle(self, background: BackgroundSaver) -> BaseException | None:
        """Wait for the in-flight save_async; its unseen error, unless ``on_save_error="warn"``
        already reported it (then it is marked seen and training goes on)."""
        pending = background.settle()
        if pending is not None and self.tolerates(pending):
            handle = background.last
            if handle is not None:
                handle._observed = True
            return None
        if pending is None and background.last is not None and background.last.done():
            manifest = background.last._manifest
            if manifest is not None:
                self.last_valid = (manifest.step, commit_time(manifest))
        return pending

    def warn_failed(self, step: int, exc: BaseException) -> None:
        """Log loudly that ``step`` did not commit and what is at risk."""
        last = self.last_valid
        if last is None:
            since = "no checkpoint of this run has been committed or restored yet: everything trained so far is at risk"
        else:
            since = f"the last valid checkpoint is step {last[0]}, committed {max(0.0, time.time() - last[1]):.0f} s ago"
        log.error(
            "CHECKPOINT NOT SAVED: step %d did not commit (%s: %s); training goes on (on_save_error='warn') and "
            "the next due checkpoint tries again; %s",
            step,
            type(exc).__name__,
            exc,
            since,
        )
