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

:func:`charged_exchange` does the same for a read-once restore
(``coordination.exchange.read_shared``): every rank computes the same plan from the same receipts
object and CRC32C-checks the shards of the one gathered list; memoized by object identity, the
real work runs once per object and every caller is charged its measured CPU (a derived
quantity, as above).
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


@contextlib.contextmanager
def charged_exchange(memoize: bool) -> Iterator[None]:
    """For the block, in :func:`~objckpt.coordination.exchange.read_shared`: its plan
    (:func:`~objckpt.coordination.exchange.plan_shared`) and its check of what it received
    (:func:`~objckpt.coordination.exchange.check_received`: the CRC32C of every other rank's
    shards) are charged to the calling rank's timeline (measured CPU) and, with ``memoize``,
    computed once per distinct input object. Every rank of a read-once restore plans from the
    very same receipts object (the adapter's index of the one decoded manifest; it is never
    mutated) and receives the very same gathered list (``SimComm.all_gather_bytes``), so W
    ranks each planning W shards and checking W - 1 of them cost O(W^2) real time here
    (16,384 ranks: ~0.1 s of CPU per rank, ~30 min in all); memoized, each is computed once
    and every rank's clock is charged what it measured, as if every rank had computed for itself
    (a derived quantity: the inputs are the same objects, so the results are the same). The
    memoized check covers every source, the caller's own too (its ``skip`` is applied to the
    result: the caller's shards and failures are dropped), so each rank is charged W checks
    where it makes W - 1. Without ``memoize`` every call runs for real (and is charged)."""
    from ...coordination import exchange

    original_plan = exchange.plan_shared
    original_check = exchange.check_received
    plans, checks = _Memo(cap=8), _Memo(cap=8)

    def charged(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            value = fn(*args, **kwargs)
            tl = clock.current()
            if tl is not None:
                tl.advance(time.thread_time() - t0)
            return value

        return call

    def plan_shared(receipts: Any, world_size: int) -> exchange.SharedPlan:
        return cast(
            "exchange.SharedPlan",
            plans.call(
                (id(receipts), len(receipts), world_size),
                receipts,
                lambda: original_plan(receipts, world_size),
            ),
        )

    def check_received(
        blobs: Any, plan: exchange.SharedPlan, *, skip: int | None = None
    ) -> tuple[dict[str, Any], list[tuple[int, str]]]:
        verified, corrupt = cast(
            "tuple[dict[str, Any], list[tuple[int, str]]]",
            checks.call((id(blobs), id(plan)), (blobs, plan), lambda: original_check(blobs, plan)),
        )
        mine = dict(verified)  # the caller's own: it adds its reads and drops what it decodes
        if skip is not None:
            for r in plan.owned[skip]:
                mine.pop(r.key, None)
        return mine, [c for c in corrupt if c[0] != skip]

    exchange.plan_shared = plan_shared if memoize else charged(original_plan)
    exchange.check_received = check_received if memoize else charged(original_check)
    try:
        yield
    finally:
        exchange.plan_shared = original_plan
        exchange.check_received = original_check
