"""What each simulated rank writes and reads: a torch-free mirror of ``CheckpointManager``'s
shard layout (:mod:`objckpt.training.shards`).

Per rank and save: ``shards_per_rank - 1`` per-rank shards (``shard-NN.bin``, ``shard_bytes``
each: the sharded state) and ``replicated.bin``, this rank's ``1/N`` of the replicated state
(``replicated_bytes / N``), all written through the rank's ``ShardWriter`` one after the other
(``shards.write`` writes its shards in sequence; ``write_lanes`` > 1 models concurrent uploads).

Restore (``stage``): today's rule of ``shards.stage``: a rank reads its own shards **and every
rank's** ``replicated.bin`` (so each rank downloads the whole replicated state), through
``Reader.read_shard`` (size and CRC32C verified), ``read_lanes`` at a time (``shards.stage``
uses a pool of 8). Unlike that pool, which drains its queue after a failed read, a simulated
rank stops at its first failure, and (``stop_restore_on_failure``) once any rank has failed the
others stop too (and report nothing: the failing rank's error is the restore's): the traffic
reported for a failed restore is a lower bound.

The bytes are real (a deterministic pattern) and go through the real writer, store wrapper,
retry policy and reader; only their size is chosen small (see ``NetworkModel.byte_scale``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...manifest import Manifest, ShardReceipt
from ...reader import Reader
from ...store.base import Store
from ...writer import ShardWriter
from . import clock

if TYPE_CHECKING:
    from ...coordination.save import SaveTicket
    from .scenario import ScaleOptions
    from .world import SimComm, SimWorld

__all__ = ["REPLICATED", "Adapter", "RankIO"]

REPLICATED = "replicated.bin"


@dataclass
class RankIO:
    """What the adapter did for each rank (planned and completed bytes and requests)."""

    planned_bytes: dict[int, int] = field(default_factory=dict)
    planned_reads: dict[int, int] = field(default_factory=dict)
    read_bytes: dict[int, int] = field(default_factory=dict)
    written_bytes: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Stopped(Exception):
    """A rank stopped staging because another rank's failed (``stop_restore_on_failure``)."""


class Adapter:
    """The simulated training job's checkpoint content (see the module doc)."""

    def __init__(self, options: ScaleOptions) -> None:
        self.options = options
        n = options.shards_per_rank
        if n < 1:
            raise ValueError("shards_per_rank must be >= 1")
        self.names = [f"shard-{i:02d}.bin" for i in range(n - 1)] + [REPLICATED]
        self.io = RankIO()
        self._index: dict[int, tuple[Manifest, dict[int, list[ShardReceipt]], list[ShardReceipt]]] = {}
        self._index_lock = threading.Lock()

    def reset(self) -> RankIO:
        old, self.io = self.io, RankIO()
        return old

    # ------------------------------------------------------------------ save

    def payload(self, step: int, rank: int, name: str) -> bytes:
        o = self.options
        size = max(1, o.replicated_bytes // o.world_size) if name == REPLICATED else o.shard_bytes
        seed = f"{step}:{rank}:{name}|".encode()
        return (seed * (size // len(seed) + 1))[:size]

    def write(self, world: SimWorld, comm: SimComm, store: Store, ticket: SaveTicket) -> None:
        """Write every hosted rank's shards; the first rank's through the session's ticket, the
        others' through their own ``ShardWriter`` (registered as their gather reports)."""

        def one(rank: int) -> None:
            if rank == ticket.rank:
                assert ticket.writer is not None
                try:
                    self._write_rank(ticket.writer, ticket.step, rank)
                except Exception as exc:  # noqa: BLE001 - reported to rank 0 like SaveSession.save
                    ticket.fail(exc)
                return
            writer = ShardWriter(store, step=ticket.step, attempt=ticket.attempt, rank=rank)
            try:
                self._write_rank(writer, ticket.step, rank)
                report: dict[str, Any] = {"receipts": [r.to_dict() for r in writer.receipts]}
            except Exception as exc:  # noqa: BLE001 - becomes this rank's report
                report = {"error": f"{type(exc).__name__}: {exc}"}
            world.report(rank, report)

        for outcome in world.each_hosted(comm, one, phase="write"):
            if isinstance(outcome, BaseException):
                raise outcome

    def _write_rank(self, writer: ShardWriter, step: int, rank: int) -> None:
        tl = clock.current()
        assert tl is not None
        lanes = [tl.now] * max(1, self.options.write_lanes)
        written = 0
        for name in self.names:
            i = min(range(len(lanes)), key=lanes.__getitem__)
            tl.set(lanes[i])
            data = self.payload(step, rank, name)
            writer.write(name, data)
            written += len(data)
            lanes[i] = tl.now
        tl.set(max(lanes))
        with self.io.lock:
            self.io.written_bytes[rank] = written

    # ------------------------------------------------------------------ restore

    def _indexed(self, manifest: Manifest) -> tuple[dict[int, list[ShardReceipt]], list[ShardReceipt]]:
        # One index per manifest object (every rank holds the same decoded manifest when decoding
        # is memoized); built from the public ``shards`` tuple.
        with self._index_lock:
            hit = self._index.get(id(manifest))
            if hit is not None and hit[0] is manifest:
                return hit[1], hit[2]
            own: dict[int, list[ShardReceipt]] = {}
            replicated: list[ShardReceipt] = []
            for s in manifest.shards:
                if s.name == REPLICATED:
                    replicated.append(s)
                else:
                    own.setdefault(s.rank, []).append(s)
            self._index = {id(manifest): (manifest, own, replicated)}
            return own, replicated

    def plan(self, manifest: Manifest, rank: int) -> list[ShardReceipt]:
        """The shards ``rank`` reads to restore ``manifest`` (today: its own and every
        ``replicated.bin``)."""
        own, replicated = self._indexed(manifest)
        return [*own.get(rank, []), *replicated]

    def stage(self, world: SimWorld, comm: SimComm, reader: Reader, manifest: Manifest) -> None:
        """Read (and verify) every hosted rank's shards; raise the first failure."""

        def one(rank: int) -> None:
            try:
                self._read_rank(reader, manifest, rank)
            except _Stopped:
                return  # the restore has failed elsewhere; the failing rank reports it
            except Exception as exc:
                with self.io.lock:
                    self.io.errors[rank] = f"{type(exc).__name__}: {exc}"
                raise

        for outcome in world.each_hosted(comm, one, phase="stage"):
            if isinstance(outcome, BaseException):
                raise outcome

    def _read_rank(self, reader: Reader, manifest: Manifest, rank: int) -> None:
        tl = clock.current()
        assert tl is not None
        receipts: Sequence[ShardReceipt] = self.plan(manifest, rank)
        with self.io.lock:
            self.io.planned_bytes[rank] = sum(r.size for r in receipts)
            self.io.planned_reads[rank] = len(receipts)
        lanes = [tl.now] * max(1, self.options.read_lanes)
        done = 0
        stop = self.options.stop_restore_on_failure
        try:
            for r in receipts:
                if stop and self.io.errors:
                    raise _Stopped()
                i = min(range(len(lanes)), key=lanes.__getitem__)
                tl.set(lanes[i])
                done += len(reader.read_shard(r))
                lanes[i] = tl.now
        finally:
            tl.set(max(max(lanes), tl.now))
            with self.io.lock:
                self.io.read_bytes[rank] = done
