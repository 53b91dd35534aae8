"""PyTorch Lightning: a ``CheckpointIO`` that commits every Lightning checkpoint to a run root.

::

    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.io import AsyncCheckpointIO   # optional: save in a thread
    from objckpt.integrations.lightning import ObjckptCheckpointIO

    io = ObjckptCheckpointIO("s3://bucket/runs/eta")
    trainer = Trainer(strategy="ddp", plugins=[io])          # or plugins=[AsyncCheckpointIO(io)]
    trainer.fit(model)                                         # ModelCheckpoint saves through io
    trainer.fit(model, ckpt_path="latest")                     # resume from the newest commit

How Lightning paths map to checkpoints: a save commits step ``checkpoint["global_step"]`` (one
shard, ``lightning.ckpt``) and records the file name Lightning asked for in the manifest's
metadata. Lightning's local ``dirpath`` only supplies names; nothing is written there. A load
path resolves, in order, to: the newest valid commit for ``"latest"``, ``"last"``,
``"last.ckpt"`` or the run root's URI (falling back to older commits, loudly, if the newest is
damaged); the step in a name containing ``step=N`` (``epoch=0-step=10.ckpt``); otherwise the
newest commit whose recorded name equals the file name.

Under DDP Lightning calls ``save_checkpoint`` on global rank 0 only (the state is replicated), so
this plug-in writes and commits with ``world_size=1`` from rank 0; ``load_checkpoint`` is called
by every rank, and the ranks check collectively that they loaded the same step. Strategies that
save sharded state themselves (FSDP, DeepSpeed, ModelParallel) do not use ``CheckpointIO``.

Serialization: objckpt's own pickle-free format (:mod:`objckpt.training.serialization`), never
``torch.save``/``pickle``. Loading therefore runs no code from the store whatever
``weights_only`` says. A value the format cannot hold (e.g. an ``argparse.Namespace`` in the
hyper-parameters) fails the save with :class:`UnsupportedStateError` naming its path -- at the
first checkpoint, after a whole epoch, unless the :class:`ObjckptHyperparametersCheck` callback
checks ``save_hyperparameters()`` when ``fit`` starts (``CheckpointIO`` sees nothing before the
first save)::

    trainer = Trainer(plugins=[io], callbacks=[ObjckptHyperparametersCheck()])
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from ..coordination.comm import Comm, LocalComm
from ..coordination.mirror import Mirror, save_session
from ..coordination.restore import RestoreSession
from ..coordination.roots import open_root
from ..defaults import HANDSHAKE_TIMEOUT, TIMEOUT
from ..errors import CommitConflict, NoCheckpointError, StoreError
from ..gc import RetentionPolicy, plan_gc, run_gc
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..reader import Reader
from ..store import Store
from ..training.dist import LazyComm, world
from . import _common

try:  # the unified package first, then the standalone pytorch_lightning's fabric
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        # The standalone package's class: the same API, but a distinct type to mypy.
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO  # type: ignore[assignment]
    except ImportError as exc:
        raise ImportError(
            "objckpt.integrations.lightning needs PyTorch Lightning: pip install 'lightning>=2.6'"
        ) from exc

__all__ = [
    "SHARD_NAME",
    "ObjckptCheckpointIO",
    "ObjckptHyperparametersCheck",
    "check_hyperparameters",
    "step_from_path",
]

log = logging.getLogger("objckpt.integrations.lightning")

#: the one shard of a Lightning checkpoint
SHARD_NAME = "lightning.ckpt"
#: load paths that mean "the newest committed checkpoint"
LATEST_NAMES = frozenset({"latest", "last", "last.ckpt"})

_STEP_RE = re.compile(r"(?:^|[^A-Za-z0-9])step=(\d+)")


def step_from_path(path: str | os.PathLike[str]) -> int | None:
    """The ``N`` of ``step=N`` in a checkpoint file name (``epoch=0-step=10.ckpt`` -> 10)."""
    m = _STEP_RE.search(os.path.basename(os.fspath(path)))
    return int(m.group(1)) if m else None


class ObjckptCheckpointIO(_CheckpointIO):
    """Lightning ``CheckpointIO`` backed by an objckpt run root.

    Args:
        uri_or_store: run root (``s3://...``, ``gs://...``, ``file:///...``) or a Store.
        store_options: options for :func:`objckpt.store.open_store` when a URI is given.
        mirror: a second run root (URI or Store: another bucket, region or cloud) every commit
            is replicated to in the background (``CheckpointManager(mirror=)``); loads take its
            copy when the primary cannot be read or its checkpoint is damaged, loudly.
        metadata: JSON recorded in every manifest.
        config_hash: recorded in the manifest's run identity.
        collective_load: check with the other ranks that every rank loaded the same step
            (invariant 13). Default: when ``torch.distributed`` is initialised with more than one
            rank. Every rank must then call ``load_checkpoint`` (Lightning's resume does).
        timeout, handshake_timeout: seconds for those collectives (see ``CheckpointManager``).

    Thread-safe: ``AsyncCheckpointIO`` may run :meth:`save_checkpoint` in its worker thread.
    """

    def __init__(
        self,
        uri_or_store: str | Store,
        *,
        store_options: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
        collective_load: bool | None = None,
        timeout: float = TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        metrics: CheckpointMetrics | None = None,
        mirror: str | Store | None = None,
    ) -> None:
        super().__init__()
        self.store, _ = open_root(uri_or_store, store_options)
        self.mirror_store = open_root(mirror)[0] if mirror is not None else None
        self.mirror = (
            Mirror(self.store, self.mirror_store, metrics=metrics) if self.mirror_store is not None else None
        )
        self.uri = uri_or_store if isinstance(uri_or_store, str) else None
        self.reader = Reader(self.store)
        self.metadata = dict(metadata or {})
        self.config_hash = config_hash
        self.collective_load = collective_load
        self.metrics = metrics
        self._comm = LazyComm(timeout=timeout, handshake_timeout=handshake_timeout)
        identity = {"config_hash": config_hash} if config_hash is not None else {}
        # Lightning saves on global rank 0 only: a one-process save session
        self._saves = save_session(
            self.store,
            LocalComm(),
            mirror=self.mirror,
            metrics=metrics,
            identity=identity,
            label="Lightning save",
        )
        self._lock = threading.RLock()
        #: steps this process committed or loaded: a second save of one is a no-op
        self._known: set[int] = set()
        #: file name -> step, for names this process saved or loaded
        self._names: dict[str, int] = {}
        #: steps Lightning asked to remove that are not yet safe to delete
        self._pending_removal: set[int] = set()
        self._saving = 0

    # ------------------------------------------------------------------ save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Commit ``checkpoint`` as step ``checkpoint["global_step"]`` (from ``path`` if absent).

        Returns once the manifest is written (and ``LATEST`` advanced). A step this process
        already committed or loaded is not written again (Lightning saves ``last.ckpt`` and the
        top-k file of one step separately; both name that one commit).

        Raises:
            UnsupportedStateError: a value the pickle-free format cannot hold (path named).
            CommitConflict: another run already committed this step under the run root.
            CommitError, StoreError: the save failed; nothing was committed.
            TypeError: ``storage_options`` given (as Lightning's own ``TorchCheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(
                f"ObjckptCheckpointIO.save_checkpoint does not take storage_options; got {storage_options!r}"
            )
        from ..training import serialization

        name = os.path.basename(os.fspath(path))
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = step_from_path(path)
        if step is None:
            raise ValueError(
                f"cannot tell the step of Lightning checkpoint {path!r}: it has no integer "
                "'global_step' and its name has no 'step=N'"
            )
        with self._lock:
            if step in self._known:
                log.info(
                    "step %d is already committed under %s; %s names that checkpoint",
                    step,
                    self.store.location,
                    name,
                )
                self._names[name] = step
                return
            self._saving += 1
        try:
            encoded = serialization.encode(checkpoint)
            _, world_size = world()
            try:
                _common.commit_single_writer(
                    self.store,
                    step,
                    [(SHARD_NAME, encoded)],
                    progress={"global_step": step, "epoch": checkpoint.get("epoch")},
                    topology={"writer": "global rank 0", "training_world_size": world_size},
                    metadata={
                        **self.metadata,
                        "integration": "lightning",
                        "lightning": {
                            "name": name,
                            "path": os.fspath(path),
                            "version": checkpoint.get("pytorch-lightning_version"),
                        },
                    },
                    session=self._saves,
                )
            except CommitConflict as exc:
                raise CommitConflict(
                    f"Lightning checkpoint {name}: step {step} is already committed under "
                    f"{self.store.location} by another run or attempt (resume from the latest "
                    f"commit, or use a fresh run root): {exc}"
                ) from exc
            with self._lock:
                self._known.add(step)
                self._names[name] = step
        finally:
            with self._lock:
                self._saving -= 1
        self._collect_pending()

    # ------------------------------------------------------------------ load

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint ``path`` names (see the module docstring), verified.

        ``weights_only`` is accepted for Lightning's signature; loading is always pickle-free.
        ``map_location``: None (tensors on CPU) or a device.

        Raises:
            NoCheckpointError: nothing committed matches ``path``, or the named step is damaged.
            DistributedError: under ``collective_load``, a rank failed or ranks loaded different
                steps (every rank raises).
        """
        if map_location is not None and (callable(map_location) or isinstance(map_location, dict)):
            raise TypeError("ObjckptCheckpointIO.load_checkpoint: map_location must be None or a device")
        kind, value = self._resolve(path)
        if kind == "name":
            value = self._find_by_name(value).step
        session = RestoreSession(
            self.store,
            self._load_comm(),
            metrics=self.metrics,
            label="Lightning load",
            mirror=self.mirror_store,
        )
        restored = session.restore(
            lambda m: self._decode(m, session.reader), step=None if kind == "latest" else int(value)
        )
        if restored is None:
            raise NoCheckpointError(f"no committed Lightning checkpoint under {self.store.location}")
        with self._lock:
            self._known.add(restored.step)
            self._names[os.path.basename(os.fspath(path))] = restored.step
        loaded: dict[str, Any] = _common.move_to(restored.value, map_location)
        return loaded

    def _load_comm(self) -> Comm:
        """The restore session's world: every rank when ``collective_load`` (Lightning's resume
        calls ``load_checkpoint`` on every rank), else this process alone."""
        if self.collective_load is False:
            return LocalComm()
        _, world_size = world()
        return self._comm.get() if world_size > 1 else LocalComm()

    def _resolve(self, path: Any) -> tuple[str, Any]:
        text = os.fspath(path)
        name = os.path.basename(text.rstrip("/"))
        if name in LATEST_NAMES or (self.uri is not None and text.rstrip("/") == self.uri.rstrip("/")):
            return "latest", None
        step = step_from_path(name)
        if step is not None:
            return "step", step
        with self._lock:
            if name in self._names:
                return "step", self._names[name]
        return "name", name

    def _find_by_name(self, name: str) -> Manifest:
        for manifest in self.reader.candidates():
            info = manifest.metadata.get("lightning")
            if isinstance(info, dict) and info.get("name") == name:
                return manifest
        raise NoCheckpointError(
            f"no committed Lightning checkpoint named {name!r} under {self.store.location}"
        )

    def _decode(self, manifest: Manifest, reader: Reader | None = None) -> dict[str, Any]:
        from ..training import serialization

        receipt = next((r for r in manifest.shards if r.name == SHARD_NAME), None)
        if receipt is None:
            raise NoCheckpointError(
                f"step {manifest.step} under {self.store.location} is not a Lightning checkpoint "
                f"(no {SHARD_NAME} shard)"
            )
        reader = reader or self.reader  # the session's: the mirror's after a restore from it
        obj = serialization.decode_stream(reader.open_shard(receipt), total_size=receipt.size)
        if not isinstance(obj, dict):
            raise serialization.SerializationError(f"step {manifest.step}: {SHARD_NAME} does not hold a dict")
        return obj

    # ------------------------------------------------------------------ remove

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the commit ``path`` names, when it is safe (invariants 9 and 15).

        The newest commit, the target of ``LATEST``, and every commit newer than the newest one
        whose shards verify are never deleted; nor is anything while a save is in flight
        (``AsyncCheckpointIO`` calls this before the save it just queued has committed). Such
        removals are remembered and retried after the next commit. The manifest goes before its
        shards. Failures are logged, not raised: checkpoints are intact either way.
        """
        name = os.path.basename(os.fspath(path))
        kind, value = self._resolve(path)
        if kind == "latest":
            log.warning("not removing %s: it names the newest checkpoint", name)
            return
        if kind == "name":
            try:
                value = self._find_by_name(value).step
            except (NoCheckpointError, StoreError) as exc:
                log.info("nothing to remove for %s: %s", name, exc)
                return
        with self._lock:
            self._pending_removal.add(int(value))
            self._names.pop(name, None)
        self._collect_pending()

    def _collect_pending(self) -> None:
        with self._lock:
            if not self._pending_removal or self._saving:
                return
            pending = set(self._pending_removal)
            try:
                steps = set(self.reader.steps())
                pending &= steps
                plan = plan_gc(self.store, RetentionPolicy(keep_last=0, pinned=frozenset(steps - pending)))
                plan.orphans.clear()  # only what Lightning asked for
                plan.uploads.clear()
                if plan.manifests:
                    run_gc(self.store, plan)
                remaining = set(self.reader.steps()) if plan.manifests else steps
            except Exception as exc:  # noqa: BLE001 - deletion is best effort
                log.warning(
                    "could not remove checkpoints %s under %s (kept): %s",
                    sorted(pending),
                    self.store.location,
                    exc,
                )
                return
            deleted = pending - remaining
            self._pending_removal = pending & remaining
            self._known -= deleted
            for step in sorted(deleted):
                log.info("removed checkpoint step %d under %s", step, self.store.location)
            for step in sorted(self._pending_removal):
                log.info(
                    "checkpoint step %d kept for now (%s); removed after a later commit",
                    step,
                    plan.why_kept(step) or "not yet safe",
                )

    def teardown(self) -> None:
        """Retry pending removals, then destroy the gloo groups this plug-in created for its
        load collectives (Lightning calls ``teardown`` on every rank at the end of each
        ``fit``/``validate``/...). The store stays open: Lightning may fit again, and the next
        collective load creates new groups.

        ``AsyncCheckpointIO.teardown`` does not call the wrapped plug-in's; groups that no
        ``teardown`` released are destroyed at interpreter exit (``atexit``), never left to the
        interpreter's finalization.
        """
        if self.mirror is not None:
            self.mirror.wait()  # the last commit reaches the mirror (bounded by the retry budgets)
        try:
            self._collect_pending()
        finally:
            self._comm.close()


# ---------------------------------------------------------------------- hyper-parameters, early


def _callback_base() -> Any:
    """Lightning's ``Callback``: the unified package's trainer first, then pytorch_lightning."""
    import importlib

    try:
        return importlib.import_module("lightning.pytorch.callbacks").Callback
    except ImportError:  # pragma: no cover - depends on what is installed
        return importlib.import_module("pytorch_lightning.callbacks").Callback


_Callback: Any = _callback_base()


def check_hyperparameters(pl_module: Any, datamodule: Any | None = None) -> None:
    """Check now that the hyper-parameters Lightning will put in every checkpoint
    (``save_hyperparameters()`` of the module and of the datamodule) can be saved by
    :class:`ObjckptCheckpointIO`.

    Raises:
        UnsupportedStateError: naming the hyper-parameter's path (``hparams['args']``) and its
            type, with how to fix it.
    """
    from ..errors import UnsupportedStateError
    from ..training import serialization

    for obj, where in ((pl_module, "hparams"), (datamodule, "datamodule.hparams")):
        hparams = getattr(obj, "hparams", None) if obj is not None else None
        if not hparams:
            continue
        # what Lightning's dump_checkpoint stores: dict(hparams), or an OmegaConf container as is
        value = dict(hparams) if isinstance(hparams, dict) else hparams
        try:
            serialization.validate(value, path_root=where)
        except UnsupportedStateError as exc:
            raise UnsupportedStateError(
                f"{type(obj).__name__}.save_hyperparameters() holds a value every checkpoint would fail "
                f"on: {exc}. ObjckptCheckpointIO saves without pickle, so hyper-parameters must be None, "
                "bool, int, float, str, bytes, tensors, or lists/tuples/dicts of them: convert it before "
                "save_hyperparameters() (vars(namespace), str(path)) or leave it out with "
                "save_hyperparameters(ignore=[...])"
            ) from None


class ObjckptHyperparametersCheck(_Callback):  # type: ignore[misc]  # Lightning resolved at import
    """A Lightning callback that runs :func:`check_hyperparameters` in ``setup``, i.e. when
    ``fit`` (or ``validate``/``test``/``predict``) starts, before the sanity check and the first
    epoch -- instead of the first checkpoint failing after a whole epoch.

    ::

        trainer = Trainer(plugins=[ObjckptCheckpointIO(uri)], callbacks=[ObjckptHyperparametersCheck()])
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        check_hyperparameters(pl_module, getattr(trainer, "datamodule", None))
