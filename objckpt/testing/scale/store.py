"""The simulated store: a wrapper around any :class:`~objckpt.store.base.Store` (by default an
in-memory one) that models rate limits, latency and bandwidth on the virtual clock and counts
every request.

It is a :class:`objckpt.store.wrappers._Wrapper` and overrides only its ``_invoke`` hook, so it
sees every primitive the wrapper forwards, whatever their names and signatures become: an op is
classed by its name (:func:`op_kind`), its upload payload is every buffer among its arguments,
its download is the bytes it returns or the chunks its stream yields. The public methods are the
base class's, so the store's retry policy (tenacity, under the virtual clock) retries an injected
``503 SlowDown`` exactly as it would a real server's.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ... import layout
from ...errors import TransientError
from ...store.base import Store
from ...store.memory import MemoryStore
from ...store.pacing import Pacer
from ...store.wrappers import _Wrapper
from . import clock
from .model import Network, NetworkModel, RateModel, StoreProfile

__all__ = [
    "SLOWDOWN",
    "IndexedMemoryStore",
    "Recorder",
    "SimulatedStore",
    "SimulationBudgetExceeded",
    "inner_cpu",
    "is_slowdown",
    "op_kind",
]

#: the text every injected throttling error carries
SLOWDOWN = "503 SlowDown"

_cpu = threading.local()


def inner_cpu() -> float:
    """CPU seconds the calling thread has spent inside the inner store (the in-memory server's
    own work, which a real server does elsewhere): subtracted from measured client CPU."""
    return getattr(_cpu, "seconds", 0.0)


def _inner(fn: Any, *args: Any) -> Any:
    t = time.thread_time()
    try:
        return fn(*args)
    finally:
        _cpu.seconds = inner_cpu() + time.thread_time() - t


class _Objects(dict):  # type: ignore[type-arg]
    """MemoryStore's object table, keeping its keys sorted as they come and go (a new key is
    inserted in place, a removed one taken out: the sort is never redone, which with ranks
    LISTing their own prefixes between other ranks' PUTs would be once per LIST)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys_sorted: list[str] = []

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:
            bisect.insort(self.keys_sorted, key)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._forget(key)

    def pop(self, key: Any, *default: Any) -> Any:
        present = key in self
        value = super().pop(key, *default)
        if present:
            self._forget(key)
        return value

    def _forget(self, key: str) -> None:
        i = bisect.bisect_left(self.keys_sorted, key)
        if i < len(self.keys_sorted) and self.keys_sorted[i] == key:
            del self.keys_sorted[i]


class IndexedMemoryStore(MemoryStore):
    """A :class:`MemoryStore` whose LIST pages bisect a sorted key list kept up to date
    (:class:`_Objects`) instead of sorting every key on every page (at 16,384 ranks x 8 shards
    that sort dominates the simulation's CPU). Same results as ``MemoryStore``; falls back to
    it if its object table is not a dict."""

    def __init__(self, name: str = "", **options: Any) -> None:
        super().__init__(name, **options)
        objects = getattr(self, "_objects", None)
        self._indexed = isinstance(objects, dict) and not objects
        if self._indexed:
            self._objects = _Objects()

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[Any], bool]:
        if not self._indexed:
            return super()._list_page(prefix, start_after, limit)
        with self._lock:
            objects = self._objects
            assert isinstance(objects, _Objects)
            keys = objects.keys_sorted
            if start_after is not None and start_after >= prefix:
                i = bisect.bisect_right(keys, start_after)
            else:
                i = bisect.bisect_left(keys, prefix)
            page: list[str] = []
            while i < len(keys) and len(page) <= limit and keys[i].startswith(prefix):
                page.append(keys[i])
                i += 1
            return [objects[k].meta for k in page[:limit]], len(page) > limit


class SimulationBudgetExceeded(Exception):
    """The simulation issued more requests than its ``max_requests`` budget (a guard against a
    scenario that would run for hours on this machine). Not a store error: never retried."""


def is_slowdown(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error in its cause/context chain) is an injected SlowDown."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, TransientError) and SLOWDOWN in str(exc):
            return True
        if SLOWDOWN in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def op_kind(op: str) -> str:
    """``list``, ``read`` or ``write`` for a primitive's name (unknown names: by their words)."""
    if "list" in op:
        return "list"
    if op in ("get", "open", "head") or op.startswith(("get", "open", "head", "read")):
        return "read"
    return "write"


def _is_shard(key: str) -> bool:
    """Shard bytes stand for ``byte_scale`` times as many; a manifest's are its real size."""
    return key.startswith(layout.DATA_PREFIX)


def _payload_bytes(args: tuple[Any, ...]) -> int:
    """The bytes a write request sends: its buffer, or its list of buffers (vectored writes)."""
    n = 0
    for a in args:
        if isinstance(a, memoryview):
            n += a.nbytes
        elif isinstance(a, (bytes, bytearray)):
            n += len(a)
        elif isinstance(a, list):
            n += sum(b.nbytes for b in a if isinstance(b, memoryview))
    return n


