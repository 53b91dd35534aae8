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
from ..gc import RetentionPolicy, plan_gc, run_gc
from ..manifest import Manifest, ShardReceipt
from ..reader import Reader, agree_on_step
from ..store import Store, open_store
from ..writer import ShardWriter
from . import serialization
from .dist import Comm, decode_error, encode_error, make_comm
from .serialization import SerializationError, TensorRef
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

__all__ = ["CheckpointManager", "hash_config"]

log = logging.getLogger("objckpt.training")

STATE_LAYOUT = "objckpt.training/1"
REPLICATED_SHARD = "replicated.bin"
RANK_SHARD = "rank.bin"

#: errors that mean "this checkpoint is damaged": restore falls back to the parent
_DAMAGE = (IntegrityError, NotFoundError, SerializationError)


def hash_config(config: Any) -> str:
    """A stable SHA-256 of a JSON-able config (sorted keys), for ``config_hash=``."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class CheckpointManager:
    """Saves and restores training state under one run root.

    Construct it on every rank (under torch.distributed it creates two gloo process groups,
    which is a collective on the default group), after ``init_process_group``.

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
    ) -> None:
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
        self.comm: Comm = make_comm(timeout=timeout, handshake_timeout=handshake_timeout)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        #: (step, reason) of every checkpoint a restore rejected and fell back from
        self.fallbacks: list[tuple[int, str]] = []
        #: bytes written by this rank and seconds taken by the last save
        self.last_save: dict[str, Any] = {}
        self._coordinator: Coordinator | None = None

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

        Tensors are streamed straight from their memory: do not modify them until this returns.

        Raises (identically on every rank):
            TrainingStateError: not at an optimizer-step boundary, or an unsupported value.
            UnsupportedStateError: a value inside a state dict cannot be serialized.
            CommitError: a rank failed to write its shards, or the commit checks failed;
                ``failures`` names every failing rank. CommitConflict: the step was already
                committed by another attempt.
            DistributedError: ranks disagree on the step or the replicated layout, or a rank
                did not take part within the timeout (e.g. a rank-0-only call).
        """
        if self.every is not None and not force and step % self.every:
            return None
        started = time.monotonic()
        prep = self._prepare_save(step, state)
        attempt = layout.new_attempt_id() if self.rank == 0 else None
        hello = {
            "step": step,
            "error": prep.get("error"),
            "digests": prep.get("digests"),
            "attempt": attempt,
        }
        attempt = self.comm.agree(hello, self._decide_save_handshake, f"save(step={step}) handshake", handshake=True)

        # Every rank writes its shards; a failure is reported, not raised, so that rank 0 can
        # tell every rank the same outcome.
        report: dict[str, Any]
        try:
            report = {"receipts": [r.to_dict() for r in self._write(step, attempt, prep)]}
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator
            log.error("rank %d failed to write its shards for step %d: %s", self.rank, step, exc)
            report = {"error": f"{type(exc).__name__}: {exc}"}
        reports = self.comm.gather(report, f"save(step={step}) receipts")

        outcome: dict[str, Any] = {}
        if self.rank == 0:
            assert reports is not None
            try:
                manifest = self._commit(step, attempt, reports, state, prep, metadata)
                outcome = {"manifest": manifest.encode().decode("utf-8")}
            except Exception as exc:  # noqa: BLE001 - broadcast and raised on every rank
                if not isinstance(exc, CommitError):
                    exc = CommitError(
                        f"step {step} attempt {attempt} not committed: the coordinator failed: "
                        f"{type(exc).__name__}: {exc}",
                        {0: f"{type(exc).__name__}: {exc}"},
                    )
                outcome = {"error": encode_error(exc)}
        outcome = self.comm.broadcast(outcome, f"save(step={step}) outcome")
        if "error" in outcome:
            raise decode_error(outcome["error"])
        key = layout.manifest_key(step)
        manifest = Manifest.decode(outcome["manifest"].encode("utf-8"), key=key)
        self.last_save = {
            "step": step,
            "bytes": prep["bytes_written"],
            "seconds": time.monotonic() - started,
        }
        if self.rank == 0:
            self._retain()
        return manifest

    def restore(self, state: Mapping[str, Any], *, step: int | None = None) -> int | None:
        """Load the newest usable checkpoint (or ``step``) into ``state``; every rank calls it.

        Walks committed checkpoints newest first. Every rank downloads what it needs (all
        replicated shards, its own per-rank shard), verifying size and CRC32C, decodes and
        checks it against the live objects *before* touching any of them. If any rank finds the
        checkpoint damaged, all ranks fall back to its parent together (logged as a warning on
        every rank, recorded in :attr:`fallbacks`). Then every rank applies it (RNG last) and
        the ranks check they restored the same step.

        Returns the restored step, or None when the run root holds no checkpoint (nothing is
        modified then).

        Raises (identically on every rank):
            NoCheckpointError: checkpoints exist but none is usable, or ``step`` is not usable.
            TrainingStateError: the checkpoint does not fit ``state`` (names, tensor shapes,
                optimizer groups, world size): no object was modified.
            DistributedError: ranks asked for different steps, see different checkpoints, or
                did not all call restore within the timeout.
        """
        prep_error = None
        try:
            for name, obj in state.items():
                classify(name, obj)
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error below
            prep_error = encode_error(exc)
        self.comm.agree(
            {"step": step, "error": prep_error}, _decide_restore_handshake, "restore handshake", handshake=True
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
            why = "; ".join(f"rank {r}: {m}" for r, m in sorted(verdict["damaged"].items(), key=lambda kv: int(kv[0])))
            if step is not None:  # an explicit step: no fallback
                raise NoCheckpointError(f"checkpoint step {target} under {self.store.location} is damaged: {why}")
            log.warning(
                "checkpoint step %d under %s is damaged, falling back to an older one (all ranks): %s",
                target, self.store.location, why,
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

    def close(self) -> None:
        """Release the process groups and (when opened from a URI) the store."""
        self.comm.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ save internals

    def _replicated_names(self, state: Mapping[str, Any], kinds: Mapping[str, str]) -> list[str]:
        if self.replicated is not None:
            return [n for n in state if n in self.replicated]
        return [n for n in state if kinds[n] in (MODULE, OPTIMIZER)]

    def _prepare_save(self, step: int, state: Mapping[str, Any]) -> dict[str, Any]:
        """Capture references to everything to save; no I/O, nothing copied."""
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
            rep_body: serialization.EncodedState | None = None
            if rep_names and (mine or self.rank == 0):
                body: dict[str, Any] = {"index": mine, "tensors": [tensors[i] for i in mine]}
                if self.rank == 0:
                    body["skeleton"] = skeleton
                    body["count"] = len(tensors)
                rep_body = serialization.encode(body)
            progress = progress_of(state)
            return {
                "replicated_names": rep_names,
                "local_names": [n for n in state if n not in rep_names],
                "replicated_body": rep_body,
                "local_body": serialization.encode({"items": local, "rng": capture_global_rng()}),
                "digests": digests,
                "progress": progress.summary() if progress is not None else {"global_step": step},
                "bytes_written": 0,
            }
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error after the handshake
            return {"error": encode_error(exc)}

    def _decide_save_handshake(self, hellos: list[dict[str, Any]]) -> str:
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
        return str(hellos[0]["attempt"])

    def _write(self, step: int, attempt: str, prep: dict[str, Any]) -> list[ShardReceipt]:
        writer = ShardWriter(self.store, step=step, attempt=attempt, rank=self.rank)
        written = 0
        for name, encoded in ((REPLICATED_SHARD, prep["replicated_body"]), (RANK_SHARD, prep["local_body"])):
            if encoded is not None:
                # streamed from tensor memory: header, then each tensor's bytes in place
                writer.write(name, encoded.buffers())
                written += encoded.size
        prep["bytes_written"] = written
        return writer.receipts

    def _commit(
        self,
        step: int,
        attempt: str,
        reports: list[dict[str, Any]],
        state: Mapping[str, Any],
        prep: dict[str, Any],
        metadata: Mapping[str, Any] | None,
    ) -> Manifest:
        receipts: dict[int, Any] = {}
        for rank, rep in enumerate(reports):
            if "error" in rep:
                receipts[rank] = rep["error"]
            else:
                receipts[rank] = [ShardReceipt.from_dict(d, key=f"rank {rank} receipt") for d in rep["receipts"]]
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
        """Retention after a commit (rank 0). Failures are logged, never raised: the save is
        committed whatever happens here."""
        if self.keep_last is None:
            return
        try:
            policy = RetentionPolicy(keep_last=self.keep_last, keep_every=self.keep_every)
            plan = plan_gc(self.store, policy, grace_period=self.gc_grace_period)
            if not plan.empty:
                result = run_gc(self.store, plan)
                log.info(
                    "retention: deleted %d checkpoint(s), %d object(s)",
                    len(result.deleted_manifests), result.deleted_objects,
                )
        except Exception as exc:  # noqa: BLE001
            log.warning("retention under %s failed (checkpoints are intact): %s", self.store.location, exc)

    # ------------------------------------------------------------------ restore internals

    def _propose(self, step: int | None, candidates: Iterator[Manifest] | None, rejected: list[str]) -> dict[str, Any]:
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

    def _stage(self, state: Mapping[str, Any], step: int, proposal: Mapping[str, Any]) -> tuple[dict[str, Any], Manifest]:
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
                manifest.step, saved, self.config_hash,
            )


# ---------------------------------------------------------------------------------- helpers


class _Damaged(Exception):
    """The checkpoint being staged is damaged: fall back (internal)."""


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
