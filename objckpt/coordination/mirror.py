"""Multi-cloud durability: every committed checkpoint re-committed on a second run root (another
bucket, region or cloud) in the background, and restores that take the mirror's copy when the
primary cannot give one.

Writing (:class:`Mirror`, fed by :class:`MirroredSaveSession` on the coordinator):

* after each commit on the primary, rank 0 hands the manifest to the mirror and returns at once;
  one background thread re-commits it on the mirror **by the same protocol** a training job
  uses (:func:`mirror_checkpoint`: every shard streamed from the primary with its size and
  CRC32C verified, written create-if-absent under a fresh attempt on the mirror, the receipts
  compared, then :class:`~objckpt.commit.Coordinator` checks the mirror's objects itself, writes
  the manifest create-if-absent and moves the mirror's pointer forward by compare-and-swap), then
  applies the job's retention to the mirror;
* **bounded**: one replication in flight, at most one waiting. Back-pressure policy
  ``"latest"`` (default): a commit that arrives while one is waiting replaces it (the replaced
  step is not mirrored, counted as skipped), so the mirror always converges on the newest
  checkpoint and the training loop never waits -- except that a waiting step whose objects
  the new one reuses (deduplication) is never replaced: that commit waits for the slot, as
  under ``"wait"``, so every reference has a copy to name on the mirror; ``"wait"``: the committing thread waits until
  the waiting slot is free (every step mirrored, training slowed to the mirror's pace);
* a failed replication is logged loudly and counted; the next commit replicates a newer step;
* replication lag (seconds from the primary's commit to the mirror's) and the mirrored step
  are :class:`~objckpt.metrics.CheckpointMetrics` fields (``mirror_lag_seconds`` keeps growing
  while a commit waits, so an alert can fire on it).

Where a replica lands on the mirror follows the primary's lines: after the mirror's head when
that is a copy of an ancestor of the checkpoint (``metadata.replicated_from`` names the source
checkpoint), else on a new timeline of the mirror claimed from the newest copy of an ancestor
(a rollback on the primary becomes a rollback on the mirror at its next commit).

Reading: :class:`~objckpt.coordination.restore.RestoreSession` takes ``mirror=`` and consults it
on rank 0 only when the primary cannot give a checkpoint (see that module).

Deduplicated checkpoints (references to ancestors' objects) are mirrored by
:func:`objckpt.replicate.copy_checkpoint`, the copy procedure ``objckpt cp`` uses: only the
checkpoint's own shards are copied, its references become the mirror's references to the copies
of those objects, which the mirror's copy of the parent must hold or reference. When it does not
(a mirror added late, or one whose timelines are numbered differently from the primary's), that
replication fails loudly and is counted, and the mirror catches up with the next checkpoint it can
place.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from .. import layout
from ..errors import CommitError, IntegrityError
from ..gc import DEFAULT_GRACE_PERIOD, RetentionPolicy, retain
from ..history import History
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..reader import Reader
from ..replicate import copy_checkpoint
from ..store.base import Store
from ..timelines import claim_timeline
from .save import SaveSession

__all__ = [
    "MIRROR_POLICIES",
    "Mirror",
    "MirroredSaveSession",
    "mirror_checkpoint",
    "source_ref",
]

log = logging.getLogger("objckpt.mirror")

#: back-pressure policies (see the module doc)
MIRROR_POLICIES = ("latest", "wait")

#: the manifest metadata entry naming the checkpoint a replica was copied from
REPLICATED_FROM = "replicated_from"

Ref = tuple[int, int]


def source_ref(manifest: Manifest) -> Ref | None:
    """``(timeline, step)`` of the primary checkpoint ``manifest`` (a replica) was copied from,
    from its ``metadata.replicated_from``; ``None`` when it is not a replica. Copies made by
    :func:`objckpt.replicate.replicate` name no timeline: timeline 0."""
    origin = manifest.metadata.get(REPLICATED_FROM) if isinstance(manifest.metadata, Mapping) else None
    if not isinstance(origin, Mapping):
        return None
    step, timeline = origin.get("step"), origin.get("timeline", 0)
    if isinstance(step, int) and isinstance(timeline, int) and not isinstance(step, bool):
        return (timeline, step)
    return None


def source_checksum(manifest: Manifest) -> str | None:
    origin = manifest.metadata.get(REPLICATED_FROM) if isinstance(manifest.metadata, Mapping) else None
    checksum = origin.get("checksum") if isinstance(origin, Mapping) else None
    return checksum if isinstance(checksum, str) else None


def mirror_checkpoint(
    primary: Store,
    manifest: Manifest,
    mirror: Store,
    *,
    progress: Callable[[int], None] | None = None,
) -> tuple[Manifest, bool]:
    """Re-commit ``manifest`` (committed on ``primary``) on ``mirror``; returns the mirror's
    manifest and whether anything was copied (``False``: the mirror already had this copy).

    Atomicity: as a save's: the mirror gains the checkpoint exactly when its manifest is
    written. A failure leaves only the fresh attempt's shards (deleted best-effort here, else
    swept by GC after its grace period) and the mirror's previous checkpoints untouched.

    Raises:
        NoCheckpointError: the checkpoint reuses objects of its ancestors (deduplication) that
            the mirror's copy of its parent neither holds nor references (the parent was not
            mirrored: a mirror added late); the next
            checkpoint that the mirror can place tries again.
        ChecksumMismatchError: a primary shard does not match its receipt (nothing committed).
        CommitError: the mirror's commit checks failed, or no place on the mirror's lines fits.
        StoreError: either store failed past its retry budget.
    """
    timeline, after, existing = _placement(primary, manifest, mirror)
    if existing is not None:
        return existing, False
    provenance = {
        "location": primary.location,
        "timeline": manifest.timeline,
        "step": manifest.step,
        "attempt": manifest.attempt,
        "checksum": manifest.checksum,
    }
    committed = copy_checkpoint(
        primary, manifest, mirror, timeline=timeline, after=after, provenance=provenance, progress=progress
    )
    return committed, True


def _placement(primary: Store, manifest: Manifest, mirror: Store) -> tuple[int, Ref | None, Manifest | None]:
    """``(timeline, after, existing)`` for the replica of ``manifest`` on ``mirror``: the mirror
    timeline to commit on and the mirror checkpoint it continues from, or the mirror's existing
    copy of this very checkpoint."""
    dst = Reader(mirror)
    head = dst.head()
    if head.key is None or head.ref is None:
        return 0, None, None
    ancestry = History(primary).line(manifest.timeline)

    def is_ancestor(m: Manifest) -> bool:
        src = source_ref(m)
        return src is not None and src[1] < manifest.step and ancestry.contains(src)

    head_manifest = dst.fetch(head.key)
    if source_checksum(head_manifest) == manifest.checksum:
        return head.timeline, head.ref, head_manifest  # mirrored already (a retried submission)
    if head.ref[1] < manifest.step and is_ancestor(head_manifest):
        return head.timeline, head.ref, None
    # The mirror's head is not an ancestor (a rollback on the primary, or skipped steps): the
    # newest copy of an ancestor on the mirror's line becomes the base of a new mirror timeline.
    for t, s in dst.line():
        try:
            candidate = dst.fetch(layout.manifest_key(s, t))
        except IntegrityError:
            continue  # a damaged manifest on the mirror: not a base
        if source_checksum(candidate) == manifest.checksum:
            return t, (t, s), candidate
        if is_ancestor(candidate):
            claim = claim_timeline(mirror, candidate, reason="mirror")
            return claim.timeline, candidate.ref, None
    if head.ref[1] < manifest.step:
        # No copy of any ancestor (the mirror was added late, or every ancestor was skipped):
        # continue the mirror's head line; the replica's content is what was committed.
        return head.timeline, head.ref, None
    raise CommitError(
        f"cannot place step {manifest.label} on {mirror.location}: the mirror holds step {head.ref[1]} "
        "and no copy of an ancestor of this checkpoint"
    )


class Mirror:
    """Replicates committed checkpoints of ``primary`` to ``mirror`` in the background.

    Args:
        primary: the run root the job commits to.
        mirror: the second run root (must enforce create-if-absent and compare-and-swap).
        retention: applied to the mirror after each replica (``None``: keep everything).
        grace_period: GC's grace period on the mirror.
        metrics: fed with replication lag, mirrored steps, failures and skips.
        policy: ``"latest"`` or ``"wait"`` (see the module doc).

    Thread-safe. The worker thread starts with the first :meth:`submit` (on rank 0 only).
    """

    def __init__(
        self,
        primary: Store,
        mirror: Store,
        *,
        retention: RetentionPolicy | None = None,
        grace_period: timedelta = DEFAULT_GRACE_PERIOD,
        metrics: CheckpointMetrics | None = None,
        policy: str = "latest",
    ) -> None:
        if policy not in MIRROR_POLICIES:
            raise ValueError(f"mirror policy must be one of {MIRROR_POLICIES}, got {policy!r}")
        same = mirror.location == primary.location and not primary.location.startswith("memory://")
        if mirror is primary or same:
            raise ValueError(f"the mirror must be another run root than the primary ({primary.location})")
        self.primary = primary
        self.store = mirror
        self.retention = retention
        self.grace_period = grace_period
        self.metrics = metrics
        self.policy = policy
        self._cond = threading.Condition()
        self._pending: tuple[Manifest, float] | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        #: what the mirror did: mirrored (copied), already (present), skipped, failed
        self.counts = {"mirrored": 0, "already": 0, "skipped": 0, "failed": 0}
        #: the last replication's error (None after a success)
        self.last_error: BaseException | None = None
        #: the mirror's manifest of the newest checkpoint mirrored
        self.last: Manifest | None = None

    @property
    def location(self) -> str:
        return self.store.location

    def submit(self, manifest: Manifest, *, committed_at: float | None = None) -> None:
        """Queue ``manifest`` (just committed on the primary) for replication; returns at once
        (``policy="latest"``) or once the waiting slot is free (``"wait"``)."""
        committed_at = time.time() if committed_at is None else committed_at
        with self._cond:
            if self._closed:
                log.warning("mirror %s is closed: step %s is not mirrored", self.location, manifest.label)
                return
            if self.policy == "wait" or self._reuses_pending(manifest):
                # "latest" never drops a step whose objects the new one reuses (deduplication):
                # the new step's references would have no copy to name on the mirror, nor would
                # those of every later step; it waits for the slot instead (one replication)
                while self._pending is not None and not self._closed:
                    self._cond.wait()
            if self._pending is not None:
                replaced = self._pending[0]
                self.counts["skipped"] += 1
                log.warning(
                    "mirror %s is behind: step %s is replaced by step %s before it was copied "
                    "(policy='latest': the mirror converges on the newest checkpoint)",
                    self.location,
                    replaced.label,
                    manifest.label,
                )
                if self.metrics is not None:
                    self.metrics.record_mirror_skipped(replaced.step)
                committed_at = self._pending[1]  # the lag counts from the oldest unmirrored commit
            self._pending = (manifest, committed_at)
            if self.metrics is not None:
                self.metrics.record_mirror_pending(manifest.step, committed_at)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="objckpt-mirror", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _reuses_pending(self, manifest: Manifest) -> bool:
        pending = self._pending[0] if self._pending is not None else None
        return pending is not None and any(r.origin == pending.ref for r in manifest.references)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is in flight or waiting; ``False`` when ``timeout`` ran out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, *, wait: bool = True) -> None:
        """Stop the worker: ``wait=True`` lets the in-flight and the waiting replication finish
        first (each bounded by the stores' retry budgets); ``False`` drops the waiting one."""
        if wait:
            self.wait()
        with self._cond:
            self._closed = True
            if not wait and self._pending is not None:
                log.warning(
                    "mirror %s closed: step %s is not mirrored", self.location, self._pending[0].label
                )
                self._pending = None
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                manifest, committed_at = self._pending
                self._pending = None
                self._busy = True
                self._cond.notify_all()
            try:
                self._replicate(manifest, committed_at)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _replicate(self, manifest: Manifest, committed_at: float) -> None:
        started = time.monotonic()
        try:
            replica, copied = mirror_checkpoint(self.primary, manifest, self.store)
        except Exception as exc:  # noqa: BLE001 - logged loudly, counted; the next commit retries
            self.counts["failed"] += 1
            self.last_error = exc
            log.error(
                "MIRROR FAILED: step %s of %s was not replicated to %s: %s (the next commit replicates a "
                "newer step; restores fall back to the mirror only with what it holds)",
                manifest.label,
                self.primary.location,
                self.location,
                exc,
            )
            if self.metrics is not None:
                self.metrics.record_mirror_failure(manifest.step, exc)
            return
        self.counts["mirrored" if copied else "already"] += 1
        self.last_error = None
        self.last = replica
        lag = max(0.0, time.time() - committed_at)
        log.info(
            "mirrored step %s of %s to %s in %.1f s (replication lag %.1f s)",
            manifest.label,
            self.primary.location,
            self.location,
            time.monotonic() - started,
            lag,
        )
        if self.metrics is not None:
            self.metrics.record_mirror(manifest.step, lag_seconds=lag, bytes=manifest.total_size)
        if self.retention is not None:
            retain(self.store, self.retention, grace_period=self.grace_period)


class MirroredSaveSession(SaveSession):
    """A :class:`SaveSession` whose coordinator hands every commit to a :class:`Mirror`
    (``finish`` and DCP's ``commit`` both commit through :meth:`commit`, on rank 0 only)."""

    def __init__(self, store: Store, comm: Any, *, mirror: Mirror, **options: Any) -> None:
        super().__init__(store, comm, **options)
        self.mirror = mirror

    def commit(
        self, step: int, attempt: str, reports: Sequence[Mapping[str, Any]], **options: Any
    ) -> Manifest:
        manifest = super().commit(step, attempt, reports, **options)
        self.mirror.submit(manifest)
        return manifest


def save_session(store: Store, comm: Any, *, mirror: Mirror | None = None, **options: Any) -> SaveSession:
    """A :class:`SaveSession`, mirrored when ``mirror`` is given (what adapters construct)."""
    if mirror is None:
        return SaveSession(store, comm, **options)
    return MirroredSaveSession(store, comm, mirror=mirror, **options)
