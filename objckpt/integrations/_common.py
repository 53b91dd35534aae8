"""What the framework plug-ins share: opening the run root, a single-writer commit, collectives
that make every rank raise the same error, and the restricted ``torch.load`` codec.

Nothing here imports a training framework; torch is imported only by the functions that need it.
"""

from __future__ import annotations

import atexit
import logging
import platform
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import IO, Any

from .. import layout
from ..commit import Coordinator
from ..errors import CommitError, DistributedError
from ..manifest import Manifest, ShardReceipt
from ..reader import agree_on_step
from ..store import Store, open_store
from ..store.base import BytesSource
from ..writer import ShardWriter

log = logging.getLogger("objckpt.integrations")

#: a ``torch.save`` stream held in memory up to this size, then spilled to a temporary file
DEFAULT_SPOOL_BYTES = 64 * 1024 * 1024


def open_root(uri_or_store: str | Store, store_options: Mapping[str, Any] | None) -> Store:
    """The run root's store: a :class:`Store` is used as given, a URI is opened."""
    if isinstance(uri_or_store, Store):
        if store_options:
            raise ValueError("store_options only apply when a URI is given, not a Store")
        return uri_or_store
    return open_store(uri_or_store, **dict(store_options or {}))


def software(**extra: str | None) -> dict[str, str]:
    """Versions recorded in the manifest's run identity."""
    from .. import __version__

    out = {"objckpt": __version__, "python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    out.update({k: v for k, v in extra.items() if v})
    return out


def commit_single_writer(
    store: Store,
    step: int,
    shards: Iterable[tuple[str, BytesSource]],
    *,
    progress: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    topology: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write ``shards`` as rank 0 of a fresh attempt and commit it with ``world_size=1``.

    For frameworks where one process holds the whole checkpoint (Lightning under DDP saves on
    global rank 0 only). The commit checks the shards against the store, writes the manifest
    create-if-absent and advances ``LATEST`` forward-only, like any other commit.

    Raises:
        CommitError / CommitConflict: as :meth:`Coordinator.commit`; a shard that fails to
            upload raises its store error and nothing is committed.
    """
    attempt = layout.new_attempt_id()
    writer = ShardWriter(store, step=step, attempt=attempt, rank=0)
    for name, source in shards:
        writer.write(name, source)
    return Coordinator(store, world_size=1).commit(
        step,
        attempt,
        {0: writer.receipts},
        progress=progress,
        run=run,
        topology=topology,
        metadata=metadata,
    )


# ---------------------------------------------------------------------------------- collectives


def dist_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised default process group, else ``(0, 1)``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


#: communicators created by a :class:`Collective` and not closed yet, with a weak reference to
#: their owner; whatever is still here at exit is closed by :func:`_close_open_comms`
_open_comms: dict[int, tuple[Any, weakref.ref[Collective]]] = {}
_open_comms_lock = threading.Lock()
_atexit_registered = False


def _close_open_comms() -> None:
    """``atexit``: destroy the gloo groups of every communicator still open, and drop them.

    A ``ProcessGroupGloo`` still referenced when the interpreter finalizes is torn down (its
    worker and transport threads joined) while the interpreter is being dismantled, which can
    abort the process (``terminate called without an active exception``, exit code -6) after the
    work itself succeeded. This runs while the interpreter is still whole; ``atexit`` runs it
    before handlers registered earlier, such as one that destroys the default group.
    """
    with _open_comms_lock:
        entries = list(_open_comms.values())
        _open_comms.clear()
    for comm, owner_ref in entries:
        owner = owner_ref()
        try:
            if owner is not None:
                owner.close()  # also drops the owner's reference to the groups
            else:
                comm.close()
        except Exception as exc:  # noqa: BLE001 - best effort at exit
            log.debug("closing objckpt's checkpoint process groups at exit failed: %s", exc)
    # returning drops the last references: the groups are freed now, not at finalization


def _track(comm: Any, owner: Collective) -> None:
    global _atexit_registered
    with _open_comms_lock:
        _open_comms[id(comm)] = (comm, weakref.ref(owner))
        if not _atexit_registered:
            atexit.register(_close_open_comms)
            _atexit_registered = True


def _untrack(comm: Any) -> None:
    with _open_comms_lock:
        _open_comms.pop(id(comm), None)


class Collective:
    """objckpt's checkpoint collectives (:mod:`objckpt.training.dist`), created on first use.

    Creating them is itself a collective on the default group (two ``new_group`` calls), so the
    first call that needs them must be made by every rank, as every method here must.

    The gloo groups are released by :meth:`close` (the plug-ins call it from their teardown, on
    every rank); a later call creates new ones. Groups still open when the interpreter exits are
    destroyed by an ``atexit`` handler, never left to the interpreter's finalization.
    """

    def __init__(self, *, timeout: float, handshake_timeout: float) -> None:
        self.timeout = timeout
        self.handshake_timeout = handshake_timeout
        self._comm: Any = None
        self._lock = threading.Lock()

    @property
    def comm(self) -> Any:
        with self._lock:
            if self._comm is None:
                from ..training.dist import DistComm, make_comm

                comm = make_comm(timeout=self.timeout, handshake_timeout=self.handshake_timeout)
                if isinstance(comm, DistComm):
                    _track(comm, self)
                self._comm = comm
            return self._comm

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def agree(
        self, obj: Any, decide: Callable[[list[Any]], Any], what: str, *, handshake: bool = False
    ) -> Any:
        """Gather, decide on rank 0, broadcast; every rank returns or raises the same thing."""
        return self.comm.agree(obj, decide, what, handshake=handshake)

    def close(self) -> None:
        """Destroy the gloo groups (if any were created) and drop this object's reference to
        them, so their threads are joined now, not at interpreter exit. Every rank should call
        it; it sends nothing, is idempotent and never raises."""
        with self._lock:
            comm, self._comm = self._comm, None
        if comm is None:
            return
        _untrack(comm)
        try:
            comm.close()
        except Exception as exc:  # noqa: BLE001 - releasing resources: log, never raise
            log.warning("could not destroy objckpt's checkpoint process groups: %s", exc)


def error_report(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def decide_restored(reports: list[Any]) -> int | None:
    """Invariant 13 on rank 0: every rank restored the same step, or every rank raises."""
    failed = {r: rep["error"] for r, rep in enumerate(reports) if rep.get("error")}
    if failed:
        why = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
        raise DistributedError(f"not every rank could load the checkpoint ({why})")
    return agree_on_step({r: rep.get("step") for r, rep in enumerate(reports)})


def agree_restored(
    collective: Collective, step: int | None, error: BaseException | None, what: str
) -> int | None:
    """Every rank reports the step it restored (or its error); all return the same step or all
    raise. A single process raises its own error unchanged."""
    if collective.world_size == 1:
        if error is not None:
            raise error
        return step
    report = {"step": step, "error": error_report(error) if error is not None else None}
    return collective.agree(report, decide_restored, what)


def commit_gathered(
    store: Store,
    step: int,
    attempt: str,
    reports: list[Any],
    **commit_kwargs: Any,
) -> Manifest:
    """Rank 0: commit from every rank's gathered ``{"receipts": [...]}`` or ``{"error": "..."}``."""
    receipts: dict[int, Any] = {}
    for rank, rep in enumerate(reports):
        if rep.get("error"):
            receipts[rank] = rep["error"]
        else:
            receipts[rank] = [
                ShardReceipt.from_dict(d, key=f"rank {rank} receipt") for d in rep.get("receipts", [])
            ]
    try:
        return Coordinator(store, world_size=len(reports)).commit(step, attempt, receipts, **commit_kwargs)
    except CommitError:
        raise
    except Exception as exc:  # noqa: BLE001 - becomes the same CommitError on every rank
        raise CommitError(
            f"step {step} attempt {attempt} not committed: the coordinator failed: {error_report(exc)}",
            {0: error_report(exc)},
        ) from exc


# ---------------------------------------------------------------------------------- torch codec


def torch_save_spooled(obj: Any, *, spool_bytes: int = DEFAULT_SPOOL_BYTES) -> IO[bytes]:
    """``torch.save(obj)`` into a spooled temporary file (memory up to ``spool_bytes``, then
    disk), rewound, ready for :meth:`ShardWriter.write`. The caller closes it."""
    import torch

    spool = tempfile.SpooledTemporaryFile(max_size=spool_bytes)  # noqa: SIM115 - caller closes
    try:
        torch.save(obj, spool)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return spool  # type: ignore[return-value]


def torch_load_verified(
    chunks: Iterable[bytes],
    *,
    allowed: Iterable[Any] = (),
    map_location: Any = None,
    spool_bytes: int = DEFAULT_SPOOL_BYTES,
) -> Any:
    """``torch.load(weights_only=True)`` of a shard stream, after the stream is fully read.

    ``chunks`` is a verifying stream (:meth:`Reader.open_shard`): it raises its
    :class:`ChecksumMismatchError` on the last ``next()``, so nothing is unpickled before the
    bytes are known to be the committed ones. Unpickling is restricted to tensors, primitive
    containers and the classes in ``allowed`` (``torch.serialization.safe_globals``): a shard
    naming any other global is rejected (``pickle.UnpicklingError``), never executed.
    """
    import torch

    with tempfile.SpooledTemporaryFile(max_size=spool_bytes) as spool:
        for chunk in chunks:
            spool.write(chunk)
        spool.seek(0)
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(spool, map_location=map_location, weights_only=True)


def move_to(obj: Any, device: Any) -> Any:
    """Every tensor in a nested container moved to ``device`` (None: unchanged)."""
    if device is None:
        return obj
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        moved = {k: move_to(v, device) for k, v in obj.items()}
        if type(obj) is dict:
            return moved
        out = type(obj)()
        out.update(moved)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined]
        return out
    if isinstance(obj, list):
        return [move_to(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(move_to(v, device) for v in obj)
    return obj
