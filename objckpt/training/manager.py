"""``CheckpointManager``: save and restore the whole training state, on one process or many.

::

    manager = CheckpointManager("s3://bucket/runs/eta", keep_last=3, every=100)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler,
             "progress": progress}
    start = manager.restore(state) or 0          # every rank calls; None: fresh start
    for step in range(start + 1, total + 1):
        train_one_step()
        manager.save(step, state)                 # every rank calls; saves when step % every == 0

The manager is a thin adapter over the coordination layer: :class:`~objckpt.coordination.SaveSession`
runs the multi-rank save protocol (handshake, attempt id, receipts, commit on rank 0, one outcome
on every rank, retention) and :class:`~objckpt.coordination.RestoreSession` the restore protocol
(resolve on rank 0, broadcast, stage on every rank, fall back together on damage, agree on the
step). What the manager adds is *what* is written (:mod:`.shards`: replicated state split across
ranks, per-rank state, RNG) and asynchronous saves (:mod:`.background`, :mod:`.staging`). This
module is the facade; each save runs in :mod:`._save_runner`, each restore and rollback in
:mod:`._restore_runner`, under the checks and wiring of :mod:`._manager_setup`,
:mod:`._manager_checks` and :mod:`._save_errors`.

Bitwise resume (invariant 14) holds for CPU runs with the same world size, given deterministic
collectives. One trap outside objckpt: DDP rebuilds its gradient-bucket layout after the first
iteration of every process, and with more than 2 ranks the all-reduce's float sum order depends
on the layout, so a restarted DDP job's first step differs in the last bits from the
uninterrupted job's. Pin the layout (``find_unused_parameters=True`` disables the rebuild) when
bitwise equality matters. Likewise give each ``DataLoader`` its own ``generator=``: it draws a
seed per iterator from the global torch RNG otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from ..coordination.roots import open_root
from ..defaults import GC_GRACE_PERIOD, HANDSHAKE_TIMEOUT, KEEP_LAST, TIMEOUT
from ..errors import SaveAbandonedError, StagingBudgetError
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..reader import Reader
from ..store import Store
from . import shards
from ._manager_checks import check_roots, hash_config, run_identity
from ._manager_setup import ASYNC_POLICIES, SKIP, WAIT, validate_options, wire_sessions
from ._restore_runner import RestoreRunner
from ._save_errors import RAISE, SaveErrorPolicy
from ._save_runner import SaveRunner
from .codec import CompressionPolicy
from .dist import make_comm
from .staging import SaveHandle, StagingArea
from .state import RestoreReport

__all__ = ["CheckpointManager", "SaveAbandonedError", "SaveHandle", "StagingBudgetError", "hash_config"]

log = logging.getLogger("objckpt.training")


class CheckpointManager:
    """Saves and restores training state under one run root.

    Construct it on every rank (under torch.distributed it creates three gloo process groups,
    which is a collective on the default group), after ``init_process_group``. Call
    :meth:`close` (or use it as a context manager) to finish an in-flight asynchronous save.

    Args:
        uri_or_store: run-root URI (``s3://bucket/run``, ``gs://...``, ``file:///...``) or a
            :class:`~objckpt.store.Store`.
        keep_last: committed checkpoints to keep (retention runs on rank 0 after each commit);
            ``None`` disables retention.
        keep_every: also keep every step divisible by this.
        every: :meth:`save` only saves when ``step % every == 0`` (unless ``force=True``).
        config_hash: recorded in the manifest's run identity (see :func:`hash_config`); a restore
            under another hash logs a warning.
        dataset_snapshot: dataset snapshot id recorded in the run identity.
        replicated: names of ``state`` entries identical on every rank, written once across
            ranks. Default: every ``nn.Module`` and optimizer (data parallelism). Pass ``()`` to
            write everything per rank (e.g. models that differ per rank).
        timeout: seconds a rank waits for the others after transfers (must exceed the slowest
            rank's upload).
        handshake_timeout: seconds a rank waits for the others to enter save/restore; a save
            called by rank 0 only raises :class:`DistributedError` after this long.
        gc_grace_period: unreferenced attempt data younger than this is never collected (must
            exceed the longest save).
        metadata: free-form JSON recorded in every manifest.
        max_staging_bytes: the most host memory :meth:`save_async` may stage on this rank.
            Default ``None``: no limit; the staging buffer is then as large as this rank's share
            of the state, allocated by the first ``save_async``, reused by every later one and
            freed by :meth:`close`. A state that needs more raises :class:`StagingBudgetError`
            on every rank before anything is staged. :meth:`save` never stages.
        async_policy: what :meth:`save_async` does while the previous save is still in flight:
            ``"wait"`` (default) blocks until it is over; ``"skip"`` saves nothing, logs a
            warning and returns a handle with ``skipped=True``.
        metrics: a :class:`~objckpt.metrics.CheckpointMetrics` fed with every save, restore,
            retry and validation failure (``None``: no metrics, no cost).
        on_save_error: what a save that did not commit (a store outage past the retry budget, a
            rank's failed upload, failed commit checks) does to the training loop. ``"raise"``
            (default): :meth:`save` raises it, and a failed :meth:`save_async` raises from its
            handle or the next ``save``/``save_async``/``close``. ``"warn"``: it is logged loudly
            (ERROR, with the last valid checkpoint and how long ago it was committed), counted in
            the metrics, and training goes on: :meth:`save` returns ``None``, the next due
            checkpoint tries again (``handle.wait()`` still raises for whoever asks). Errors in
            the state itself (``TrainingStateError``...), disagreeing or missing ranks are raised
            either way.
        mirror: a second run root (URI or Store: another bucket, region or cloud) that every
            committed checkpoint is replicated to in the background by the same commit protocol
            (:mod:`objckpt.coordination.mirror`); :meth:`restore` takes the mirror's copy when
            the primary cannot be read past its retry budget or its checkpoint is damaged, and
            says so loudly. Every rank passes the same one. The mirror gets the same retention.
        mirror_policy: back-pressure when commits come faster than the mirror copies them:
            ``"latest"`` (default: a waiting commit is replaced by a newer one, training never
            waits) or ``"wait"`` (every commit is mirrored; the commit after the waiting one
            blocks rank 0 inside the commit until the mirror has taken it -- at most one
            replication, which must stay well under ``timeout``, as the other ranks wait for
            the commit's outcome meanwhile).
        check: check the run root (and the mirror) at construction: ``True`` (default) one LIST
            per root (the server answers, the bucket exists, the credentials may read it);
            ``"write"`` also a probe write and delete; ``False`` nothing. A failure is raised on
            every rank, naming the bucket.
        dedup: write only what changed (default): chunks of the state whose bytes the parent
            checkpoint (the one restored or last committed) already holds are recorded as
            references to them instead of being written again (:mod:`.dedup`). ``False``
            writes every byte of every save.
        compression: ``None`` (default), ``"zstd"`` (byte-plane split + zstd on float
            tensors) or ``"auto"`` (only for tensor classes where it shortens the save at the
            measured upload bandwidth), see :mod:`.codec`.
        replicated_read: ``"once"``: on restore each replicated shard is downloaded by one rank
            and shared over the process group (~1/W of the replicated state per rank);
            ``"every"``: every rank downloads all of it (docs/DESIGN.md, "Scale"). Default
            ``None``: ``"once"`` on object stores, ``"every"`` on file://, where a read is a
            page-cache copy and per-rank reads measured faster (``shards.default_replicated_read``).
        key_spreading: shard keys carry a spreading prefix (``data/<hh>/...``) so one save's
            requests fall on many key partitions (default); ``False``: the old layout.
        verify: who LISTs the store to check the receipts before a commit: ``"coordinator"``
            (rank 0 LISTs every attempt prefix used), ``"ranks"`` (after every rank's writes,
            up to 256 ranks each LIST one slice of the attempt and rank 0 checks the receipts
            against them: the same coverage) or ``"auto"`` (default: ``"ranks"`` above 16 ranks).
        **store_options: options for :func:`objckpt.store.open_store` when a URI is given
            (``endpoint_url=``, ``path_style=``, ``part_size=``, ...).

    Raises:
        ConfigError: a bad URI or store option (or store options with a Store).
        ValueError: a bad ``keep_last``, ``every``, ``async_policy`` or ``max_staging_bytes``.
    """

    def __init__(
        self,
        uri_or_store: str | Store,
        *,
        keep_last: int | None = KEEP_LAST,
        keep_every: int | None = None,
        every: int | None = None,
        config_hash: str | None = None,
        dataset_snapshot: str | None = None,
        replicated: Iterable[str] | None = None,
        timeout: float = TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        gc_grace_period: timedelta = GC_GRACE_PERIOD,
        metadata: Mapping[str, Any] | None = None,
        max_staging_bytes: int | None = None,
        async_policy: str = WAIT,
        metrics: CheckpointMetrics | None = None,
        on_save_error: str = RAISE,
        mirror: str | Store | None = None,
        mirror_policy: str = "latest",
        check: bool | str = True,
        dedup: bool = True,
        compression: str | None = None,
        replicated_read: str | None = None,
        key_spreading: bool = True,
        verify: str = "auto",
        **store_options: Any,
    ) -> None:
        validate_options(async_policy, on_save_error, check, keep_last, every)
        self.on_save_error = on_save_error
        self._errors = SaveErrorPolicy(on_save_error)
        self.store, self._owns_store = open_root(uri_or_store, store_options)
        self.reader = Reader(self.store)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.every = every
        self.config_hash = config_hash
        self.dataset_snapshot = dataset_snapshot
        self.replicated = None if replicated is None else frozenset(replicated)
        self.gc_grace_period = gc_grace_period
        self.metadata = dict(metadata or {})
        self.metrics = metrics
        self._staging = StagingArea(max_staging_bytes)  # validates the budget before any collective
        self.async_policy = async_policy
        self.dedup = bool(dedup)
        if replicated_read is not None and replicated_read not in shards.REPLICATED_READS:
            raise ValueError(
                f"replicated_read must be one of {shards.REPLICATED_READS}, got {replicated_read!r}"
            )
        self.replicated_read = replicated_read
        self._compression = CompressionPolicy(compression)  # validates before any collective
        self.comm = make_comm(timeout=timeout, handshake_timeout=handshake_timeout, background=True)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self._mirror_store: Store | None
        self._mirror_store, self._owns_mirror = open_root(mirror) if mirror is not None else (None, False)
        try:
            self._primary_down = check_roots(self.comm, self.store, self._mirror_store, check=check)
        except BaseException:
            self._release_roots()
            raise
        sessions = wire_sessions(
            self.store,
            self.comm,
            self._mirror_store,
            keep_last=keep_last,
            keep_every=keep_every,
            gc_grace_period=gc_grace_period,
            metrics=metrics,
            mirror_policy=mirror_policy,
            identity=run_identity(self.world_size, config_hash, dataset_snapshot),
            key_spreading=key_spreading,
            verify=verify,
            primary_down=self._primary_down,
        )
        self._mirror, self._background = sessions.mirror, sessions.background
        self._saver = SaveRunner(
            sessions.saves,
            self._background,
            self._staging,
            self._errors,
            replicated=self.replicated,
            dedup=self.dedup,
            compression=self._compression,
            metadata=self.metadata,
        )
        self._restorer = RestoreRunner(
            sessions.restores,
            self.reader,
            self._errors,
            replicated_read=replicated_read,
            config_hash=config_hash,
        )
        self._closed = False

    @property
    def last_save(self) -> dict[str, Any]:
        """Bytes written by this rank (and reused from the parent instead) and seconds taken by
        the last save (empty before the first)."""
        return self._saver.last_save

    @property
    def fallbacks(self) -> list[tuple[int, str]]:
        """(step, reason) of every checkpoint a restore rejected and fell back from."""
        return self._restorer.fallbacks

    @property
    def last_restore(self) -> RestoreReport | None:
        """What the last restore loaded on this rank (missing/unexpected keys, elastic mapping)."""
        return self._restorer.last_restore

    # ------------------------------------------------------------------ public API

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        force: bool = False,
        metadata: Mapping[str, Any] | None = None,
    ) -> Manifest | None:
        """Save ``state`` as checkpoint ``step``; every rank must call it with the same step.

        Returns the committed manifest (the same on every rank), or None when ``every`` says
        this step is not due (and ``force`` is false).

        Atomicity: the checkpoint exists iff its manifest was written; until then nothing any
        reader resolves changes. On any failure no manifest is written and the attempt's shards
        are left for garbage collection; the previous checkpoint is untouched.

        Tensors are streamed straight from their memory: do not modify them until this returns
        (:meth:`save_async` stages a copy instead). A :meth:`save_async` still in flight is
        waited for first.

        Raises (identically on every rank):
            TrainingStateError: not at an optimizer-step boundary, or an unsupported value.
            UnsupportedStateError: a value inside a state dict cannot be serialized.
            CommitError: a rank failed to write its shards, or the commit checks failed;
                ``failures`` names every failing rank. CommitConflict: the step was already
                committed by another attempt. Also the error of an earlier :meth:`save_async`
                that no one has seen (on any rank): this save is then not started.
            DistributedError: ranks disagree on the step or the replicated layout, mix ``save``
                and ``save_async``, or a rank did not take part within the timeout (e.g. a
                rank-0-only call).
        """
        if self.metrics is not None:
            self.metrics.observe_step(step)
        if self.every is not None and not force and step % self.every:
            return None
        self._check_open()
        return self._saver.save(step, state, metadata)

    def save_async(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        force: bool = False,
        metadata: Mapping[str, Any] | None = None,
        policy: str | None = None,
    ) -> SaveHandle:
        """Stage ``state`` in host memory and save it as checkpoint ``step`` in the background;
        every rank must call it with the same step.

        Returns once this rank's share of the state is copied into the staging buffer: the
        caller may then change every tensor (the next optimizer step) without affecting the
        checkpoint. Encoding, upload, the receipt gather and the commit run on a background
        thread, on a process group of its own; the training thread takes part in one small
        collective here (the handshake on the checkpoint group, never on the training group).

        At most one save is in flight. While one is, ``policy`` (default: the manager's
        ``async_policy``) decides: ``"wait"`` waits for it to finish; ``"skip"`` saves nothing,
        logs a warning and returns a handle with ``skipped=True`` -- on every rank, if a save is
        still in flight on any rank. A step that is not due (``every``) also returns a skipped
        handle, without a warning.

        Atomicity: as :meth:`save`; the checkpoint exists iff its manifest was written. A failed
        or abandoned save writes no manifest.

        Errors: those found before staging are raised here, identically on every rank (see
        :meth:`save`, plus :class:`StagingBudgetError` when this rank's share exceeds
        ``max_staging_bytes``). Errors of the background part (a rank's upload failed, commit
        checks, :class:`CommitConflict`, :class:`SaveAbandonedError`, a collective timeout) are
        the handle's outcome, the same on every rank: raised by ``handle.wait()``/``result()``;
        if no one looks, by the next ``save``/``save_async``/``close``, which then starts no new
        save.

        Raises:
            ValueError: unknown ``policy``.
            StagingBudgetError, TrainingStateError, UnsupportedStateError, DistributedError,
            CommitError: as above.
        """
        policy = policy or self.async_policy
        if policy not in ASYNC_POLICIES:
            raise ValueError(f"policy must be one of {ASYNC_POLICIES}, got {policy!r}")
        if self.metrics is not None:
            self.metrics.observe_step(step)
        if self.every is not None and not force and step % self.every:
            return SaveHandle(step, skipped=True, reason=f"step {step} is not due (every={self.every})")
        self._check_open()
        return self._saver.save_async(step, state, metadata, skip=policy == SKIP)

    def wait(self) -> Manifest | None:
        """Wait for the in-flight :meth:`save_async` (if any) and return its manifest (None when
        there is none); local, no collective.

        Raises:
            the in-flight save's error (see :meth:`SaveHandle.wait`).
        """
        self._background.settle()
        handle = self._background.last
        return None if handle is None else handle.wait()

    def restore(
        self, state: Mapping[str, Any], *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load the newest usable checkpoint (or ``step``) into ``state``; every rank calls it.

        Rank 0 resolves the newest committed checkpoint and sends its manifest to the others.
        Every rank downloads what it needs (all replicated shards, its own per-rank shard),
        verifying size and CRC32C, decodes and checks it against the live objects *before*
        touching any of them. If any rank finds the checkpoint damaged, all ranks fall back to
        its parent together (logged as a warning on every rank, recorded in :attr:`fallbacks`);
        an outage or permission error is raised instead (falling back would lose work). Then
        every rank applies it (RNG last) and the ranks check they restored the same step.

        Returns the restored step, or None when the run root holds no checkpoint (nothing is
        modified then). An in-flight :meth:`save_async` is waited for first (its error, if any,
        is left for the next save or close to raise). What was loaded is in
        :attr:`last_restore` (a :class:`~objckpt.training.state.RestoreReport`).

        Any subset of the saved entries may be restored (``{"model": model}`` to evaluate), at
        any world size: replicated state bit for bit, per-rank state by the elastic rule of
        :mod:`.shards` (``docs/ELASTIC.md``). A checkpoint written through DCP restores its
        modules into plain modules through DCP's resharding. ``strict=False`` loads the keys a
        module and the checkpoint both have and leaves entries the checkpoint lacks untouched,
        reporting both (:attr:`last_restore`, and a warning in the log).

        Raises (identically on every rank):
            NoCheckpointError: checkpoints exist but none is usable, or ``step`` is not usable.
            TrainingStateError: the checkpoint does not fit ``state`` (names and keys with
                ``strict``, tensor shapes, optimizer groups, a sampler or loader that cannot be
                re-partitioned for this world size): no object was modified.
            DistributedError: ranks asked for different steps, see different run roots, or
                did not all call restore within the timeout.
            StoreError: the store could not be read (after the retry budget).
        """
        self._check_open()
        self._background.settle()
        return self._restorer.restore(state, step=step, strict=strict)

    def rollback(self, step: int, *, timeline: int | None = None) -> int:
        """Make committed checkpoint ``step`` the head again and continue from it on a new
        timeline (after a loss spike, say); every rank calls it. Returns the new timeline.

        Metadata only (one create-if-absent claim and one pointer update, no shard copied). The
        steps after ``step`` on the old line are abandoned: restores never resume them, retention
        keeps them for ``keep_abandoned`` (7 days by default), then collects them. Call
        :meth:`restore` afterwards to load ``step`` into the live objects.

        Raises (identically on every rank):
            NoCheckpointError: no such committed checkpoint, or it is damaged or quarantined.
        """
        self._check_open()
        self._background.settle()
        return self._restorer.rollback(step, timeline=timeline)

    def latest_step(self) -> int | None:
        """The newest committed step (no shard checks), or None. Local: no collective."""
        m = self.reader.latest()
        return m.step if m is not None else None

    @property
    def staging_bytes(self) -> int:
        """Host memory held by the staging buffer of :meth:`save_async` (0 before the first)."""
        return self._staging.capacity

    def close(self, *, abandon: bool = False) -> None:
        """Finish the in-flight :meth:`save_async`, then release the staging buffer, the process
        groups and (when opened from a URI) the store. Idempotent; every rank calls it.

        ``abandon=False`` (default): wait until the in-flight save has committed or failed.
        ``abandon=True``: cancel it: uploads stop at the next part and are aborted, and the
        coordinator does not commit an attempt that any rank abandoned before the commit began
        (all ranks get the same outcome: :class:`SaveAbandonedError`); its leftover shards are
        swept by garbage collection after the grace period. A save already being committed when
        the request arrives completes (logged). Either way this returns only once the background
        thread is done (bounded by ``timeout`` if a peer rank is gone).

        Raises:
            the error of the last :meth:`save_async` if no one has seen it yet (after releasing
            everything); not with ``abandon=True``, which logs it instead.
        """
        if self._closed:
            return
        error: BaseException | None = None
        try:
            error = self._saver.settle_for_close(abandon=abandon)
        finally:
            self._closed = True
            self._background.close()
            self._staging.release()
            try:
                if self._mirror is not None:
                    # the last commits reach the mirror before the job goes (bounded by the
                    # stores' retry budgets); abandon: the waiting one is dropped
                    self._mirror.close(wait=not abandon)
            finally:
                self._release_roots()
        if error is not None:
            raise error

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        # Leaving on an exception: finish the in-flight save, but never mask the exception
        # that is propagating with the save's own error.
        try:
            self.close()
        except Exception as err:  # noqa: BLE001
            log.error("the last save_async failed (raised while leaving on another error): %s", err)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this CheckpointManager is closed")

    def _release_roots(self) -> None:
        """Release the process groups and the stores this manager opened (not a given Store)."""
        self.comm.close()
        if self._owns_store:
            self.store.close()
        if self._owns_mirror and self._mirror_store is not None:
            self._mirror_store.close()
