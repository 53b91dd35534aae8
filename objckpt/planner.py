"""How often to checkpoint: Young/Daly optimal interval and the overhead/loss trade-off.

Checkpointing every ``T`` seconds of work with a save cost ``C`` (time training is blocked by a
save), a restart cost ``R`` (time from a failure until training runs again, restore included) and
a mean time between failures ``M`` costs, per unit of time:

* **overhead** ``C / T``: the fraction of time spent saving;
* **expected lost work** per failure ``T / 2 + R``: on average a failure strikes half-way through
  an interval, and then the restart is paid on top;
* **expected waste**: the two combined, as the fraction of wall time not spent on useful work,
  under exponentially distributed failures (Daly's model): a segment of ``T`` work plus its save
  takes ``M e^(R/M) (e^((T+C)/M) - 1)`` of wall time on average, so waste is ``1 - T / that``;
  to first order in ``T / M`` this is ``C / T + (T / 2 + R) / M``.

The waste is minimised by Young's interval ``sqrt(2 C M)``; Daly's higher-order refinement
(J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
FGCS 2006) is ``sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C`` for ``C < 2M``, and
``M`` otherwise.

Both assume the save is small against the MTBF (``C << M``). When the save exceeds a tenth of
the MTBF (:data:`SMALL_SAVE_RATIO`) the figures are rough and both :func:`make_plan` and
:func:`suggest_interval` carry a warning; when the optimum would be shorter than the save itself
(from about ``C > 0.7 M``) checkpointing cannot keep up: :func:`make_plan` says so in its warnings
(``Plan.infeasible``; the CLI refuses such a plan) and :func:`suggest_interval` never suggests
less than the save time (the interval is raised to it, with a warning).

Worked example (the figures the seed used): with a 12 s save, checkpointing every 20 min costs
1 % overhead and loses ~10 min of work per failure; every 5 min costs 4 % and loses ~2.5 min.

Everything here is pure arithmetic: no I/O, no torch. The checkpoint manager can call
:func:`suggest_interval` with the save times it measured to pick its own interval.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = [
    "DEFAULT_CANDIDATES",
    "SMALL_SAVE_RATIO",
    "Plan",
    "PlanRow",
    "Suggestion",
    "daly_interval",
    "evaluate",
    "format_duration",
    "make_plan",
    "parse_duration",
    "suggest_interval",
    "planning_warnings",
    "young_interval",
]

#: candidate intervals (seconds) the plan table shows besides the optimum: 5, 10, 20, 30, 60 min
DEFAULT_CANDIDATES: tuple[float, ...] = (300.0, 600.0, 1200.0, 1800.0, 3600.0)

#: Young/Daly assume save << MTBF; above this fraction of the MTBF their figures are rough
SMALL_SAVE_RATIO = 0.1

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|sec|s|min|m|hr|h|d|w)?", re.IGNORECASE)
_UNIT_SECONDS = {
    None: 1.0,
    "ms": 0.001,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
}


def parse_duration(value: str | float | int) -> float:
    """``"12s"``, ``"20m"``, ``"6h"``, ``"3d"``, ``"1.5h"``, ``"250ms"`` or a plain number of
    seconds -> seconds. Compound forms (``"1h30m"``) are accepted too.

    Raises:
        ConfigError: not a non-negative duration.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip()
        seconds = 0.0
        parts = _DURATION_PART.findall(text)
        # Accept only when the pieces spell the whole string (no stray characters).
        rebuilt = "".join(n + (u or "") for n, u in parts)
        if (
            not parts
            or rebuilt.lower() != re.sub(r"\s+", "", text).lower()
            or (len(parts) > 1 and any(not u for _, u in parts))
        ):
            raise ConfigError(f"not a duration: {value!r} (e.g. 12s, 20m, 6h, 3d or seconds)")
        for number, unit in parts:
            seconds += float(number) * _UNIT_SECONDS[unit.lower() if unit else None]
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"not a non-negative duration: {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Short human form: ``45s``, ``2.5min``, ``1.5h``, ``3.2d``."""
    if seconds == 0:
        return "0s"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 90:
        return f"{seconds:.3g}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.3g}min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.3g}h"
    return f"{seconds / 86400:.3g}d"


