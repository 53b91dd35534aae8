"""What the save and restore sessions need from the process world, and two torch-free worlds.

A :class:`Comm` moves small JSON-able values between the ranks of one job: ``gather`` to rank 0,
``broadcast`` from rank 0; and raw bytes: ``broadcast_bytes`` from any rank (a resolved manifest),
``all_gather_bytes`` from every rank to every rank in one collective (the replicated shards read
once for the whole job, each rank contributing those it read). On top of
them :func:`agree` is the protocol's one decision primitive: every rank sends what it knows, rank 0
decides, and every rank returns the same value or raises the same error (invariants 4, 5, 13).

Implementations:

* :class:`LocalComm` -- one process; every collective is the identity.
* :class:`ThreadWorld` -- N ranks as threads of one process (tests at 1, 2 and 16 ranks, and the
  scale simulator at thousands). Values cross the "wire" as JSON, exactly as between processes,
  so a value that would not survive the real transport fails here too.
* ``objckpt.training.dist.DistComm`` -- torch.distributed over dedicated gloo groups.

Collectives on one communicator must be issued in the same order on every rank. After a
collective fails (a timeout: a rank died, or not every rank called it) the communicator is broken
and every later call raises :class:`DistributedError` at once: restart the job.
"""

from __future__ import annotations

import json
import mmap
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .._crc import Buffer
from ..errors import DistributedError, decode_error, encode_error

__all__ = ["Comm", "LocalComm", "ThreadComm", "ThreadWorld", "agree", "exchange_rounds", "writable_buffer"]

T = TypeVar("T")


def _wire(obj: Any) -> Any:
    """What ``obj`` becomes after crossing the wire (a JSON round trip, no pickle ever)."""
    return json.loads(json.dumps(obj, separators=(",", ":")))


