"""What the framework plug-ins share beyond the coordination layer: the restricted ``torch.load``
codec for frameworks that pickle their checkpoints, and moving a loaded checkpoint to a device.

The multi-rank protocol itself is not here: every plug-in saves through
:class:`objckpt.coordination.SaveSession` and restores through
:class:`objckpt.coordination.RestoreSession`. Nothing here imports a training framework; torch is
imported only by the functions that need it.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import IO, Any

from ..coordination.comm import LocalComm
from ..coordination.mirror import Mirror, save_session
from ..coordination.restore import RestoreSession
from ..coordination.save import SaveSession
from ..gc import RetentionPolicy
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..store import Store
from ..store.base import BytesSource
from ..training.dist import LazyComm
from ..tree import map_tree

log = logging.getLogger("objckpt.integrations")

#: a ``torch.save`` stream held in memory up to this size, then spilled to a temporary file
DEFAULT_SPOOL_BYTES = 64 * 1024 * 1024


class PluginSessions:
    """The save session of a plug-in whose framework calls it where every rank is present but
    not at construction: the communicator (gloo groups) is created on first use, released by
    :meth:`close`, and a later use makes a new one and a new session over it."""

    def __init__(
        self,
        store: Store,
        *,
        label: str,
        keep_last: int | None,
        keep_every: int | None,
        grace_period: timedelta,
        metrics: CheckpointMetrics | None,
        config_hash: str | None,
        timeout: float,
        handshake_timeout: float,
        mirror: Store | None = None,
    ) -> None:
        self.store = store
        #: the mirror run root (``mirror=`` of the plug-in) and its replicator
        self.mirror_store = mirror
        self.mirror: Mirror | None = None
        self.label = label
        self.retention = RetentionPolicy.from_options(keep_last, keep_every)
        self.grace_period = grace_period
        self.metrics = metrics
        self.identity = {"config_hash": config_hash} if config_hash is not None else {}
        self.comm = LazyComm(timeout=timeout, handshake_timeout=handshake_timeout)
        self._saves: SaveSession | None = None
        if mirror is not None:
            self.mirror = Mirror(
                store, mirror, retention=self.retention, grace_period=grace_period, metrics=metrics
            )

    def saves(self) -> SaveSession:
        comm = self.comm.get()
        if self._saves is None or self._saves.comm is not comm:
            self._saves = save_session(
                self.store,
                comm,
                mirror=self.mirror,
                retention=self.retention,
                grace_period=self.grace_period,
                metrics=self.metrics,
                identity=self.identity,
                label=f"{self.label} save",
            )
        return self._saves

    def restores(self) -> RestoreSession:
        return RestoreSession(
            self.store,
            self.comm.get(),
            metrics=self.metrics,
            label=f"{self.label} load",
            mirror=self.mirror_store,
        )

    def close(self) -> None:
        self._saves = None
        if self.mirror is not None:
            self.mirror.wait()  # the last commit reaches the mirror (bounded by the retry budgets)
        self.comm.close()


def commit_single_writer(
    store: Store,
    step: int,
    shards: Iterable[tuple[str, BytesSource]],
    *,
    progress: Mapping[str, Any] | None = None,
    run: Mapping[str, Any] | None = None,
    topology: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    session: SaveSession | None = None,
) -> Manifest:
    """Write ``shards`` as rank 0 of a fresh attempt and commit it with ``world_size=1``: the
    save session on a one-process world, for frameworks where one process holds the whole
    checkpoint (Lightning under DDP saves on global rank 0 only).

    Raises:
        CommitError / CommitConflict: as :meth:`SaveSession.finish`; a shard that fails to
            upload fails the commit (naming it) and nothing is committed.
    """
    session = session or SaveSession(store, LocalComm())

    def write(ticket: Any) -> None:
        for name, source in shards:
            ticket.writer.write(name, source)

    return session.save(step, write, progress=progress, run=run, topology=topology, metadata=metadata)


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
    return spool


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

    return map_tree(obj, lambda v: v.to(device) if isinstance(v, torch.Tensor) else v)
