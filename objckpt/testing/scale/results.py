"""What one simulated scenario reports: :class:`PhaseResult` per save and restore, the
:class:`ScenarioResult` of a run, and the summary of a phase from what the simulated store
recorded (requests, rates on the hottest partition, SlowDowns, bytes, modelled times).
:mod:`.scenario` runs the phases; this module only turns their records into results."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ...errors import CommitError
from .adapter import RankIO
from .model import RateModel
from .store import Recorder, SimulatedStore, is_slowdown
from .world import SimWorld

__all__ = ["PhaseResult", "ScenarioResult"]


@dataclass
class PhaseResult:
    """One save or the restore, as the simulated store saw it."""

    kind: str
    step: int | None
    ok: bool
    outcome: str
    failed_ranks: int
    seeded: bool
    requests: dict[str, int]
    requests_by_phase: dict[str, dict[str, int]]
    rank0: dict[str, int]
    other_ranks_max: dict[str, int]
    other_ranks_lists: int
    data_lists: dict[str, int]
    slowdowns_injected: int
    slowdowns_absorbed: int
    slowdowns_gave_up: int
    slowdowns_by_phase: dict[str, int]
    gave_up_by_phase: dict[str, int]
    hottest: dict[str, Any]
    partitions: int
    virtual_s: float
    retention_s: float | None
    commit_thread_cpu_s: float | None
    commit_process_cpu_s: float | None
    wall_s: float
    bytes_written: int
    bytes_read: int
    rank_read_bytes_max: int
    rank_read_bytes_min: int
    rank_planned_bytes_max: int
    planned_reads: int
    planned_read_bytes: int
    threads: int
    shared_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(self.requests.values())


@dataclass
class ScenarioResult:
    options: dict[str, Any]
    saves: list[PhaseResult]
    restore: PhaseResult | None
    unique_bytes: int
    manifest_bytes: int
    manifest_shards: int
    manifest_decode_s: float
    manifest_encode_s: float
    wall_s: float
    pace_waits: int = 0
    lag_violations: int = 0
    #: distinct ``data/<x>/`` second components of the latest manifest's shard keys (1 for the
    #: old layout ``data/<step>-<attempt>/``; up to 256 with key spreading)
    key_prefixes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Probe:
    """Timings of the coordinator's commit and retention (rank 0)."""

    def __init__(self) -> None:
        self.commit_thread_cpu: float | None = None
        self.commit_process_cpu: float | None = None
        self.retain_start: float | None = None
        self.retain_end: float | None = None


def _counts(c: Any) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(c.items())}


def _hottest(rates: RateModel, t0: float, t1: float) -> tuple[dict[str, Any], int]:
    best: dict[str, Any] = {}
    ratio = -1.0
    window = rates.profile.window_s
    for scope in rates.scopes:
        peak = scope.peak_per_s(window, t0, t1)
        for kind in ("write", "read"):
            limit = rates.limit_of(scope, kind)
            r = peak[f"{kind}_offered"] / limit
            if r > ratio:
                ratio = r
                best = {
                    "scope": scope.label,
                    "kind": kind,
                    "offered_per_s": peak[f"{kind}_offered"],
                    "accepted_per_s": peak[kind],
                    "limit_per_s": limit,
                    "ratio": r,
                }
    return best, len(rates.partitions) or 1


def _summarise(
    kind: str,
    step: int | None,
    results: list[Any],
    rec: Recorder,
    io: RankIO,
    store: SimulatedStore,
    world: SimWorld,
    t0: float,
    wall: float,
    *,
    probe: _Probe | None = None,
    seeded: bool = False,
    returned: dict[int, float] | None = None,
) -> PhaseResult:
    errors = [r for r in results if isinstance(r, BaseException)]
    failed = 0
    if errors:
        err = errors[0]
        if isinstance(err, CommitError) and err.failures:
            failed = len(err.failures)
        else:
            failed = world.world_size
        outcome = f"{type(err).__name__}: {str(err)[:300]}"
        if is_slowdown(err):
            outcome = "SlowDown surfaced: " + outcome
    else:
        outcome = "committed" if kind == "save" else "restored"
    ranks = rec.ranks()
    other = [c for r, c in ranks.items() if r not in (0, None)]
    other_max: dict[str, int] = {}
    for c in other:
        for op, n in c.items():
            other_max[op] = max(other_max.get(op, 0), n)
    other_lists = sum(n for c in rec.ranks(phase="resolve").values() for op, n in c.items() if "list" in op)
    other_lists -= sum(n for op, n in rec.ops(phase="resolve", rank=0).items() if "list" in op)
    phases = sorted({ph for _, ph in rec.by})
    by_phase = {ph: _counts(rec.ops(phase=ph)) for ph in phases}
    slow_phase: dict[str, int] = {}
    for (ph, _), n in rec.slowdowns.items():
        slow_phase[ph] = slow_phase.get(ph, 0) + n
    t1 = world.now
    if returned:
        end = max(returned.values())
        if probe is not None and probe.retain_start is not None:
            end = max([probe.retain_start, *(t for r, t in returned.items() if r != 0)])
    else:
        end = t1
    hottest, partitions = _hottest(store.rates, t0, t1)
    read_bytes = list(io.read_bytes.values()) or [0]
    planned = list(io.planned_bytes.values()) or [0]
    return PhaseResult(
        kind=kind,
        step=step,
        ok=not errors,
        outcome=outcome,
        failed_ranks=failed,
        seeded=seeded,
        requests=_counts(rec.ops()),
        requests_by_phase=by_phase,
        rank0=_counts(ranks.get(0, {})),
        other_ranks_max=dict(sorted(other_max.items())),
        other_ranks_lists=other_lists,
        data_lists=_counts(rec.data_lists),
        slowdowns_injected=rec.injected,
        slowdowns_absorbed=rec.absorbed,
        slowdowns_gave_up=rec.surfaced,
        slowdowns_by_phase=slow_phase,
        gave_up_by_phase=rec.gave_up_by_phase(),
        hottest=hottest,
        partitions=partitions,
        virtual_s=end - t0,
        retention_s=(
            probe.retain_end - probe.retain_start
            if probe is not None and probe.retain_start is not None and probe.retain_end is not None
            else None
        ),
        commit_thread_cpu_s=probe.commit_thread_cpu if probe else None,
        commit_process_cpu_s=probe.commit_process_cpu if probe else None,
        wall_s=wall,
        bytes_written=sum(rec.bytes_written.values()),
        bytes_read=sum(rec.bytes_read.values()),
        rank_read_bytes_max=max(read_bytes),
        rank_read_bytes_min=min(read_bytes),
        rank_planned_bytes_max=max(planned),
        planned_reads=sum(io.planned_reads.values()),
        planned_read_bytes=sum(io.planned_bytes.values()),
        threads=world.threads,
        shared_bytes=sum(io.shared_bytes.values()),
    )
