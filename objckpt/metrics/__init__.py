"""Checkpoint metrics and monitoring (torch-free).

Three pieces, usable separately:

* :class:`CheckpointMetrics` records what happened: the last committed step and attempt id,
  save / upload / commit durations, bytes and throughput, time since the last committed
  checkpoint, **work at risk** (steps trained since it x step time), validation failures, store
  retries (via ``store.add_retry_listener``), restarts and restores. It is thread-safe (retry
  listeners fire from upload threads) and takes injectable clocks so tests never sleep.
* Callbacks (:class:`MetricsCallback`): every recorded event is handed to each callback's
  ``on_<event>`` method. :class:`JsonLogCallback` writes one structured JSON line per event
  through :mod:`logging`; write your own by overriding the methods of :class:`BaseMetricsCallback`.
* :class:`PrometheusExporter` exposes the recorder's state through ``prometheus-client`` (an
  optional dependency): an HTTP endpoint, a node-exporter textfile, or a registry of your own.
  Values are computed at scrape time, so "seconds since last commit" keeps growing while
  nothing commits, which is exactly what an alert needs.

Typical use::

    metrics = CheckpointMetrics(run="s3://bucket/runs/eta", callbacks=[JsonLogCallback()])
    metrics.watch_store(store)
    with metrics.track_save(step, attempt) as save:
        with save.phase("upload"):
            receipts = writer.write("model.pt", data)
            save.add_bytes(receipts.size)
        with save.phase("commit"):
            manifest = coordinator.commit(...)
    ...
    metrics.observe_step(step, seconds=step_time)   # every step: feeds work-at-risk

A callback that raises is logged and ignored: monitoring must never fail a save.

The events and callbacks live in :mod:`.events`, the exporter in :mod:`.prometheus`; every name
is importable from here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .events import (
    BaseMetricsCallback,
    CommitEvent,
    FailureEvent,
    JsonLogCallback,
    MetricsCallback,
    MetricsEvent,
    MirrorEvent,
    RestartEvent,
    RestoreEvent,
    RetryEvent,
    SaveStartEvent,
    ValidationFailureEvent,
)
from .prometheus import PrometheusExporter

__all__ = [
    "BaseMetricsCallback",
    "CheckpointMetrics",
    "CommitEvent",
    "FailureEvent",
    "JsonLogCallback",
    "MetricsCallback",
    "MetricsEvent",
    "MirrorEvent",
    "PrometheusExporter",
    "RestartEvent",
    "RestoreEvent",
    "RetryEvent",
    "SaveStartEvent",
    "SaveTracker",
    "ValidationFailureEvent",
]

log = logging.getLogger("objckpt.metrics")


# -------------------------------------------------------------------------------------- recorder


@dataclass
class _PhaseStats:
    count: int = 0
    total: float = 0.0
    last: float | None = None

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        self.last = seconds


@dataclass
class _State:
    last_step: int | None = None
    last_attempt: str | None = None
    last_commit_time: float | None = None
    last_bytes: int | None = None
    last_throughput: float | None = None
    saving_step: int | None = None
    saving_attempt: str | None = None
    current_step: int | None = None
    step_seconds: float | None = None
    bytes_total: int = 0
    commits: int = 0
    failures: int = 0
    validation_failures: int = 0
    retries: int = 0
    restarts: int = 0
    restores: int = 0
    last_restored_step: int | None = None
    mirrored_step: int | None = None
    mirror_lag: float | None = None  # of the last replication
    mirror_pending_step: int | None = None
    mirror_pending_since: float | None = None  # commit time of the oldest unmirrored commit
    mirrored: int = 0
    restores_from_mirror: int = 0
    mirror_failures: int = 0
    mirror_skipped: int = 0
    phases: dict[str, _PhaseStats] = field(default_factory=dict)


class CheckpointMetrics:
    """Thread-safe recorder of checkpoint events; fans each event out to the callbacks.

    Args:
        run: a label for the run (e.g. its run root URI; never a URI with credentials in it).
        callbacks: :class:`MetricsCallback` objects.
        step_seconds: the step time to assume for work at risk until :meth:`observe_step`
            measures one.
        clock: wall clock (epoch seconds) for event times and ages; ``monotonic``: for durations.
            Injectable so tests control time without sleeping.
        ema: weight of a new step-time measurement in the running estimate.
    """

    def __init__(
        self,
        *,
        run: str = "",
        callbacks: Iterable[MetricsCallback] = (),
        step_seconds: float | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        ema: float = 0.1,
    ) -> None:
        if not 0 < ema <= 1:
            raise ConfigError(f"ema must be in (0, 1], got {ema!r}")
        self.run = run
        self.callbacks: list[MetricsCallback] = list(callbacks)
        self.clock = clock
        self.monotonic = monotonic
        self.ema = ema
        self._lock = threading.Lock()
        self._state = _State(step_seconds=step_seconds)

    # -- wiring

    def add_callback(self, callback: MetricsCallback) -> None:
        self.callbacks.append(callback)

    def watch_store(self, store: Any) -> None:
        """Count every retry the store's retry policy makes (``store.add_retry_listener``)."""
        store.add_retry_listener(self.record_retry)

    def _dispatch(self, method: str, event: MetricsEvent) -> None:
        for cb in list(self.callbacks):
            fn = getattr(cb, method, None)
            if fn is None:
                continue
            try:
                fn(event)
            except Exception:  # monitoring must never fail a save or a restore
                log.exception("metrics callback %r failed in %s", cb, method)

    # -- recording

    def record_save_start(self, step: int, attempt: str) -> None:
        with self._lock:
            self._state.saving_step = step
            self._state.saving_attempt = attempt
        self._dispatch("on_save_start", SaveStartEvent(self.clock(), self.run, step, attempt))

    def record_commit(
        self,
        step: int,
        attempt: str,
        *,
        bytes: int = 0,  # noqa: A002 - reads naturally at call sites
        save_seconds: float | None = None,
        blocking_seconds: float | None = None,
        upload_seconds: float | None = None,
        commit_seconds: float | None = None,
    ) -> CommitEvent:
        """A checkpoint was committed (its manifest exists). Returns the event."""
        transfer = upload_seconds if upload_seconds is not None else save_seconds
        throughput = bytes / transfer if bytes and transfer else None
        now = self.clock()
        with self._lock:
            s = self._state
            s.last_step, s.last_attempt, s.last_commit_time = step, attempt, now
            s.last_bytes, s.last_throughput = bytes, throughput
            s.bytes_total += bytes
            s.commits += 1
            if s.saving_step == step:
                s.saving_step = s.saving_attempt = None
            for name, value in (
                ("save", save_seconds),
                ("blocking", blocking_seconds if blocking_seconds is not None else save_seconds),
                ("upload", upload_seconds),
                ("commit", commit_seconds),
            ):
                if value is not None:
                    s.phases.setdefault(name, _PhaseStats()).add(value)
        event = CommitEvent(
            now,
            self.run,
            step,
            attempt,
            bytes,
            save_seconds,
            blocking_seconds if blocking_seconds is not None else save_seconds,
            upload_seconds,
            commit_seconds,
            throughput,
        )
        self._dispatch("on_commit", event)
        return event

    def record_failure(
        self, step: int, attempt: str, error: BaseException | str, *, phase: str = "save"
    ) -> None:
        """A save did not commit (the previous checkpoint is still the latest)."""
        with self._lock:
            self._state.failures += 1
            if self._state.saving_step == step:
                self._state.saving_step = self._state.saving_attempt = None
        etype = type(error).__name__ if isinstance(error, BaseException) else "Error"
        self._dispatch(
            "on_failure", FailureEvent(self.clock(), self.run, step, attempt, phase, etype, str(error))
        )

    def record_restore(
        self,
        step: int,
        attempt: str,
        *,
        seconds: float | None = None,
        bytes: int | None = None,  # noqa: A002
        fell_back_from: int | None = None,
        source: str = "primary",
    ) -> None:
        """Training resumed from ``step``; ``fell_back_from`` names a newer step that was rejected."""
        with self._lock:
            s = self._state
            s.restores += 1
            if source != "primary":
                s.restores_from_mirror += 1
            s.last_restored_step = step
            s.current_step = step
            # The restored checkpoint is the one at risk-free baseline from now on.
            if s.last_step is None or step >= s.last_step:
                s.last_step, s.last_attempt = step, attempt
            if s.last_commit_time is None:
                s.last_commit_time = self.clock()
            if seconds is not None:
                s.phases.setdefault("restore", _PhaseStats()).add(seconds)
        self._dispatch(
            "on_restore",
            RestoreEvent(self.clock(), self.run, step, attempt, seconds, bytes, fell_back_from, source),
        )

    def record_validation_failure(self, reason: str, *, step: int | None = None, key: str = "") -> None:
        """A manifest or shard failed validation (bad checksum, schema, key outside the root)."""
        with self._lock:
            self._state.validation_failures += 1
        self._dispatch(
            "on_validation_failure", ValidationFailureEvent(self.clock(), self.run, step, reason, key)
        )

    def record_retry(self, error: BaseException, attempt: int) -> None:
        """A store request is being retried; signature matches ``Store.add_retry_listener``."""
        with self._lock:
            self._state.retries += 1
        self._dispatch(
            "on_retry", RetryEvent(self.clock(), self.run, type(error).__name__, str(error), attempt)
        )

    def record_restart(self, *, step: int | None = None, reason: str = "") -> None:
        """The job (re)started; ``step`` is the step it resumes from, if any."""
        with self._lock:
            self._state.restarts += 1
        self._dispatch("on_restart", RestartEvent(self.clock(), self.run, step, reason))

    def record_mirror_pending(self, step: int, committed_at: float) -> None:
        """Checkpoint ``step`` (committed at epoch ``committed_at``) waits for the mirror."""
        with self._lock:
            s = self._state
            s.mirror_pending_step = step
            if s.mirror_pending_since is None or committed_at < s.mirror_pending_since:
                s.mirror_pending_since = committed_at

    def record_mirror(self, step: int, *, lag_seconds: float, bytes: int = 0) -> None:  # noqa: A002
        """Checkpoint ``step`` is on the mirror, ``lag_seconds`` after its primary commit."""
        with self._lock:
            s = self._state
            s.mirrored_step, s.mirror_lag = step, lag_seconds
            s.mirrored += 1
            if s.mirror_pending_step is None or s.mirror_pending_step <= step:
                s.mirror_pending_step = s.mirror_pending_since = None
        self._dispatch("on_mirror", MirrorEvent(self.clock(), self.run, step, lag_seconds, bytes))

    def record_mirror_failure(self, step: int, error: BaseException | str) -> None:
        """Replicating ``step`` to the mirror failed (it stays pending for the lag)."""
        with self._lock:
            self._state.mirror_failures += 1
        etype = type(error).__name__ if isinstance(error, BaseException) else "Error"
        self._dispatch(
            "on_failure", FailureEvent(self.clock(), self.run, step, "", "mirror", etype, str(error))
        )

    def record_mirror_skipped(self, step: int) -> None:
        """``step`` was replaced by a newer commit before the mirror copied it."""
        with self._lock:
            self._state.mirror_skipped += 1

    def mirror_lag(self) -> float | None:
        """Replication lag in seconds: how long the oldest commit not yet on the mirror has been
        waiting (growing until the mirror catches up), else the last replication's lag;
        ``None`` before anything was mirrored or queued."""
        with self._lock:
            s = self._state
            if s.mirror_pending_since is not None:
                return max(0.0, self.clock() - s.mirror_pending_since, s.mirror_lag or 0.0)
            return s.mirror_lag

    def observe_step(self, step: int, *, seconds: float | None = None) -> None:
        """Training reached ``step``; ``seconds`` is that step's duration (updates the estimate)."""
        with self._lock:
            s = self._state
            s.current_step = step
            if seconds is not None and seconds >= 0:
                s.step_seconds = (
                    seconds
                    if s.step_seconds is None
                    else (1 - self.ema) * s.step_seconds + self.ema * seconds
                )

    @contextmanager
    def track_save(self, step: int, attempt: str) -> Iterator[SaveTracker]:
        """Time one save. Normal exit records a commit; an exception records a failure (naming
        the phase it happened in) and propagates."""
        tracker = SaveTracker(self, step, attempt)
        self.record_save_start(step, attempt)
        try:
            yield tracker
        except BaseException as exc:
            self.record_failure(step, attempt, exc, phase=tracker.current_phase or "save")
            raise
        tracker._finish()

    # -- derived values

    def time_since_last_commit(self) -> float | None:
        """Seconds since the last committed (or restored) checkpoint; ``None`` before any."""
        with self._lock:
            t = self._state.last_commit_time
        return None if t is None else max(0.0, self.clock() - t)

    def work_at_risk(self) -> tuple[int | None, float | None]:
        """``(steps, seconds)`` trained since the last committed checkpoint: what a failure now
        would lose. Seconds need a step time (``observe_step(seconds=)`` or ``step_seconds``)."""
        with self._lock:
            s = self._state
            if s.current_step is None:
                return None, None
            steps = s.current_step - (s.last_step if s.last_step is not None else 0)
            steps = max(0, steps)
            return steps, (steps * s.step_seconds if s.step_seconds is not None else None)

    def snapshot(self) -> dict[str, Any]:
        """Every recorded value as a JSON-serialisable dict."""
        since = self.time_since_last_commit()
        risk_steps, risk_seconds = self.work_at_risk()
        lag = self.mirror_lag()
        with self._lock:
            s = self._state
            return {
                "run": self.run,
                "last_committed_step": s.last_step,
                "last_committed_attempt": s.last_attempt,
                "last_commit_time": s.last_commit_time,
                "seconds_since_last_commit": since,
                "saving_step": s.saving_step,
                "current_step": s.current_step,
                "step_seconds": s.step_seconds,
                "work_at_risk_steps": risk_steps,
                "work_at_risk_seconds": risk_seconds,
                "last_save_bytes": s.last_bytes,
                "last_throughput_bytes_per_second": s.last_throughput,
                "bytes_total": s.bytes_total,
                "commits": s.commits,
                "failures": s.failures,
                "validation_failures": s.validation_failures,
                "retries": s.retries,
                "restarts": s.restarts,
                "restores": s.restores,
                "last_restored_step": s.last_restored_step,
                "mirror_lag_seconds": lag,
                "mirrored_step": s.mirrored_step,
                "mirror_pending_step": s.mirror_pending_step,
                "mirrored": s.mirrored,
                "restores_from_mirror": s.restores_from_mirror,
                "mirror_failures": s.mirror_failures,
                "mirror_skipped": s.mirror_skipped,
                "phases": {
                    name: {"count": p.count, "total_seconds": p.total, "last_seconds": p.last}
                    for name, p in sorted(s.phases.items())
                },
            }


