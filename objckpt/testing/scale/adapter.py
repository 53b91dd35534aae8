"""What each simulated rank writes and reads: a torch-free mirror of ``CheckpointManager``'s
shard layout (:mod:`objckpt.training.shards`).

Per rank and save: ``shards_per_rank - 1`` per-rank shards (``shard-NN.bin``, ``shard_bytes``
each: the sharded state) and ``replicated.bin``, this rank's ``1/N`` of the replicated state
(``replicated_bytes / N``), all written through the rank's ``ShardWriter`` one after the other
(``write_lanes`` > 1 models concurrent uploads: since 2026-12-06 ``shards.write`` writes a
replicated share of two parts or more on an object store as that many pieces at once, up to
``max_in_flight``; one lane is the case of a share under two parts).

Restore (``stage``), ``replicated_read="every"`` (before the fix): a rank reads its own shards
**and every rank's** ``replicated.bin`` (so each rank downloads the whole replicated state);
``"once"``: the rank calls the library's ``coordination.exchange.read_shared`` on its
communicator, as ``shards.stage`` does (it downloads ~1/W of the ``replicated.bin`` shards, the
ranks exchange them in one all-gather and CRC32C-check what they receive), then reads its own shards; through
``Reader.read_shard`` (size and CRC32C verified), ``read_lanes`` at a time (``shards.stage``
uses a pool of 8). Unlike that pool, which drains its queue after a failed read, a simulated
rank stops at its first failure, and (``stop_restore_on_failure``) once any rank has failed the
others stop too (and report nothing: the failing rank's error is the restore's): the traffic
reported for a failed restore is a lower bound.

The bytes are real (a deterministic pattern) and go through the real writer, store wrapper,
retry policy and reader; only their size is chosen small (see ``NetworkModel.byte_scale``).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...coordination.exchange import assign, read_shared
from ...manifest import Manifest, ShardReceipt
from ...reader import Reader
from ...store.base import Store
from ...writer import ShardWriter
from . import clock
from .fixes import Switches
from .world import shard_payloads

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
    shared_bytes: dict[int, int] = field(default_factory=dict)
    written_bytes: dict[int, int] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Stopped(Exception):
    """A rank stopped staging because another rank's failed (``stop_restore_on_failure``)."""


