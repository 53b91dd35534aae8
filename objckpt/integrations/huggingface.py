"""Hugging Face ``Trainer``: commit every checkpoint folder Trainer writes, resume from the store.

::

    from transformers import Trainer, TrainingArguments
    from objckpt.integrations.huggingface import ObjckptCallback, download_checkpoint

    args = TrainingArguments(output_dir="/local/out", save_steps=500, ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ObjckptCallback("s3://bucket/runs/eta", keep_last=3)])
    path = download_checkpoint("s3://bucket/runs/eta", "/local/resume")   # every rank; None: fresh
    trainer.train(resume_from_checkpoint=path)

Saving: Trainer writes ``<output_dir>/checkpoint-<global_step>/`` (model, optimizer, scheduler,
``trainer_state.json``, one ``rng_state_<rank>.pth`` per rank) and then calls ``on_save`` on
every rank, with no barrier of its own. In ``on_save`` each rank uploads the files it owns
(``rng_state_<r>.pth`` belongs to rank ``r``, every other file to rank 0, which wrote them; see
``owner_of``) as shards of one attempt; receipts (or each rank's error) are gathered to rank 0,
which checks that every file any rank saw in its folder was uploaded exactly once, then commits
step ``global_step`` with ``world_size`` = the number of ranks; every rank returns or raises the
same :class:`CommitError`. That gather is the barrier that makes rank 0 wait for every rank's
files. Rank 0 then applies retention (``keep_last``) to the store; Trainer's own
``save_total_limit`` still governs the local folders.

Resuming: :func:`download_checkpoint` picks the newest committed checkpoint whose shards pass the
HEAD check (or ``step=``), downloads every file into ``<local_dir>/checkpoint-<step>/``, verifying
each file's size and CRC32C before it is moved into place, and checks that every rank got the
same step. Trainer itself then loads the folder; transformers 5 loads its ``.pt``/``.pth`` files
with ``torch.load(weights_only=True)`` and the model from safetensors. ``training_args.bin``
(a pickle Trainer writes) is stored and downloaded but never loaded by objckpt or by Trainer's
resume.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from .. import layout
from ..coordination.restore import RestoreSession
from ..coordination.roots import open_root
from ..coordination.save import SaveSession
from ..defaults import GC_GRACE_PERIOD, HANDSHAKE_TIMEOUT, TIMEOUT
from ..errors import CommitError, NoCheckpointError
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..reader import Reader
from ..store import Store
from ..training.dist import LazyComm
from . import _common

try:
    from transformers import TrainerCallback as _Base
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "objckpt.integrations.huggingface needs transformers: pip install 'transformers>=5'"
    ) from None

__all__ = ["CHECKPOINT_PREFIX", "ObjckptCallback", "default_owner", "download_checkpoint"]

log = logging.getLogger("objckpt.integrations.huggingface")

#: Trainer's checkpoint folder prefix (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``)
CHECKPOINT_PREFIX = "checkpoint"

_RNG_RE = re.compile(r"^rng_state_(\d+)\.pth$")


def default_owner(relpath: str, world_size: int) -> int:
    """Which rank uploads ``relpath`` of a Trainer checkpoint folder: ``rng_state_<r>.pth`` is
    rank ``r``'s (each rank writes its own), everything else rank 0's (Trainer writes model,
    optimizer, scheduler and state on the main process)."""
    m = _RNG_RE.match(relpath)
    if m and int(m.group(1)) < world_size:
        return int(m.group(1))
    return 0


class ObjckptCallback(_Base):
    """Commits each checkpoint folder Trainer saves to an objckpt run root.

    Args:
        uri_or_store: run root URI or Store.
        store_options: options for ``open_store`` when a URI is given.
        mirror: a second run root (URI or Store: another bucket, region or cloud) every commit
            is replicated to in the background (``CheckpointManager(mirror=)``); loads take its
            copy when the primary cannot be read or its checkpoint is damaged, loudly.
        keep_last, keep_every: retention in the store after each commit; None keeps all.
        metadata, config_hash: recorded in every manifest.
        owner_of: ``(relpath, world_size) -> rank`` that uploads a file (:func:`default_owner`).
            A rank uploads only files it sees locally, so on node-local disks every file must
            be owned by a rank of the node that wrote it.
        timeout, handshake_timeout: seconds for the collectives.
        gc_grace_period: retention's grace period for unreferenced attempt data.

    Every rank must have the callback (Trainer calls callbacks on every rank).
    """

    def __init__(
        self,
        uri_or_store: str | Store,
        *,
        store_options: Mapping[str, Any] | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
        owner_of: Callable[[str, int], int] = default_owner,
        timeout: float = TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        gc_grace_period: timedelta = GC_GRACE_PERIOD,
        metrics: CheckpointMetrics | None = None,
        mirror: str | Store | None = None,
    ) -> None:
        self.store, _ = open_root(uri_or_store, store_options)
        self.reader = Reader(self.store)
        self.mirror_store = open_root(mirror)[0] if mirror is not None else None
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.metadata = dict(metadata or {})
        self.config_hash = config_hash
        self.owner_of = owner_of
        self.gc_grace_period = gc_grace_period
        self.metrics = metrics
        self._sessions = _common.PluginSessions(
            self.store,
            label="Trainer",
            keep_last=keep_last,
            keep_every=keep_every,
            grace_period=gc_grace_period,
            metrics=metrics,
            config_hash=config_hash,
            timeout=timeout,
            handshake_timeout=handshake_timeout,
            mirror=self.mirror_store,
        )
        #: the manifest of the last commit (every rank)
        self.last_manifest: Manifest | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Create the checkpoint process groups now, while every rank is at the same point.
        self._sessions.comm.get()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sessions.close()  # released while every rank is here; a later train() makes new ones

    def _session(self) -> SaveSession:
        return self._sessions.saves()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Upload this rank's files of ``checkpoint-<global_step>`` and commit (every rank)."""
        step = int(state.global_step)
        folder_name = f"{CHECKPOINT_PREFIX}-{step}"
        folder = os.path.join(args.output_dir, folder_name)
        session = self._session()
        ticket = session.begin(step)
        seen: list[str] = []
        try:
            seen = _files_under(folder)
            for relpath in seen:
                if self.owner_of(relpath, ticket.world_size) == ticket.rank:
                    with open(os.path.join(folder, *relpath.split("/")), "rb") as fh:
                        assert ticket.writer is not None
                        ticket.writer.write(relpath, fh)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, raised on every rank
            log.error("rank %d failed to upload %s: %s", ticket.rank, folder, exc)
            ticket.fail(exc)
        self.last_manifest = session.finish(
            ticket,
            report={"seen": seen},
            check_reports=lambda reports: _check_coverage(step, reports),
            progress={"global_step": step, "epoch": state.epoch},
            topology={"owner": "rng_state_<r>.pth: rank r; other files: rank 0"},
            metadata={**self.metadata, "integration": "huggingface", "huggingface": {"folder": folder_name}},
        )


