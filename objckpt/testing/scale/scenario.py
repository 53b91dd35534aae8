"""Scenarios: saves and a restore of a simulated job, through the library's own sessions.

:func:`run_scenario` builds a :class:`~.store.SimulatedStore` (around a ``MemoryStore``) and a
:class:`~.world.SimWorld`, then, under :func:`~.clock.virtual_time`:

1. ``options.saves`` saves (steps 1, 2, ...), ``interval_s`` of virtual time apart, each by
   every rank through :class:`~objckpt.coordination.save.SaveSession` (``begin``, the adapter's
   writes through ``ShardWriter``, ``finish``: the receipts gather, rank 0's
   ``Coordinator.commit`` and its retention, the outcome and manifest broadcasts). The session
   is subclassed only to time ``commit`` and ``retain`` and label their requests.
2. If nothing committed (today's design at thousands of ranks: the saves fail on SlowDowns) and
   ``seed_unthrottled``, one more save with the rate limits off, so that the restore can still
   be measured (reported as "seeded").
3. One restore by every rank through :class:`~objckpt.coordination.restore.RestoreSession`
   (rank 0 resolves and broadcasts the manifest, every rank stages its reads through
   ``Reader.read_shard``, the ranks agree).
4. The committed manifest's size, and the time of ``Manifest.decode`` on it (real CPU, measured
   in the harness thread while nothing else runs).

What the virtual clock is charged with: every request's modelled latency and transfer time, every
collective's modelled cost, every retry backoff (the policy's own jittered sleeps), and the real
CPU time (``time.thread_time``) of the coordinator's ``commit`` call and of every
``Manifest.decode`` (each rank decodes the manifest it receives). Other CPU of the simulation
(JSON of the collectives, the adapter, the store wrapper's bookkeeping) is not charged.

``memoize_manifest_decode``: every rank receives the same manifest bytes; with this option the
real ``Manifest.decode`` runs once per distinct bytes object and every rank after the first gets
the same result, its virtual clock still charged the measured time (:mod:`.decoding`). Off, every rank parses for real.
``memoize_exchange``: the same for the CRC32C checks and the plan (``assign``) inside a read-once
restore's ``read_shared`` (every rank receives the very same gathered shard objects; charged
either way: :func:`.decoding.charged_exchange`).
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ..._retry import RetryPolicy
from ...coordination.restore import RestoreSession
from ...coordination.save import SaveSession
from ...gc import RetentionPolicy
from ...manifest import Manifest
from ...reader import Reader
from ...store.pacing import Pacer
from . import clock
from .adapter import Adapter
from .decoding import charged_exchange, charged_parsing
from .fixes import FIXES, switches_for
from .model import NetworkModel, StoreProfile
from .results import PhaseResult, ScenarioResult, _Probe, _summarise
from .store import (
    IndexedMemoryStore,
    SimulatedStore,
    SimulationBudgetExceeded,
    inner_cpu,
)
from .world import SimComm, SimWorld

__all__ = ["PhaseResult", "ScaleOptions", "ScenarioResult", "run_scenario"]


@dataclass(frozen=True)
class ScaleOptions:
    """One scenario. Sizes are real bytes (``network.byte_scale`` scales them for the model).

    Attributes:
        world_size: ranks.
        shards_per_rank: shards each rank writes per save, its ``replicated.bin`` included.
        shard_bytes: real bytes of each per-rank shard.
        replicated_bytes: real bytes of the whole replicated state (each rank writes 1/N).
        profile, network: the store's performance model.
        retry: the store's retry policy (the library's default).
        keep_last: retention applied by rank 0 after every commit (``None``: none).
        saves: saves before the restore (the last one is the steady state reported).
        interval_s: virtual seconds between saves.
        max_threads: host ranks on at most this many threads (see :mod:`.world`).
        restore_max_threads: the same for the restore alone (``None``: ``max_threads``). A
            read-once restore needs a thread per rank (``read_shared`` is a collective of every
            rank): beyond ``max_threads`` ranks set this to ``world_size``, and the saves still
            share threads.
        read_lanes / write_lanes: concurrent transfers of one rank while staging / writing.
        memoize_manifest_decode: see the module doc.
        memoize_exchange: see the module doc.
        lag: scheduling slack in virtual seconds (see :mod:`.clock`); ``None``: threads run
            free (no ordering of requests by virtual time).
        stop_restore_on_failure: once one rank's staging failed, the others stop issuing reads
            (the restore is failed anyway; a real job's ranks would go on until their own
            failure, so the traffic reported for a failed restore is a lower bound).
        max_requests: stop a save (each save: the budget is per phase) that would issue more
            requests than this (:class:`~.store.SimulationBudgetExceeded` fails it).
        max_restore_requests: the same for the restore (``None``: ``max_requests``). Today's
            restore at 4,096 ranks needs 16.8 M GETs (hours of this machine): a budget stops it
            and the report states how far it got and the lower bound of the rest.
        seed_unthrottled: see step 2 of the module doc.
        key_spreading, replicated_read_once, verify_ranks, auto_part_size, aimd_pacing: the
            fixes (:mod:`.fixes`); all off is today's design before them. A fix that is not
            built or not modelled raises :class:`FixNotBuilt`.
    """

    world_size: int = 8
    shards_per_rank: int = 8
    shard_bytes: int = 4096
    replicated_bytes: int = 4 * 1024 * 1024
    profile: StoreProfile = field(default_factory=StoreProfile.s3)
    network: NetworkModel = field(default_factory=NetworkModel)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    keep_last: int | None = 1
    saves: int = 2
    interval_s: float = 600.0
    max_threads: int = 4096
    restore_max_threads: int | None = None
    read_lanes: int = 8
    write_lanes: int = 1
    memoize_manifest_decode: bool = True
    memoize_exchange: bool = True
    lag: float | None = 0.25
    stop_restore_on_failure: bool = True
    max_requests: int | None = 6_000_000
    max_restore_requests: int | None = None
    seed_unthrottled: bool = True
    key_spreading: bool = False
    replicated_read_once: bool = False
    verify_ranks: bool = False
    auto_part_size: bool = False
    aimd_pacing: bool = False

    @property
    def fixes(self) -> list[str]:
        return [f.option for f in FIXES if getattr(self, f.option)]

    @property
    def threads(self) -> int:
        """Threads hosting the ranks of a save (the largest divisor of ``world_size`` up to
        ``max_threads``)."""
        return _divisor_up_to(self.world_size, self.max_threads)

    @property
    def restore_threads(self) -> int:
        """Threads hosting the ranks of the restore."""
        cap = self.max_threads if self.restore_max_threads is None else self.restore_max_threads
        return _divisor_up_to(self.world_size, cap)


def _divisor_up_to(n: int, cap: int) -> int:
    t = max(1, min(n, cap))
    while n % t:
        t -= 1
    return t


class _InstrumentedSaveSession(SaveSession):
    """The library's SaveSession; ``commit`` and ``retain`` are timed and their requests labelled
    (nothing else differs)."""

    probe: _Probe
    world: SimWorld

    def _listing_report(self, comm: Any, step: int, attempt: str) -> dict[str, Any]:
        # Hosted ranks (several per thread): each lists its own verification slice as itself
        # (its timeline), registered as its contribution to the listings gather.
        world = self.world
        if world.group == 1:
            return super()._listing_report(comm, step, attempt)
        outcomes = world.each_hosted(
            comm, lambda rank: self.list_slice(step, attempt, rank, comm.world_size), phase="save"
        )
        reports: list[dict[str, Any]] = [
            o if not isinstance(o, BaseException) else {"error": f"{type(o).__name__}: {o}"} for o in outcomes
        ]
        for rank, report in zip(world.hosted(comm), reports, strict=True):
            if rank != comm.rank:
                world.report(rank, report)
        return reports[0]

    def commit(self, *args: Any, **kwargs: Any) -> Manifest:
        with clock.phase("commit"):
            t_thread, t_process, t_store = time.thread_time(), time.process_time(), inner_cpu()
            try:
                return super().commit(*args, **kwargs)
            finally:
                # the in-memory store's own CPU is the server's work, not the coordinator's
                cpu = time.thread_time() - t_thread - (inner_cpu() - t_store)
                self.probe.commit_thread_cpu = cpu
                self.probe.commit_process_cpu = time.process_time() - t_process
                tl = clock.current()
                if tl is not None:
                    tl.advance(cpu)  # everyone waits for the coordinator's CPU

    def retain(self, committed: Manifest | None = None) -> None:
        tl = clock.current()
        with clock.phase("retain"):
            self.probe.retain_start = tl.now if tl else None
            super().retain(committed)
            self.probe.retain_end = tl.now if tl else None


def _save(
    store: SimulatedStore, adapter: Adapter, options: ScaleOptions, step: int, start: float, *, seeded: bool
) -> tuple[PhaseResult, float]:
    store.reset()
    adapter.reset()
    world = SimWorld(options.world_size, threads=options.threads, network=options.network, start=start)
    probe = _Probe()
    returned: dict[int, float] = {}
    lock = threading.Lock()
    retention = RetentionPolicy(keep_last=options.keep_last) if options.keep_last is not None else None

    def body(comm: SimComm) -> Any:
        session = _InstrumentedSaveSession(
            store,
            comm,
            retention=retention,
            key_spreading=adapter.switches.key_spreading,
            verify=adapter.switches.verify,
        )
        session.probe = probe
        session.world = world
        try:
            with clock.phase("save"):
                manifest = session.save(step, lambda ticket: adapter.write(world, comm, store, ticket))
            return manifest.step
        finally:
            with lock:
                for r in world.hosted(comm):
                    returned[r] = world.timelines[r].now

    wall = time.perf_counter()
    results = world.run(body)
    wall = time.perf_counter() - wall
    rec = store.reset()
    io = adapter.reset()
    result = _summarise(
        "save",
        step,
        results,
        rec,
        io,
        store,
        world,
        start,
        wall,
        probe=probe,
        seeded=seeded,
        returned=returned,
    )
    return result, world.now


def _restore(
    store: SimulatedStore, adapter: Adapter, options: ScaleOptions, start: float
) -> tuple[PhaseResult, float]:
    store.reset()
    adapter.reset()
    world = SimWorld(
        options.world_size, threads=options.restore_threads, network=options.network, start=start
    )
    reader = Reader(store)
    saves_budget = store.max_requests
    if options.max_restore_requests is not None:
        store.max_requests = options.max_restore_requests

    def body(comm: SimComm) -> Any:
        session = RestoreSession(store, comm)
        with clock.phase("resolve"):
            restored = session.restore(lambda m: adapter.stage(world, comm, reader, m))
        return None if restored is None else restored.step

    wall = time.perf_counter()
    try:
        results = world.run(body)
    finally:
        store.max_requests = saves_budget
    wall = time.perf_counter() - wall
    rec = store.reset()
    io = adapter.reset()
    return _summarise("restore", None, results, rec, io, store, world, start, wall), world.now


@contextlib.contextmanager
def _progress(store: SimulatedStore, say: Any, every_s: float) -> Iterator[None]:
    """Log the running phase's request count every ``every_s`` real seconds."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(every_s):
            rec = store.recorder
            say(f"    ... {rec.total:,} requests so far in this phase, virtual time {rec.t_last or 0:,.0f} s")

    thread = threading.Thread(target=report, name="objckpt-scale-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def run_scenario(
    options: ScaleOptions, *, log: Any = None, progress_s: float | None = None
) -> ScenarioResult:
    """Run the saves, the restore and the manifest measurement of ``options``; ``log`` gets a
    line per phase (and, with ``progress_s``, the running request count that often)."""
    say = log or (lambda _msg: None)
    switches = switches_for(options)
    if switches.replicated_read == "once" and options.restore_threads < options.world_size:
        raise ValueError(
            "replicated_read='once' needs one thread per rank in the restore (read_shared is a "
            f"collective of every rank; {options.world_size} ranks on {options.restore_threads} threads "
            "here): raise max_threads or restore_max_threads"
        )
    started = time.perf_counter()
    store = SimulatedStore(
        IndexedMemoryStore("scale", retry=options.retry),
        profile=options.profile,
        network=options.network,
        max_requests=options.max_requests,
    )
    # one AIMD pacer shared by every simulated rank would throttle them all together, and it
    # would see real (not virtual) requests in flight: the store objects' own pacing is off; with
    # aimd_pacing the simulated store drives one real Pacer per rank (see .fixes)
    for s in (store, store.inner):
        s.pacing = None
        s.auto_part_size = options.auto_part_size
    if switches.pacing:
        store.pacer_factory = Pacer
    adapter = Adapter(options, switches)
    saves: list[PhaseResult] = []
    restore: PhaseResult | None = None
    baton: clock.Baton | None = None
    with contextlib.ExitStack() as stack:
        # Cyclic GC over thousands of thread stacks costs ~25% of the run; collect once at the end.
        if gc.isenabled():
            gc.disable()
            stack.callback(gc.enable)
            stack.callback(gc.collect)
        baton = stack.enter_context(clock.virtual_time(lag=options.lag))
        stack.enter_context(charged_parsing(options.memoize_manifest_decode))
        stack.enter_context(charged_exchange(options.memoize_exchange))
        if log is not None and progress_s:
            stack.enter_context(_progress(store, say, progress_s))
        t = 0.0
        step = 0
        for _ in range(options.saves):
            step += 1
            result, t = _save(store, adapter, options, step, t, seeded=False)
            saves.append(result)
            say(
                f"  save step {step}: {result.outcome[:120]} ({result.total:,} requests, "
                f"{result.slowdowns_injected:,} SlowDowns, {result.wall_s:.1f}s real)"
            )
            t += options.interval_s
        latest = Reader(store.inner).latest()
        if latest is None and options.seed_unthrottled:
            step += 1
            store.throttle = False
            try:
                result, t = _save(store, adapter, options, step, t, seeded=True)
            finally:
                store.throttle = True
            saves.append(result)
            say(f"  seeded step {step} with the rate limits off: {result.outcome[:120]}")
            t += options.interval_s
            latest = Reader(store.inner).latest()
        if latest is not None:
            try:
                restore, t = _restore(store, adapter, options, t)
            except SimulationBudgetExceeded as exc:  # pragma: no cover - guarded per request
                say(f"  restore stopped: {exc}")
            if restore is not None:
                say(
                    f"  restore: {restore.outcome[:120]} ({restore.total:,} requests, "
                    f"{restore.slowdowns_injected:,} SlowDowns, {restore.wall_s:.1f}s real)"
                )
    unique = latest.total_size if latest is not None else 0
    body = store.inner.get(latest.key) if latest is not None else b""
    decode_s = encode_s = math.nan
    if latest is not None:
        decode_s = _best_of(lambda: Manifest.decode(body, key=latest.key))
        decoded = Manifest.decode(body, key=latest.key)
        encode_s = _best_of(decoded.encode)
    return ScenarioResult(
        options=_options_dict(options),
        saves=saves,
        restore=restore,
        unique_bytes=unique,
        manifest_bytes=len(body),
        manifest_shards=len(latest.shards) if latest is not None else 0,
        manifest_decode_s=decode_s,
        manifest_encode_s=encode_s,
        wall_s=time.perf_counter() - started,
        key_prefixes=len({s.key.split("/", 2)[1] for s in latest.shards}) if latest is not None else 0,
        pace_waits=baton.waits if baton is not None else 0,
        lag_violations=baton.violations if baton is not None else 0,
    )


def _best_of(fn: Any, runs: int = 5, spend_s: float = 2.0) -> float:
    """The fastest of up to ``runs`` timed calls, stopping once ``spend_s`` real seconds are
    spent (at 16,384 ranks one decode of the manifest takes seconds here)."""
    times = [_timed(fn)]
    while len(times) < runs and sum(times) < spend_s:
        times.append(_timed(fn))
    return min(times)


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _options_dict(options: ScaleOptions) -> dict[str, Any]:
    d = asdict(options)
    d["threads"] = options.threads
    d["restore_threads"] = options.restore_threads
    return d
