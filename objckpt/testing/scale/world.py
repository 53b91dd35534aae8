"""N simulated ranks on the library's :class:`~objckpt.coordination.comm.ThreadWorld`, with a
virtual clock per rank.

:class:`SimComm` is a :class:`~objckpt.coordination.comm.Comm` over a ``ThreadWorld`` rank: every
collective still crosses the thread world's barriers as JSON (so the sessions run exactly their
production collectives), and each value is wrapped with the sender's virtual time, so that every
rank leaves a collective at the time its last participant arrived plus the modelled cost
(:meth:`NetworkModel.collective_s`). ``broadcast_bytes`` (from rank 0 or, ``src=``, any rank)
uses a byte path, as the gloo transport does: the source's thread publishes the bytes and the
others wait for that one thread only, not on the thread world's barrier (a 4,096-thread barrier
costs ~1 s here); every rank receives the very same ``bytes`` object. ``all_gather_bytes`` (the
exchange of a restore that reads replicated state once) is one rendezvous of every thread, not
on the barrier either: each publishes its bytes and its arrival, the last to arrive releases the
others, and every rank gets the very same list; each leaves at the last arrival plus the cost of
the gloo transport's rounds (:func:`~objckpt.coordination.comm.exchange_rounds` of the modelled
sizes under ``defaults.EXCHANGE_BUDGET``: ``collective_s`` of ``W x width`` bytes per round).

**Hosting several ranks per thread** (``threads < world_size``). A ``ThreadWorld`` barrier wakes
every thread, and on this 2-core machine that costs ~0.2 ms per thread per barrier, growing faster
than linearly: 4,096 threads take ~1 s per barrier, 16,384 threads ~36 s (measured), which makes
a 16,384-thread save hours long. So a ``ThreadWorld`` thread may *host* ``world_size / threads``
consecutive ranks. What stays real: the sessions see ``world_size`` ranks (``comm.rank`` is the
hosted group's first rank, ``comm.world_size`` is N); the coordinator receives N reports and
verifies N ranks' receipts against the store; every hosted rank's I/O is issued through the
library (``ShardWriter``, ``Reader``) on its own helper thread with its own timeline
(:meth:`SimWorld.each_hosted`), so all N ranks are concurrent in virtual time and scheduled like
the others. What is derived: a hosted rank other than the group's first does not run the session
code itself; its contribution to a collective is the first rank's (the same hello, the same
staging verdict, which covers the whole group's reads), except for the report that follows its
writes, which the adapter registers with :meth:`SimWorld.report` and which replaces the first
rank's in the next gather (the receipts gather: the protocol is write, then gather).
With ``threads == world_size`` nothing is derived.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ...coordination.comm import Comm, ThreadComm, ThreadWorld, exchange_rounds
from ...defaults import EXCHANGE_BUDGET
from ...errors import DistributedError
from . import clock
from .model import NetworkModel

__all__ = ["SimComm", "SimWorld", "shard_payloads"]

T = TypeVar("T")
_payloads = threading.local()


@contextlib.contextmanager
def shard_payloads() -> Iterator[None]:
    """Byte collectives of the calling thread inside the block carry shard bytes, which stand for
    ``byte_scale`` times as many (a manifest's bytes are its real size)."""
    previous = getattr(_payloads, "on", False)
    _payloads.on = True
    try:
        yield
    finally:
        _payloads.on = previous


class SimWorld:
    """``world_size`` simulated ranks on ``threads`` threads (default: one thread per rank).

    Args:
        world_size: the ranks the protocol sees.
        threads: how many ``ThreadWorld`` ranks (threads) host them; must divide ``world_size``.
        network: collective costs and the rank -> host mapping.
        start: the virtual time every rank starts at.
        timeout: the thread world's barrier timeout (real seconds; generous, as one simulated
            rank may wait a long real time for thousands of others).
    """

    def __init__(
        self,
        world_size: int,
        *,
        threads: int | None = None,
        network: NetworkModel | None = None,
        start: float = 0.0,
        timeout: float = 6 * 3600.0,
    ) -> None:
        threads = world_size if threads is None else threads
        if threads < 1 or world_size % threads:
            raise ValueError(f"threads ({threads}) must divide world_size ({world_size})")
        self.world_size = world_size
        self.threads = threads
        self.group = world_size // threads
        self.network = network or NetworkModel()
        self.threads_world = ThreadWorld(threads, timeout=timeout)
        per_host = self.network.ranks_per_host
        self.timelines = [clock.Timeline(start, rank, rank // per_host) for rank in range(world_size)]
        self._pending: dict[int, Any] = {}
        self._slots: dict[int, _Slot] = {}
        self._gathers: dict[int, _Gathered] = {}
        self._broken: str | None = None
        self._timeout = timeout
        self._lock = threading.Lock()
        self.stack_size = 512 * 1024

    @property
    def now(self) -> float:
        """The latest virtual time any rank has reached."""
        return max(t.now for t in self.timelines)

    def advance_all(self, t: float) -> None:
        """Move every rank to virtual time ``t`` (e.g. the interval between two saves)."""
        for tl in self.timelines:
            tl.advance_to(t)

    def hosted(self, comm: SimComm) -> range:
        """The ranks ``comm``'s thread hosts (its own first)."""
        return range(comm.rank, comm.rank + self.group)

    @contextlib.contextmanager
    def acting_as(self, rank: int, phase: str | None = None) -> Iterator[clock.Timeline]:
        """Run the block as simulated ``rank`` (its timeline; optionally labelled ``phase``)."""
        tl = self.timelines[rank]
        with clock.acting_as(tl):
            if phase is None:
                yield tl
            else:
                with clock.phase(phase, tl):
                    yield tl

    def each_hosted(
        self, comm: SimComm, fn: Callable[[int], T], *, phase: str | None = None
    ) -> list[T | BaseException]:
        """``fn(rank)`` for every rank ``comm``'s thread hosts, each as that rank (its timeline),
        concurrently: the first rank on this thread, the others on helper threads joined before
        returning. One result or exception per hosted rank, in rank order."""
        ranks = list(self.hosted(comm))
        results: dict[int, Any] = {}

        def one(rank: int) -> None:
            try:
                with self.acting_as(rank, phase):
                    results[rank] = fn(rank)
            except BaseException as exc:  # noqa: BLE001 - returned to the caller per rank
                results[rank] = exc

        helpers = []
        if len(ranks) > 1:
            old = threading.stack_size()
            threading.stack_size(self.stack_size)
            try:
                # daemon: Python's bookkeeping of non-daemon threads (``_maintain_shutdown_locks``)
                # walks every live one at each start and join, O(threads^2) per phase here
                helpers = [
                    threading.Thread(target=one, args=(r,), name=f"rank-{r}", daemon=True) for r in ranks[1:]
                ]
                for t in helpers:
                    t.start()
            finally:
                threading.stack_size(old)
        one(ranks[0])
        with clock.blocked():
            for t in helpers:
                t.join()
        return [results[r] for r in ranks]

    def report(self, rank: int, obj: Any) -> None:
        """Register what hosted ``rank`` (not a group's first) contributes to the next gather."""
        with self._lock:
            self._pending[rank] = obj

    def run(self, fn: Callable[[SimComm], T]) -> list[T | BaseException]:
        """Run ``fn(comm)`` on every thread, each as its group's first rank; one result per thread."""

        def body(tcomm: ThreadComm) -> T:
            comm = SimComm(self, tcomm)
            try:
                with clock.acting_as(self.timelines[comm.rank]):
                    return fn(comm)
            except BaseException as exc:
                self._break(f"rank {comm.rank} failed: {type(exc).__name__}: {exc}")
                raise

        return _run_daemon(self.threads_world, body, self.stack_size)

    # -- used by SimComm

    def _take_pending(self, ranks: range) -> dict[int, Any]:
        with self._lock:
            return {r: self._pending.pop(r) for r in ranks if r in self._pending}

    def _break(self, why: str) -> None:
        """A thread left early: wake every rank waiting for a byte broadcast it may never send."""
        with self._lock:
            if self._broken is None:
                self._broken = why
            slots: list[_Slot | _Gathered] = [*self._slots.values(), *self._gathers.values()]
        for slot in slots:
            slot.ready.set()

    def _share(self, seq: int, src: int, rank: int, data: bytes | None, t: float, what: str) -> _Slot:
        """The ``seq``-th byte collective of every thread, a broadcast: ``src``'s thread
        publishes, the others wait for it (not for each other: a broadcast needs only its
        source)."""
        with self._lock:
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot()
            if self._broken is not None:
                slot.ready.set()
        if rank == src:
            slot.data = bytes(data) if data is not None else None
            slot.t = t
            slot.sent = True
            slot.ready.set()
        elif not slot.ready.is_set():
            with clock.blocked():
                if not slot.ready.wait(self._timeout):
                    raise DistributedError(f"{what}: rank {src} sent nothing within {self._timeout:g}s")
        with self._lock:
            slot.left += 1
            if slot.left == self.threads:
                del self._slots[seq]  # every thread has it: free the bytes
        if not slot.sent:
            raise DistributedError(f"{what}: rank {src} never sent ({self._broken})")
        return slot

    def _all_gather(self, seq: int, rank: int, data: bytes, t: float, what: str) -> _Gathered:
        """The ``seq``-th byte collective of every thread, an all-gather: each publishes its
        bytes and arrival time; the last to arrive releases the others (one wake-up each, no
        barrier round); every thread gets the same :class:`_Gathered`."""
        with self._lock:
            slot = self._gathers.get(seq)
            if slot is None:
                slot = self._gathers[seq] = _Gathered(self.threads)
            slot.data[rank // self.group] = data
            slot.t = max(slot.t, t)
            slot.arrived += 1
            if slot.arrived == self.threads or self._broken is not None:
                slot.ready.set()
        if not slot.ready.is_set():
            with clock.blocked():
                if not slot.ready.wait(self._timeout):
                    raise DistributedError(f"{what}: not every rank took part within {self._timeout:g}s")
        with self._lock:
            slot.left += 1
            if slot.left == self.threads:
                del self._gathers[seq]  # every thread has it: the world no longer holds the bytes
        if slot.arrived < self.threads:
            raise DistributedError(f"{what}: a rank never took part ({self._broken})")
        return slot


def _run_daemon(
    world: ThreadWorld, fn: Callable[[ThreadComm], T], stack_size: int
) -> list[T | BaseException]:
    """``ThreadWorld.run`` on daemon threads (the same comms, results and exceptions): a
    non-daemon thread's start and join walk the tstate lock of every live non-daemon thread
    (``threading._maintain_shutdown_locks``), which at 16,384 threads is most of a phase."""
    results: dict[int, T | BaseException] = {}

    def body(rank: int) -> None:
        try:
            value: T | BaseException = fn(world.comm(rank))
        except BaseException as exc:  # noqa: BLE001 - returned to the caller per rank
            value = exc
        results[rank] = value

    old = threading.stack_size()
    threading.stack_size(stack_size)
    try:
        threads = [
            threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
            for r in range(world.world_size)
        ]
        for t in threads:
            t.start()
    finally:
        threading.stack_size(old)
    for t in threads:
        t.join()
    return [results[r] for r in range(world.world_size)]


class _Slot:
    """One byte broadcast in flight (see :meth:`SimWorld._share`)."""

    __slots__ = ("data", "left", "ready", "sent", "t")

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.t = 0.0
        self.left = 0
        self.sent = False
        self.ready = threading.Event()


class _Gathered:
    """One all-gather of bytes in flight (see :meth:`SimWorld._all_gather`)."""

    __slots__ = ("arrived", "data", "left", "ready", "t")

    def __init__(self, threads: int) -> None:
        self.data: list[bytes] = [b""] * threads
        self.t = -math.inf
        self.arrived = 0
        self.left = 0
        self.ready = threading.Event()


class SimComm(Comm):
    """One thread's communicator: the ranks it hosts speak through one ``ThreadWorld`` rank."""

    def __init__(self, world: SimWorld, inner: ThreadComm) -> None:
        self.world = world
        self.inner = inner
        self.rank = inner.rank * world.group
        self.world_size = world.world_size
        self._hosted = [world.timelines[r] for r in world.hosted(self)]
        self._seq = 0

    @property
    def timeline(self) -> clock.Timeline:
        return self._hosted[0]

    def _arrived(self) -> float:
        return max(tl.now for tl in self._hosted)

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        hosted = self.world.hosted(self)
        pending = self.world._take_pending(hosted) if self.world.group > 1 else {}
        values = [obj if r == self.rank else pending.get(r, obj) for r in hosted]
        nbytes = len(json.dumps(values, separators=(",", ":")))
        with clock.blocked():
            got = self.inner.gather(
                {"t": self._arrived(), "v": values, "n": nbytes}, what, handshake=handshake
            )
        net = self.world.network
        if self.rank != 0:
            for tl in self._hosted:
                tl.advance(net.collective_latency_s)  # sent; the root gathers
            return None
        assert got is not None
        t = max(g["t"] for g in got) + net.collective_s(self.world_size, sum(g["n"] for g in got))
        for tl in self._hosted:
            tl.advance_to(t)
        return [v for g in got for v in g["v"]]

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return self._broadcast(obj, what, handshake=handshake, nbytes=None)

    def _broadcast(self, obj: Any, what: str, *, handshake: bool, nbytes: int | None) -> Any:
        payload = None
        if self.rank == 0:
            n = nbytes if nbytes is not None else len(json.dumps(obj, separators=(",", ":")))
            payload = {"t": self._arrived(), "v": obj, "n": n}
        with clock.blocked():
            got = self.inner.broadcast(payload, what, handshake=handshake)
        t = got["t"] + self.world.network.collective_s(self.world_size, got["n"])
        for tl in self._hosted:
            tl.advance_to(t)
        return got["v"]

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        """Rank ``src``'s bytes on every rank, the very same object (see :meth:`SimWorld._share`);
        each rank leaves at ``src``'s arrival plus the collective's modelled cost."""
        if not 0 <= src < self.world_size:
            raise DistributedError(f"{what}: no rank {src} in a world of {self.world_size}")
        if src % self.world.group:
            raise DistributedError(
                f"{what}: rank {src} is hosted on rank {src - src % self.world.group}'s thread and takes "
                "no part in collectives of its own (run with one thread per rank)"
            )
        seq = self._seq
        self._seq += 1
        shards = getattr(_payloads, "on", False)
        slot = self.world._share(seq, src, self.rank, data, self._arrived(), what)
        if slot.data is None:
            raise DistributedError(f"{what}: rank {src} sent no bytes")
        net = self.world.network
        n = len(slot.data) * (net.byte_scale if shards else 1)
        # a receiver takes part from its own arrival: W broadcasts in a row cost W x the cost
        t = max(slot.t, self._arrived()) + net.collective_s(self.world_size, round(n))
        for tl in self._hosted:
            tl.advance_to(t)
        return slot.data

    def _all_gather_bytes(self, mine: bytes, sizes: list[int], what: str) -> Sequence[bytes]:
        """Every rank's bytes, the very same list on every rank (see :meth:`SimWorld._all_gather`);
        each rank leaves at the last arrival plus the modelled cost of the gloo transport's
        rounds over the modelled (``byte_scale``d, for shard payloads) sizes."""
        if self.world.group > 1:
            raise DistributedError(
                f"{what}: ranks share threads here ({self.world.group} per thread), and hosted ranks "
                "take no part in collectives of their own (run with one thread per rank)"
            )
        seq = self._seq
        self._seq += 1
        slot = self.world._all_gather(seq, self.rank, mine, self._arrived(), what)
        net = self.world.network
        scale = net.byte_scale if getattr(_payloads, "on", False) else 1
        rounds = exchange_rounds([round(n * scale) for n in sizes], EXCHANGE_BUDGET)
        t = slot.t + sum(net.collective_s(self.world_size, self.world_size * width) for _, width in rounds)
        for tl in self._hosted:
            tl.advance_to(t)
        return slot.data

    def background(self) -> Comm:
        return self
