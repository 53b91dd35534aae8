"""Every rank parsing the manifest it received (and checking the shards of a read-once exchange):
charged to each rank, computed once if asked.

After a commit (and on restore) every rank receives the very same manifest bytes from rank 0 and
parses them: ``Manifest.decode`` (schema, self-checksum, every receipt; the key to check it
against comes with the commit outcome). In a real job each rank does that once, in parallel with the others; in the simulator
the ranks share two cores, so W parses of a manifest that itself grows with W cost O(W^2) real
time (4,096 ranks x a 5 MB manifest: minutes per save). With ``memoize`` the real function runs
once per distinct bytes object (and arguments) and every later caller gets the same result;
*every* caller's virtual clock is still charged the measured CPU time, so modelled times are
those of every rank parsing for itself. Without ``memoize`` every call runs for real (the tests
check that both give the same counts).

:func:`charged_exchange` does the same for the receive side of a read-once restore
(``coordination.exchange.read_shared``): every rank CRC32C-checks the W shards of the one
gathered list and computes the same ``assign`` plan from the same receipt objects; memoized by
object identity, the real work runs once per object and every caller is charged its measured
CPU (a derived quantity, as above).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from ...manifest import Manifest
from . import clock

__all__ = ["charged_exchange", "charged_parsing"]


class _Once:
    """One memoized call: the first caller computes, concurrent callers wait for it."""

    def __init__(self, data: Any, args: tuple[Any, ...]) -> None:
        self.data = data
        self.args = args
        self.done = threading.Event()
        self.ok = False
        self.value: Any = None
        self.cpu = 0.0


def _charged(fn: Callable[..., Any], memoize: bool) -> Callable[..., Any]:
    """``fn(data, *args, **kwargs)`` charging its CPU to the caller's timeline (see the module
    doc); with ``memoize``, computed once per (``data`` object, arguments)."""
    cache: dict[int, _Once] = {}
    lock = threading.Lock()

    def real(data: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, float]:
        t0 = time.thread_time()
        value = fn(data, *args, **kwargs)
        return value, time.thread_time() - t0

    def call(data: Any, *args: Any, **kwargs: Any) -> Any:
        tl = clock.current()
        if not (memoize and isinstance(data, bytes)):
            value, cpu = real(data, args, kwargs)
        else:
            key = (*args, *sorted(kwargs.items()))
            with lock:
                entry = cache.get(id(data))
                leader = entry is None or entry.data is not data or entry.args != key
                if leader:
                    entry = cache[id(data)] = _Once(data, key)
                    for old in [k for k, e in cache.items() if e is not entry and e.done.is_set()][:-4]:
                        del cache[old]
            assert entry is not None
            if leader:
                try:
                    entry.value, entry.cpu = real(data, args, kwargs)
                    entry.ok = True
                finally:
                    entry.done.set()
            else:
                with clock.blocked():
                    entry.done.wait()
            if not entry.ok:  # the leader's call raised: raise the same, ourselves
                value, cpu = real(data, args, kwargs)
            else:
                value, cpu = entry.value, entry.cpu
        if tl is not None:
            tl.advance(cpu)
        return value

    return call


@contextlib.contextmanager
def charged_parsing(memoize: bool) -> Iterator[None]:
    """For the block: ``Manifest.decode`` is charged (and optionally memoized) as the module
    doc says."""
    original_decode = Manifest.__dict__["decode"]
    decode = _charged(lambda data, **kw: original_decode.__func__(Manifest, data, **kw), memoize)
    Manifest.decode = classmethod(lambda cls, data, **kw: decode(data, **kw))  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        Manifest.decode = original_decode  # type: ignore[method-assign]


class _Memo:
    """Results of a pure function by the identity of its argument objects: the entry holds
    the arguments, so an ``id`` cannot be reused while it is cached. Bounded: when full, the
    older half goes."""

    def __init__(self, cap: int = 1 << 17) -> None:
        self.cap = cap
        self.entries: dict[Any, _Once] = {}
        self.lock = threading.Lock()

    def call(self, key: Any, hold: Any, fn: Callable[[], Any]) -> Any:
        """``fn()``, or the result of the call under ``key`` (``hold``: what keeps the key's ids
        alive); the first caller computes, concurrent ones wait for it (thousands of ranks
        arrive at once: each computing would be the O(W^2) this avoids); the caller's timeline
        is charged the measured CPU either way. If the first call raised, each caller calls."""
        with self.lock:
            entry = self.entries.get(key)
            leader = entry is None
            if entry is None:
                if len(self.entries) >= self.cap:
                    for old in list(self.entries)[: self.cap // 2]:
                        del self.entries[old]
                entry = self.entries[key] = _Once(hold, ())
        if leader:
            try:
                t0 = time.thread_time()
                entry.value = fn()
                entry.cpu = time.thread_time() - t0
                entry.ok = True
            finally:
                entry.done.set()
        elif not entry.done.is_set():
            with clock.blocked():
                entry.done.wait()
        if entry.ok:
            value, cpu = entry.value, entry.cpu
        else:  # the first call raised: raise the same, ourselves
            t0 = time.thread_time()
            value = fn()
            cpu = time.thread_time() - t0
        tl = clock.current()
        if tl is not None:
            tl.advance(cpu)
        return value


def _views_whole(view: memoryview) -> bool:
    """Is ``view`` all of the bytes object it views? (A contiguous view of as many bytes as the
    object holds starts at its first.)"""
    obj = view.obj
    return isinstance(obj, bytes) and view.nbytes == len(obj) and view.contiguous


@contextlib.contextmanager
def charged_exchange(memoize: bool) -> Iterator[None]:
    """For the block, in :func:`~objckpt.coordination.exchange.read_shared`: its CRC32C check
    of each received shard and its ``assign`` plan are charged to the calling rank's timeline
    (measured CPU) and, with ``memoize``, computed once per distinct input object. Every rank of
    a read-once restore receives the very same gathered list (one bytes object per source) and
    plans from the same receipt objects (the one decoded manifest), so W ranks each checking W
    shards cost O(W^2) real time here (16,384 ranks: ~90 ms of CPU per rank); memoized, each
    shard's CRC32C is computed once and every rank's clock is charged what it measured, as if
    every rank had checked for itself (a derived quantity: the bytes every rank checks are the
    same object, so the result is the same). Without ``memoize`` every call runs for real (and
    is charged)."""
    from ...coordination import exchange

    original_crc: Callable[[Any], str] = getattr(exchange, "crc32c_b64")  # noqa: B009 - not exported
    original_assign = exchange.assign
    crcs, plans = _Memo(), _Memo(cap=8)

    def charged(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = time.thread_time()
            value = fn(*args)
            tl = clock.current()
            if tl is not None:
                tl.advance(time.thread_time() - t0)
            return value

        return call

    charged_crc = charged(original_crc)

    def crc(data: Any) -> str:
        # read_shared checks views (no copies): a view of a whole bytes object (one shard a
        # source, the usual case) is that object's check; any other part is checked for real
        whole = data.obj if isinstance(data, memoryview) and _views_whole(data) else data
        if not isinstance(whole, bytes):
            return cast("str", charged_crc(data))
        return cast("str", crcs.call(id(whole), whole, lambda: original_crc(whole)))

    def assign(receipts: Any, world_size: int) -> dict[str, int]:
        held = tuple(receipts)
        return cast(
            "dict[str, int]",
            plans.call((tuple(map(id, held)), world_size), held, lambda: original_assign(held, world_size)),
        )

    setattr(exchange, "crc32c_b64", crc if memoize else charged(original_crc))  # noqa: B010
    exchange.assign = assign if memoize else charged(original_assign)
    try:
        yield
    finally:
        setattr(exchange, "crc32c_b64", original_crc)  # noqa: B010
        exchange.assign = original_assign
