"""The simulated object store's performance model: request-rate limits, latency, bandwidth.

Everything here is a plain function of virtual time (:mod:`.clock`); nothing sleeps.

Request-rate limits (:class:`StoreProfile`, :class:`RateModel`)
    Requests are classed as *writes* (PUT, POST: multipart create/part/complete/abort, DELETE)
    and *reads* (GET, HEAD, and LIST: Google documents listing as a read; AWS does not say how
    LIST counts against a partition, so the S3 profile assumes the same). Each class is counted
    in fixed windows of ``window_s`` virtual seconds against ``limit x window_s``; a request that
    would exceed it is refused (the store answers ``503 SlowDown``) and does not consume capacity.
    Two kinds of scope can limit a request, and it must fit in every scope it touches:

    * **key-range partitions** (S3): the key space is cut into lexicographic ranges (initially
      one, or ``initial_boundaries``); each range serves ``partition_limits``. A range that keeps
      throttling for ``split_after_s`` (a throttling gap longer than ``split_idle_s`` restarts
      the count) splits in two at the median of the keys it recently served, each half with the
      full limit. Because ranges are lexicographic, a split learnt on ``data/<step>-<attempt>/``
      does not help the next save, whose keys sort after all of them (the "sequential names"
      hot spot both providers warn about).
    * **the bucket** (GCS): ``bucket_limits`` for the whole bucket, doubled each time the offered
      load has stayed above ``ramp_threshold`` of the current limit for ``ramp_period_s``.

    A ``DeleteObjects`` batch is one request that costs one write unit per key, in the partition
    of each key (AWS does not document this; it is the conservative reading).

Latency and bandwidth (:class:`NetworkModel`, :class:`Network`)
    A request costs ``request_latency_s`` (``list_latency_s`` for a LIST page,
    ``error_latency_s`` for a 503) before its first byte, then its payload moves at no more than
    ``connection_bandwidth`` (one rank or pool worker is one connection) and within the host's
    NIC, ``host_bandwidth`` per direction shared by the ``ranks_per_host`` ranks of a host
    (a capacity calendar in slots of ``bandwidth_slot_s``). Payload sizes are the real bytes
    multiplied by ``byte_scale`` for shard objects (keys under ``data/``: small in-memory shards
    stand for large ones); manifests, pointers and markers move at their real size.
    A collective costs ``collective_latency_s x ceil(log2 N)`` plus its bytes at
    ``collective_bandwidth`` (a tree broadcast/gather on the training network).

Sources of the defaults are in :data:`SOURCES` and in ``SCALE.md``.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

__all__ = [
    "SOURCES",
    "Network",
    "NetworkModel",
    "RateLimits",
    "RateModel",
    "Scope",
    "StoreProfile",
]

SOURCES = {
    "s3_rates": (
        "AWS, Amazon S3 User Guide, 'Best practices design patterns: optimizing Amazon S3 performance': "
        "'at least 3,500 PUT/COPY/POST/DELETE or 5,500 GET/HEAD requests per second per partitioned "
        "Amazon S3 prefix' https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html "
        "(also the older 'Request Rate and Performance Guidelines', "
        "https://docs.aws.amazon.com/AmazonS3/latest/dev/request-rate-perf-considerations.html)"
    ),
    "s3_503": (
        "AWS whitepaper 'Best Practices Design Patterns: Optimizing Amazon S3 Performance', 'Timeouts and "
        "Retries for Latency-Sensitive Applications': while S3 optimises for a new request rate it answers "
        "HTTP 503 temporarily; small requests (< 512 KB) have median latencies 'in the tens of milliseconds' "
        "https://docs.aws.amazon.com/whitepapers/latest/s3-optimizing-performance-best-practices/"
        "timeouts-and-retries-for-latency-sensitive-applications.html"
    ),
    "s3_split_time": (
        "AWS re:Post answer on the Knowledge Center article 'How can I scale my request rate to S3' (not "
        "the official text): auto-partitioning 'can take from 30 to 60 minutes'; pre-partitioning through "
        "AWS support https://aws.amazon.com/premiumsupport/knowledge-center/s3-object-key-naming-pattern/"
    ),
    "gcs_rates": (
        "Google Cloud, Cloud Storage 'Request rate and access distribution guidelines': buckets start at "
        "'approximately 1000 object write requests per second' and 'approximately 5000 object read requests "
        "per second, which includes listing objects'; ramp up 'no faster than doubling over a period of 20 "
        "minutes'; redistribution takes 'on the order of minutes'; sequential names make index ranges "
        "auto-scale slowly https://cloud.google.com/storage/docs/request-rate"
    ),
    "assumed": (
        "Not published by either provider, chosen for this model: per-connection bandwidth (100 MB/s), "
        "host NIC (100 Gb/s per direction, the class of GPU instances), 8 ranks per host, LIST page "
        "latency 100 ms, 503 answered in 10 ms, how LIST and DeleteObjects count against a partition, "
        "collective cost (50 us per tree level, 1 GB/s)."
    ),
}


@dataclass(frozen=True)
class RateLimits:
    """Requests per second a scope serves, by class."""

    write_per_s: float
    read_per_s: float

    def scaled(self, factor: float) -> RateLimits:
        return RateLimits(self.write_per_s * factor, self.read_per_s * factor)


@dataclass(frozen=True)
class StoreProfile:
    """Which rate limits apply, and how the store adapts to load (see the module doc)."""

    name: str
    partition_limits: RateLimits | None = None
    split_after_s: float | None = None
    split_idle_s: float = 60.0
    bucket_limits: RateLimits | None = None
    ramp_period_s: float | None = None
    ramp_threshold: float = 0.5
    initial_boundaries: tuple[str, ...] = ()
    window_s: float = 1.0

    def __post_init__(self) -> None:
        if self.window_s <= 0:
            raise ValueError("window_s must be positive")
        for limits in (self.partition_limits, self.bucket_limits):
            if limits is not None and min(limits.write_per_s, limits.read_per_s) * self.window_s < 1:
                raise ValueError(f"{limits} admits less than one request per {self.window_s}s window")

    @classmethod
    def s3(cls, **changes: object) -> StoreProfile:
        """S3: 3,500 writes / 5,500 reads per second per key-range partition, one partition to
        start with, a partition splits after 30 minutes of sustained throttling."""
        base = cls(
            name="s3",
            partition_limits=RateLimits(3500.0, 5500.0),
            split_after_s=30 * 60.0,
        )
        return replace(base, **changes)  # type: ignore[arg-type]

    @classmethod
    def gcs(cls, **changes: object) -> StoreProfile:
        """GCS: ~1,000 writes / 5,000 reads per second per bucket to start with, doubling after
        each 20 minutes of sustained load."""
        base = cls(name="gcs", bucket_limits=RateLimits(1000.0, 5000.0), ramp_period_s=20 * 60.0)
        return replace(base, **changes)  # type: ignore[arg-type]

    @classmethod
    def unlimited(cls) -> StoreProfile:
        """No rate limit (latency and bandwidth still apply)."""
        return cls(name="unlimited")


@dataclass(frozen=True)
class NetworkModel:
    """Latency and bandwidth of the simulated store and of the training network."""

    request_latency_s: float = 0.03
    list_latency_s: float = 0.1
    error_latency_s: float = 0.01
    connection_bandwidth: float = 100e6
    host_bandwidth: float = 12.5e9
    ranks_per_host: int = 8
    byte_scale: float = 1.0
    bandwidth_slot_s: float = 0.01
    collective_latency_s: float = 50e-6
    collective_bandwidth: float = 1e9

    def __post_init__(self) -> None:
        if self.ranks_per_host < 1 or self.connection_bandwidth <= 0 or self.host_bandwidth <= 0:
            raise ValueError("ranks_per_host, connection_bandwidth and host_bandwidth must be positive")

    def collective_s(self, world_size: int, nbytes: int) -> float:
        hops = max(1, math.ceil(math.log2(world_size))) if world_size > 1 else 0
        return hops * self.collective_latency_s + nbytes / self.collective_bandwidth

    def latency_s(self, kind: str) -> float:
        return self.list_latency_s if kind == "list" else self.request_latency_s


# ------------------------------------------------------------------------------------- rates


@dataclass
class Scope:
    """One rate-limited scope: a key range ``[lo, next boundary)`` or the whole bucket."""

    label: str
    lo: str
    limits: RateLimits
    #: window -> [reads accepted, writes accepted, reads offered, writes offered]
    windows: dict[int, list[int]] = field(default_factory=dict)
    throttled_since: float | None = None
    last_throttle: float = -math.inf
    busy_since: float | None = None
    last_busy: float = -math.inf
    ramps: int = 0
    recent: list[str] = field(default_factory=list)
    throttled: int = 0

    def peak_per_s(self, window_s: float, t0: float = -math.inf, t1: float = math.inf) -> dict[str, float]:
        """Highest per-second counts (sliding over whole windows) between ``t0`` and ``t1``."""
        per = max(1, round(1.0 / window_s))
        lo = -(2**62) if t0 == -math.inf else math.floor(t0 / window_s)
        hi = 2**62 if t1 == math.inf else math.ceil(t1 / window_s)
        keys = sorted(w for w in self.windows if lo <= w <= hi)
        out = {"read": 0.0, "write": 0.0, "read_offered": 0.0, "write_offered": 0.0}
        names = ("read", "write", "read_offered", "write_offered")
        if not keys:
            return out
        sums = [0, 0, 0, 0]
        queue: list[int] = []
        start = 0
        for w in keys:
            queue.append(w)
            counts = self.windows[w]
            for i in range(4):
                sums[i] += counts[i]
            while queue[start] <= w - per:
                old = self.windows[queue[start]]
                for i in range(4):
                    sums[i] -= old[i]
                start += 1
            for i, name in enumerate(names):
                out[name] = max(out[name], float(sums[i]))
        return out


class RateModel:
    """The rate-limit state of one simulated bucket (thread-safe)."""

    def __init__(self, profile: StoreProfile) -> None:
        self.profile = profile
        self._lock = threading.Lock()
        self.partitions: list[Scope] = []
        self._bounds: list[str] = []
        self.bucket: Scope | None = None
        if profile.partition_limits is not None:
            for lo in ("", *sorted(set(profile.initial_boundaries) - {""})):
                self._bounds.append(lo)
                self.partitions.append(Scope(f"range[{lo!r}..)", lo, profile.partition_limits))
        if profile.bucket_limits is not None:
            self.bucket = Scope("bucket", "", profile.bucket_limits)
        self.splits: list[tuple[float, str]] = []

    @property
    def scopes(self) -> list[Scope]:
        return self.partitions + ([self.bucket] if self.bucket is not None else [])

    def _partition(self, key: str) -> Scope:
        return self.partitions[bisect.bisect_right(self._bounds, key) - 1]

    def admit(self, kind: str, keys: Iterable[str], t: float) -> tuple[bool, list[Scope]]:
        """Count one request of class ``kind`` (``read``/``write``) touching ``keys`` at virtual
        time ``t``; ``False`` when a scope is over its limit in that window (a 503)."""
        p = self.profile
        reading = kind == "read"
        acc, off = (0, 2) if reading else (1, 3)
        w = math.floor(t / p.window_s)
        with self._lock:
            units: dict[int, tuple[Scope, int]] = {}
            keys = list(keys) or [""]
            if self.partitions:
                for key in keys:
                    scope = self._partition(key)
                    old = units.get(id(scope))
                    units[id(scope)] = (scope, (old[1] if old else 0) + 1)
                    scope.recent.append(key)
                    if len(scope.recent) > 512:
                        del scope.recent[:256]
            if self.bucket is not None:
                units[id(self.bucket)] = (self.bucket, len(keys))
            ok = True
            for scope, n in units.values():
                counts = scope.windows.setdefault(w, [0, 0, 0, 0])
                counts[off] += n
                limits = scope.limits.scaled(2.0**scope.ramps)
                cap = (limits.read_per_s if reading else limits.write_per_s) * p.window_s
                if counts[acc] + n > cap + 1e-9:
                    ok = False
            touched = [scope for scope, _ in units.values()]
            if ok:
                for scope, n in units.values():
                    scope.windows[w][acc] += n
            for scope, _ in units.values():
                self._adapt(scope, t, throttled=not ok, offered=scope.windows[w][off], reading=reading)
            return ok, touched

    def _adapt(self, scope: Scope, t: float, *, throttled: bool, offered: int, reading: bool) -> None:
        p = self.profile
        if throttled:
            scope.throttled += 1
            if scope.throttled_since is None or t - scope.last_throttle > p.split_idle_s:
                scope.throttled_since = t
            scope.last_throttle = max(scope.last_throttle, t)
            if (
                scope is not self.bucket
                and p.split_after_s is not None
                and t - scope.throttled_since >= p.split_after_s
            ):
                self._split(scope, t)
        if scope is self.bucket and p.ramp_period_s is not None:
            limits = scope.limits.scaled(2.0**scope.ramps)
            cap = (limits.read_per_s if reading else limits.write_per_s) * p.window_s
            if offered >= p.ramp_threshold * cap:
                if scope.busy_since is None or t - scope.last_busy > p.split_idle_s:
                    scope.busy_since = t
                scope.last_busy = max(scope.last_busy, t)
                if t - scope.busy_since >= p.ramp_period_s:
                    scope.ramps += 1
                    scope.busy_since = t

    def _split(self, scope: Scope, t: float) -> None:
        i = self.partitions.index(scope)
        hi = self._bounds[i + 1] if i + 1 < len(self._bounds) else None
        keys = sorted(k for k in scope.recent if k > scope.lo and (hi is None or k < hi))
        scope.throttled_since = None
        if not keys:
            return
        cut = keys[len(keys) // 2]
        if cut <= scope.lo or cut in self._bounds:
            return
        new = Scope(f"range[{cut!r}..)", cut, scope.limits)
        new.recent = [k for k in scope.recent if k >= cut]
        scope.recent = [k for k in scope.recent if k < cut]
        self._bounds.insert(i + 1, cut)
        self.partitions.insert(i + 1, new)
        self.splits.append((t, cut))

    def limit_of(self, scope: Scope, kind: str) -> float:
        limits = scope.limits.scaled(2.0**scope.ramps)
        return limits.read_per_s if kind == "read" else limits.write_per_s


# ------------------------------------------------------------------------------------- bandwidth


class _Calendar:
    """Capacity over virtual time in fixed slots (one host NIC, one direction)."""

    __slots__ = ("rate", "slot", "used")

    def __init__(self, rate: float, slot: float) -> None:
        self.rate = rate
        self.slot = slot
        self.used: dict[int, float] = {}

    def transfer(self, start: float, amount: float, max_rate: float) -> float:
        """Move ``amount`` bytes starting at ``start`` at no more than ``max_rate`` and within the
        slots' remaining capacity; returns the finish time."""
        t, remaining = start, amount
        per_slot = self.rate * self.slot
        i = math.floor(t / self.slot)
        while True:
            # Walk slots by index (not by adding slot ends to t, which float rounding can stall).
            slot_end = (i + 1) * self.slot
            room = max(0.0, per_slot - self.used.get(i, 0.0))
            can = min(room, max_rate * max(0.0, slot_end - t))
            if remaining <= can:
                self.used[i] = self.used.get(i, 0.0) + remaining
                return t + remaining / max_rate
            if can > 0:
                self.used[i] = self.used.get(i, 0.0) + can
                remaining -= can
            i += 1
            t = max(t, i * self.slot)


class Network:
    """Per-host NIC calendars and the request costs of :class:`NetworkModel` (thread-safe)."""

    def __init__(self, model: NetworkModel) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._nics: dict[tuple[int, str], _Calendar] = {}

    def transfer(self, host: int, direction: str, start: float, nbytes: int, *, scaled: bool = True) -> float:
        """Finish time of ``nbytes`` real bytes moved at ``start`` (``scaled``: shard bytes, each
        standing for ``byte_scale``)."""
        if nbytes <= 0:
            return start
        m = self.model
        amount = nbytes * (m.byte_scale if scaled else 1.0)
        with self._lock:
            nic = self._nics.get((host, direction))
            if nic is None:
                nic = self._nics[(host, direction)] = _Calendar(m.host_bandwidth, m.bandwidth_slot_s)
            return nic.transfer(start, amount, min(m.connection_bandwidth, m.host_bandwidth))
