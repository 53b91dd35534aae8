"""The scale simulator: objckpt's real save / commit / resolve / restore / retention code at
thousands of ranks, against a simulated object store, on a virtual clock.

Real (the library's own code, unmodified): ``SaveSession`` (handshake, receipts gather, the
coordinator's ``Coordinator.commit`` with its LIST verification, the manifest create-if-absent,
the pointer compare-and-swap, retention/GC), ``RestoreSession`` (rank 0 resolves through the
pointer and ``manifests/``, broadcasts the manifest, every rank validates it), ``ShardWriter``,
``Reader.read_shard`` (CRC32C-verified streams), the store's public methods (retry policy with
tenacity, ``put_stream``, ``get_stream``'s resume loop), ``MemoryStore`` holding the real bytes,
and the library's ``ThreadWorld`` carrying every collective as JSON between threads.

Simulated: the object store's performance (:mod:`.model`: per-partition request-rate limits
answered with ``503 SlowDown``, latency, per-connection and per-host bandwidth), time itself
(:mod:`.clock`: per-rank virtual clocks, retry sleeps that cost virtual time only), the cost of
collectives, what a rank writes and reads (:mod:`.adapter`, a torch-free mirror of
``CheckpointManager``'s layout), and, beyond ``max_threads`` ranks, ranks hosted several per
thread (:mod:`.world` says exactly what is derived then).

Entry points: :func:`run_scenario` with :class:`ScaleOptions`; ``python -m benchmarks.scale``
writes ``SCALE.md``.
"""

from __future__ import annotations

from .clock import Timeline, acting_as, current, virtual_time
from .fixes import FIXES, Fix, FixNotBuilt
from .model import SOURCES, NetworkModel, RateLimits, RateModel, StoreProfile
from .scenario import PhaseResult, ScaleOptions, ScenarioResult, run_scenario
from .store import SLOWDOWN, Recorder, SimulatedStore, SimulationBudgetExceeded, is_slowdown
from .world import SimComm, SimWorld

__all__ = [
    "FIXES",
    "SLOWDOWN",
    "SOURCES",
    "Fix",
    "FixNotBuilt",
    "NetworkModel",
    "PhaseResult",
    "RateLimits",
    "RateModel",
    "Recorder",
    "ScaleOptions",
    "ScenarioResult",
    "SimComm",
    "SimWorld",
    "SimulatedStore",
    "SimulationBudgetExceeded",
    "StoreProfile",
    "Timeline",
    "acting_as",
    "current",
    "is_slowdown",
    "run_scenario",
    "virtual_time",
]