@dataclass
class Recorder:
    """Every request the simulated store saw (each try of a retried request counts).

    Attributes:
        by: ``(rank, phase) -> Counter(op)`` of tries; rank ``None`` is the harness.
        slowdowns: ``(phase, op) -> 503s injected``.
        absorbed: SlowDowns followed by a retry of the same request (the retry policy absorbed
            them); ``injected - absorbed`` requests gave up on a SlowDown.
        data_lists: ``phase -> LIST pages`` whose prefix lies under ``data/``.
        bytes_read / bytes_written: real bytes per rank.
        t_first / t_last: virtual time of the first and last request.
    """

    by: dict[tuple[int | None, str], collections.Counter[str]] = field(default_factory=dict)
    slowdowns: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    absorbed: int = 0
    absorbed_by_phase: collections.Counter[str] = field(default_factory=collections.Counter)
    data_lists: collections.Counter[str] = field(default_factory=collections.Counter)
    bytes_read: collections.Counter[int | None] = field(default_factory=collections.Counter)
    bytes_written: collections.Counter[int | None] = field(default_factory=collections.Counter)
    t_first: float | None = None
    t_last: float | None = None
    total: int = 0

    def ops(self, *, phase: str | None = None, rank: int | None | str = "any") -> collections.Counter[str]:
        """Tries by op, optionally of one phase and/or one rank."""
        out: collections.Counter[str] = collections.Counter()
        for (r, ph), counts in self.by.items():
            if (phase is None or ph == phase) and (rank == "any" or r == rank):
                out.update(counts)
        return out

    def ranks(self, *, phase: str | None = None) -> dict[int | None, collections.Counter[str]]:
        """Tries by op for each rank (optionally of one phase)."""
        out: dict[int | None, collections.Counter[str]] = {}
        for (r, ph), counts in self.by.items():
            if phase is None or ph == phase:
                out.setdefault(r, collections.Counter()).update(counts)
        return out

    @property
    def injected(self) -> int:
        return sum(self.slowdowns.values())

    @property
    def surfaced(self) -> int:
        """Requests whose last try was a SlowDown (the retry budget ran out)."""
        return max(0, self.injected - self.absorbed)

    def gave_up_by_phase(self) -> dict[str, int]:
        """Requests that gave up on a SlowDown, by the phase that made them."""
        injected: collections.Counter[str] = collections.Counter()
        for (ph, _), n in self.slowdowns.items():
            injected[ph] += n
        return {
            ph: n - self.absorbed_by_phase[ph]
            for ph, n in sorted(injected.items())
            if n > self.absorbed_by_phase[ph]
        }


