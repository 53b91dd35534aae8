"""Virtual time for the scale simulator: one timeline per simulated rank, never a real sleep.

Every simulated rank (and every pool thread working for one) carries a :class:`Timeline`, a
float of virtual seconds. Modelled costs *advance* it: a request's latency and transfer time
(:mod:`.model`), a collective's cost (:mod:`.world`), a retry's backoff (the patched
``time.sleep`` below), measured CPU where the simulator charges it. Ranks synchronise where the
protocol does, at collectives: every rank leaves a collective at the time its last participant
arrived, plus the collective's cost.

**Scheduling (one runner, earliest first).** Simulated threads (ranks, their helper and pool
threads) run one at a time: a thread runs only while it holds the *baton*. Before every store
request the holder checks the threads waiting for the baton; if one of them is more than ``lag``
virtual seconds behind it, the holder hands the baton to the earliest one and waits its turn.
A thread gives the baton up while it blocks on other threads (a collective, a pool wait, a join)
and queues for it again afterwards. So requests reach the store's rate limiter in virtual-time
order to within ``lag`` (who gets a 503 is decided among the requests of the same moment, as on
a real server, not by which thread the OS happened to run first), and thousands of threads never
contend for the simulator's locks, which on 2 cores collapses throughput (lock convoys: ~1 ms a
request at 4,096 free-running threads against ~0.03 ms with the baton). When nothing at all has
happened for ``stall_s`` real seconds (the holder blocked somewhere the scheduler does not know
of), the earliest waiter is let run anyway; each such event is counted as a *lag violation* and
reported.

What is patched, only while :func:`virtual_time` is active, and only for threads that carry a
timeline (any other thread of the process sees the real functions):

* ``time.sleep`` / ``time.monotonic`` / ``time.perf_counter`` as seen by the modules in
  :data:`PATCHED_MODULES`: tenacity (the store's retry policy: its backoff sleeps and its
  ``stop_after_delay`` deadline), ``tenacity.nap``, ``objckpt.store._reads`` (``get_stream``'s
  own resume loop), ``objckpt.store._budget`` (the time budget nested requests share) and the
  save/restore sessions (their metrics timestamps). Each module's ``time`` global is replaced
  by a shim module; ``time.time()`` (wall clock: ``created_at``, ``last_modified``) stays real.
* ``ThreadPoolExecutor.submit`` / ``.shutdown`` and ``Future.result`` / ``.exception``: a task
  submitted by a thread with a timeline runs on a worker timeline that starts at the submitter's
  time, or when one of the pool's ``max_workers`` virtual lanes for that submitter is free (so a
  pool of 16 HEAD workers, ``Reader.check``, is 16 concurrent connections in virtual time however
  many real threads it started); whoever observes a task's outcome advances to the task's end,
  and gives the baton up while it waits.

* ``threading.local`` as seen by tenacity: :class:`_ThreadLocal`, the same semantics at a cost
  that does not grow with the number of threads (CPython's walks every thread when one is
  freed, and tenacity makes one per request: most of a 16,384-rank save's real time).

The library has no injectable clock; this patching is the workaround (see ``SCALE.md``, hooks).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import importlib
import itertools
import math
import sys
import threading
import time as _real_time
import types
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "LOCAL_PATCHED_MODULES",
    "PATCHED_MODULES",
    "Baton",
    "Timeline",
    "acting_as",
    "blocked",
    "current",
    "baton",
    "before_request",
    "phase",
    "virtual_time",
]

#: modules whose ``time`` global is replaced by the virtual-time shim (missing ones are skipped)
PATCHED_MODULES: tuple[str, ...] = (
    "tenacity",
    "tenacity.nap",
    "objckpt.store._reads",
    "objckpt.store._budget",
    "objckpt.coordination.save",
    "objckpt.coordination.restore",
)


class Timeline:
    """One simulated actor's virtual clock (seconds), plus who it is.

    Attributes:
        now: virtual seconds.
        rank: the simulated rank it belongs to (``None``: the harness itself).
        host: the simulated host (ranks share a host's NIC).
        phase: what the rank is doing (``write``, ``commit``, ``retain``, ``resolve``, ``stage``
            ...); requests are counted per phase.
        lanes: while the rank issues concurrent requests as virtual lanes of this timeline
            (:mod:`.adapter`), the end times of the *other* lanes' latest requests (the running
            lane's entry is ``-inf``): what a rank has in flight, for pacing. ``None`` otherwise.
    """

    __slots__ = ("now", "rank", "host", "phase", "lanes", "_lock")

    def __init__(self, now: float = 0.0, rank: int | None = None, host: int = 0, phase: str = "idle"):
        self.now = float(now)
        self.rank = rank
        self.host = host
        self.phase = phase
        self.lanes: list[float] | None = None
        self._lock = threading.Lock()

    def advance(self, seconds: float) -> float:
        """Spend ``seconds`` (>= 0) of virtual time; returns the new time."""
        with self._lock:
            if seconds > 0:
                self.now += seconds
            return self.now

    def advance_to(self, t: float) -> float:
        """Wait (virtually) until ``t``; never moves backwards."""
        with self._lock:
            if t > self.now:
                self.now = t
            return self.now

    def set(self, t: float) -> None:
        """Jump to ``t``, possibly backwards: used to model concurrent lanes of one rank."""
        with self._lock:
            self.now = t

    def __repr__(self) -> str:
        return f"Timeline(rank={self.rank}, now={self.now:.6f}, phase={self.phase!r})"


class Baton:
    """The baton scheduler of the module doc. Thread-safe; identifies threads by ident."""

    def __init__(self, lag: float, *, stall_s: float = 60.0) -> None:
        if lag < 0:
            raise ValueError("lag must be >= 0")
        self.lag = lag
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._holder: int | None = None
        self._ready: list[tuple[float, int, int, threading.Event]] = []
        self._seq = itertools.count()
        self._last_change = _real_time.monotonic()
        self._closed = threading.Event()
        #: hand-overs of the baton, and forced ones after ``stall_s`` without any progress
        self.waits = 0
        self.violations = 0
        threading.Thread(target=self._watch, name="objckpt-scale-baton", daemon=True).start()

    def _grant_next(self) -> None:
        if self._ready:
            _, _, ident, event = heapq.heappop(self._ready)
            self._holder = ident
            event.set()
        else:
            self._holder = None

    def _queue(self, t: float, me: int) -> threading.Event:
        event = threading.Event()
        heapq.heappush(self._ready, (t, next(self._seq), me, event))
        self.waits += 1
        return event

    def holds(self) -> bool:
        return self._holder == threading.get_ident()

    def acquire(self, tl: Timeline) -> bool:
        """Run as ``tl``: wait for the baton (earliest first). ``False``: already held."""
        me = threading.get_ident()
        with self._lock:
            self._last_change = _real_time.monotonic()
            if self._holder == me:
                return False
            if self._holder is None:
                self._holder = me
                return True
            event = self._queue(tl.now, me)
        event.wait()
        return True

    def release(self) -> None:
        """Give the baton to the earliest waiting thread (this one blocks, or is done)."""
        with self._lock:
            self._last_change = _real_time.monotonic()
            if self._holder == threading.get_ident():
                self._grant_next()

    def pace(self, tl: Timeline) -> None:
        """Before a request: let a thread more than ``lag`` behind ``tl`` run first."""
        me = threading.get_ident()
        with self._lock:
            self._last_change = _real_time.monotonic()
            if self._holder != me:
                if self._holder is not None:  # running without the baton (a forced release)
                    return
                self._holder = me
            if not self._ready or self._ready[0][0] + self.lag >= tl.now:
                return
            event = self._queue(tl.now, me)
            self._grant_next()
        event.wait()

    def _watch(self) -> None:
        while not self._closed.wait(min(5.0, self.stall_s)):
            with self._lock:
                if self._ready and _real_time.monotonic() - self._last_change > self.stall_s:
                    self.violations += 1
                    self._grant_next()  # the holder is stuck somewhere unknown: let the next run
                    self._last_change = _real_time.monotonic()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            while self._ready:
                heapq.heappop(self._ready)[3].set()
            self._holder = None


_local = threading.local()
_baton: list[Baton | None] = [None]


def current() -> Timeline | None:
    """The calling thread's timeline, or ``None`` outside the simulation."""
    return getattr(_local, "timeline", None)


def baton() -> Baton | None:
    """The baton scheduler of the running simulation (``None``: threads run free)."""
    return _baton[0]


def before_request() -> None:
    """Called before every simulated request: hand the baton to a thread more than ``lag``
    behind this one, and wait for it back."""
    p, tl = _baton[0], current()
    if p is not None and tl is not None:
        p.pace(tl)


@contextlib.contextmanager
def acting_as(timeline: Timeline | None) -> Iterator[Timeline | None]:
    """Run the block as ``timeline`` (requests and sleeps are charged to it); under a scheduler
    the thread first waits for the baton if it does not hold it."""
    previous = current()
    _local.timeline = timeline
    p = _baton[0]
    acquired = p is not None and timeline is not None and p.acquire(timeline)
    try:
        yield timeline
    finally:
        _local.timeline = previous
        if acquired and p is not None:
            p.release()


@contextlib.contextmanager
def blocked(timeline: Timeline | None = None) -> Iterator[None]:
    """The block waits for other threads (a collective, a join, a pool task): give the baton up
    meanwhile, queue for it again afterwards."""
    tl = timeline or current()
    p = _baton[0]
    if p is None or tl is None or not p.holds():
        yield
        return
    p.release()
    try:
        yield
    finally:
        p.acquire(tl)


@contextlib.contextmanager
def phase(name: str, timeline: Timeline | None = None) -> Iterator[None]:
    """Label what ``timeline`` (default: the current one) does during the block."""
    tl = timeline or current()
    if tl is None:
        yield
        return
    previous = tl.phase
    tl.phase = name
    try:
        yield
    finally:
        tl.phase = previous


class _TimeShim(types.ModuleType):
    """Stands in for the ``time`` module inside the patched modules."""

    def __init__(self) -> None:
        super().__init__("time")

    def __getattr__(self, name: str) -> Any:
        return getattr(_real_time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        tl = current()
        if tl is None:
            _real_time.sleep(seconds)
        else:
            tl.advance(max(0.0, float(seconds)))

    @staticmethod
    def monotonic() -> float:
        tl = current()
        return _real_time.monotonic() if tl is None else tl.now

    @staticmethod
    def perf_counter() -> float:
        tl = current()
        return _real_time.perf_counter() if tl is None else tl.now


class _ThreadLocal:
    """``threading.local`` semantics (each thread sees its own attributes) in a plain dict.

    CPython's ``threading.local`` walks every live thread's state when one is freed (it removes
    itself from each thread's dict): 0.8 ms at 4,096 threads, 2.4 ms at 16,384 (measured here).
    tenacity makes one per ``Retrying``, and the store's retry policy builds a ``Retrying`` per
    request, so at thousands of simulated threads that walk was most of a save's real time.
    This one costs the same with any number of threads; entries live as long as the object
    (a ``Retrying`` lives for one request)."""

    __slots__ = ("_values",)

    def __init__(self) -> None:
        object.__setattr__(self, "_values", {})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[(threading.get_ident(), name)]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._values[(threading.get_ident(), name)] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self._values[(threading.get_ident(), name)]
        except KeyError:
            raise AttributeError(name) from None


class _ThreadingShim(types.ModuleType):
    """Stands in for the ``threading`` module inside the patched modules: ``local`` is
    :class:`_ThreadLocal`, everything else the real module's."""

    local = _ThreadLocal

    def __init__(self) -> None:
        super().__init__("threading")

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


_SHIM = _TimeShim()
_THREADING_SHIM = _ThreadingShim()
#: modules whose ``threading`` global is replaced by :class:`_ThreadingShim`
LOCAL_PATCHED_MODULES: tuple[str, ...] = ("tenacity",)
_install_lock = threading.Lock()
_installed = [0]
_saved: dict[str, Any] = {}
_lanes_lock = threading.Lock()


def _submit_with_timeline(original: Callable[..., Any]) -> Callable[..., Any]:
    def submit(self: concurrent.futures.ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        parent = current()
        if parent is None:
            return original(self, fn, *args, **kwargs)
        submitted = parent.now
        cell: dict[str, float] = {}
        with _lanes_lock:
            pools = self.__dict__.setdefault("_sim_lanes", {})
            # One set of max_workers virtual lanes per submitter: a pool is that many concurrent
            # connections in virtual time, however many real threads it happened to start.
            lanes = pools.setdefault(id(parent), [-math.inf] * max(1, self._max_workers))

        def run() -> Any:
            with _lanes_lock:
                lane = min(range(len(lanes)), key=lanes.__getitem__)
                start = max(submitted, lanes[lane])
                lanes[lane] = math.inf  # busy
            worker = Timeline(start, parent.rank, parent.host, parent.phase)
            try:
                with acting_as(worker):
                    return fn(*args, **kwargs)
            finally:
                with _lanes_lock:
                    lanes[lane] = cell["end"] = worker.now

        future = original(self, run)
        future._sim_cell = cell
        return future

    return submit


def _observe(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Future.result`` / ``Future.exception``: whoever observes a task's completion has waited
    (virtually) until the task's end."""

    def observe(self: concurrent.futures.Future[Any], timeout: float | None = None) -> Any:
        tl = current()
        try:
            if self.done():  # nothing to wait for (tenacity's attempt outcomes are Futures too)
                return original(self, timeout)
            with blocked(tl):
                return original(self, timeout)
        finally:
            cell = getattr(self, "_sim_cell", None)
            if cell and tl is not None and "end" in cell:
                tl.advance_to(cell["end"])

    return observe


def _shutdown_blocked(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: concurrent.futures.ThreadPoolExecutor, *args: Any, **kwargs: Any) -> Any:
        with blocked():
            return original(self, *args, **kwargs)

    return shutdown


_PATCHES: tuple[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    (concurrent.futures.ThreadPoolExecutor, "submit", _submit_with_timeline),
    (concurrent.futures.ThreadPoolExecutor, "shutdown", _shutdown_blocked),
    (concurrent.futures.Future, "result", _observe),
    (concurrent.futures.Future, "exception", _observe),
)


@contextlib.contextmanager
def virtual_time(*, lag: float | None = None, extra_modules: tuple[str, ...] = ()) -> Iterator[Baton | None]:
    """Install the virtual-time patches (see the module doc) for the duration of the block;
    ``lag``: run the simulated threads under a :class:`Baton` that keeps them within ``lag``
    virtual seconds of each other (``None``: they run free). Yields the baton.

    Re-entrant: nested simulations share the outermost installation (and its baton).
    """
    with _install_lock:
        outermost = _installed[0] == 0
        if outermost:
            for name in PATCHED_MODULES + tuple(extra_modules):
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                if getattr(module, "time", None) is _real_time:
                    _saved[name] = module.time
                    module.time = _SHIM  # type: ignore[attr-defined]
            for name in LOCAL_PATCHED_MODULES:
                try:
                    module = importlib.import_module(name)
                except ImportError:
                    continue
                if getattr(module, "threading", None) is threading:
                    _saved[f"{name}:threading"] = module.threading
                    module.threading = _THREADING_SHIM  # type: ignore[attr-defined]
            for owner, attr, wrap in _PATCHES:
                _saved[f"<{owner.__name__}.{attr}>"] = getattr(owner, attr)
                setattr(owner, attr, wrap(getattr(owner, attr)))
            _baton[0] = Baton(lag) if lag is not None else None
        _installed[0] += 1
        installed_baton = _baton[0]
    try:
        yield installed_baton
    finally:
        with _install_lock:
            _installed[0] -= 1
            if _installed[0] == 0:
                if _baton[0] is not None:
                    _baton[0].close()
                _baton[0] = None
                for owner, attr, _ in _PATCHES:
                    setattr(owner, attr, _saved.pop(f"<{owner.__name__}.{attr}>"))
                for name, original in list(_saved.items()):
                    module_name, _, attr = name.partition(":")
                    patched = sys.modules.get(module_name)
                    if patched is not None:
                        setattr(patched, attr or "time", original)
                    del _saved[name]
