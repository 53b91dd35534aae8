"""The one save protocol: handshake -> attempt id -> write -> gather receipts -> commit on rank 0
-> broadcast the outcome -> retention (invariants 1-9).

Every way of saving (``CheckpointManager.save``/``save_async``, the DCP storage writer, the
Lightning, DeepSpeed and Hugging Face plug-ins) goes through :class:`SaveSession`; the adapters
only decide *what* bytes each rank writes. The session decides everything that must be the same
on every rank:

1. :meth:`SaveSession.begin` -- the handshake (one :func:`~objckpt.coordination.comm.agree`):
   every rank says which step it saves and whether it could prepare; rank 0 checks that all
   ranks save the same step, that values which must be identical everywhere are (e.g. the
   layout of replicated tensors), and draws the fresh attempt id. An error nobody has seen yet
   (a failed asynchronous save) comes first. Every rank gets the same :class:`SaveTicket`, or
   raises the same error.
2. The adapter writes this rank's shards through ``ticket.writer`` (create-if-absent, under the
   attempt's own prefix). A failure is recorded on the ticket, not raised: rank 0 must hear it.
3. :meth:`SaveSession.finish` -- every rank's receipts (or its error) are gathered to rank 0
   (with ``verify="ranks"`` a broadcast and a second gather follow: once every rank has written,
   up to 256 ranks LIST their slices of the attempt for rank 0's check), which checks them
   against the store and writes the manifest create-if-absent (THE commit
   point, :class:`~objckpt.commit.Coordinator`); the outcome is broadcast, so every rank returns
   the same :class:`~objckpt.manifest.Manifest` or raises the same :class:`CommitError` naming
   every failing rank. Then rank 0 applies retention, which never raises.

Metrics (:class:`~objckpt.metrics.CheckpointMetrics`, optional) are fed here: save start, upload
and commit durations, bytes, commits, failures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from .. import layout
from ..commit import Coordinator
from ..defaults import VERIFY_SPREAD_ABOVE
from ..errors import (
    CommitError,
    DistributedError,
    ManifestError,
    decode_error,
    encode_error,
    with_rank,
)
from ..gc import DEFAULT_GRACE_PERIOD, RetentionPolicy, retain
from ..manifest import Manifest, Reference, ShardReceipt, run_identity
from ..metrics import CheckpointMetrics
from ..store.base import ObjectMeta, Store
from ..writer import ShardWriter
from . import lineage
from ._verification import gather_listings, list_slice, listed_entry
from .comm import Comm, agree

__all__ = ["SaveSession", "SaveTicket"]

log = logging.getLogger("objckpt.save")

#: ``SaveSession(verify=)``: who lists the store to check the receipts before a commit
VERIFY_AUTO, VERIFY_COORDINATOR, VERIFY_RANKS = "auto", "coordinator", "ranks"
VERIFY_MODES = (VERIFY_AUTO, VERIFY_COORDINATOR, VERIFY_RANKS)

#: how a rank that disagrees with rank 0 on an ``agree_on`` value is reported
Disagreement = Callable[[str, int, Any, Any], Exception]


@dataclass
class SaveTicket:
    """One rank's view of a save that every rank has agreed to start.

    Attributes:
        step, attempt: what is being saved; ``attempt`` is the same fresh id on every rank.
        rank, world_size: of the communicator the save was agreed on.
        skip: every rank agreed not to save (a save was still in flight somewhere).
        writer: this rank's :class:`ShardWriter` for the attempt (``None`` when skipped).
        errors: failures of this rank's writes, reported to rank 0 by :meth:`SaveSession.finish`.
        started: ``time.monotonic()`` when the handshake began.
    """

    step: int
    attempt: str
    rank: int
    world_size: int
    skip: bool = False
    writer: ShardWriter | None = None
    errors: list[str] = field(default_factory=list)
    started: float = 0.0
    abandoned: bool = False
    #: objects of ancestors this rank's shards reuse instead of rewriting (deduplication)
    references: list[Reference] = field(default_factory=list)

    def fail(self, exc: BaseException | str) -> None:
        """Record that this rank could not write its part; :meth:`SaveSession.finish` reports
        it to rank 0, which fails the commit naming this rank."""
        self.errors.append(exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}")

    def abandon(self) -> None:
        """This rank gave the save up (an abandon request): rank 0 commits nothing."""
        self.abandoned = True

    @property
    def receipts(self) -> list[ShardReceipt]:
        return [] if self.writer is None else self.writer.receipts

    @property
    def bytes_written(self) -> int:
        return sum(r.size for r in self.receipts)


def _check_same_root(hellos: list[dict[str, Any]]) -> None:
    """Every rank must name the same run root: a rank writing elsewhere would commit a
    checkpoint whose shards no reader finds."""
    for rank, h in enumerate(hellos[1:], start=1):
        if h.get("root") != hellos[0].get("root"):
            raise DistributedError(
                f"rank {rank} uses run root {h.get('root')!r} but rank 0 uses {hellos[0].get('root')!r}: "
                "all ranks must be configured with the same run root"
            )


class SaveSession:
    """Saves checkpoints under one run root, on every rank of ``comm``.

    Args:
        store: the run root; must enforce create-if-absent and compare-and-swap (checked when
            rank 0 first commits).
        comm: the job's communicator (every rank constructs the session with its own).
        retention: applied by rank 0 after every commit (``None``: keep everything).
        grace_period: unreferenced attempt data younger than this is never collected.
        metrics: fed with every save's events; ``None`` costs nothing.
        identity: run identity recorded in every manifest (config hash, dataset snapshot,
            software versions); objckpt, python and loaded frameworks' versions are added.
        label: how the adapter names a save in messages (``save``, ``DCP save``, ...).
        key_spreading: shard keys under spreading prefixes (``layout.spread_of``; default);
            ``False``: ``data/<step>-<attempt>/<rank>/`` as before (docs/DESIGN.md, "Scale").
        verify: ``"coordinator"``: rank 0 LISTs every attempt prefix the receipts use and
            checks each receipt; ``"ranks"``: once every rank has written, ranks
            ``0..min(W, 256)-1`` each LIST one slice of the attempt
            (:func:`~objckpt.layout.verification_slices`: with spreading, one spread prefix
            each) and rank 0 checks the receipts against them: the same coverage, strays
            included, with no LIST on rank 0 beyond its own slice (one more broadcast and
            gather); ``"auto"`` (default): ``"ranks"`` above
            :data:`~objckpt.defaults.VERIFY_SPREAD_ABOVE` ranks, else ``"coordinator"``.
    """

    def __init__(
        self,
        store: Store,
        comm: Comm,
        *,
        retention: RetentionPolicy | None = None,
        grace_period: timedelta = DEFAULT_GRACE_PERIOD,
        metrics: CheckpointMetrics | None = None,
        identity: Mapping[str, Any] | None = None,
        label: str = "save",
        key_spreading: bool = True,
        verify: str = VERIFY_AUTO,
    ) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.key_spreading = bool(key_spreading)
        self.verify = verify
        self.store = store
        self.comm = comm
        self.retention = retention
        self.grace_period = grace_period
        self.metrics = metrics
        self.identity = dict(identity or {})
        self.label = label
        self._coordinator: Coordinator | None = None

    # ------------------------------------------------------------------ 1. handshake

    def begin(
        self,
        step: int,
        *,
        kind: str = "save",
        error: BaseException | None = None,
        pending: BaseException | None = None,
        busy: bool = False,
        agree_on: Mapping[str, Any] | None = None,
        on_disagree: Disagreement | None = None,
        comm: Comm | None = None,
    ) -> SaveTicket:
        """The entry collective of every save; every rank calls it with the same arguments'
        meaning and gets the same ticket, or raises the same error.

        Args:
            step: the step this rank saves.
            kind: what kind of save this rank is making (``save`` / ``save_async``); ranks that
                mix kinds raise :class:`DistributedError`.
            error: this rank could not prepare its part (e.g. an unserialisable value): every
                rank raises it, prefixed ``rank N:``.
            pending: this rank's unseen error of an earlier save; if any rank has one, every
                rank raises it (this rank its own object) and nothing is saved.
            busy: a save is still in flight here; if any rank is busy every rank gets a ticket
                with ``skip=True`` (the ``policy="skip"`` of asynchronous saves).
            agree_on: values that must be equal on every rank (e.g. the digest of the
                replicated tensors' layout); a difference raises ``on_disagree(name, rank,
                rank0_value, value)`` (default :class:`DistributedError`) on every rank.

        Raises (the same on every rank): the pending error, the rank's preparation error,
        :class:`DistributedError` (different steps or kinds, a rank missing within the
        handshake timeout), or what ``on_disagree`` returns.
        """
        comm = comm or self.comm
        started = time.monotonic()
        layout.check_step(step)
        hello = {
            "step": step,
            "kind": kind,
            "busy": bool(busy),
            "error": encode_error(error) if error is not None else None,
            "pending": encode_error(pending) if pending is not None else None,
            "agree": dict(agree_on or {}),
            "root": self.store.location,
            "attempt": layout.new_attempt_id() if comm.rank == 0 else None,
        }

        def decide(hellos: list[dict[str, Any]]) -> dict[str, Any]:
            return self._decide_begin(hellos, on_disagree)

        what = f"{self.label}(step={step}) handshake"
        decision = agree(comm, hello, decide, what, handshake=True)
        if decision.get("pending"):
            # An older failure outranks this save: every rank raises it, each its own copy
            # where it has one (so the caller can mark it seen).
            if pending is not None:
                raise pending
            raise decode_error(decision["pending"])
        ticket = SaveTicket(
            step=step,
            attempt=str(decision["attempt"]),
            rank=comm.rank,
            world_size=comm.world_size,
            skip=bool(decision["skip"]),
            started=started,
        )
        if not ticket.skip:
            ticket.writer = ShardWriter(
                self.store,
                step=step,
                attempt=ticket.attempt,
                rank=comm.rank,
                key_spreading=self.key_spreading,
            )
            if self.metrics is not None:
                self.metrics.record_save_start(step, ticket.attempt)
        return ticket

    @staticmethod
    def _decide_begin(hellos: list[dict[str, Any]], on_disagree: Disagreement | None) -> dict[str, Any]:
        for h in hellos:
            if h.get("pending"):
                return {"pending": h["pending"]}
        kinds = {h.get("kind") for h in hellos}
        if len(kinds) != 1:
            detail = ", ".join(f"rank {r}: {h.get('kind')}" for r, h in enumerate(hellos))
            raise DistributedError(f"ranks mixed different kinds of save for one checkpoint ({detail})")
        for rank, h in enumerate(hellos):
            if h.get("error"):
                raise with_rank(decode_error(h["error"]), rank) if rank else decode_error(h["error"])
        steps = {h["step"] for h in hellos}
        if len(steps) != 1:
            detail = ", ".join(f"rank {r}: {h['step']}" for r, h in enumerate(hellos))
            raise DistributedError(f"ranks called save with different steps ({detail})")
        _check_same_root(hellos)
        first = hellos[0].get("agree") or {}
        for rank, h in enumerate(hellos[1:], start=1):
            mine = h.get("agree") or {}
            for name in sorted(set(first) | set(mine)):
                if first.get(name) != mine.get(name):
                    if on_disagree is not None:
                        raise on_disagree(name, rank, first.get(name), mine.get(name))
                    raise DistributedError(
                        f"rank {rank} disagrees with rank 0 on {name} "
                        f"({mine.get(name)!r} != {first.get(name)!r})"
                    )
        attempt = layout.check_attempt_id(str(hellos[0]["attempt"]))
        return {"attempt": attempt, "skip": any(h.get("busy") for h in hellos)}

    # ------------------------------------------------------------------ 3. commit

    def finish(
        self,
        ticket: SaveTicket,
        *,
        comm: Comm | None = None,
        report: Mapping[str, Any] | None = None,
        check_reports: Callable[[list[dict[str, Any]]], None] | None = None,
        progress: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
        topology: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        blocking_seconds: float | None = None,
    ) -> Manifest:
        """Gather every rank's receipts, commit on rank 0, and return the manifest on every rank.

        Args:
            ticket: from :meth:`begin`; its writer's receipts (or its errors) are this rank's
                report.
            comm: the communicator to run on (e.g. a background thread's); default the
                session's. It must be the same kind of channel on every rank.
            report: extra JSON this rank adds to its report (e.g. the files it saw).
            check_reports: rank 0's extra check of every rank's report before committing; it
                raises (e.g. :class:`CommitError`) to refuse the commit.
            progress, run, topology, metadata: recorded in the manifest (``run`` on top of the
                session's identity).
            blocking_seconds: how long the training loop was blocked (asynchronous saves).

        Atomicity: the checkpoint exists iff rank 0 wrote its manifest; any failure leaves no
        manifest and the previous checkpoint untouched.

        Raises (identically on every rank):
            CommitError: naming every failing rank; :class:`CommitConflict` when another attempt
                committed this step; :class:`SaveAbandonedError` when a rank abandoned it.
            DistributedError: a rank did not take part within the timeout.
        """
        comm = comm or self.comm
        step, attempt = ticket.step, ticket.attempt
        wrote = time.monotonic()  # this rank's writes are done: the upload phase ends here
        mine: dict[str, Any] = dict(report or {})
        if ticket.abandoned:
            mine["abandoned"] = True
        elif ticket.errors:
            mine["error"] = "; ".join(ticket.errors)
        else:
            mine["receipts"] = [r.to_dict() for r in ticket.receipts]
            if ticket.references:
                mine["references"] = [r.to_dict() for r in ticket.references]
        what = f"{self.label}(step={step})"
        reports = comm.gather(mine, f"{what} receipts")
        by_ranks = self.verifies_by_ranks(comm.world_size)
        if by_ranks:
            reports = self._gather_listings(comm, step, attempt, reports, what)
        outcome: dict[str, Any] = {}
        body = b""
        if comm.rank == 0:
            assert reports is not None
            try:
                if check_reports is not None:
                    check_reports(reports)
                manifest = self.commit(
                    step,
                    attempt,
                    reports,
                    progress=progress,
                    run=run,
                    topology=topology,
                    metadata=metadata,
                    listed=by_ranks,
                )
                body = manifest.encode()
                # its timeline tells every rank the key to decode the body against, so no rank
                # parses a (W-shard) manifest twice
                outcome = {"ok": True, "timeline": manifest.timeline}
            except Exception as exc:  # noqa: BLE001 - broadcast and raised on every rank
                outcome = {"error": encode_error(exc)}
        outcome = comm.broadcast(outcome, f"{what} outcome")
        if "error" in outcome:
            error = decode_error(outcome["error"])
            if self.metrics is not None:
                self.metrics.record_failure(step, attempt, error, phase="commit")
            raise error
        body = comm.broadcast_bytes(body if comm.rank == 0 else None, f"{what} manifest")
        manifest = Manifest.decode(body, key=layout.manifest_key(step, outcome["timeline"]))
        lineage.record(self.store, lineage.Position(manifest, manifest.timeline))
        if self.metrics is not None:
            now = time.monotonic()
            self.metrics.record_commit(
                step,
                attempt,
                bytes=ticket.bytes_written,
                save_seconds=now - ticket.started,
                blocking_seconds=blocking_seconds,
                upload_seconds=wrote - ticket.started,
                commit_seconds=now - wrote,
            )
        if comm.rank == 0:
            self.retain(manifest)
        return manifest

    def verifies_by_ranks(self, world_size: int) -> bool:
        """Do the ranks LIST the attempt's slices for the commit (``verify``, resolved for
        ``world_size``: ``"auto"`` is ``"ranks"`` above ``VERIFY_SPREAD_ABOVE`` ranks)?"""
        if self.verify == VERIFY_AUTO:
            return world_size > VERIFY_SPREAD_ABOVE
        return self.verify == VERIFY_RANKS

    def _gather_listings(
        self, comm: Comm, step: int, attempt: str, reports: list[Any] | None, what: str
    ) -> list[Any] | None:
        return gather_listings(comm, reports, lambda: self._listing_report(comm, step, attempt), what)

    def _listing_report(self, comm: Comm, step: int, attempt: str) -> dict[str, Any]:
        """This rank's contribution to the listings gather (the simulator's hosted ranks
        override it to list for every rank a thread hosts)."""
        return self.list_slice(step, attempt, comm.rank, comm.world_size)

    def list_slice(self, step: int, attempt: str, rank: int, world_size: int) -> dict[str, Any]:
        """``rank``'s LIST of its verification slice: :func:`._verification.list_slice`."""
        return list_slice(self.store, step, attempt, rank, world_size, spread=self.key_spreading)

    def save(
        self,
        step: int,
        write: Callable[[SaveTicket], None],
        *,
        error: BaseException | None = None,
        **finish_options: Any,
    ) -> Manifest:
        """:meth:`begin`, ``write(ticket)`` on this rank (its exception is reported, not raised),
        then :meth:`finish`. The simple path for adapters whose ranks write synchronously."""
        ticket = self.begin(step, error=error)
        try:
            write(ticket)
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, raised on every rank
            log.error("rank %d failed to write its shards for step %d: %s", ticket.rank, step, exc)
            ticket.fail(exc)
        return self.finish(ticket, **finish_options)

    def commit(
        self,
        step: int,
        attempt: str,
        reports: Sequence[Mapping[str, Any]],
        *,
        progress: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
        topology: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        listed: bool = False,
    ) -> Manifest:
        """Rank 0's half of :meth:`finish`, for adapters whose framework gathers the reports
        itself (DCP): commit ``attempt`` from every rank's report (``{"receipts": [...]}``,
        ``{"error": "..."}`` or ``{"abandoned": True}``, in rank order).

        ``listed``: the reports carry the ranks' listings of their verification slices
        (:meth:`finish` with ``verify="ranks"``), checked instead of the coordinator's own
        LISTs; otherwise (a framework gathered the reports) the coordinator LISTs.

        Raises:
            CommitError: naming every failing rank (any other failure of the coordinator becomes
                a CommitError of rank 0); CommitConflict; SaveAbandonedError.
        """
        from ..errors import SaveAbandonedError

        abandoned = [r for r, rep in enumerate(reports) if rep.get("abandoned")]
        if abandoned:
            raise SaveAbandonedError(
                f"step {step} attempt {attempt} was abandoned before it was committed; no manifest was written",
                {r: "abandoned (close(abandon=True))" for r in abandoned},
            )
        receipts: dict[int, Any] = {}
        references: dict[int, list[Reference]] = {}
        listings: dict[int, list[ObjectMeta]] | None = {} if listed else None
        for rank, rep in enumerate(reports):
            if rep.get("error"):
                receipts[rank] = str(rep["error"])
                continue
            try:
                receipts[rank] = [
                    ShardReceipt.from_dict(d, key=f"rank {rank} receipt") for d in rep.get("receipts", [])
                ]
                references[rank] = [
                    Reference.from_dict(d, key=f"rank {rank} reference") for d in rep.get("references", [])
                ]
            except ManifestError as exc:
                receipts[rank] = f"sent an invalid receipt: {exc}"
                continue
            if listings is not None and isinstance(rep.get("listing"), list):
                try:
                    listings[rank] = [listed_entry(d) for d in rep["listing"]]
                except (KeyError, TypeError, ValueError) as exc:
                    receipts[rank] = f"sent an invalid listing of its verification slice: {exc}"
        try:
            if self._coordinator is None or self._coordinator.world_size != len(reports):
                # once per world size: construction checks (and warns about) the store
                self._coordinator = Coordinator(self.store, world_size=len(reports))
            timeline, after = lineage.where_to_commit(self.store, step)
            manifest = self._coordinator.commit(
                step,
                attempt,
                receipts,
                progress=progress,
                run=run_identity({**self.identity, **dict(run or {})}),
                topology=topology,
                metadata=metadata,
                timeline=timeline,
                after=after,
                references=references,
                listings=listings,
                spread=self.key_spreading,
            )
            lineage.record(self.store, lineage.Position(manifest, manifest.timeline))
            return manifest
        except CommitError:
            raise
        except Exception as exc:  # noqa: BLE001 - becomes the same CommitError on every rank
            why = f"{type(exc).__name__}: {exc}"
            raise CommitError(
                f"step {step} attempt {attempt} not committed: the coordinator failed: {why}", {0: why}
            ) from exc

    def retain(self, committed: Manifest | None = None) -> None:
        """Apply the retention policy (rank 0, after a commit); logs instead of raising.
        ``committed``: the manifest this session just committed (its shards verified by the
        commit, so retention does not HEAD them again)."""
        if self.retention is not None:
            verified = () if committed is None else (committed.ref,)
            retain(self.store, self.retention, grace_period=self.grace_period, verified=verified)
