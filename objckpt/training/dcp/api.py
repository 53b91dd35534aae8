"""``save_sharded`` / ``async_save_sharded`` / ``load_sharded``: DCP through the sessions."""

from __future__ import annotations

import concurrent.futures
import logging
import warnings
from collections.abc import Mapping
from typing import Any, Union, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import (
    LoadPlanner,
    SavePlanner,
)

from ...coordination.mirror import Mirror
from ...coordination.restore import RestoreSession
from ...coordination.roots import open_root
from ...errors import (
    CommitConflict,
    CommitError,
    NoCheckpointError,
    ObjckptError,
)
from ...gc import RetentionPolicy
from ...layout import check_step
from ...manifest import Manifest
from ...metrics import CheckpointMetrics
from ...store import Store
from ..dist import shared_comm
from .reader import ObjckptStorageReader
from .writer import ObjckptStorageWriter

log = logging.getLogger("objckpt.training.dcp")

StoreLike = Union[str, Store]


def _unwrap(wrapped: Any) -> BaseException:
    """DCP stores each rank's failure as ``(exception, traceback summary)``."""
    if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
        return wrapped[0]
    if isinstance(wrapped, BaseException):
        return wrapped
    return RuntimeError(str(wrapped))


def _failures(cpe: CheckpointException) -> dict[int, BaseException]:
    return {int(rank): _unwrap(w) for rank, w in sorted(cpe.failures.items())}


def commit_error_from(cpe: CheckpointException, *, step: int, location: str) -> CommitError:
    """Translate DCP's ``CheckpointException`` (a ``BaseException``) from a save into a
    :class:`CommitError` (``CommitConflict`` if any rank lost the step to another attempt).

    Built only from what every rank holds identically (failing ranks, exception types and
    messages), so every rank raises the same error."""
    fails = _failures(cpe)
    cls = CommitConflict if any(isinstance(e, CommitConflict) for e in fails.values()) else CommitError
    reasons = {rank: f"{type(e).__name__}: {e}" for rank, e in fails.items()}
    return cls(f"DCP save of step {step} to {location} was not committed", reasons)


# ------------------------------------------------------------------------------ convenience


def save_sharded(
    state_dict: dict[str, Any],
    uri_or_store: StoreLike,
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: SavePlanner | None = None,
    progress: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    retention: RetentionPolicy | None = None,
    metrics: CheckpointMetrics | None = None,
    mirror: StoreLike | Mirror | None = None,
    dedup: bool = True,
    **store_options: Any,
) -> int:
    """``dcp.save`` ``state_dict`` as committed step ``step`` on every rank of the group.

    Call on every rank (with no process group initialized: a single-process save). Returns the
    committed step on every rank. ``retention`` is applied by the coordinator after the commit;
    ``store_options`` open a URI (as :func:`objckpt.store.open_store`). ``dedup``: tensor items
    unchanged since the parent checkpoint are not written again (see
    :class:`ObjckptStorageWriter`).

    ``mirror``: a :class:`~objckpt.coordination.mirror.Mirror` (long-lived: the commit is
    handed to it and replicated in the background), or a second run root (URI or Store), which
    the coordinator re-commits the checkpoint on before returning (with ``retention`` there
    too); a failed copy is logged loudly, never the save's failure.

    Atomicity: the step is committed whole (manifest + pointer) or not at all; a failure never
    modifies any other checkpoint.

    Raises:
        CommitError: the save was not committed; ``failures`` names every failing rank, and every
            rank raises the same error. :class:`CommitConflict` when another attempt already
            committed this step. Never DCP's ``CheckpointException`` (a ``BaseException``).
    """
    step = check_step(step)
    writer = ObjckptStorageWriter(
        uri_or_store, step, progress=progress, run=run, metadata=metadata,
        retention=retention, metrics=metrics, store_options=store_options, dedup=dedup,
    )  # fmt: skip
    try:
        # torch.distributed.checkpoint re-exports it without __all__ (mypy: not exported)
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=process_group)  # type: ignore[attr-defined]
        if mirror is not None and writer.manifest is not None:  # the coordinator, committed
            _mirror_commit(writer.store, writer.manifest, mirror, retention, metrics)
    except CheckpointException as cpe:
        raise commit_error_from(cpe, step=step, location=writer.store.location) from cpe
    finally:
        writer.close()
    return step


def _mirror_commit(
    store: Store,
    manifest: Manifest,
    mirror: StoreLike | Mirror,
    retention: RetentionPolicy | None,
    metrics: CheckpointMetrics | None,
) -> None:
    if isinstance(mirror, Mirror):
        mirror.submit(manifest)
        return
    target, owns = open_root(mirror)
    try:
        once = Mirror(store, target, retention=retention, metrics=metrics, policy="wait")
        once.submit(manifest)
        once.close(wait=True)  # logged loudly and counted if it failed; the save is committed
    finally:
        if owns:
            target.close()


