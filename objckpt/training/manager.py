"""``CheckpointManager``: save and restore the whole training state, on one process or many.

::

    manager = CheckpointManager("s3://bucket/runs/eta", keep_last=3, every=100)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler,
             "progress": progress}
    start = manager.restore(state) or 0          # every rank calls; None: fresh start
    for step in range(start + 1, total + 1):
        train_one_step()
        manager.save(step, state)                 # every rank calls; saves when step % every == 0

What a save writes (``data/<step>-<attempt>/<rank>/``):

* ``replicated.bin`` – replicated state (by default every ``nn.Module`` and optimizer, which DDP
  keeps identical on all ranks) is written once, not once per rank: its tensors are split across
  the ranks by size (largest first, onto the least loaded rank), so every rank uploads about
  ``1/world_size`` of it, in parallel. Rank 0's file also holds the structure (non-tensor values).
* ``rank.bin`` – everything per rank: the global RNG states (Python, NumPy, torch CPU, CUDA),
  random generators, samplers, schedulers, progress, dicts.

Shards are self-describing binary (see :mod:`.serialization`), streamed straight from tensor
memory; nothing is pickled. The distributed protocol (invariants 4-6, 13): a handshake checks all
ranks save the same step with the same replicated layout and shares rank 0's fresh attempt id;
every rank writes its shards; receipts (or each rank's error) are gathered to rank 0, which
commits (:class:`objckpt.commit.Coordinator`); the outcome is broadcast so every rank returns
the same manifest or raises the same :class:`CommitError`. Then rank 0 applies retention
(:mod:`objckpt.gc`), which never deletes the previous checkpoint before the new one is committed
and verified.

Asynchronous saves (:meth:`CheckpointManager.save_async`): the training thread captures the
state, agrees with the other ranks on the step and attempt (one small collective on the
checkpoint handshake group, never on the training process group), copies this rank's share of
the state into a reusable host staging buffer (:mod:`.staging`; pinned when CUDA is present) and
returns a :class:`SaveHandle`. A background thread then encodes, uploads, gathers the receipts
and commits exactly as :meth:`save` does, on a gloo group of its own. At most one save is in
flight; its outcome (committed, or the same error on every rank) is delivered by the handle, or
else raised by the next ``save``/``save_async``/``close``.

Bitwise resume (invariant 14) holds for CPU runs with the same world size, given deterministic
collectives. One trap outside objckpt: DDP rebuilds its gradient-bucket layout after the first
iteration of every process, and with more than 2 ranks the all-reduce's float sum order depends
on the layout, so a restarted DDP job's first step differs in the last bits from the
uninterrupted job's. Pin the layout (``find_unused_parameters=True`` disables the rebuild) when
bitwise equality matters. Likewise give each ``DataLoader`` its own ``generator=``: it draws a
seed per iterator from the global torch RNG otherwise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch

from .. import layout
from ..commit import Coordinator
from ..errors import (
    CommitError,
    DistributedError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    ObjckptError,
)
from ..gc import retain_after_commit
from ..manifest import Manifest, ShardReceipt
from ..reader import Reader, agree_on_step
from ..store import Store, open_store
from ..writer import ShardWriter
from . import serialization
from .dist import Comm, decode_error, encode_error, make_comm
from .serialization import SerializationError, TensorRef
from .staging import SaveAbandonedError, SaveHandle, StagingArea, StagingBudgetError
from .state import (
    MODULE,
    OPTIMIZER,
    TrainingStateError,
    apply_state,
    capture_global_rng,
    capture_item,
    check_restorable,
    check_step_boundary,
    classify,
    progress_of,
)

__all__ = [
    "CheckpointManager",
    "SaveAbandonedError",
    "SaveHandle",
    "StagingBudgetError",
    "hash_config",
]

log = logging.getLogger("objckpt.training")

STATE_LAYOUT = "objckpt.training/1"
REPLICATED_SHARD = "replicated.bin"
RANK_SHARD = "rank.bin"

#: errors that mean "this checkpoint is damaged": restore falls back to the parent
_DAMAGE = (IntegrityError, NotFoundError, SerializationError)

#: what save_async does while a save is in flight
WAIT, SKIP = "wait", "skip"
_POLICIES = (WAIT, SKIP)


def hash_config(config: Any) -> str:
    """A stable SHA-256 of a JSON-able config (sorted keys), for ``config_hash=``."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


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
            of the state (its part of the replicated tensors plus its per-rank state), allocated
            by the first ``save_async``, reused by every later one and freed by :meth:`close`.
            Only one save is ever in flight, so that one buffer is the whole overhead. A state
            that needs more raises :class:`StagingBudgetError` on every rank before anything is
            staged. :meth:`save` never stages.
        async_policy: what :meth:`save_async` does while the previous save is still in flight:
            ``"wait"`` (default) blocks until it is over; ``"skip"`` saves nothing, logs a
            warning and returns a handle with ``skipped=True``.
    """

    def __init__(
        self,
        uri_or_store: str | Store,
        *,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        every: int | None = None,
        config_hash: str | None = None,
        dataset_snapshot: str | None = None,
        replicated: Iterable[str] | None = None,
        timeout: float = 1800.0,
        handshake_timeout: float = 300.0,
        gc_grace_period: timedelta = timedelta(hours=6),
        metadata: Mapping[str, Any] | None = None,
        max_staging_bytes: int | None = None,
        async_policy: str = WAIT,
    ) -> None:
        if async_policy not in _POLICIES:
            raise ValueError(f"async_policy must be one of {_POLICIES}, got {async_policy!r}")
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        if every is not None and every < 1:
            raise ValueError(f"every must be >= 1 or None, got {every}")
        self._owns_store = isinstance(uri_or_store, str)
        self.store: Store = open_store(uri_or_store) if isinstance(uri_or_store, str) else uri_or_store
        self.reader = Reader(self.store)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.every = every
        self.config_hash = config_hash
        self.dataset_snapshot = dataset_snapshot
        self.replicated = None if replicated is None else frozenset(replicated)
        self.gc_grace_period = gc_grace_period
        self.metadata = dict(metadata or {})
        self._staging = StagingArea(max_staging_bytes)  # validates the budget before any collective
        self.async_policy = async_policy
        self.comm: Comm = make_comm(timeout=timeout, handshake_timeout=handshake_timeout, background=True)
        # The background save thread's own group: it alone issues collectives there, so their
        # order is the same on every rank whatever the training thread does meanwhile.
        self._bg_comm: Comm = self.comm.background()
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        #: (step, reason) of every checkpoint a restore rejected and fell back from
        self.fallbacks: list[tuple[int, str]] = []
        #: bytes written by this rank and seconds taken by the last save
        self.last_save: dict[str, Any] = {}
        self._coordinator: Coordinator | None = None
        #: the last save_async that ran (finished or not) and the thread running it
        self._last_async: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

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
        if self.every is not None and not force and step % self.every:
            return None
        self._check_open()
        started = time.monotonic()
        pending = self._settle()
        prep = self._prepare_save(step, state)
        decision = self._save_handshake(step, prep, pending, mode="save", busy=False)
        manifest = self._save_protocol(self.comm, step, decision["attempt"], prep, metadata, started)
        if self.rank == 0:
            self._retain()
        return manifest

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
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if self.every is not None and not force and step % self.every:
            return SaveHandle(step, skipped=True, reason=f"step {step} is not due (every={self.every})")
        self._check_open()
        started = time.monotonic()
        busy = policy == SKIP and self._thread is not None and self._thread.is_alive()
        pending = None if busy else self._settle()
        prep = self._prepare_save(step, state, stage=True)
        decision = self._save_handshake(step, prep, pending, mode="save_async", busy=busy)
        if decision["skip"]:
            log.warning(
                "save_async(step=%d) skipped: the previous save is still in flight on %s (policy='skip')",
                step,
                "this rank" if busy else "another rank",
            )
            return SaveHandle(
                step, skipped=True, reason="the previous save was still in flight (policy='skip')"
            )
        attempt = decision["attempt"]
        plan = prep.pop("plan")
        handle = SaveHandle(step, attempt=attempt, staged_bytes=plan.nbytes)
        stage_error: Exception | None = None
        try:
            prep["replicated_tree"], prep["local_tree"] = self._staging.stage(plan)
        except Exception as exc:  # noqa: BLE001 - reported by the background thread, so all ranks agree
            log.error("rank %d failed to stage step %d: %s", self.rank, step, exc)
            stage_error = exc
        del plan  # the plan references the live tensors; the background thread must not
        handle.blocking_seconds = time.monotonic() - started
        thread = threading.Thread(
            target=self._background_save,
            args=(handle, prep, metadata, started, stage_error),
            name=f"objckpt-save-{step}",
            # daemon: a job that exits without close() must not hang at interpreter exit on a
            # collective with ranks that are gone; that save is simply never committed
            daemon=True,
        )
        self._last_async, self._thread = handle, thread
        thread.start()
        return handle

    def wait(self) -> Manifest | None:
        """Wait for the in-flight :meth:`save_async` (if any) and return its manifest (None when
        there is none); local, no collective.

        Raises:
            the in-flight save's error (see :meth:`SaveHandle.wait`).
        """
        self._settle()
        handle = self._last_async
        return None if handle is None else handle.wait()

    def restore(self, state: Mapping[str, Any], *, step: int | None = None) -> int | None:
        """Load the newest usable checkpoint (or ``step``) into ``state``; every rank calls it.

        Walks committed checkpoints newest first. Every rank downloads what it needs (all
        replicated shards, its own per-rank shard), verifying size and CRC32C, decodes and
        checks it against the live objects *before* touching any of them. If any rank finds the
        checkpoint damaged, all ranks fall back to its parent together (logged as a warning on
        every rank, recorded in :attr:`fallbacks`). Then every rank applies it (RNG last) and
        the ranks check they restored the same step.

        Returns the restored step, or None when the run root holds no checkpoint (nothing is
        modified then). An in-flight :meth:`save_async` is waited for first (its error, if any,
        is left for the next save or close to raise).

        Raises (identically on every rank):
            NoCheckpointError: checkpoints exist but none is usable, or ``step`` is not usable.
            TrainingStateError: the checkpoint does not fit ``state`` (names, tensor shapes,
                optimizer groups, world size): no object was modified.
            DistributedError: ranks asked for different steps, see different checkpoints, or
                did not all call restore within the timeout.
        """
        self._check_open()
        self._settle()
        prep_error = None
        try:
            for name, obj in state.items():
                classify(name, obj)
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error below
            prep_error = encode_error(exc)
        self.comm.agree(
            {"step": step, "error": prep_error},
            _decide_restore_handshake,
            "restore handshake",
            handshake=True,
        )

        candidates: Iterator[Manifest] | None = None
        if self.rank == 0 and step is None:
            candidates = self.reader.candidates()
        rejected: list[str] = []
        while True:
            proposal: dict[str, Any] = {}
            if self.rank == 0:
                proposal = self._propose(step, candidates, rejected)
            proposal = self.comm.broadcast(proposal, "restore proposal")
            if "error" in proposal:
                raise decode_error(proposal["error"])
            if proposal.get("none"):
                return None
            target = int(proposal["step"])
            staged: dict[str, Any] | None = None
            try:
                staged, manifest = self._stage(state, target, proposal)
                result: dict[str, Any] = {"ok": True}
            except _Damaged as exc:
                result = {"damaged": str(exc)}
            except Exception as exc:  # noqa: BLE001 - fatal on every rank, decided below
                result = {"fatal": encode_error(exc)}
            verdict = self.comm.agree(result, _decide_staging, f"restore(step={target}) verification")
            if verdict.get("ok"):
                break
            why = "; ".join(
                f"rank {r}: {m}" for r, m in sorted(verdict["damaged"].items(), key=lambda kv: int(kv[0]))
            )
            if step is not None:  # an explicit step: no fallback
                raise NoCheckpointError(
                    f"checkpoint step {target} under {self.store.location} is damaged: {why}"
                )
            log.warning(
                "checkpoint step %d under %s is damaged, falling back to an older one (all ranks): %s",
                target,
                self.store.location,
                why,
            )
            self.fallbacks.append((target, why))
            rejected.append(f"step {target}: {why}")

        assert staged is not None
        self._check_identity(manifest)
        apply_error = None
        try:
            apply_state(state, staged["items"], rng=staged["rng"])
        except Exception as exc:  # noqa: BLE001 - every rank raises below
            log.error("rank %d failed to apply checkpoint step %d: %s", self.rank, target, exc)
            apply_error = encode_error(exc)
        restored = self.comm.agree(
            {"step": target, "error": apply_error}, _decide_restored, f"restore(step={target}) agreement"
        )
        log.info("restored checkpoint step %d from %s", restored, self.store.location)
        return restored

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
            handle, thread = self._last_async, self._thread
            if abandon and handle is not None and thread is not None and thread.is_alive():
                handle.abandon()
            error = self._settle()
            if error is not None:
                assert handle is not None
                handle._observed = True
                if abandon:
                    if not isinstance(error, SaveAbandonedError):
                        log.warning("the abandoned save of step %d had failed: %s", handle.step, error)
                    error = None
            elif abandon and handle is not None and handle.abandon_requested and handle.committed:
                log.info("save of step %d was committed before the abandon request took effect", handle.step)
        finally:
            self._closed = True
            self._staging.release()
            self.comm.close()
            if self._owns_store:
                self.store.close()
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

    # ------------------------------------------------------------------ save internals

    def _replicated_names(self, state: Mapping[str, Any], kinds: Mapping[str, str]) -> list[str]:
        if self.replicated is not None:
            return [n for n in state if n in self.replicated]
        return [n for n in state if kinds[n] in (MODULE, OPTIMIZER)]

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this CheckpointManager is closed")

    def _settle(self) -> BaseException | None:
        """Wait for the background save thread, if any. Training-thread collectives start only
        after it: one save at a time, and restore sees what the last save committed.

        Returns the last async save's error when no one has seen it yet (not marked seen).
        """
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None
        handle = self._last_async
        return handle._unobserved_error() if handle is not None else None

    def _prepare_save(self, step: int, state: Mapping[str, Any], *, stage: bool = False) -> dict[str, Any]:
        """Capture references to everything to save; no I/O, nothing copied. With ``stage``,
        also lay the state out for staging (raises StagingBudgetError in the result)."""
        try:
            layout.check_step(step)
            check_step_boundary(state)
            kinds = {name: classify(name, obj) for name, obj in state.items()}
            rep_names = self._replicated_names(state, kinds)
            replicated = {n: capture_item(n, state[n], kinds[n]) for n in rep_names}
            local = {n: capture_item(n, state[n], kinds[n]) for n in state if n not in rep_names}
            # Refuse unserializable values now, naming them, before any rank writes anything.
            serialization.validate(replicated)
            serialization.validate(local)
            tensors: list[torch.Tensor] = []
            skeleton = _split_tensors(replicated, tensors)
            digests = {n: _layout_digest(skeleton[n], tensors) for n in rep_names}
            mine = _assign(tensors, self.world_size)[self.rank]
            rep_tree: dict[str, Any] | None = None
            if rep_names and (mine or self.rank == 0):
                rep_tree = {"index": mine, "tensors": [tensors[i] for i in mine]}
                if self.rank == 0:
                    rep_tree["skeleton"] = skeleton
                    rep_tree["count"] = len(tensors)
            local_tree = {"items": local, "rng": capture_global_rng()}
            progress = progress_of(state)
            prep = {
                "step": step,
                "replicated_names": rep_names,
                "local_names": [n for n in state if n not in rep_names],
                "replicated_tree": rep_tree,
                "local_tree": local_tree,
                "digests": digests,
                "progress": progress.summary() if progress is not None else {"global_step": step},
                "bytes_written": 0,
            }
            if stage:
                prep["plan"] = self._staging.plan([rep_tree, local_tree], what=f"save_async(step={step})")
            return prep
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error after the handshake
            return {"error": encode_error(exc)}

    def _save_handshake(
        self, step: int, prep: dict[str, Any], pending: BaseException | None, *, mode: str, busy: bool
    ) -> dict[str, Any]:
        """The entry collective of every save: returns ``{"attempt", "skip"}``, the same on
        every rank, or raises the same error on every rank (see :meth:`_decide_save_handshake`).

        ``pending``: this rank's unseen error of an earlier save_async. If any rank has one,
        every rank raises it (each its own copy: outcomes are agreed, so they are the same)."""
        hello = {
            "step": step,
            "mode": mode,
            "busy": busy,
            "pending": encode_error(pending) if pending is not None else None,
            "error": prep.get("error"),
            "digests": prep.get("digests"),
            "attempt": layout.new_attempt_id() if self.rank == 0 else None,
        }
        decision = self.comm.agree(
            hello, self._decide_save_handshake, f"{mode}(step={step}) handshake", handshake=True
        )
        if decision.get("pending"):
            if pending is not None:
                assert self._last_async is not None
                self._last_async._observed = True
                raise pending
            raise decode_error(decision["pending"])
        return decision

    def _decide_save_handshake(self, hellos: list[dict[str, Any]]) -> dict[str, Any]:
        # an earlier failure nobody has seen comes first: it is older than anything else here
        for h in hellos:
            if h.get("pending"):
                return {"pending": h["pending"]}
        modes = {h.get("mode") for h in hellos}
        if len(modes) != 1:
            detail = ", ".join(f"rank {r}: {h.get('mode')}" for r, h in enumerate(hellos))
            raise DistributedError(f"ranks mixed save() and save_async() for one checkpoint ({detail})")
        for rank, h in enumerate(hellos):
            if h.get("error"):
                err = decode_error(h["error"])
                if rank:
                    err.args = (f"rank {rank}: {err}",)
                    if isinstance(err, ObjckptError):
                        err.message = err.args[0]
                raise err
        steps = {h["step"] for h in hellos}
        if len(steps) != 1:
            detail = ", ".join(f"rank {r}: {h['step']}" for r, h in enumerate(hellos))
            raise DistributedError(f"ranks called save() with different steps ({detail})")
        first = hellos[0]["digests"]
        for rank, h in enumerate(hellos[1:], start=1):
            if h["digests"] != first:
                names = sorted(
                    n for n in set(first) | set(h["digests"]) if first.get(n) != h["digests"].get(n)
                )
                raise TrainingStateError(
                    f"state {names} is not replicated: rank {rank} holds tensors of other names or "
                    "shapes than rank 0. Pass replicated=() (or the names that really are identical "
                    "on every rank) to CheckpointManager"
                )
        # policy="skip": skip on every rank if a save is still in flight on any rank
        return {"attempt": str(hellos[0]["attempt"]), "skip": any(h.get("busy") for h in hellos)}

    def _save_protocol(
        self,
        comm: Comm,
        step: int,
        attempt: str,
        prep: dict[str, Any],
        metadata: Mapping[str, Any] | None,
        started: float,
        *,
        abandon: threading.Event | None = None,
        stage_error: Exception | None = None,
    ) -> Manifest:
        """Write, gather receipts, commit on rank 0, broadcast the outcome (on ``comm``)."""
        # Every rank writes its shards; a failure is reported, not raised, so that rank 0 can
        # tell every rank the same outcome.
        report: dict[str, Any]
        if stage_error is not None:
            report = {"error": f"staging failed: {type(stage_error).__name__}: {stage_error}"}
        else:
            try:
                report = {"receipts": [r.to_dict() for r in self._write(step, attempt, prep, abandon)]}
            except _Abandoned:
                report = {"abandoned": True}
            except Exception as exc:  # noqa: BLE001 - reported to the coordinator
                log.error("rank %d failed to write its shards for step %d: %s", self.rank, step, exc)
                report = {"error": f"{type(exc).__name__}: {exc}"}
        if abandon is not None and abandon.is_set():
            report = {"abandoned": True}
        reports = comm.gather(report, f"save(step={step}) receipts")

        outcome: dict[str, Any] = {}
        if self.rank == 0:
            assert reports is not None
            abandoned = [r for r, rep in enumerate(reports) if rep.get("abandoned")]
            # The last look at our own request: after this point the commit goes ahead.
            if abandon is not None and abandon.is_set() and 0 not in abandoned:
                abandoned.insert(0, 0)
            try:
                if abandoned:
                    raise SaveAbandonedError(
                        f"step {step} attempt {attempt} was abandoned before it was committed; no "
                        "manifest was written",
                        {r: "abandoned (close(abandon=True))" for r in abandoned},
                    )
                manifest = self._commit(step, attempt, reports, prep, metadata)
                outcome = {"manifest": manifest.encode().decode("utf-8")}
            except Exception as exc:  # noqa: BLE001 - broadcast and raised on every rank
                if not isinstance(exc, CommitError):
                    exc = CommitError(
                        f"step {step} attempt {attempt} not committed: the coordinator failed: "
                        f"{type(exc).__name__}: {exc}",
                        {0: f"{type(exc).__name__}: {exc}"},
                    )
                outcome = {"error": encode_error(exc)}
        outcome = comm.broadcast(outcome, f"save(step={step}) outcome")
        if "error" in outcome:
            raise decode_error(outcome["error"])
        key = layout.manifest_key(step)
        manifest = Manifest.decode(outcome["manifest"].encode("utf-8"), key=key)
        self.last_save = {
            "step": step,
            "bytes": prep["bytes_written"],
            "seconds": time.monotonic() - started,
        }
        return manifest

    def _background_save(
        self,
        handle: SaveHandle,
        prep: dict[str, Any],
        metadata: Mapping[str, Any] | None,
        started: float,
        stage_error: Exception | None,
    ) -> None:
        """The background thread of save_async: the whole protocol on the background group."""
        step = handle.step
        try:
            assert handle.attempt is not None
            manifest = self._save_protocol(
                self._bg_comm,
                step,
                handle.attempt,
                prep,
                metadata,
                started,
                abandon=handle._abandon,
                stage_error=stage_error,
            )
        except BaseException as exc:  # noqa: BLE001 - the handle's outcome; never lost
            if isinstance(exc, SaveAbandonedError):
                log.warning("save of step %d abandoned: %s", step, exc)
            else:
                log.error("background save of step %d failed: %s", step, exc)
            handle._finish(error=exc)
            return
        finally:
            prep.clear()  # drop the staged trees (views of the reused buffer) and the encodings
        self.last_save["blocking_seconds"] = handle.blocking_seconds
        handle._finish(manifest=manifest)
        if self.rank == 0:
            self._retain()  # still in this thread: the next save waits for it

    def _write(
        self, step: int, attempt: str, prep: dict[str, Any], abandon: threading.Event | None = None
    ) -> list[ShardReceipt]:
        writer = ShardWriter(self.store, step=step, attempt=attempt, rank=self.rank)
        written = 0
        progress = None
        if abandon is not None:

            def progress(_: int) -> None:
                # called after every uploaded part: raising here aborts the multipart upload
                if abandon.is_set():
                    raise _Abandoned()

        for name, tree in ((REPLICATED_SHARD, prep["replicated_tree"]), (RANK_SHARD, prep["local_tree"])):
            if tree is not None:
                # streamed from the tensors' memory (the staged copies for save_async): header,
                # then each tensor's bytes in place
                encoded = serialization.encode(tree)
                source: Iterable[memoryview] = encoded.buffers()
                if abandon is not None:
                    source = _abortable(source, abandon)
                writer.write(name, source, progress=progress)
                written += encoded.size
        prep["bytes_written"] = written
        return writer.receipts

    def _commit(
        self,
        step: int,
        attempt: str,
        reports: list[dict[str, Any]],
        prep: dict[str, Any],
        metadata: Mapping[str, Any] | None,
    ) -> Manifest:
        receipts: dict[int, Any] = {}
        for rank, rep in enumerate(reports):
            if "error" in rep:
                receipts[rank] = rep["error"]
            else:
                receipts[rank] = [
                    ShardReceipt.from_dict(d, key=f"rank {rank} receipt") for d in rep["receipts"]
                ]
        if self._coordinator is None:  # once: its construction checks (and warns about) the store
            self._coordinator = Coordinator(self.store, world_size=self.world_size)
        coordinator = self._coordinator
        software = {"torch": torch.__version__, "python": platform.python_version()}
        try:
            import numpy

            software["numpy"] = numpy.__version__
        except ImportError:  # pragma: no cover
            pass
        run: dict[str, Any] = {"software": software, "world_size": self.world_size}
        if self.config_hash is not None:
            run["config_hash"] = self.config_hash
        if self.dataset_snapshot is not None:
            run["dataset_snapshot"] = self.dataset_snapshot
        return coordinator.commit(
            step,
            attempt,
            receipts,
            progress=prep["progress"],
            run=run,
            topology={
                "layout": STATE_LAYOUT,
                "replicated": prep["replicated_names"],
                "per_rank": prep["local_names"],
            },
            metadata={**self.metadata, **dict(metadata or {})},
        )

    def _retain(self) -> None:
        retain_after_commit(
            self.store,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            grace_period=self.gc_grace_period,
        )

    def _propose(
        self, step: int | None, candidates: Iterator[Manifest] | None, rejected: list[str]
    ) -> dict[str, Any]:
        """Rank 0: the next checkpoint to try."""
        try:
            if step is not None:
                m = self.reader.load(step)
            else:
                assert candidates is not None
                m = next(candidates, None)
                if m is None:
                    steps = self.reader.steps()
                    if rejected or steps:
                        detail = "; ".join(rejected) or "see the warnings logged by objckpt.reader"
                        raise NoCheckpointError(
                            f"{len(steps)} committed checkpoint(s) under {self.store.location} but "
                            f"none is usable ({detail})"
                        )
                    return {"none": True}
            return {"step": m.step, "attempt": m.attempt, "checksum": m.checksum}
        except Exception as exc:  # noqa: BLE001 - raised on every rank
            return {"error": encode_error(exc)}

    def _stage(
        self, state: Mapping[str, Any], step: int, proposal: Mapping[str, Any]
    ) -> tuple[dict[str, Any], Manifest]:
        """Download, verify, decode and check one checkpoint; modifies nothing.

        Raises:
            _Damaged: the checkpoint is damaged (fall back).
            DistributedError / TrainingStateError: fatal for the restore.
        """
        try:
            manifest = self.reader.load(step)
        except ManifestError as exc:
            raise _Damaged(f"manifest: {exc}") from exc
        except NoCheckpointError as exc:
            raise DistributedError(
                f"rank {self.rank} finds no manifest for step {step} under {self.store.location} "
                "but rank 0 does: are all ranks configured with the same run root?"
            ) from exc
        if manifest.attempt != proposal["attempt"] or manifest.checksum != proposal["checksum"]:
            raise DistributedError(
                f"rank {self.rank} sees attempt {manifest.attempt} for step {step} under "
                f"{self.store.location}, rank 0 sees {proposal['attempt']}: the ranks read "
                "different run roots"
            )
        topo = manifest.topology
        if topo.get("layout") != STATE_LAYOUT:
            raise TrainingStateError(
                f"checkpoint step {step} was not written by CheckpointManager (layout "
                f"{topo.get('layout')!r}); use the API that wrote it"
            )
        if manifest.world_size != self.world_size:
            raise TrainingStateError(
                f"checkpoint step {step} was written by {manifest.world_size} rank(s), this job has "
                f"{self.world_size}: per-rank state (RNG, samplers) cannot be mapped"
            )
        rep_names = list(topo.get("replicated", []))
        wanted_rep = [n for n in state if n in rep_names]
        try:
            rank_receipt = manifest.shard(self.rank, RANK_SHARD)
            rep_receipts = [s for s in manifest.shards if s.name == REPLICATED_SHARD] if wanted_rep else []
        except KeyError as exc:
            raise _Damaged(str(exc)) from exc
        receipts = [rank_receipt, *rep_receipts]
        try:
            with ThreadPoolExecutor(min(8, len(receipts)), thread_name_prefix="objckpt-restore") as pool:
                decoded = list(pool.map(self._read, receipts))
        except _DAMAGE as exc:
            raise _Damaged(str(exc)) from exc
        local = decoded[0]
        items: dict[str, Any] = dict(_mapping(local.get("items"), "items"))
        if wanted_rep:
            items.update(_join_replicated(decoded[1:], wanted_rep))
        check_restorable(state, items, rng=local.get("rng"))
        return {"items": items, "rng": local.get("rng")}, manifest

    def _read(self, receipt: ShardReceipt) -> Any:
        try:
            return serialization.decode_stream(self.reader.open_shard(receipt), total_size=receipt.size)
        except SerializationError as exc:
            raise SerializationError(f"{receipt.key}: {exc}") from exc

    def _check_identity(self, manifest: Manifest) -> None:
        saved = manifest.run.get("config_hash")
        if self.config_hash is not None and saved is not None and saved != self.config_hash:
            log.warning(
                "restoring step %d written under config hash %s, this run's is %s",
                manifest.step,
                saved,
                self.config_hash,
            )


# ---------------------------------------------------------------------------------- helpers


class _Damaged(Exception):
    """The checkpoint being staged is damaged: fall back (internal)."""


class _Abandoned(Exception):
    """This rank stopped writing an abandoned save (internal)."""


def _abortable(buffers: Iterable[memoryview], abandon: threading.Event) -> Iterator[memoryview]:
    """``buffers``, stopping with _Abandoned once ``abandon`` is set (the upload is aborted)."""
    for buf in buffers:
        if abandon.is_set():
            raise _Abandoned()
        yield buf


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _Damaged(f"checkpoint {what} is a {type(value).__name__}, not a mapping")
    return value


def _map_tree(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Rebuild nested dict/list/tuple containers, applying ``fn`` to every other leaf; keeps
    ``OrderedDict`` and its ``_metadata`` (module state dicts carry version info there)."""
    if isinstance(obj, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _map_tree(v, fn)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [_map_tree(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_tree(v, fn) for v in obj)
    return fn(obj)


def _split_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``tree`` by a :class:`TensorRef` into ``tensors`` (appended in
    depth-first order, one entry per tensor object)."""
    seen: dict[int, int] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            idx = seen.get(id(v))
            if idx is None:
                idx = seen[id(v)] = len(tensors)
                tensors.append(v)
            return TensorRef(idx)
        return v

    return _map_tree(tree, leaf)


def _layout_digest(skeleton: Any, tensors: list[torch.Tensor]) -> str:
    """A digest of the tensor layout of one replicated item (names, dtypes, shapes), so ranks
    can check they split the same list the same way."""
    h = hashlib.sha256()

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k!r}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(node, TensorRef):
            t = tensors[node.index]
            h.update(f"{path}:{node.index}:{t.dtype}:{tuple(t.shape)};".encode())

    walk(skeleton, "")
    return h.hexdigest()


def _assign(tensors: list[torch.Tensor], world_size: int) -> list[list[int]]:
    """Split tensor indices across ranks by size: largest first onto the least-loaded rank
    (ties to the lower rank). Deterministic, so every rank computes the same split."""
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].numel() * tensors[i].element_size(), i))
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        out[r].append(i)
        loads[r] += tensors[i].numel() * tensors[i].element_size()
    for lst in out:
        lst.sort()
    return out


def _join_replicated(parts: list[Any], names: list[str]) -> dict[str, Any]:
    """Rebuild the replicated items from every rank's ``replicated.bin``."""
    skeleton = None
    count = None
    table: dict[int, Any] = {}
    for part in parts:
        part = _mapping(part, "replicated shard")
        index, tensors = part.get("index"), part.get("tensors")
        if not isinstance(index, list) or not isinstance(tensors, list) or len(index) != len(tensors):
            raise _Damaged("replicated shard has a malformed tensor table")
        for i, t in zip(index, tensors):
            if not isinstance(i, int) or not isinstance(t, torch.Tensor) or i in table:
                raise _Damaged(f"replicated shard has a bad or duplicate tensor entry {i!r}")
            table[i] = t
        if "skeleton" in part:
            skeleton, count = part["skeleton"], part.get("count")
    if skeleton is None:
        raise _Damaged("no replicated shard holds the structure (rank 0's shard is missing)")
    if count != len(table):
        raise _Damaged(f"replicated shards hold {len(table)} tensors, the structure names {count}")

    def leaf(v: Any) -> Any:
        if isinstance(v, TensorRef):
            if v.index not in table:
                raise _Damaged(f"replicated tensor {v.index} is in no shard")
            return table[v.index]
        return v

    skeleton = _mapping(skeleton, "replicated structure")
    missing = [n for n in names if n not in skeleton]
    if missing:
        raise TrainingStateError(f"the checkpoint has no replicated state for {missing}")
    return {n: _map_tree(skeleton[n], leaf) for n in names}


def _decide_restore_handshake(hellos: list[dict[str, Any]]) -> None:
    for rank, h in enumerate(hellos):
        if h.get("error"):
            raise decode_error(h["error"])
    steps = {h["step"] for h in hellos}
    if len(steps) != 1:
        detail = ", ".join(f"rank {r}: {h['step']}" for r, h in enumerate(hellos))
        raise DistributedError(f"ranks asked to restore different steps ({detail})")


def _decide_staging(results: list[dict[str, Any]]) -> dict[str, Any]:
    for rank, r in enumerate(results):
        if "fatal" in r:
            err = decode_error(r["fatal"])
            if isinstance(err, ObjckptError) and not err.message.startswith("rank "):
                err.message = f"rank {rank}: {err.message}"
                err.args = (err.message,)
            raise err
    damaged = {str(rank): r["damaged"] for rank, r in enumerate(results) if "damaged" in r}
    if damaged:
        return {"damaged": damaged}
    return {"ok": True}


def _decide_restored(results: list[dict[str, Any]]) -> int:
    failed = {rank: r["error"] for rank, r in enumerate(results) if r.get("error")}
    if failed:
        rank, err = min(failed.items())
        exc = decode_error(err)
        raise TrainingStateError(
            f"applying the checkpoint failed on rank(s) {sorted(failed)} (rank {rank}: "
            f"{type(exc).__name__}: {exc}); the live state of those ranks may be partially loaded"
        )
    step = agree_on_step({rank: r["step"] for rank, r in enumerate(results)})
    assert step is not None
    return step