class Adapter:
    """The simulated training job's checkpoint content (see the module doc)."""

    def __init__(self, options: ScaleOptions, switches: Switches | None = None) -> None:
        self.options = options
        self.switches = switches or Switches()
        n = options.shards_per_rank
        if n < 1:
            raise ValueError("shards_per_rank must be >= 1")
        self.names = [f"shard-{i:02d}.bin" for i in range(n - 1)] + [REPLICATED]
        self.io = RankIO()
        self._index: dict[int, tuple[Manifest, dict[int, list[ShardReceipt]], list[ShardReceipt]]] = {}
        self._index_lock = threading.Lock()
        self._sizes: dict[int, tuple[list[ShardReceipt], int]] = {}
        self._assigned: dict[int, tuple[list[ShardReceipt], dict[int, int], dict[int, int]]] = {}

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
            writer = ShardWriter(
                store,
                step=ticket.step,
                attempt=ticket.attempt,
                rank=rank,
                key_spreading=self.switches.key_spreading,
            )
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
        tl.lanes = lanes
        try:
            for name in self.names:
                i = min(range(len(lanes)), key=lanes.__getitem__)
                tl.set(lanes[i])
                lanes[i] = -math.inf  # running: not one of the others in flight
                data = self.payload(step, rank, name)
                writer.write(name, data)
                written += len(data)
                lanes[i] = tl.now
        finally:
            tl.lanes = None
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

    def plan(self, manifest: Manifest, rank: int) -> tuple[list[ShardReceipt], list[ShardReceipt]]:
        """The shards ``rank`` reads to restore ``manifest`` (today: its own, then every
        ``replicated.bin``), as two lists shared with the index (not concatenated: at 16,384
        ranks one rank's list would hold 16,391 receipts, and every rank holds one)."""
        own, replicated = self._indexed(manifest)
        return own.get(rank, []), replicated

    def _size_of(self, receipts: list[ShardReceipt]) -> int:
        with self._index_lock:
            hit = self._sizes.get(id(receipts))
            if hit is None or hit[0] is not receipts:
                hit = self._sizes[id(receipts)] = (receipts, sum(r.size for r in receipts))
            return hit[1]

    def _shares(self, replicated: list[ShardReceipt]) -> tuple[dict[int, int], dict[int, int]]:
        """``replicated_read="once"``: from the library's own plan (``exchange.assign``) of who
        reads which replicated shard, the bytes and the shards each rank reads of them (cached per
        manifest)."""
        # computed under the lock: thousands of ranks arrive at once, and each computing the
        # plan for itself would be O(W^2) real time
        with self._index_lock:
            hit = self._assigned.get(id(replicated))
            if hit is not None and hit[0] is replicated:
                return hit[1], hit[2]
            ordered = sorted({r.key: r for r in replicated}.values(), key=lambda r: r.key)
            owners = assign(ordered, self.options.world_size)
            loads: dict[int, int] = {}
            counts: dict[int, int] = {}
            for r in ordered:
                loads[owners[r.key]] = loads.get(owners[r.key], 0) + r.size
                counts[owners[r.key]] = counts.get(owners[r.key], 0) + 1
            self._assigned = {id(replicated): (replicated, loads, counts)}
            return loads, counts

    def stage(self, world: SimWorld, comm: SimComm, reader: Reader, manifest: Manifest) -> None:
        """Read (and verify) every hosted rank's shards; raise the first failure.

        ``replicated_read="every"`` (before): each rank reads its own shards and every
        ``replicated.bin``. ``"once"``: as ``training.shards.stage`` does then, each rank first
        takes part in the library's :func:`~objckpt.coordination.exchange.read_shared` (it
        downloads its assigned share of the ``replicated.bin`` shards, the ranks exchange them in
        one all-gather and every other rank CRC32C-checks every shard), then reads its own
        shards."""
        once = self.switches.replicated_read == "once" and world.world_size > 1
        if once and world.group > 1:
            raise ValueError(
                "replicated_read='once' needs one thread per rank: read_shared is a collective of "
                f"every rank, and {world.group} ranks share each thread here (raise restore_max_threads)"
            )

        def one(rank: int) -> None:
            try:
                if once:
                    self._read_once(comm, reader, manifest, rank)
                else:
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
        own, replicated = self.plan(manifest, rank)
        with self.io.lock:
            self.io.planned_bytes[rank] = sum(r.size for r in own) + self._size_of(replicated)
            self.io.planned_reads[rank] = len(own) + len(replicated)
        done = self._read_each(reader, itertools.chain(own, replicated))
        with self.io.lock:
            self.io.read_bytes[rank] = done

    def _read_once(self, comm: SimComm, reader: Reader, manifest: Manifest, rank: int) -> None:
        own, replicated = self.plan(manifest, rank)
        loads, counts = self._shares(replicated)
        mine = loads.get(rank, 0)
        with self.io.lock:
            self.io.planned_bytes[rank] = sum(r.size for r in own) + mine
            self.io.planned_reads[rank] = len(own) + counts.get(rank, 0)
        with shard_payloads():
            shared = read_shared(comm, reader, replicated, f"restore(step={manifest.step})")
        # every shard's bytes, less this rank's own downloads (O(W) in C, not a Python loop per
        # shard: each of thousands of ranks does it)
        received = sum(map(len, shared.values())) - mine
        del shared
        done = self._read_each(reader, iter(own))
        with self.io.lock:
            self.io.read_bytes[rank] = done + mine
            self.io.shared_bytes[rank] = received

    def _read_each(self, reader: Reader, receipts: Iterator[ShardReceipt]) -> int:
        """Read ``receipts`` ``read_lanes`` at a time (virtual lanes of the rank's timeline);
        the bytes read. Stops (``_Stopped``) once another rank has failed, if asked to."""
        tl = clock.current()
        assert tl is not None
        lanes = [tl.now] * max(1, self.options.read_lanes)
        done = 0
        stop = self.options.stop_restore_on_failure
        tl.lanes = lanes
        try:
            for r in receipts:
                if stop and self.io.errors:
                    raise _Stopped()
                i = min(range(len(lanes)), key=lanes.__getitem__)
                tl.set(lanes[i])
                lanes[i] = -math.inf  # running: not one of the others in flight
                done += len(reader.read_shard(r))
                lanes[i] = tl.now
        finally:
            tl.lanes = None
            tl.set(max(max(lanes), tl.now))
        return done
