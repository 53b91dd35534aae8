"""N simulated ranks as threads (started by a :class:`~objckpt.coordination.comm.ThreadWorld`),
with a virtual clock per rank.

:class:`SimComm` is a :class:`~objckpt.coordination.comm.Comm` whose collectives carry the values
the production sessions send (``gather`` and ``broadcast`` as JSON, round-tripped as the wire
does: every sender's value and every receiver's copy is decoded from JSON text; the byte
collectives as bytes), each wrapped with the sender's virtual time, so that every rank leaves a
collective at the time its last participant arrived plus the modelled cost
(:meth:`NetworkModel.collective_s`). None of them uses the ``ThreadWorld`` barrier: each is one
rendezvous (:meth:`SimWorld._meet`) where a waiting thread blocks on an event of its own and the
arrival that completes the collective sets them (one wake-up per waiter). A barrier instead wakes
every thread through one shared condition, which costs ~1 s per collective at 4,096 threads and
~110 s at 16,384 here (measured); one ``agree`` (a gather and a broadcast) on the rendezvous
took 19-22 s at 16,384 threads (3 runs, load average 110-160 on 2 cores). A ``gather``'s senders
leave once they have published (as a real sender does); rank 0 waits for the last. A
``broadcast`` / ``broadcast_bytes`` receiver waits for the source's thread only: every rank
receives the very same ``bytes`` object of a byte broadcast. ``all_gather_bytes`` (the exchange
of a restore that reads replicated state once) waits for every thread, and every rank gets the
very same list; each leaves at the last arrival plus the cost of what the gloo transport sends
(up to ``defaults.EXCHANGE_BROADCAST_MAX_WORLD`` ranks ``collective_s`` of each contribution, one
broadcast per source; above, :func:`~objckpt.coordination.comm.exchange_rounds` of the modelled
sizes under ``defaults.EXCHANGE_BUDGET``: ``collective_s`` of ``W x width`` bytes per round). A thread that
fails, or a wait longer than ``timeout``, breaks the world: every rank waiting in a collective,
then or later, raises :class:`~objckpt.errors.DistributedError` naming the failure.

**Hosting several ranks per thread** (``threads < world_size``). A ``ThreadWorld`` barrier wakes
every thread, and so did each collective here before the rendezvous above (~1 s at 4,096
threads, ~110 s at 16,384), which made a 16,384-thread save hours long; threads still cost
memory and scheduling (a save's thousands of requests per thread). So a ``ThreadWorld`` thread
may *host* ``world_size / threads`` consecutive ranks. What stays real: the sessions see ``world_size`` ranks (``comm.rank`` is the
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
from typing import Any, TypeVar, cast

from ..._crc import Buffer
from ...coordination.comm import Comm, ThreadComm, ThreadWorld, exchange_rounds
from ...defaults import EXCHANGE_BROADCAST_MAX_WORLD, EXCHANGE_BUDGET
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
        self._meets: dict[int, _Meeting] = {}
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
        """A thread left early (or a wait timed out): release every rank waiting in a collective
        it may never complete; each raises :class:`DistributedError` naming ``why``."""
        wake: list[threading.Event] = []
        with self._lock:
            if self._broken is None:
                self._broken = why
            for m in self._meets.values():
                if not m.released:
                    m.released = True
                wake += m.waiters
                m.waiters = []
        for ev in wake:
            ev.set()

    def _meet(
        self,
        seq: int,
        index: int,
        value: Any,
        t: float | None,
        what: str,
        *,
        src: int | None,
        waits: bool,
    ) -> _Meeting:
        """The ``seq``-th collective of every thread, one rendezvous without a barrier round.

        ``index`` is this thread's slot; ``value`` and ``t`` (arrival time) are published when
        ``t`` is not ``None``. ``src`` is the thread whose arrival completes the meeting (a
        broadcast), or ``None``: every thread's (a gather, an all-gather). ``waits``: this
        thread returns only once the meeting is complete, blocked on an event of its own that
        the completing arrival sets (one wake-up per waiter; a ``ThreadWorld`` barrier's shared
        condition costs ~110 s per collective at 16,384 threads here). Threads that do not wait
        (a gather's senders) leave at once, as a real sender does.

        Raises:
            DistributedError: the world broke (a thread failed: :meth:`_break`), or this thread
                waited ``timeout`` seconds (which breaks the world, so no other rank hangs).
        """
        ev: threading.Event | None = None
        with self._lock:
            m = self._meets.get(seq)
            if m is None:
                m = self._meets[seq] = _Meeting(self.threads)
            if t is not None:
                m.values[index] = value
                m.t = max(m.t, t)
                m.sent = True
            m.arrived += 1
            done = m.arrived == self.threads if src is None else m.sent
            wake: list[threading.Event] = []
            if not m.released and (done or self._broken is not None):
                m.released, m.complete = True, done
                wake, m.waiters = m.waiters, []
            if waits and not m.released:
                ev = threading.Event()
                m.waiters.append(ev)
        for w in wake:
            w.set()
        if ev is not None:
            with clock.blocked():
                if not ev.wait(self._timeout):
                    who = "not every rank took part" if src is None else f"rank {src} sent nothing"
                    self._break(f"{what}: {who} within {self._timeout:g}s")
        with self._lock:
            m.left += 1
            if m.left == self.threads:
                del self._meets[seq]  # every thread is done with it: free the values
        if not m.complete and (waits or self._broken is not None):
            raise DistributedError(f"{what}: the simulated world broke ({self._broken})")
        return m


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


class _Meeting:
    """One collective in flight (see :meth:`SimWorld._meet`)."""

    __slots__ = ("arrived", "complete", "left", "released", "sent", "t", "values", "waiters")

    def __init__(self, threads: int) -> None:
        self.values: list[Any] = [None] * threads
        self.t = -math.inf
        self.arrived = 0
        self.left = 0
        self.sent = False
        self.released = False
        self.complete = False
        self.waiters: list[threading.Event] = []


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

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        """Every hosted rank's ``obj``, JSON round-tripped as the wire does, on rank 0 (one
        :meth:`SimWorld._meet`: the senders leave at once, rank 0 waits for the last)."""
        hosted = self.world.hosted(self)
        pending = self.world._take_pending(hosted) if self.world.group > 1 else {}
        values = [obj if r == self.rank else pending.get(r, obj) for r in hosted]
        text = json.dumps(values, separators=(",", ":"))
        arrived = self._arrived()
        index = self.inner.rank
        m = self.world._meet(
            self._next(), index, (json.loads(text), len(text)), arrived, what, src=None, waits=index == 0
        )
        net = self.world.network
        if self.rank != 0:
            for tl in self._hosted:
                tl.advance(net.collective_latency_s)  # sent; the root gathers
            return None
        t = m.t + net.collective_s(self.world_size, sum(n for _, n in m.values))
        for tl in self._hosted:
            tl.advance_to(t)
        return [v for got, _ in m.values for v in got]

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return self._broadcast(obj, what, handshake=handshake, nbytes=None)

    def _broadcast(self, obj: Any, what: str, *, handshake: bool, nbytes: int | None) -> Any:
        """Rank 0's ``obj`` on every rank: rank 0 encodes it once, every other rank decodes its
        own copy (a JSON round trip each, as the wire does; no rank shares another's object)."""
        root = self.rank == 0
        text = json.dumps(obj, separators=(",", ":")) if root else None
        n = (nbytes if nbytes is not None else len(text)) if text is not None else 0
        m = self.world._meet(
            self._next(),
            self.inner.rank,
            (text, n),
            self._arrived() if root else None,
            what,
            src=0,
            waits=not root,
        )
        text, n = m.values[0]
        t = m.t + self.world.network.collective_s(self.world_size, n)
        for tl in self._hosted:
            tl.advance_to(t)
        return json.loads(text)

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        """Rank ``src``'s bytes on every rank, the very same object (the others wait for that
        one thread only: :meth:`SimWorld._meet`); each rank leaves at ``src``'s arrival (or its
        own, if later) plus the collective's modelled cost."""
        if not 0 <= src < self.world_size:
            raise DistributedError(f"{what}: no rank {src} in a world of {self.world_size}")
        if src % self.world.group:
            raise DistributedError(
                f"{what}: rank {src} is hosted on rank {src - src % self.world.group}'s thread and takes "
                "no part in collectives of its own (run with one thread per rank)"
            )
        shards = getattr(_payloads, "on", False)
        source = src // self.world.group
        mine = self.inner.rank == source
        sent = (bytes(data) if data is not None else None) if mine else None
        m = self.world._meet(
            self._next(),
            self.inner.rank,
            sent,
            self._arrived() if mine else None,
            what,
            src=source,
            waits=not mine,
        )
        got = m.values[source]
        if got is None:
            raise DistributedError(f"{what}: rank {src} sent no bytes")
        net = self.world.network
        n = len(got) * (net.byte_scale if shards else 1)
        # a receiver takes part from its own arrival: W broadcasts in a row cost W x the cost
        t = max(m.t, self._arrived()) + net.collective_s(self.world_size, round(n))
        for tl in self._hosted:
            tl.advance_to(t)
        return cast("bytes", got)

    def _all_gather_bytes(self, mine: Buffer, sizes: list[int], what: str) -> Sequence[Buffer]:
        """Every rank's bytes, the very same list on every rank (one :meth:`SimWorld._meet`, the
        last arrival releases the others); each rank leaves at the last arrival plus the modelled
        cost of what the gloo transport sends for the modelled (``byte_scale``d, for shard
        payloads) sizes: up to ``EXCHANGE_BROADCAST_MAX_WORLD`` ranks one broadcast per
        contributing rank, above it rounds of one all-gather."""
        if self.world.group > 1:
            raise DistributedError(
                f"{what}: ranks share threads here ({self.world.group} per thread), and hosted ranks "
                "take no part in collectives of their own (run with one thread per rank)"
            )
        m = self.world._meet(self._next(), self.rank, mine, self._arrived(), what, src=None, waits=True)
        net = self.world.network
        scale = net.byte_scale if getattr(_payloads, "on", False) else 1
        modelled = [round(n * scale) for n in sizes]
        if self.world_size <= EXCHANGE_BROADCAST_MAX_WORLD:  # as DistComm: a broadcast per source
            t = m.t + sum(net.collective_s(self.world_size, n) for n in modelled if n)
        else:
            rounds = exchange_rounds(modelled, EXCHANGE_BUDGET)
            t = m.t + sum(net.collective_s(self.world_size, self.world_size * width) for _, width in rounds)
        for tl in self._hosted:
            tl.advance_to(t)
        return cast("list[Buffer]", m.values)

    def background(self) -> Comm:
        return self