class SimulatedStore(_Wrapper):
    """A store with the performance model of :mod:`.model`, on the virtual clock.

    Args:
        inner: the store holding the bytes (default: a fresh :class:`IndexedMemoryStore`).
        profile: rate limits (default :meth:`StoreProfile.s3`).
        network: latency and bandwidth (default :class:`NetworkModel`).
        max_requests: raise :class:`SimulationBudgetExceeded` beyond this many requests.
        options: as for every wrapper (``retry``, ``part_size``, ...).

    Requests made by a thread without a timeline (the harness preparing a scenario) are counted
    under rank ``None`` / phase ``setup`` and cost nothing. ``throttle = False`` turns the rate
    limits off (e.g. to seed a run root) while latency and bandwidth still apply.
    """

    def __init__(
        self,
        inner: Store | None = None,
        *,
        profile: StoreProfile | None = None,
        network: NetworkModel | None = None,
        max_requests: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(inner if inner is not None else IndexedMemoryStore("scale-sim"), **options)
        self.profile = profile or StoreProfile.s3()
        self.network_model = network or NetworkModel()
        self.rates = RateModel(self.profile)
        self.net = Network(self.network_model)
        self.recorder = Recorder()
        self.max_requests = max_requests
        self.throttle = True
        #: AIMD pacing per simulated rank (``aimd_pacing``): a factory of the library's
        #: :class:`~objckpt.store.pacing.Pacer`, one made per rank (``None``: off). The store's
        #: own ``pacing`` stays off: one Pacer would be shared by every rank and count real
        #: requests in flight, where a rank's concurrency is virtual lanes of one thread.
        self.pacer_factory: Callable[[], Pacer] | None = None
        self.pacers: dict[int | None, Pacer] = {}
        #: rank -> (virtual time its last cut's answer arrived, the epoch before that cut)
        self._cuts: dict[int | None, tuple[float, int]] = {}
        self._rec_lock = threading.Lock()
        self.add_retry_listener(self._on_retry)

    def reset(self) -> Recorder:
        """Start a fresh :class:`Recorder` (the rate-limit state is kept); returns the old one."""
        with self._rec_lock:
            old, self.recorder = self.recorder, Recorder()
        return old

    def _on_retry(self, exc: BaseException, attempt: int) -> None:
        if is_slowdown(exc):
            tl = clock.current()
            with self._rec_lock:
                self.recorder.absorbed += 1
                self.recorder.absorbed_by_phase[tl.phase if tl is not None else "setup"] += 1

    def _record(self, op: str, key: str, tl: clock.Timeline | None) -> None:
        rank = tl.rank if tl is not None else None
        ph = tl.phase if tl is not None else "setup"
        with self._rec_lock:
            rec = self.recorder
            counts = rec.by.get((rank, ph))
            if counts is None:
                counts = rec.by[(rank, ph)] = collections.Counter()
            counts[op] += 1
            rec.total += 1
            if op_kind(op) == "list" and key.startswith(layout.DATA_PREFIX):
                rec.data_lists[ph] += 1
            if tl is not None:
                rec.t_first = tl.now if rec.t_first is None else min(rec.t_first, tl.now)
                rec.t_last = tl.now if rec.t_last is None else max(rec.t_last, tl.now)
            if self.max_requests is not None and rec.total > self.max_requests:
                raise SimulationBudgetExceeded(
                    f"the simulation exceeded its budget of {self.max_requests:,} requests"
                )

    def _paced(self, tl: clock.Timeline) -> tuple[Pacer, int, int] | None:
        """Wait (virtually) for one of the rank's pacing slots: until fewer of its other lanes'
        requests are in flight than its Pacer's limit. The Pacer, the epoch and the number in
        flight (this one included) to report the answer with; ``None``: pacing off."""
        if self.pacer_factory is None:
            return None
        with self._rec_lock:
            pacer = self.pacers.get(tl.rank)
            if pacer is None:
                pacer = self.pacers[tl.rank] = self.pacer_factory()
        limit = max(1, int(pacer.limit))
        others = sorted(e for e in (tl.lanes or ()) if e > tl.now)
        if len(others) >= limit:
            pacer.waits += 1
            tl.advance_to(others[len(others) - limit])  # enough of them have finished by then
            others = [e for e in others if e > tl.now]
        epoch = pacer.epoch
        cut = self._cuts.get(tl.rank)
        if cut is not None and tl.now < cut[0]:
            # the answer that cut the limit is still on its way: this try starts before the cut
            epoch = cut[1]
        return pacer, epoch, len(others) + 1

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Any, *args: Any) -> Any:
        tl = clock.current()
        paced = self._paced(tl) if tl is not None else None
        if tl is not None:
            clock.before_request()  # requests reach the rate limiter in virtual-time order (to within the lag)
        self._record(op, key, tl)
        kind = op_kind(op)
        if tl is None:
            return _inner(fn, *args)
        net = self.network_model
        if self.throttle:
            ok, scopes = self.rates.admit("write" if kind == "write" else "read", keys or [key], tl.now)
            if paced is not None:
                pacer, epoch, flight = paced
                cuts = pacer.decreases
                pacer.feedback(epoch, throttled=not ok, in_flight=flight)
                if pacer.decreases != cuts:
                    self._cuts[tl.rank] = (tl.now + net.error_latency_s, epoch)
            if not ok:
                with self._rec_lock:
                    self.recorder.slowdowns[(tl.phase, op)] += 1
                tl.advance(net.error_latency_s)
                raise TransientError(
                    f"{SLOWDOWN}: please reduce your request rate (simulated {self.profile.name} "
                    f"{', '.join(s.label for s in scopes)})",
                    key=key,
                    location=self.location,
                    operation=op,
                )
        elif paced is not None:
            paced[0].feedback(paced[1], throttled=False, in_flight=paced[2])
        tl.advance(net.latency_s(kind))
        sent = _payload_bytes(args)
        if sent:
            with self._rec_lock:
                self.recorder.bytes_written[tl.rank] += sent
            tl.advance_to(self.net.transfer(tl.host, "up", tl.now, sent, scaled=_is_shard(key)))
        result = _inner(fn, *args)
        if isinstance(result, (bytes, bytearray, memoryview)):
            self._received(len(result), _is_shard(key))
        elif isinstance(result, Iterator):
            return self._metered(result, _is_shard(key))
        return result

    def _received(self, n: int, scaled: bool) -> None:
        tl = clock.current()
        if tl is None or n <= 0:
            return
        with self._rec_lock:
            self.recorder.bytes_read[tl.rank] += n
        tl.advance_to(self.net.transfer(tl.host, "down", tl.now, n, scaled=scaled))

    def _metered(self, stream: Iterator[bytes], scaled: bool) -> Iterator[bytes]:
        try:
            while True:
                chunk = _inner(next, stream, None)
                if chunk is None:
                    return
                self._received(len(chunk), scaled)
                yield chunk
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