def _check_positive(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _check_non_negative(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum ``sqrt(2 C M)`` (seconds of work between checkpoints)."""
    c = _check_non_negative("save cost", save_seconds)
    m = _check_positive("MTBF", mtbf_seconds)
    return math.sqrt(2.0 * c * m)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum; equals ``M`` when the save costs at least ``2 M``."""
    c = _check_non_negative("save cost", save_seconds)
    m = _check_positive("MTBF", mtbf_seconds)
    if c >= 2.0 * m:
        return m
    r = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(r) / 3.0 + r / 9.0) - c


def planning_warnings(
    save_seconds: float, mtbf_seconds: float, interval_seconds: float | None = None
) -> list[str]:
    """Why a Young/Daly figure for this save and MTBF should not be trusted as is (empty: fine).

    ``interval_seconds``: the planned interval, checked against the save time.
    """
    warnings = []
    if save_seconds > SMALL_SAVE_RATIO * mtbf_seconds:
        warnings.append(
            f"the save ({format_duration(save_seconds)}) is not small against the MTBF "
            f"({format_duration(mtbf_seconds)}): more than {SMALL_SAVE_RATIO:.0%} of it; Young/Daly "
            "assume save << MTBF, so these figures are rough"
        )
    if interval_seconds is not None and interval_seconds < save_seconds:
        warnings.append(
            f"the planned interval ({format_duration(interval_seconds)}) is shorter than the save "
            f"itself ({format_duration(save_seconds)}): checkpointing cannot keep up with failures "
            "this frequent; make saves cheaper (e.g. asynchronous) or check the MTBF"
        )
    return warnings


@dataclass(frozen=True)
class PlanRow:
    """One candidate interval and what it costs.

    Attributes:
        interval_s: seconds of training between checkpoints.
        every_steps: the interval in optimizer steps (rounded, at least 1) when a step time is
            known, else ``None``.
        overhead: ``save / interval`` (fraction of time spent saving).
        expected_loss_s: ``interval / 2 + restart``: expected work lost per failure, in seconds.
        expected_waste: fraction of wall time lost to saving and failures together (Daly's
            exponential-failure model; about ``overhead + expected_loss / MTBF``).
        label: ``"young"``, ``"daly"`` or ``""`` for a plain candidate.
    """

    interval_s: float
    every_steps: int | None
    overhead: float
    expected_loss_s: float
    expected_waste: float
    label: str = ""


def evaluate(
    interval_seconds: float,
    *,
    save_seconds: float,
    mtbf_seconds: float,
    restart_seconds: float = 0.0,
    step_seconds: float | None = None,
    label: str = "",
) -> PlanRow:
    """Cost of checkpointing every ``interval_seconds`` (see the module docstring for formulas).

    When ``step_seconds`` is given the interval is rounded to whole steps and the row's figures
    are computed for that rounded interval, since that is what a trainer can actually do.
    """
    t = _check_positive("interval", interval_seconds)
    c = _check_non_negative("save cost", save_seconds)
    m = _check_positive("MTBF", mtbf_seconds)
    r = _check_non_negative("restart cost", restart_seconds)
    steps = None
    if step_seconds is not None:
        s = _check_positive("step time", step_seconds)
        steps = max(1, round(t / s))
        t = steps * s
    loss = t / 2.0 + r
    try:
        wall = m * math.exp(r / m) * math.expm1((t + c) / m)
        waste = 1.0 - t / wall
    except OverflowError:  # intervals far beyond the MTBF: essentially nothing gets done
        waste = 1.0
    return PlanRow(
        interval_s=t,
        every_steps=steps,
        overhead=c / t,
        expected_loss_s=loss,
        expected_waste=waste,
        label=label,
    )


@dataclass(frozen=True)
class Plan:
    """Inputs, both optima and the candidate table (sorted by interval)."""

    save_s: float
    mtbf_s: float
    restart_s: float
    step_s: float | None
    young_s: float
    daly_s: float
    rows: list[PlanRow] = field(default_factory=list)
    #: see :func:`planning_warnings`
    warnings: tuple[str, ...] = ()

    @property
    def optimum(self) -> PlanRow:
        """The Daly row (the recommended interval)."""
        return next(r for r in self.rows if r.label == "daly")

    @property
    def infeasible(self) -> bool:
        """The optimum is shorter than the save: no interval keeps up with the failures."""
        return self.optimum.interval_s < self.save_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "save_seconds": self.save_s,
            "mtbf_seconds": self.mtbf_s,
            "restart_seconds": self.restart_s,
            "step_seconds": self.step_s,
            "young_interval_seconds": self.young_s,
            "daly_interval_seconds": self.daly_s,
            "recommended_interval_seconds": self.optimum.interval_s,
            "recommended_every_steps": self.optimum.every_steps,
            "rows": [asdict(r) for r in self.rows],
            "warnings": list(self.warnings),
            "infeasible": self.infeasible,
        }