class SaveTracker:
    """Handed out by :meth:`CheckpointMetrics.track_save`; times phases and counts bytes."""

    def __init__(self, metrics: CheckpointMetrics, step: int, attempt: str) -> None:
        self.metrics = metrics
        self.step = step
        self.attempt = attempt
        self.bytes = 0
        self.current_phase: str | None = None
        self.durations: dict[str, float] = {}
        self._start = metrics.monotonic()
        self._unblocked: float | None = None

    def add_bytes(self, n: int) -> None:
        self.bytes += int(n)

    def unblocked(self) -> None:
        """Training may continue from here (async save): ends the blocking part of the save."""
        self._unblocked = self.metrics.monotonic() - self._start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (``"upload"``, ``"commit"``, ...); repeated phases add up."""
        previous, self.current_phase = self.current_phase, name
        t0 = self.metrics.monotonic()
        try:
            yield
        finally:
            self.durations[name] = self.durations.get(name, 0.0) + self.metrics.monotonic() - t0
        self.current_phase = previous

    def _finish(self) -> CommitEvent:
        total = self.metrics.monotonic() - self._start
        return self.metrics.record_commit(
            self.step,
            self.attempt,
            bytes=self.bytes,
            save_seconds=total,
            blocking_seconds=self._unblocked if self._unblocked is not None else total,
            upload_seconds=self.durations.get("upload"),
            commit_seconds=self.durations.get("commit"),
        )