def _files_under(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Trainer checkpoint folder {folder} does not exist on this rank")
    out = []
    for dirpath, _, files in os.walk(folder):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), folder)
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _check_coverage(step: int, reports: list[Any]) -> None:
    """Rank 0, before committing: every file any rank saw was uploaded, exactly once. A file
    whose owner did not see it (node-local disks and an ``owner_of`` that does not match who
    wrote it) fails the commit instead of silently missing from the checkpoint."""
    if any(rep.get("error") for rep in reports):
        return  # commit_gathered reports the failing ranks
    uploaded: dict[str, list[int]] = {}
    for rank, rep in enumerate(reports):
        for d in rep.get("receipts", []):
            uploaded.setdefault(d["name"], []).append(rank)
    failures: dict[int, list[str]] = {}
    for rank, rep in enumerate(reports):
        for name in rep.get("seen", []):
            if name not in uploaded:
                failures.setdefault(rank, []).append(
                    f"{name!r} is in its checkpoint folder but no rank uploaded it (its owner does "
                    "not see it: use a shared output_dir or pass owner_of=)"
                )
    for name, ranks in uploaded.items():
        if len(ranks) > 1:
            for rank in ranks:
                failures.setdefault(rank, []).append(f"{name!r} uploaded by ranks {ranks}")
    if failures:
        raise CommitError(
            f"step {step} not committed: the ranks' uploads do not cover the checkpoint folder",
            {rank: "; ".join(why) for rank, why in failures.items()},
        )