def make_plan(
    save_seconds: float,
    mtbf_seconds: float,
    *,
    restart_seconds: float = 0.0,
    step_seconds: float | None = None,
    candidates: Iterable[float] = DEFAULT_CANDIDATES,
) -> Plan:
    """The candidate table plus the Young and Daly optima.

    Raises:
        ConfigError: a non-positive MTBF or interval, or a negative cost.
    """
    young = young_interval(save_seconds, mtbf_seconds)
    daly = daly_interval(save_seconds, mtbf_seconds)
    common = dict(
        save_seconds=save_seconds,
        mtbf_seconds=mtbf_seconds,
        restart_seconds=restart_seconds,
        step_seconds=step_seconds,
    )
    rows = [evaluate(t, **common) for t in candidates]  # type: ignore[arg-type]
    if young > 0:
        rows.append(evaluate(young, label="young", **common))  # type: ignore[arg-type]
    # A zero save cost makes any interval free; fall back to one step (or one second).
    rows.append(evaluate(daly if daly > 0 else (step_seconds or 1.0), label="daly", **common))  # type: ignore[arg-type]
    rows.sort(key=lambda r: (r.interval_s, r.label))
    optimum = next(r for r in rows if r.label == "daly")
    return Plan(
        save_s=float(save_seconds),
        mtbf_s=float(mtbf_seconds),
        restart_s=float(restart_seconds),
        step_s=None if step_seconds is None else float(step_seconds),
        young_s=young,
        daly_s=daly,
        rows=rows,
        warnings=tuple(planning_warnings(save_seconds, mtbf_seconds, optimum.interval_s)),
    )


@dataclass(frozen=True)
class Suggestion:
    """What :func:`suggest_interval` recommends.

    Attributes:
        interval_s: seconds of training between checkpoints.
        every_steps: the same in steps (when a step time was given).
        save_s: the save cost the suggestion assumed (from the measurements).
        row: the full cost figures of the suggested interval.
        reason: one line saying how the interval was chosen (for logs).
        warnings: why the figures should not be trusted as is (see :func:`planning_warnings`);
            when the optimum was shorter than the save, the interval was raised to the save.
    """

    interval_s: float
    every_steps: int | None
    save_s: float
    row: PlanRow
    reason: str
    warnings: tuple[str, ...] = ()


def suggest_interval(
    save_seconds: float | Sequence[float],
    mtbf_seconds: float,
    *,
    restart_seconds: float = 0.0,
    step_seconds: float | None = None,
    min_interval_seconds: float = 0.0,
    max_interval_seconds: float | None = None,
    max_overhead: float | None = None,
) -> Suggestion:
    """Suggest a checkpoint interval from measured save times (Daly's optimum, then clamped).

    Args:
        save_seconds: one save cost, or the blocking durations of recent saves; several
            measurements are summarised by their median so one slow outlier (a cold
            connection pool, a throttled request) does not move the interval.
        mtbf_seconds: mean time between failures of the whole job (``node MTBF / nodes``).
        restart_seconds: time from a failure until training runs again.
        step_seconds: time of one optimizer step; rounds the interval to whole steps.
        min_interval_seconds / max_interval_seconds: hard bounds (e.g. an SLO on lost work).
        max_overhead: if given, lengthen the interval until ``save / interval <= max_overhead``.

    The interval is never below the save time (checkpointing could not keep up): it is raised to
    the save, and ``warnings`` says so; a save over a tenth of the MTBF also warns.

    Raises:
        ConfigError: no measurements, or a non-positive MTBF / negative cost.
    """
    if isinstance(save_seconds, (int, float)) and not isinstance(save_seconds, bool):
        save = float(save_seconds)
    else:
        measured = [float(s) for s in save_seconds]  # type: ignore[union-attr]
        if not measured:
            raise ConfigError("suggest_interval needs at least one measured save time")
        save = statistics.median(measured)
    daly = daly_interval(save, mtbf_seconds)
    interval = daly if daly > 0 else (step_seconds or 1.0)
    reason = f"Daly optimum for save {format_duration(save)}, MTBF {format_duration(mtbf_seconds)}"
    if max_overhead is not None:
        if not 0 < max_overhead <= 1:
            raise ConfigError(f"max_overhead must be in (0, 1], got {max_overhead!r}")
        if save / interval > max_overhead:
            interval = save / max_overhead
            reason += f"; lengthened to keep overhead <= {max_overhead:.1%}"
    if interval < min_interval_seconds:
        interval = float(min_interval_seconds)
        reason += f"; raised to the minimum {format_duration(interval)}"
    if max_interval_seconds is not None and interval > max_interval_seconds:
        interval = float(max_interval_seconds)
        reason += f"; capped at the maximum {format_duration(interval)}"
    warnings = planning_warnings(save, mtbf_seconds, interval)
    if interval < save:
        interval = save
        reason += f"; raised to the save time {format_duration(save)} (the interval cannot be shorter)"
    row = evaluate(
        interval,
        save_seconds=save,
        mtbf_seconds=mtbf_seconds,
        restart_seconds=restart_seconds,
        step_seconds=step_seconds,
        label="suggested",
    )
    if row.interval_s < save and step_seconds:  # rounding to whole steps went below the save
        row = evaluate(
            math.ceil(save / step_seconds) * step_seconds,
            save_seconds=save,
            mtbf_seconds=mtbf_seconds,
            restart_seconds=restart_seconds,
            step_seconds=step_seconds,
            label="suggested",
        )
    return Suggestion(row.interval_s, row.every_steps, save, row, reason, tuple(warnings))