class Comm(ABC):
    """The collectives of one job (or of one of its threads, see :meth:`background`).

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``; rank 0 coordinates.
        world_size: how many ranks take part in every collective.
    """

    rank: int = 0
    world_size: int = 1

    @abstractmethod
    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        """Every rank's JSON-able ``obj`` on rank 0, in rank order; ``None`` on other ranks.

        ``what`` names the collective in errors. ``handshake=True``: the entry of a save or
        restore, where ranks should arrive within seconds of each other (a shorter timeout, so a
        save called on rank 0 alone fails fast instead of hanging).

        Raises:
            DistributedError: a rank did not take part in time, or the communicator is broken.
        """

    @abstractmethod
    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        """Rank 0's JSON-able ``obj`` on every rank (the argument is ignored elsewhere)."""

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        """Rank ``src``'s ``data`` on every rank (the argument is ignored elsewhere). The default
        sends it as base64 JSON (from a rank other than 0 through a gather to rank 0 first);
        transports with a byte path (gloo tensors, threads) override it."""
        import base64

        check_src(self, src, what)
        text = base64.b64encode(data).decode("ascii") if self.rank == src and data is not None else None
        if src != 0:
            gathered = self.gather(text, what)
            text = gathered[src] if gathered is not None else None
        got = self.broadcast(text, what)
        if not isinstance(got, str):
            raise DistributedError(f"{what}: rank {src} sent no bytes")
        return base64.b64decode(got)

    def broadcast_into(self, buffer: memoryview, what: str, *, src: int) -> None:
        """Rank ``src``'s ``buffer`` written into every other rank's ``buffer``, which holds the
        same number of bytes on every rank (the callers' shared plan says how many; no length
        is sent). A collective of every rank; nothing when the buffer is empty. The default goes
        through :meth:`broadcast_bytes` (a copy); the gloo ``DistComm`` receives in place.

        Raises:
            DistributedError: a rank did not take part in time, or sent another number of bytes.
        """
        check_src(self, src, what)
        view = memoryview(buffer).cast("B")
        if not view.nbytes:
            return
        got = self.broadcast_bytes(bytes(view) if self.rank == src else None, what, src=src)
        if self.rank != src:
            if len(got) != view.nbytes:
                raise DistributedError(
                    f"{what}: rank {self.rank} expected {view.nbytes} bytes from rank {src}, got {len(got)}"
                )
            view[:] = got

    def all_gather_bytes(self, data: Buffer | None, sizes: Sequence[int], what: str) -> Sequence[Buffer]:
        """Every rank's bytes on every rank, in rank order: rank ``r`` contributes exactly
        ``sizes[r]`` bytes. ``sizes`` is known to every rank in advance (every rank passes the
        same list), so no length is exchanged; ``data`` may be ``None`` where this rank's size is
        0. A collective of every rank. This rank's own entry is ``data`` itself (any buffer of
        ``sizes[rank]`` bytes, sent as is, never copied); the others are bytes-like (``bytes``, or
        ``memoryview`` s into the transport's receive buffers, so the exchange copies nothing per
        rank: take ``len()``, slice, hash or ``memoryview()`` them, and keep them only as long as
        needed, since a view keeps its whole receive buffer alive). Over gloo they are writable
        buffers this rank alone owns (a decoder may build tensors on them); the returned sequence
        may be shared with other ranks of the same process (:class:`ThreadComm`): read it, never
        modify it.

        The default sends each non-empty contribution with :meth:`broadcast_bytes` (one
        collective per contributing rank, so any Comm works); :class:`ThreadComm` overrides it
        with one rendezvous, the gloo ``DistComm`` with one broadcast per contributing rank into
        an exact buffer per source up to ``defaults.EXCHANGE_BROADCAST_MAX_WORLD`` ranks, and
        above it one all-gather per round of at most ``defaults.EXCHANGE_BUDGET`` padded bytes
        (see :func:`exchange_rounds`).

        Raises:
            ValueError: ``sizes`` is not ``world_size`` non-negative ints (every rank passes the
                same list, so every rank raises, before any collective); or this rank's ``data``
                is not ``sizes[rank]`` bytes: it still takes part (sending its bytes cut or
                zero-padded to that size, so no rank is left waiting) and raises afterwards.
            DistributedError: a rank did not take part in time, or the communicator is broken.
        """
        sizes = _check_sizes(self, sizes, what)
        got = self._all_gather_bytes(_fit(data, sizes[self.rank]), sizes, what)
        _raise_unfit(self, data, sizes, what)
        return got

    def _all_gather_bytes(self, mine: Buffer, sizes: list[int], what: str) -> Sequence[Buffer]:
        """:meth:`all_gather_bytes` once the arguments are checked (``mine`` is exactly
        ``sizes[rank]`` bytes): what a transport overrides."""
        out: list[Buffer] = []
        own = mine if isinstance(mine, bytes) else bytes(mine)  # what broadcast_bytes takes
        for src, n in enumerate(sizes):
            got = self.broadcast_bytes(own if src == self.rank else None, what, src=src) if n else b""
            out.append(mine if src == self.rank else got)
        return out

    def background(self) -> Comm:
        """The communicator reserved for a background save thread (its own channel, so its
        collectives never interleave with the training thread's). Default: this one."""
        return self

    def close(self) -> None:  # noqa: B027 - an optional hook: most worlds hold nothing
        """Release what the communicator holds (process groups); idempotent."""


def agree(
    comm: Comm,
    obj: Any,
    decide: Callable[[list[Any]], T],
    what: str,
    *,
    handshake: bool = False,
) -> T:
    """Gather ``obj`` to rank 0, run ``decide(all_objs)`` there, broadcast the outcome.

    Every rank returns the same (JSON round-tripped) value, or raises the same error: an
    exception raised by ``decide`` is encoded (:func:`objckpt.errors.encode_error`), sent to
    every rank and raised there as the same type with the same message -- on rank 0 too, so no
    rank sees a different error than its peers.
    """
    gathered = comm.gather(obj, what, handshake=handshake)
    outcome: dict[str, Any] = {}
    original: BaseException | None = None
    if comm.rank == 0:
        if gathered is None:
            raise DistributedError(f"{what}: rank 0 received nothing from the gather")
        try:
            outcome = {"ok": decide(gathered)}
        except Exception as exc:  # noqa: BLE001 - shipped to every rank, raised there
            original = exc
            outcome = {"error": encode_error(exc)}
    outcome = comm.broadcast(outcome, what, handshake=handshake)
    if "error" in outcome:
        raise decode_error(outcome["error"]) from original
    return outcome["ok"]  # type: ignore[no-any-return]


