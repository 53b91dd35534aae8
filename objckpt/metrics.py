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
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError

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


# ---------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class MetricsEvent:
    """Base of every event: when it happened (epoch seconds) and the run it concerns."""

    time: float
    run: str

    kind = "event"

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.kind, **asdict(self)}


@dataclass(frozen=True)
class SaveStartEvent(MetricsEvent):
    step: int
    attempt: str
    kind = "save_start"


@dataclass(frozen=True)
class CommitEvent(MetricsEvent):
    """A checkpoint was committed. Durations are ``None`` when that phase was not timed.

    ``save_seconds`` is the whole save (start to commit); ``blocking_seconds`` the part training
    was blocked for (equal to the whole save unless the save was marked unblocked earlier).
    """

    step: int
    attempt: str
    bytes: int
    save_seconds: float | None = None
    blocking_seconds: float | None = None
    upload_seconds: float | None = None
    commit_seconds: float | None = None
    throughput_bytes_per_second: float | None = None
    kind = "commit"


@dataclass(frozen=True)
class FailureEvent(MetricsEvent):
    step: int
    attempt: str
    phase: str
    error_type: str
    error: str
    kind = "failure"


@dataclass(frozen=True)
class RestoreEvent(MetricsEvent):
    step: int
    attempt: str
    seconds: float | None = None
    bytes: int | None = None
    fell_back_from: int | None = None
    #: "primary", or "mirror" when the checkpoint was read from the mirror run root
    source: str = "primary"
    kind = "restore"


@dataclass(frozen=True)
class ValidationFailureEvent(MetricsEvent):
    step: int | None
    reason: str
    key: str = ""
    kind = "validation_failure"


@dataclass(frozen=True)
class RetryEvent(MetricsEvent):
    error_type: str
    error: str
    attempt: int
    kind = "retry"


@dataclass(frozen=True)
class MirrorEvent(MetricsEvent):
    """A committed checkpoint was replicated to the mirror run root (``mirror=``);
    ``lag_seconds``: from the primary's commit to the mirror's."""

    step: int
    lag_seconds: float
    bytes: int = 0
    kind = "mirror"


@dataclass(frozen=True)
class RestartEvent(MetricsEvent):
    step: int | None
    reason: str = ""
    kind = "restart"


# ------------------------------------------------------------------------------------- callbacks


@runtime_checkable
class MetricsCallback(Protocol):
    """What :class:`CheckpointMetrics` calls. Implement any subset: missing methods are skipped."""

    def on_save_start(self, event: SaveStartEvent) -> None: ...
    def on_commit(self, event: CommitEvent) -> None: ...
    def on_failure(self, event: FailureEvent) -> None: ...
    def on_restore(self, event: RestoreEvent) -> None: ...
    def on_validation_failure(self, event: ValidationFailureEvent) -> None: ...
    def on_retry(self, event: RetryEvent) -> None: ...
    def on_restart(self, event: RestartEvent) -> None: ...
    def on_mirror(self, event: MirrorEvent) -> None: ...


class BaseMetricsCallback:
    """No-op implementation of every hook; subclass and override what you need."""

    def on_save_start(self, event: SaveStartEvent) -> None:
        pass

    def on_commit(self, event: CommitEvent) -> None:
        pass

    def on_failure(self, event: FailureEvent) -> None:
        pass

    def on_restore(self, event: RestoreEvent) -> None:
        pass

    def on_validation_failure(self, event: ValidationFailureEvent) -> None:
        pass

    def on_retry(self, event: RetryEvent) -> None:
        pass

    def on_restart(self, event: RestartEvent) -> None:
        pass

    def on_mirror(self, event: MirrorEvent) -> None:
        pass


class JsonLogCallback(BaseMetricsCallback):
    """One JSON object per event, logged at ``level`` on ``logger`` (``objckpt.metrics``).

    Lines look like ``{"event": "commit", "time": 1718000000.0, "run": "s3://b/r", "step": 20,
    ...}``: machine-parseable by any log pipeline, no extra dependency. Failures and validation
    failures are logged at WARNING whatever ``level`` is, so they stand out.
    """

    def __init__(self, logger: logging.Logger | str | None = None, level: int = logging.INFO) -> None:
        if isinstance(logger, str):
            logger = logging.getLogger(logger)
        self.logger = logger or log
        self.level = level

    def _emit(self, event: MetricsEvent, level: int | None = None) -> None:
        self.logger.log(level or self.level, json.dumps(event.to_dict(), sort_keys=True, default=str))

    on_save_start = on_commit = on_restore = on_retry = on_restart = _emit

    def on_failure(self, event: FailureEvent) -> None:
        self._emit(event, logging.WARNING)

    def on_validation_failure(self, event: ValidationFailureEvent) -> None:
        self._emit(event, logging.WARNING)


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


# ------------------------------------------------------------------------------------ prometheus


def _require_prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigError(
            "Prometheus export needs prometheus-client: pip install 'objckpt[metrics]' "
            "(or pip install prometheus-client)"
        ) from exc
    return prometheus_client