def async_save_sharded(
    state_dict: dict[str, Any],
    uri_or_store: StoreLike,
    step: int,
    *,
    process_group: dist.ProcessGroup | None = None,
    progress: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    retention: RetentionPolicy | None = None,
    metrics: CheckpointMetrics | None = None,
    dedup: bool = True,
    **store_options: Any,
) -> concurrent.futures.Future[int]:
    """``dcp.async_save`` (thread executor) to committed step ``step``.

    Returns once ``state_dict`` is staged (copied to CPU); the future resolves to ``step`` when
    committed, or raises :class:`CommitError` (never DCP's ``CheckpointException``).
    """
    step = check_step(step)
    writer = ObjckptStorageWriter(
        uri_or_store, step, progress=progress, run=run, metadata=metadata,
        retention=retention, metrics=metrics, store_options=store_options, dedup=dedup,
    )  # fmt: skip
    try:
        # torch.distributed.checkpoint re-exports it without __all__ (mypy: not exported)
        response = dcp.async_save(state_dict, storage_writer=writer, process_group=process_group)  # type: ignore[attr-defined]
    except CheckpointException as cpe:
        writer.close()
        raise commit_error_from(cpe, step=step, location=writer.store.location) from cpe
    # torch >= 2.7 returns an AsyncSaveResponse holding the upload future, older torch the future
    # itself: the attribute test covers both, which mypy cannot follow.
    upload = cast("concurrent.futures.Future[Any]", getattr(response, "upload_completion", response))
    outcome: concurrent.futures.Future[int] = concurrent.futures.Future()

    def done(f: Any) -> None:
        try:
            f.result()
        except CheckpointException as cpe:
            err = commit_error_from(cpe, step=step, location=writer.store.location)
            err.__cause__ = cpe
            outcome.set_exception(err)
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            outcome.set_exception(exc)
        else:
            outcome.set_result(step)
        finally:
            writer.close()

    upload.add_done_callback(done)
    return outcome


def load_sharded(
    state_dict: dict[str, Any],
    uri_or_store: StoreLike,
    step: int | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    planner: LoadPlanner | None = None,
    metrics: CheckpointMetrics | None = None,
    mirror: StoreLike | None = None,
    **store_options: Any,
) -> int:
    """``dcp.load`` into ``state_dict`` (in place, resharding as needed); returns the step loaded.

    Runs the restore session: rank 0 resolves the checkpoint and sends its manifest to the
    others (no other rank lists or reads a manifest), every rank loads its part through DCP,
    verifying every item's CRC32C. ``step=None``: the newest committed checkpoint; if any rank
    finds it damaged (:func:`objckpt.errors.is_damage`), every rank falls back to its parent
    together, loudly (a ``RuntimeWarning`` and a log warning). An outage, a permission error or a
    policy refusal is raised, never a reason to fall back. An explicit ``step`` never falls back.
    ``mirror``: the run root ``save_sharded(mirror=)`` copied to; its copy is loaded when the
    primary cannot be read or its checkpoint is damaged (loudly).

    Raises (on every rank alike):
        NoCheckpointError: nothing is committed, nothing usable is, or ``step`` is not
            committed or is damaged (the message says why).
        LoadRefusedError: a bytes item that ``torch.load(weights_only=True)`` refuses.
        DistributedError: ranks disagree (step asked, run root) or a rank is missing.
        Other exceptions as the failing rank raised them (e.g. DCP's ``RuntimeError`` for a key
        missing from the checkpoint), never DCP's ``CheckpointException``.
    """
    store, owns = open_root(uri_or_store, store_options)
    mirror_store, owns_mirror = open_root(mirror) if mirror is not None else (None, False)
    try:
        session = RestoreSession(
            store, shared_comm(process_group), metrics=metrics, label="DCP load", mirror=mirror_store
        )

        def stage(manifest: Manifest) -> int:
            # the session's root: the mirror's after a restore from it
            reader = ObjckptStorageReader(session.reader.store, manifest=manifest)
            try:
                # torch.distributed.checkpoint re-exports it without __all__ (mypy: not exported)
                dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=process_group)  # type: ignore[attr-defined]
            except CheckpointException as cpe:
                raise _load_error(_failures(cpe), reader) from cpe
            return manifest.step

        restored = session.restore(stage, step=step)
        if restored is None:
            raise NoCheckpointError(f"no committed DCP checkpoint under {store.location}")
        for bad, why in restored.fallbacks:
            msg = f"objckpt: DCP checkpoint step {bad} under {store.location} is damaged ({why}); fell back"
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return restored.step
    finally:
        if owns:
            store.close()
        if owns_mirror and mirror_store is not None:
            mirror_store.close()


def _load_error(fails: dict[int, BaseException], reader: ObjckptStorageReader) -> BaseException:
    # Resolution errors: DCP reduces them to an AssertionError with the text; this rank's reader
    # kept the original (e.g. a ManifestError), which is what the caller can act on.
    first_rank, first = next(iter(fails.items()))
    err: BaseException = reader.metadata_error if reader.metadata_error is not None else first
    if not isinstance(err, Exception):  # e.g. a KeyboardInterrupt on another rank
        err = ObjckptError(f"DCP load failed on rank {first_rank}: {type(err).__name__}: {err}")
    if len(fails) > 1 or first_rank != reader.rank or err is not first:
        err.add_note(
            "DCP load failed on ranks "
            + ", ".join(f"{r} ({type(e).__name__}: {str(e)[:200]})" for r, e in fails.items())
        )
    return err