def exchange_rounds(sizes: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """The rounds of a bounded all-gather of ``sizes`` (one contribution per rank), as
    ``(offset, width)``: in each round every rank sends ``width`` bytes (its bytes from
    ``offset``, zero-padded), so the gathered buffer is ``len(sizes) x width`` bytes, at most
    ``max(budget, len(sizes))``. No round when every size is 0. The same on every rank (a
    function of ``sizes`` and ``budget`` alone)."""
    longest = max(sizes, default=0)
    chunk = max(1, budget // max(1, len(sizes)))
    return [(offset, min(chunk, longest - offset)) for offset in range(0, longest, chunk)]


#: buffers of at least this many bytes are anonymous mmaps (:func:`writable_buffer`)
MMAP_FROM = 1024 * 1024


def writable_buffer(n: int) -> memoryview:
    """``n`` writable bytes to receive or download into. From :data:`MMAP_FROM` bytes an anonymous
    ``mmap`` (page-aligned, not zero-filled up front, unlike ``bytearray(n)``: its pages are
    touched once, by the write; unmapped when the last view of it is dropped); a smaller one is
    ordinary memory (an mmap is a kernel mapping of its own, page-rounded: thousands of simulated
    ranks in one process each holding one would near the kernel's map limit)."""
    return memoryview(mmap.mmap(-1, n) if n >= MMAP_FROM else bytearray(n))


def _check_sizes(comm: Comm, sizes: Sequence[int], what: str) -> list[int]:
    out = list(sizes)
    if len(out) != comm.world_size or not all(isinstance(n, int) and n >= 0 for n in out):
        raise ValueError(f"{what}: sizes must be {comm.world_size} non-negative ints, got {out!r}")
    return out


def _fit(data: Buffer | None, n: int) -> Buffer:
    """``data`` as exactly ``n`` bytes (cut or zero-padded): what a rank whose contribution is
    the wrong size still sends, so that the collective completes (it raises afterwards). A
    buffer of the right size is passed on as is, never copied (a contribution is the shard
    bytes themselves, up to the whole replicated state's share of this rank)."""
    if data is None:
        return bytes(n)
    if memoryview(data).nbytes == n:
        return data
    return bytes(memoryview(data).cast("B")[:n]).ljust(n, b"\0")


def _raise_unfit(comm: Comm, data: Buffer | None, sizes: Sequence[int], what: str) -> None:
    n = sizes[comm.rank]
    have = 0 if data is None else memoryview(data).nbytes
    if have != n:
        raise ValueError(
            f"{what}: rank {comm.rank} contributed {have} bytes where every rank expected "
            f"{n} (sent cut or zero-padded to that size)"
        )


def check_src(comm: Comm, src: int, what: str) -> None:
    """Raises ValueError, naming ``what``, unless ``src`` is a rank of ``comm``'s world."""
    if not isinstance(src, int) or not 0 <= src < comm.world_size:
        raise ValueError(f"{what}: source rank {src!r} outside world of size {comm.world_size}")


class LocalComm(Comm):
    """One process: every collective is the identity (values still take the JSON round trip,
    so a single-process job fails on a value that a distributed one could not send)."""

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        return [_wire(obj)]

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return _wire(obj)

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        check_src(self, src, what)
        if data is None:
            raise DistributedError(f"{what}: rank 0 sent no bytes")
        return bytes(data)

    def _all_gather_bytes(self, mine: Buffer, sizes: list[int], what: str) -> Sequence[Buffer]:
        return [mine]


class ThreadWorld:
    """``world_size`` ranks as threads of this process, for tests and the scale simulator.

    ::

        world = ThreadWorld(16)
        results = world.run(lambda comm: session_for(comm).save(...))   # one result per rank

    Each collective is two barrier rounds (publish, then read), so a rank that never arrives
    breaks the barrier after ``timeout`` seconds and every waiting rank raises
    :class:`DistributedError`, exactly like a gloo timeout.
    """

    def __init__(self, world_size: int, *, timeout: float = 60.0) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.timeout = timeout
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Any] = [None] * world_size
        self._value: Any = None
        # the list the next all-gather of bytes fills (a new one per collective: see _all_gather)
        self._gathered: list[Buffer] = [b""] * world_size
        #: collectives completed (rank 0's count), for tests that bound the protocol's traffic
        self.collectives = 0
        self._channels: dict[str, ThreadWorld] = {}
        self._channels_lock = threading.Lock()

    def comm(self, rank: int) -> ThreadComm:
        """The communicator of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return ThreadComm(self, rank)

    def channel(self, name: str) -> ThreadWorld:
        """A second world over the same ranks (for :meth:`Comm.background`), created once."""
        with self._channels_lock:
            world = self._channels.get(name)
            if world is None:
                world = self._channels[name] = ThreadWorld(self.world_size, timeout=self.timeout)
            return world

    def run(
        self,
        fn: Callable[[ThreadComm], T],
        *,
        ranks: Sequence[int] | None = None,
        stack_size: int | None = None,
    ) -> list[T | BaseException]:
        """Run ``fn(comm)`` on one thread per rank (or only ``ranks``); return each rank's
        result or the exception it raised, in rank order."""
        chosen = list(range(self.world_size)) if ranks is None else list(ranks)
        results: dict[int, T | BaseException] = {}
        lock = threading.Lock()

        def body(rank: int) -> None:
            try:
                value: T | BaseException = fn(self.comm(rank))
            except BaseException as exc:  # noqa: BLE001 - returned to the caller per rank
                value = exc
            with lock:
                results[rank] = value

        old = threading.stack_size()
        if stack_size is not None:
            threading.stack_size(stack_size)
        try:
            threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}") for r in chosen]
            for t in threads:
                t.start()
        finally:
            if stack_size is not None:
                threading.stack_size(old)
        for t in threads:
            t.join()
        return [results[r] for r in chosen]

    # -- the two primitives, on the shared barrier

    def _wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise DistributedError(
                f"{what} failed on rank {rank}: a rank died, or not every rank called it within "
                f"{self.timeout:g}s (save and restore must be called by all {self.world_size} ranks)"
            ) from None

    def _gather(self, rank: int, obj: Any, what: str) -> list[Any] | None:
        self._slots[rank] = _wire(obj)
        self._wait(rank, what)  # everyone has published
        out = list(self._slots) if rank == 0 else None
        self._wait(rank, what)  # rank 0 has read: the slots may be reused
        if rank == 0:
            self.collectives += 1
        return out

    def _broadcast(self, rank: int, obj: Any, what: str) -> Any:
        if rank == 0:
            self._value = _wire(obj)
        self._wait(rank, what)
        out = _wire(self._value)
        self._wait(rank, what)
        if rank == 0:
            self.collectives += 1
        return out

    def _share(self, rank: int, src: int, data: bytes | None, what: str) -> bytes | None:
        """Rank ``src``'s bytes on every rank, without a JSON round trip (raw bytes are what a
        byte transport carries); ``None`` when ``src`` had none."""
        if rank == src:
            self._value = None if data is None else bytes(data)
        self._wait(rank, what)
        out: bytes | None = self._value
        self._wait(rank, what)
        if rank == 0:
            self.collectives += 1
        return out

    def _all_gather(self, rank: int, data: Buffer, what: str) -> list[Buffer]:
        """Every rank's bytes on every rank, one rendezvous: each rank fills its entry of one
        list, and every rank returns that very list (no copy per receiver: at thousands of
        ranks, W receivers each copying W entries would be W^2 work). Rank 0 puts a fresh list
        in place after the first barrier; the second barrier keeps every rank from starting the
        next all-gather before then, so a returned list is never written again."""
        slots = self._gathered
        slots[rank] = data
        self._wait(rank, what)  # everyone has published into ``slots``
        if rank == 0:
            self._gathered = [b""] * self.world_size
        self._wait(rank, what)
        if rank == 0:
            self.collectives += 1
        return slots

    def abort(self) -> None:
        """Break the barrier: every rank waiting (now or later) raises DistributedError."""
        self._barrier.abort()


class ThreadComm(Comm):
    """One rank of a :class:`ThreadWorld`."""

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self._broken: str | None = None

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        if self._broken is not None:
            raise DistributedError(
                f"{what}: the checkpoint channel is unusable after an earlier failure "
                f"({self._broken}); restart the job"
            )
        try:
            return fn()
        except DistributedError as exc:
            self._broken = str(exc)
            raise

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> list[Any] | None:
        return self._run(what, lambda: self.world._gather(self.rank, obj, what))

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return self._run(what, lambda: self.world._broadcast(self.rank, obj, what))

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        check_src(self, src, what)
        got = self._run(what, lambda: self.world._share(self.rank, src, data, what))
        if got is None:
            raise DistributedError(f"{what}: rank {src} sent no bytes")
        return got

    def _all_gather_bytes(self, mine: Buffer, sizes: list[int], what: str) -> Sequence[Buffer]:
        """One rendezvous (two barrier rounds, as every collective here); every rank gets the
        same list (see :meth:`ThreadWorld._all_gather`)."""
        return self._run(what, lambda: self.world._all_gather(self.rank, mine, what))

    def background(self) -> Comm:
        return ThreadComm(self.world.channel("background"), self.rank)
