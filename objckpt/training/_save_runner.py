"""One checkpoint save on this rank: ``CheckpointManager.save`` and ``save_async`` run here.

:class:`SaveRunner` is separate from the manager, which decides *whether* and *when* to save
(``every``, a closed manager, the user documentation), because the two save paths share their
steps and must run them identically:

1. :meth:`SaveRunner.capture` -- what this rank writes (:func:`.shards.capture`: its share of the
   replicated state, its per-rank state, RNG), with the manager's dedup and compression settings;
   an error is kept, not raised, so that every rank raises it together after the handshake;
2. :meth:`SaveRunner.begin` -- the save session's handshake (step, attempt, replicated layout);
3. writing the shards: :meth:`SaveRunner.save` streams them from the live tensors on the
   training thread; :meth:`SaveRunner.save_async` copies them into the staging buffer
   (:mod:`.staging`) and leaves the upload to the background thread (:mod:`.background`);
4. :meth:`SaveRunner.finish` -- the receipts, rank 0's commit and the one outcome on every rank.

A save that did not commit is handled by the manager's :class:`~._save_errors.SaveErrorPolicy`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..coordination.save import SaveSession, SaveTicket
from ..errors import SaveAbandonedError, TrainingStateError
from ..manifest import Manifest
from . import shards
from ._save_errors import SaveErrorPolicy
from .background import BackgroundSaver
from .codec import CompressionPolicy
from .staging import SaveHandle, StagingArea

__all__ = ["SaveRunner"]

log = logging.getLogger("objckpt.training")


def _not_replicated(name: str, rank: int, first: Any, mine: Any) -> Exception:
    first, mine = dict(first or {}), dict(mine or {})
    names = sorted(n for n in set(first) | set(mine) if first.get(n) != mine.get(n))
    return TrainingStateError(
        f"state {names} is not replicated: rank {rank} holds tensors of other names or "
        "shapes than rank 0. Pass replicated=() (or the names that really are identical "
        "on every rank) to CheckpointManager"
    )


class SaveRunner:
    """Runs this rank's part of every save over ``saves`` (and its communicator), one at a time.

    ``background`` runs the asynchronous saves' second half; ``staging`` holds their copy;
    ``errors`` decides what a failed save does and learns every commit (the last valid
    checkpoint); ``compression`` learns the upload bandwidth of every save (what
    ``compression="auto"`` weighs its codecs against).
    """

    def __init__(
        self,
        saves: SaveSession,
        background: BackgroundSaver,
        staging: StagingArea,
        errors: SaveErrorPolicy,
        *,
        replicated: frozenset[str] | None,
        dedup: bool,
        compression: CompressionPolicy,
        metadata: Mapping[str, Any],
    ) -> None:
        self.saves = saves
        self.background = background
        self.staging = staging
        self.errors = errors
        self.rank = saves.comm.rank
        self.world_size = saves.comm.world_size
        self.replicated = replicated
        self.dedup = dedup
        self.compression = compression
        self.metadata = metadata
        #: bytes written by this rank (and reused from the parent instead) and seconds taken by
        #: the last save
        self.last_save: dict[str, Any] = {}

    def save(
        self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None
    ) -> Manifest | None:
        """``CheckpointManager.save`` of a due step on an open manager (see there): the
        committed manifest, or None when ``on_save_error="warn"`` tolerated the failure."""
        started = time.monotonic()
        pending = self.errors.settle(self.background)
        cap, error = self.capture(step, state)
        ticket = self.begin(step, cap, error, pending, kind="save", busy=False)
        assert cap is not None and ticket.writer is not None
        try:
            shards.write(ticket.writer, cap)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, raised everywhere
            log.error("rank %d failed to write its shards for step %d: %s", self.rank, step, exc)
            ticket.fail(exc)
        try:
            manifest = self.finish(ticket, cap, {}, metadata)
        except Exception as exc:
            if self.errors.tolerates(exc):
                self.errors.warn_failed(step, exc)  # the same error on every rank: all go on alike
                return None
            raise
        self._record(step, cap, started)
        return manifest

    def _record(self, step: int, cap: shards.Capture, started: float, **extra: float) -> None:
        """What :attr:`CheckpointManager.last_save` reports of the save that just committed."""
        self.last_save = {
            "step": step,
            "bytes": cap.bytes_written,
            "reused_bytes": cap.reused_bytes,
            "seconds": time.monotonic() - started,
            **extra,
        }

    def save_async(
        self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None, *, skip: bool
    ) -> SaveHandle:
        """``CheckpointManager.save_async`` of a due step on an open manager (see there);
        ``skip``: policy ``"skip"`` (else ``"wait"``)."""
        started = time.monotonic()
        busy = skip and self.background.busy
        pending = None if busy else self.errors.settle(self.background)
        cap, error = self.capture(step, state)
        plan = None
        if cap is not None and error is None:
            try:
                plan = self.staging.plan(cap.trees, what=f"save_async(step={step})")
            except Exception as exc:  # noqa: BLE001 - every rank raises the same error after the handshake
                error = exc
        ticket = self.begin(step, cap, error, pending, kind="save_async", busy=busy)
        if ticket.skip:
            log.warning(
                "save_async(step=%d) skipped: the previous save is still in flight on %s (policy='skip')",
                step,
                "this rank" if busy else "another rank",
            )
            return SaveHandle(
                step, skipped=True, reason="the previous save was still in flight (policy='skip')"
            )
        assert cap is not None and plan is not None
        handle = SaveHandle(step, attempt=ticket.attempt, staged_bytes=plan.nbytes)
        stage_error: Exception | None = None
        try:
            cap.replicated_tree, cap.local_tree = self.staging.stage(plan)
        except Exception as exc:  # noqa: BLE001 - reported by the background thread, so all ranks agree
            log.error("rank %d failed to stage step %d: %s", self.rank, step, exc)
            stage_error = exc
        del plan  # the plan references the live tensors; the background thread must not
        handle.blocking_seconds = time.monotonic() - started

        def finish(t: SaveTicket, c: shards.Capture, options: Mapping[str, Any]) -> Manifest:
            try:
                manifest = self.finish(t, c, options, metadata, blocking=handle.blocking_seconds)
            except Exception as exc:
                if self.errors.tolerates(exc):
                    self.errors.warn_failed(step, exc)
                raise
            self._record(step, c, started, blocking_seconds=handle.blocking_seconds)
            return manifest

        self.background.start(handle, ticket, cap, stage_error=stage_error, finish=finish)
        return handle

    def settle_for_close(self, *, abandon: bool) -> BaseException | None:
        """Finish the in-flight save (cancel it with ``abandon``); the error ``close`` raises:
        the last save's unseen one, unless ``abandon`` (logged) or tolerated (logged already)."""
        handle = self.background.last
        if abandon and handle is not None and self.background.busy:
            handle.abandon()
        error = self.background.settle()
        if error is not None:
            assert handle is not None
            handle._observed = True
            if abandon:
                if not isinstance(error, SaveAbandonedError):
                    log.warning("the abandoned save of step %d had failed: %s", handle.step, error)
                error = None
        elif abandon and handle is not None and handle.abandon_requested and handle.committed:
            log.info("save of step %d was committed before the abandon request took effect", handle.step)
        if error is not None and self.errors.tolerates(error):
            error = None  # logged loudly when it happened (on_save_error="warn")
        return error

    def capture(self, step: int, state: Mapping[str, Any]) -> tuple[shards.Capture | None, Exception | None]:
        """What this rank writes for ``step``, or the error that prevents it (not raised)."""
        try:
            cap = shards.capture(
                step, state, rank=self.rank, world_size=self.world_size, replicated_names=self.replicated
            )
            cap.dedup, cap.compression = self.dedup, self.compression
            return cap, None
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error after the handshake
            return None, exc

    def begin(
        self,
        step: int,
        cap: shards.Capture | None,
        error: Exception | None,
        pending: BaseException | None,
        *,
        kind: str,
        busy: bool,
    ) -> SaveTicket:
        """The handshake (a collective); raises what any rank's ``error`` or ``pending`` is,
        marking ``pending`` seen when it is the one raised."""
        try:
            return self.saves.begin(
                step,
                kind=kind,
                error=error,
                pending=pending,
                busy=busy,
                agree_on={"digests": cap.digests} if cap else {},
                on_disagree=_not_replicated,
            )
        except BaseException as exc:
            if pending is not None and exc is pending:
                handle = self.background.last
                if handle is not None:
                    handle._observed = True
            raise

    def finish(
        self,
        ticket: SaveTicket,
        cap: shards.Capture,
        options: Mapping[str, Any],
        metadata: Mapping[str, Any] | None,
        *,
        blocking: float | None = None,
    ) -> Manifest:
        """Gather the receipts and commit (a collective); the committed manifest, the same on
        every rank, or the save's error, raised on every rank (see ``SaveSession.finish``)."""
        ticket.references.extend(cap.references)
        started = time.monotonic()
        try:
            return self._commit(ticket, cap, options, metadata, blocking)
        finally:
            if cap.bytes_written and ticket.started:
                # the upload bandwidth compression="auto" weighs its codecs against
                self.compression.bandwidth = cap.bytes_written / max(1e-6, started - ticket.started)

    def _commit(
        self,
        ticket: SaveTicket,
        cap: shards.Capture,
        options: Mapping[str, Any],
        metadata: Mapping[str, Any] | None,
        blocking: float | None,
    ) -> Manifest:
        manifest = self.saves.finish(
            ticket,
            progress=cap.progress,
            topology=cap.topology(),
            metadata={**self.metadata, **dict(metadata or {})},
            blocking_seconds=blocking,
            **options,
        )
        self.errors.last_valid = (manifest.step, time.time())
        return manifest
