"""``CheckpointManager``'s construction: option checks and the coordination objects it drives.

Separate from the manager so that its constructor reads as the order of what happens (check the
options, open the roots, create the process groups, check the roots, wire the sessions) while the
details live here: :func:`validate_options` raises the ``ValueError`` of a bad option before any
store is opened or any collective issued; :func:`wire_sessions` builds the retention policy, the
mirror, the save and restore sessions and the background saver from the checked options
(:class:`Sessions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..coordination.comm import Comm
from ..coordination.mirror import Mirror, save_session
from ..coordination.restore import RestoreSession
from ..coordination.save import SaveSession
from ..gc import RetentionPolicy
from ..metrics import CheckpointMetrics
from ..store import Store
from ._save_errors import ON_SAVE_ERROR
from .background import BackgroundSaver

__all__ = ["ASYNC_POLICIES", "SKIP", "WAIT", "Sessions", "validate_options", "wire_sessions"]

#: what save_async does while a save is in flight
WAIT, SKIP = "wait", "skip"
ASYNC_POLICIES = (WAIT, SKIP)


def validate_options(
    async_policy: str, on_save_error: str, check: bool | str, keep_last: int | None, every: int | None
) -> None:
    """Raise ``ValueError`` for the first bad option (in this order); local, no side effect."""
    if async_policy not in ASYNC_POLICIES:
        raise ValueError(f"async_policy must be one of {ASYNC_POLICIES}, got {async_policy!r}")
    if on_save_error not in ON_SAVE_ERROR:
        raise ValueError(f"on_save_error must be one of {ON_SAVE_ERROR}, got {on_save_error!r}")
    if check not in (True, False, "write"):
        raise ValueError(f"check must be True, False or 'write', got {check!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    if every is not None and every < 1:
        raise ValueError(f"every must be >= 1 or None, got {every}")


@dataclass(frozen=True)
class Sessions:
    """The coordination objects one manager drives (see :func:`wire_sessions`)."""

    #: replicates every commit to the mirror root (None without one)
    mirror: Mirror | None
    saves: SaveSession
    restores: RestoreSession
    #: runs save_async's background half on the background channel
    background: BackgroundSaver


def wire_sessions(
    store: Store,
    comm: Comm,
    mirror_store: Store | None,
    *,
    keep_last: int | None,
    keep_every: int | None,
    gc_grace_period: timedelta,
    metrics: CheckpointMetrics | None,
    mirror_policy: str,
    identity: dict[str, Any],
    key_spreading: bool,
    verify: str,
    primary_down: BaseException | None,
) -> Sessions:
    """Build the sessions over ``store`` (and ``mirror_store``), with retention when
    ``keep_last`` is set, and start watching ``store`` in ``metrics``.

    Local: no request, no collective (the background channel, ``comm.background()``, was
    created with the communicator).

    Raises:
        ValueError: a bad ``mirror_policy``, or a mirror that is the primary.
        DistributedError: ``comm`` was created without a background channel.
    """
    retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every) if keep_last is not None else None
    mirror = (
        Mirror(
            store,
            mirror_store,
            retention=retention,
            grace_period=gc_grace_period,
            metrics=metrics,
            policy=mirror_policy,
        )
        if mirror_store is not None
        else None
    )
    saves = save_session(
        store,
        comm,
        mirror=mirror,
        retention=retention,
        grace_period=gc_grace_period,
        metrics=metrics,
        identity=identity,
        key_spreading=key_spreading,
        verify=verify,
    )
    restores = RestoreSession(store, comm, metrics=metrics, mirror=mirror_store)
    restores.primary_down = primary_down  # the first restore skips a primary known down
    # The background save thread's own channel: it alone issues collectives there, so their
    # order is the same on every rank whatever the training thread does meanwhile.
    background = BackgroundSaver(saves, comm.background())
    if metrics is not None:
        metrics.watch_store(store)
    return Sessions(mirror=mirror, saves=saves, restores=restores, background=background)
