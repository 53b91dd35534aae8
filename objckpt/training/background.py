"""The background half of ``CheckpointManager.save_async``: one save in flight, never lost.

The training thread captures the state, agrees on the step and attempt with the other ranks (the
save session's handshake, on the checkpoint group), copies its share into the reusable staging
buffer (:mod:`.staging`) and hands the staged copy to :class:`BackgroundSaver`. A thread then
encodes and uploads it and runs the session's commit on a gloo group of its own (collectives on
one group must be issued in the same order on every rank; a thread sharing the training thread's
group could not promise that).

At most one save is in flight: the next save waits for it (:meth:`BackgroundSaver.settle`). Its
outcome -- committed, or the same error on every rank -- is delivered by the
:class:`~objckpt.training.staging.SaveHandle`; an error nobody looked at is raised by the next
``save``/``save_async``/``close`` instead, so it is never lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ..coordination.comm import Comm
from ..coordination.save import SaveSession, SaveTicket
from ..errors import SaveAbandonedError
from ..manifest import Manifest
from . import shards
from .staging import SaveHandle

__all__ = ["BackgroundSaver"]

log = logging.getLogger("objckpt.training")


class BackgroundSaver:
    """Runs asynchronous saves, one at a time, on ``comm`` (the background channel)."""

    def __init__(self, session: SaveSession, comm: Comm) -> None:
        self.session = session
        self.comm = comm
        #: the last save that ran (finished or not) and the thread running it
        self.last: SaveHandle | None = None
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A save is still in flight on this rank."""
        return self._thread is not None and self._thread.is_alive()

    def settle(self) -> BaseException | None:
        """Wait for the in-flight save, if any. Returns its error when no one has seen it yet
        (not marked seen): the caller raises it, or reports it to the other ranks."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        return self.last._unobserved_error() if self.last is not None else None

    def start(
        self,
        handle: SaveHandle,
        ticket: SaveTicket,
        cap: shards.Capture,
        *,
        stage_error: BaseException | None,
        finish: Callable[[SaveTicket, shards.Capture, Mapping[str, Any]], Manifest],
    ) -> None:
        """Upload ``cap`` (already staged) and commit it in a new thread; ``finish`` is the
        manager's call of :meth:`SaveSession.finish` with the manifest's contents."""
        thread = threading.Thread(
            target=self._run,
            args=(handle, ticket, cap, stage_error, finish),
            name=f"objckpt-save-{ticket.step}",
            # daemon: a job that exits without close() must not hang at interpreter exit on a
            # collective with ranks that are gone; that save is simply never committed
            daemon=True,
        )
        self.last, self._thread = handle, thread
        thread.start()

    def _run(
        self,
        handle: SaveHandle,
        ticket: SaveTicket,
        cap: shards.Capture,
        stage_error: BaseException | None,
        finish: Callable[[SaveTicket, shards.Capture, Mapping[str, Any]], Manifest],
    ) -> None:
        abandon = handle._abandon
        step = ticket.step
        try:
            if stage_error is not None:
                ticket.fail(f"staging failed: {type(stage_error).__name__}: {stage_error}")
            else:
                assert ticket.writer is not None
                try:
                    shards.write(ticket.writer, cap, abandon)
                except shards.Abandoned:
                    ticket.abandon()
                except Exception as exc:  # noqa: BLE001 - reported to the coordinator
                    log.error("rank %d failed to write its shards for step %d: %s", ticket.rank, step, exc)
                    ticket.fail(exc)
            if abandon.is_set():
                ticket.abandon()

            def last_look(reports: list[dict[str, Any]]) -> None:
                # Rank 0's last look at its own abandon request: after this the commit goes on.
                if abandon.is_set() and not reports[0].get("abandoned"):
                    ranks = [0] + [r for r, rep in enumerate(reports) if rep.get("abandoned")]
                    raise SaveAbandonedError(
                        f"step {step} attempt {ticket.attempt} was abandoned before it was committed; "
                        "no manifest was written",
                        {r: "abandoned (close(abandon=True))" for r in ranks},
                    )

            manifest = finish(ticket, cap, {"comm": self.comm, "check_reports": last_look})
        except BaseException as exc:  # noqa: BLE001 - the handle's outcome; never lost
            if isinstance(exc, SaveAbandonedError):
                log.warning("save of step %d abandoned: %s", step, exc)
            else:
                log.error("background save of step %d failed: %s", step, exc)
            handle._finish(error=exc)
            return
        finally:
            # drop the staged trees (views of the reused buffer) and the encodings
            cap.replicated_tree = None
            cap.local_tree = {}
        handle._finish(manifest=manifest)