class PrometheusExporter:
    """Exposes a :class:`CheckpointMetrics` to Prometheus (needs ``prometheus-client``).

    The values are read from the recorder at collection time (a custom collector), so there is
    no double bookkeeping and ages are always current. Metric names (prefix ``namespace``)::

        objckpt_last_committed_step                 gauge
        objckpt_last_commit_timestamp_seconds       gauge
        objckpt_seconds_since_last_commit           gauge
        objckpt_work_at_risk_steps / _seconds       gauge
        objckpt_step_seconds                        gauge (running estimate)
        objckpt_last_save_bytes                     gauge
        objckpt_last_upload_throughput_bytes_per_second gauge
        objckpt_last_phase_seconds{phase=...}       gauge (save, blocking, upload, commit, restore)
        objckpt_phase_seconds{phase=...}            summary (_count, _sum)
        objckpt_saved_bytes_total, objckpt_commits_total, objckpt_save_failures_total,
        objckpt_validation_failures_total, objckpt_store_retries_total, objckpt_restarts_total,
        objckpt_restores_total                      counters
        objckpt_last_committed_info{attempt=...}    gauge = 1

    Every series carries ``labels`` (e.g. ``{"run": "eta"}``) as constant labels.

    Raises:
        ConfigError: ``prometheus-client`` is not installed.
    """

    def __init__(
        self,
        metrics: CheckpointMetrics,
        *,
        registry: Any = None,
        namespace: str = "objckpt",
        labels: dict[str, str] | None = None,
    ) -> None:
        prom = _require_prometheus()
        self.metrics = metrics
        self.namespace = namespace
        self.labels = dict(labels or {})
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        self._server: Any = None
        self.registry.register(self)

    # prometheus_client's Collector protocol
    def describe(self) -> list[Any]:
        return []  # unchecked collector: names are static but values come and go

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            SummaryMetricFamily,
        )

        snap = self.metrics.snapshot()
        ns = self.namespace
        keys = list(self.labels)
        vals = [self.labels[k] for k in keys]

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Any]:
            if value is not None:
                g = GaugeMetricFamily(f"{ns}_{name}", doc, labels=keys)
                g.add_metric(vals, float(value))
                yield g

        def counter(name: str, doc: str, value: float) -> Any:
            c = CounterMetricFamily(f"{ns}_{name}", doc, labels=keys)
            c.add_metric(vals, float(value))
            return c

        yield from gauge(
            "last_committed_step", "Step of the last committed checkpoint.", snap["last_committed_step"]
        )
        yield from gauge(
            "last_commit_timestamp_seconds",
            "Unix time of the last commit (or restore).",
            snap["last_commit_time"],
        )
        yield from gauge(
            "seconds_since_last_commit",
            "Seconds since the last committed checkpoint.",
            snap["seconds_since_last_commit"],
        )
        yield from gauge(
            "work_at_risk_steps",
            "Steps trained since the last committed checkpoint.",
            snap["work_at_risk_steps"],
        )
        yield from gauge(
            "work_at_risk_seconds", "Training seconds a failure now would lose.", snap["work_at_risk_seconds"]
        )
        yield from gauge(
            "step_seconds", "Running estimate of one training step's duration.", snap["step_seconds"]
        )
        yield from gauge(
            "mirror_lag_seconds",
            "Seconds the oldest commit not yet on the mirror has waited (else the last replication's lag).",
            snap["mirror_lag_seconds"],
        )
        yield from gauge(
            "mirrored_step", "Step of the newest checkpoint on the mirror.", snap["mirrored_step"]
        )
        yield from gauge(
            "last_save_bytes", "Bytes written by the last committed save.", snap["last_save_bytes"]
        )
        yield from gauge(
            "last_upload_throughput_bytes_per_second",
            "Upload throughput of the last committed save.",
            snap["last_throughput_bytes_per_second"],
        )
        if snap["phases"]:
            last = GaugeMetricFamily(
                f"{ns}_last_phase_seconds",
                "Duration of the last save/upload/commit/restore.",
                labels=keys + ["phase"],
            )
            summary = SummaryMetricFamily(
                f"{ns}_phase_seconds",
                "Durations of save/upload/commit/restore phases.",
                labels=keys + ["phase"],
            )
            for name, p in snap["phases"].items():
                if p["last_seconds"] is not None:
                    last.add_metric(vals + [name], p["last_seconds"])
                summary.add_metric(vals + [name], count_value=p["count"], sum_value=p["total_seconds"])
            yield last
            yield summary
        yield counter("saved_bytes", "Bytes written by committed saves.", snap["bytes_total"])
        yield counter("commits", "Committed checkpoints.", snap["commits"])
        yield counter("save_failures", "Saves that did not commit.", snap["failures"])
        yield counter(
            "validation_failures", "Manifests or shards that failed validation.", snap["validation_failures"]
        )
        yield counter("store_retries", "Store requests retried after transient errors.", snap["retries"])
        yield counter("restarts", "Job restarts.", snap["restarts"])
        yield counter("restores", "Restores from a checkpoint.", snap["restores"])
        yield counter("mirrored", "Checkpoints replicated to the mirror.", snap["mirrored"])
        yield counter("mirror_failures", "Replications to the mirror that failed.", snap["mirror_failures"])
        if snap["last_committed_attempt"] is not None:
            info = GaugeMetricFamily(
                f"{ns}_last_committed_info",
                "Attempt id of the last committed checkpoint.",
                labels=keys + ["attempt"],
            )
            info.add_metric(vals + [snap["last_committed_attempt"]], 1.0)
            yield info

    def render(self) -> bytes:
        """The exposition text, as a scrape would return it."""
        text: bytes = _require_prometheus().generate_latest(self.registry)
        return text

    def write_textfile(self, path: str | os.PathLike[str]) -> None:
        """Write the exposition text for node-exporter's textfile collector.

        Atomic: written to a temporary file in the same directory, then renamed over ``path``,
        so the collector never reads a half-written file.
        """
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".objckpt-metrics-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.render())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def start_http_server(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` from a daemon thread; returns the bound port (``port=0``: any).

        Binds to localhost by default: exposing metrics beyond the host is a deliberate choice.
        """
        prom = _require_prometheus()
        server, _thread = prom.start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return int(server.server_address[1])

    def stop_http_server(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
