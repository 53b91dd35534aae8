"""DeepSpeed: a ``CheckpointEngine`` that commits ``engine.save_checkpoint`` to a run root.

::

    import deepspeed
    from objckpt.integrations.deepspeed import ObjckptCheckpointEngine, load_checkpoint

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    ckpt = ObjckptCheckpointEngine.attach(engine, "s3://bucket/runs/eta")   # every rank
    ...
    engine.save_checkpoint("/local/scratch/ckpt")           # every rank, as usual; tag global_stepN
    ...
    load_path, client_state = load_checkpoint(engine, "/local/scratch/ckpt")  # every rank; newest commit

How DeepSpeed's calls map onto the protocol (every rank takes part in every save):

* ``create(info)``: a handshake checks every rank saves the same tag and shares rank 0's fresh
  attempt id. The tag names the step: its trailing integer (``global_step20`` -> 20), or
  ``step_of_tag(tag)``.
* ``save(state, path)``: ``torch.save`` into a spooled buffer (memory, then a temporary file),
  uploaded as shard ``<path relative to save_dir/tag>`` of this rank, create-if-absent.
* ``commit(info)``: every rank's receipts (or its error) are gathered to rank 0, which commits
  (manifest create-if-absent, ``LATEST`` forward-only); every rank returns, or raises the same
  :class:`CommitError` naming the failing ranks. Rank 0 then applies retention (``keep_last``).
* ``decoupled=True`` (``is_decoupled()``): ``save`` snapshots the state (``torch.save``) and
  uploads in a background thread; DeepSpeed calls ``commit`` at the next optimizer-step boundary,
  so training overlaps the upload and the checkpoint is committed one step later.

Local ``save_dir`` is scratch: DeepSpeed itself writes its ``latest`` tag file and recovery
scripts there; checkpoint data goes only to the store. Loading goes through
:meth:`ObjckptCheckpointEngine.prepare_load` (or :func:`load_checkpoint`): the ranks agree on a
committed tag (the newest valid one by default) and empty marker files are laid out locally,
because DeepSpeed finds its files by ``glob``/``os.path.exists`` before it calls ``load``; each
``load`` then streams the shard from the store, verifies its size and CRC32C and unpickles it with
``torch.load(weights_only=True)`` allowing only tensors, containers and DeepSpeed's own state
classes (:data:`SAFE_GLOBALS`).

How DeepSpeed's tags and local paths map onto steps and shard names is in
:mod:`._deepspeed_files` (its public names are importable from here).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import layout
from ..coordination.comm import agree
from ..coordination.roots import open_root
from ..coordination.save import SaveSession, SaveTicket
from ..defaults import GC_GRACE_PERIOD, HANDSHAKE_TIMEOUT, TIMEOUT
from ..errors import (
    ChecksumMismatchError,
    CommitError,
    DistributedError,
    NoCheckpointError,
    decode_error,
    encode_error,
    with_rank,
)
from ..manifest import Manifest
from ..metrics import CheckpointMetrics
from ..reader import Reader
from ..store import Store
from . import _common
from ._deepspeed_files import (
    SAFE_GLOBALS,
    _resolve_globals,
    _shard_name,
    _split_path,
    _tag_of,
    _write_atomic,
    step_from_tag,
)

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine as _Base
except ImportError:  # pragma: no cover - the engine logic still works (and is unit-tested) without it
    _Base = object

__all__ = ["SAFE_GLOBALS", "ObjckptCheckpointEngine", "load_checkpoint", "step_from_tag"]

log = logging.getLogger("objckpt.integrations.deepspeed")


@dataclass
class _Save:
    tag: str
    save_dir: str
    save_latest: bool
    ticket: SaveTicket
    uploads: list[Future[None]] = field(default_factory=list)
    info: Any = None

    @property
    def step(self) -> int:
        return self.ticket.step


# DeepSpeed ships no type information: its CheckpointEngine is Any to mypy.
class ObjckptCheckpointEngine(_Base):  # type: ignore[misc]
    """DeepSpeed ``CheckpointEngine`` backed by an objckpt run root. Construct it on every rank
    (after ``deepspeed.init_distributed``) and put it in ``engine.checkpoint_engine``
    (:meth:`attach`).

    Args:
        uri_or_store: run root URI or Store.
        store_options: options for ``open_store`` when a URI is given.
        mirror: a second run root (URI or Store: another bucket, region or cloud) every commit
            is replicated to in the background (``CheckpointManager(mirror=)``); loads take its
            copy when the primary cannot be read or its checkpoint is damaged, loudly.
        decoupled: upload in the background and commit at the next optimizer step.
        keep_last, keep_every: retention after each commit (rank 0); None keeps everything.
        metadata, config_hash: recorded in every manifest.
        step_of_tag: tag -> step (default :func:`step_from_tag`).
        safe_globals: extra classes (or ``"module:attr"`` names) ``torch.load`` may rebuild.
        timeout, handshake_timeout: seconds for the collectives (see ``CheckpointManager``).
        gc_grace_period: retention's grace period for unreferenced attempt data.
    """

    def __init__(
        self,
        uri_or_store: str | Store,
        *,
        store_options: Mapping[str, Any] | None = None,
        decoupled: bool = False,
        keep_last: int | None = None,
        keep_every: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
        step_of_tag: Callable[[str], int] = step_from_tag,
        safe_globals: Iterable[Any] = (),
        timeout: float = TIMEOUT,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        gc_grace_period: timedelta = GC_GRACE_PERIOD,
        spool_bytes: int = _common.DEFAULT_SPOOL_BYTES,
        metrics: CheckpointMetrics | None = None,
        mirror: str | Store | None = None,
    ) -> None:
        self.name = "ObjckptCheckpointEngine"
        self.store, _ = open_root(uri_or_store, store_options)
        self.reader = Reader(self.store)
        mirror_store = open_root(mirror)[0] if mirror is not None else None
        #: tag -> the reader of the root its loaded manifest came from (the mirror's, after a
        #: restore from the mirror)
        self._readers: dict[str, Reader] = {}
        self.decoupled = decoupled
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.metadata = dict(metadata or {})
        self.config_hash = config_hash
        self.step_of_tag = step_of_tag
        self.safe_globals = list(SAFE_GLOBALS) + list(safe_globals)
        self.gc_grace_period = gc_grace_period
        self.spool_bytes = spool_bytes
        self.metrics = metrics
        self._sessions = _common.PluginSessions(
            self.store,
            label="DeepSpeed",
            keep_last=keep_last,
            keep_every=keep_every,
            grace_period=gc_grace_period,
            metrics=metrics,
            config_hash=config_hash,
            timeout=timeout,
            handshake_timeout=handshake_timeout,
            mirror=mirror_store,
        )
        self._pending: _Save | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}  # tag -> manifest, for load()

    @classmethod
    def attach(cls, engine: Any, uri_or_store: str | Store, **kwargs: Any) -> ObjckptCheckpointEngine:
        """Make a new engine and install it as ``engine.checkpoint_engine`` (every rank)."""
        ckpt = cls(uri_or_store, **kwargs)
        engine.checkpoint_engine = ckpt
        return ckpt

    # ------------------------------------------------------------------ DeepSpeed API: saving

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Local scratch directories: DeepSpeed writes its ``latest`` file there itself."""
        os.makedirs(path, exist_ok=True)

    def create(self, info: Any) -> None:
        """Start a save of ``info.tag`` (every rank): handshake, fresh attempt id from rank 0."""
        with self._lock:
            previous = self._pending
        if previous is not None:
            if self.decoupled:
                # the previous decoupled save was not committed yet: commit it first
                self.commit(previous.info)
            else:
                log.warning(
                    "discarding the unfinished save of tag %s (create() without commit(), e.g. "
                    "after an exception); its shards are left for garbage collection",
                    previous.tag,
                )
                with self._lock:
                    self._pending = None
        tag = str(info.tag)
        step: int | None = None
        error: Exception | None = None
        try:
            step = self.step_of_tag(tag)
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error
            error = CommitError(
                f"DeepSpeed save not started: {_common_report(exc)}", {self._rank(): str(exc)}
            )
        ticket = self._session().begin(
            step if step is not None else 0,
            error=error,
            agree_on={"DeepSpeed tag": tag},
        )
        with self._lock:
            self._pending = _Save(
                tag=tag,
                save_dir=os.fspath(info.save_dir),
                save_latest=bool(getattr(info, "save_latest", True)),
                ticket=ticket,
                info=info,
            )

    def _rank(self) -> int:
        return self._sessions.comm.get().rank

    def _session(self) -> SaveSession:
        return self._sessions.saves()

    def save(self, state_dict: Any, path: str) -> None:
        """Serialize ``state_dict`` now and upload it (in the background when decoupled).

        Errors are not raised here: they are reported at :meth:`commit`, where every rank
        raises the same :class:`CommitError` naming this rank.
        """
        with self._lock:
            p = self._pending
        if p is None:
            raise RuntimeError(
                f"ObjckptCheckpointEngine.save({path!r}) outside create()/commit(); DeepSpeed "
                "calls them around every save"
            )
        try:
            name = _shard_name(p.save_dir, p.tag, path)
            layout.shard_key(p.step, p.ticket.attempt, 0, name)  # a portable name, or ValueError
            spool = _common.torch_save_spooled(state_dict, spool_bytes=self.spool_bytes)
        except Exception as exc:  # noqa: BLE001 - reported at commit
            log.error("rank %d cannot save %s: %s", p.ticket.rank, path, exc)
            p.ticket.fail(f"{path}: {_common_report(exc)}")
            return
        if self.decoupled:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(1, thread_name_prefix="objckpt-deepspeed")
                executor = self._executor
            p.uploads.append(executor.submit(self._upload, p, name, spool))
        else:
            self._upload(p, name, spool)

    def _upload(self, p: _Save, name: str, spool: Any) -> None:
        try:
            assert p.ticket.writer is not None
            p.ticket.writer.write(name, spool)
        except Exception as exc:  # noqa: BLE001 - reported at commit
            log.error("rank %d failed to upload %s: %s", p.ticket.rank, name, exc)
            p.ticket.fail(f"{name}: {_common_report(exc)}")
        finally:
            spool.close()

    def commit(self, info: Any) -> bool:
        """Commit the save of ``info.tag`` (every rank); raises the same error on every rank."""
        with self._lock:
            p = self._pending
        if p is None or str(info.tag) != p.tag:
            raise RuntimeError(
                f"ObjckptCheckpointEngine.commit(tag={info.tag!r}) without a matching create() "
                f"(pending: {p.tag if p else None!r})"
            )
        try:
            for upload in p.uploads:
                upload.result()
            manifest = self._session().finish(
                p.ticket,
                report={"files": [r.name for r in p.ticket.receipts]},
                progress={"global_step": p.step},
                topology={"deepspeed_files_per_rank": True},
                metadata={**self.metadata, "integration": "deepspeed", "deepspeed": {"tag": p.tag}},
            )
        finally:
            with self._lock:
                if self._pending is p:
                    self._pending = None
        log.info("committed DeepSpeed tag %s as step %d under %s", p.tag, manifest.step, self.store.location)
        return True

    def is_decoupled(self) -> bool:
        return self.decoupled

    def get_commit_info(self) -> Any:
        """The pending decoupled save DeepSpeed should commit at its next step, if any."""
        with self._lock:
            p = self._pending
        return p.info if (p is not None and self.decoupled) else None

    def cleanup(self) -> None:
        """Commit a pending decoupled save (every rank, from ``engine.destroy()``) and stop the
        upload thread."""
        info = self.get_commit_info()
        try:
            if info is not None:
                self.commit(info)
        finally:
            with self._lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
            self._sessions.close()  # the checkpoint groups; a later save or load creates new ones

    # ------------------------------------------------------------------ DeepSpeed API: loading

    def prepare_load(self, load_dir: str, tag: str | None = None) -> str | None:
        """Agree on a committed tag and lay out DeepSpeed's local view of it (every rank).

        The restore session: rank 0 resolves ``tag`` (default: the newest committed checkpoint)
        and sends its manifest to the others; every rank checks its shards (HEAD: present, same
        size and version) and writes ``load_dir/latest`` and an empty marker file
        ``load_dir/<tag>/<name>`` per shard (DeepSpeed globs for them); :meth:`load` reads the
        data from the store. A damaged newest checkpoint makes every rank fall back together;
        an outage is raised. Returns the tag, or None when nothing is committed.

        Raises (on every rank alike):
            NoCheckpointError: ``tag`` is not committed, is damaged, or is not a DeepSpeed
                checkpoint.
        """
        step = None
        if tag is not None:
            try:
                step = self.step_of_tag(str(tag))
            except ValueError as exc:
                raise NoCheckpointError(f"DeepSpeed tag {tag!r} names no committed step: {exc}") from exc

        session = self._sessions.restores()

        def stage(manifest: Manifest) -> str:
            chosen = _tag_of(manifest)  # NoCheckpointError (not damage): not a DeepSpeed checkpoint
            if tag is not None and chosen != str(tag):
                raise NoCheckpointError(
                    f"step {manifest.step} under {self.store.location} holds DeepSpeed tag {chosen!r}, not {tag!r}"
                )
            problems = session.reader.check(manifest)
            if problems:
                raise ChecksumMismatchError(
                    f"DeepSpeed tag {chosen} (step {manifest.step}) is damaged: "
                    + "; ".join(map(str, problems)),
                    location=self.store.location,
                )
            return chosen

        def apply(manifest: Manifest, chosen: str) -> None:
            with self._lock:
                self._manifests[chosen] = manifest
                self._readers[chosen] = session.reader
            folder = os.path.join(load_dir, chosen)
            for receipt in manifest.shards:
                marker = os.path.join(folder, *receipt.name.split("/"))
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                open(marker, "ab").close()  # noqa: SIM115 - an empty marker; never overwrites
            _write_atomic(os.path.join(load_dir, "latest"), chosen)

        restored = session.restore(stage, apply, step=step)
        return None if restored is None else restored.value

    def _manifest_for_tag(self, tag: str) -> Manifest:
        with self._lock:
            cached = self._manifests.get(tag)
        if cached is not None:
            return cached
        manifest = self.reader.load(self.step_of_tag(tag))
        if _tag_of(manifest) != tag:
            raise NoCheckpointError(
                f"step {manifest.step} under {self.store.location} holds DeepSpeed tag "
                f"{_tag_of(manifest)!r}, not {tag!r}"
            )
        with self._lock:
            self._manifests[tag] = manifest
        return manifest

    def load(self, path: str, map_location: Any = None) -> Any:
        """Stream ``<tag>/<name>`` from the store, verify it, and ``torch.load(weights_only=True)``
        it with only :data:`SAFE_GLOBALS` (and ``safe_globals=``) allowed.

        Raises:
            FileNotFoundError: the committed checkpoint has no such file.
            ChecksumMismatchError: the bytes differ from the receipt (nothing is unpickled).
            pickle.UnpicklingError: the file names a global outside the allow-list.
        """
        tag, name = _split_path(path, self._manifests)
        manifest = self._manifest_for_tag(tag)
        receipt = next((r for r in manifest.shards if r.name == name), None)
        if receipt is None:
            raise FileNotFoundError(
                f"DeepSpeed checkpoint {tag} (step {manifest.step}) under {self.store.location} has no file {name!r}"
            )
        with self._lock:
            reader = self._readers.get(tag, self.reader)
        return _common.torch_load_verified(
            reader.open_shard(receipt),
            allowed=_resolve_globals(self.safe_globals),
            map_location=map_location,
            spool_bytes=self.spool_bytes,
        )

    # DeepSpeed's defaults for is_data_parallel_writer / preserves_storage_sharing apply.
    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def preserves_storage_sharing(self) -> bool:
        return True


