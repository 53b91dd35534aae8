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
import queue
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

#: a worker with nothing to do for this long exits (a manager never closed leaves no thread
#: behind); the next save starts a new one
_IDLE_EXIT_S = 300.0


class BackgroundSaver:
    """Runs asynchronous saves, one at a time, on ``comm`` (the background channel)."""

    def __init__(self, session: SaveSession, comm: Comm) -> None:
        self.session = session
        self.comm = comm
        #: the last save that ran (finished or not)
        self.last: SaveHandle | None = None
        # One worker thread for the manager's life, started by the first save: handing a save
        # to a thread that is already running is a queue put, where starting a thread per save
        # made save_async wait until the new thread ran (Thread.start), milliseconds on a busy
        # host, inside the time the training loop is blocked.
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()  # the worker's start and its exit when idle
        self._idle = threading.Event()
        self._idle.set()

    @property
    def busy(self) -> bool:
        """A save is still in flight on this rank."""
        return not self._idle.is_set()

    def settle(self) -> BaseException | None:
        """Wait for the in-flight save, if any. Returns its error when no one has seen it yet
        (not marked seen): the caller raises it, or reports it to the other ranks."""
        self._idle.wait()
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
        """Upload ``cap`` (already staged) and commit it on the worker thread; ``finish`` is the
        manager's call of :meth:`SaveSession.finish` with the manifest's contents. The caller
        has settled the previous save (one in flight at most)."""
        self.last = handle
        self._idle.clear()
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._serve,
                    name="objckpt-save",
                    # daemon: a job that exits without close() must not hang at interpreter exit
                    # on a collective with ranks that are gone; that save is simply never committed
                    daemon=True,
                )
                self._worker.start()
            self._jobs.put((handle, ticket, cap, stage_error, finish))

    def close(self) -> None:
        """Stop the worker thread once the in-flight save is done; idempotent. A save started
        after this runs on a new worker."""
        with self._lock:
            worker, self._worker = self._worker, None
            if worker is not None:
                self._jobs.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:  # start() queues under this lock: nothing can slip in now
                    if self._jobs.empty():  # close() always queues a None: it is not closing
                        if self._worker is threading.current_thread():
                            self._worker = None
                        return
                continue
            if job is None:
                return
            try:
                self._run(*job)
            finally:
                del job  # the staged trees and the handle go with the save, not with the thread
                self._idle.set()

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