# ---------------------------------------------------------------------------------- resume


def download_checkpoint(
    uri_or_store: str | Store,
    local_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    store_options: Mapping[str, Any] | None = None,
    shared_dir: bool = False,
    timeout: float = TIMEOUT,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    mirror: str | Store | None = None,
) -> str | None:
    """Download a committed Trainer checkpoint into ``<local_dir>/checkpoint-<step>/`` (every
    rank) and return that folder, for ``trainer.train(resume_from_checkpoint=...)``.

    The restore session: rank 0 resolves the checkpoint (``step``, else the newest committed) and
    sends its manifest to the others; if any rank finds it damaged while downloading, every rank
    falls back to an older one together, with a warning (an outage is raised, never a reason to
    fall back). Each file is streamed to a
    temporary name, its size and CRC32C verified, then renamed into place, so a folder never
    holds a partial or unverified file. ``shared_dir=True``: ``local_dir`` is one folder all ranks
    see, so only rank 0 downloads (the others wait). Call it after the process group is up
    (creating ``TrainingArguments`` does that under torchrun).

    ``mirror``: the run root the job mirrored to (``mirror=`` of the callback); its copy is
    downloaded when the primary cannot be read or its checkpoint is damaged (loudly).

    Returns None when nothing is committed (a fresh start).

    Raises (on every rank alike):
        NoCheckpointError: ``step`` is not committed or is damaged, or checkpoints exist but none
            is usable.
        StoreError: the store could not be read (after the retry budget).
        DistributedError: ranks disagree or a rank is missing.
    """
    store, _ = open_root(uri_or_store, store_options)
    mirror_store = open_root(mirror)[0] if mirror is not None else None
    comm = LazyComm(timeout=timeout, handshake_timeout=handshake_timeout)
    try:
        session = RestoreSession(store, comm.get(), label="download_checkpoint", mirror=mirror_store)
        local = os.fspath(local_dir)

        def stage(manifest: Manifest) -> str:
            folder = os.path.join(local, _trainer_folder(manifest))
            if session.comm.rank == 0 or not shared_dir:
                _download(session.reader, manifest, folder)  # verified; damage falls back, all ranks
            return folder

        restored = session.restore(stage, step=step)
        if restored is None:
            return None
        log.info("downloaded checkpoint step %s from %s to %s", restored.step, store.location, restored.value)
        return restored.value
    finally:
        comm.close()


def _trainer_folder(manifest: Manifest) -> str:
    """The Trainer folder a committed checkpoint holds (NoCheckpointError, not damage, for a
    checkpoint of another kind: falling back past it would silently restore older state)."""
    info = manifest.metadata.get("huggingface")
    if not isinstance(info, dict) or not isinstance(info.get("folder"), str):
        raise NoCheckpointError(
            f"step {manifest.step} ({manifest.key}) is not a Hugging Face Trainer checkpoint"
        )
    folder: str = info["folder"]
    if folder != f"{CHECKPOINT_PREFIX}-{manifest.step}":
        raise NoCheckpointError(f"step {manifest.step}: unexpected folder name {folder!r} in {manifest.key}")
    return folder


def _download(reader: Reader, manifest: Manifest, folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    tag = f".objckpt-{os.getpid()}-{threading.get_ident()}"
    for receipt in manifest.shards:
        layout.validate_key_in_root(receipt.name)  # no absolute names, no '..'
        dest = os.path.join(folder, *receipt.name.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = dest + tag
        try:
            with open(tmp, "wb") as fh:
                for chunk in reader.open_shard(receipt):  # the last chunk raises on a mismatch
                    fh.write(chunk)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