def load_checkpoint(engine: Any, load_dir: str, tag: str | None = None, **kwargs: Any) -> tuple[Any, Any]:
    """``engine.load_checkpoint`` from the store (every rank): :meth:`prepare_load`, then
    DeepSpeed's own load, then a check that every rank loaded the same tag.

    Returns ``(load_path, client_state)`` as DeepSpeed does; ``(None, None)`` when nothing is
    committed. Raises the same error on every rank when any rank failed.
    """
    ckpt = engine.checkpoint_engine
    if not isinstance(ckpt, ObjckptCheckpointEngine):
        raise TypeError("engine.checkpoint_engine is not an ObjckptCheckpointEngine (use attach())")
    chosen = ckpt.prepare_load(load_dir, tag)
    if chosen is None:
        return None, None
    error: dict[str, Any] | None = None
    result: tuple[Any, Any] = (None, None)
    try:
        result = engine.load_checkpoint(load_dir, chosen, **kwargs)
        if result[0] is None:
            raise NoCheckpointError(f"DeepSpeed did not load tag {chosen} from {load_dir}")
    except Exception as exc:  # noqa: BLE001 - every rank raises alike
        error = encode_error(exc)
    agree(
        ckpt._sessions.comm.get(),
        {"tag": chosen, "error": error},
        _decide_loaded,
        f"load_checkpoint(tag={chosen})",
    )
    return result


def _decide_loaded(reports: list[dict[str, Any]]) -> str:
    for rank, rep in enumerate(reports):
        if rep.get("error"):
            raise with_rank(decode_error(rep["error"]), rank)
    tags = {rep["tag"] for rep in reports}
    if len(tags) != 1:
        raise DistributedError(f"ranks loaded different DeepSpeed tags {sorted(tags)}")
    return str(reports[0]["tag"])


def _common_report(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
