"""objckpt.metrics: recorder, callbacks, JSON log lines, Prometheus export. No sleeps: the
recorder's clocks are injected."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest

from objckpt.errors import TransientError
from objckpt.metrics import (
    BaseMetricsCallback,
    CheckpointMetrics,
    JsonLogCallback,
    MetricsCallback,
    PrometheusExporter,
)
from objckpt.store import PutMode, open_store


class FakeClock:
    def __init__(self, t: float = 1_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class Recorder(BaseMetricsCallback):
    def __init__(self) -> None:
        self.events = []

    def on_save_start(self, e):
        self.events.append(e)

    def on_commit(self, e):
        self.events.append(e)

    def on_failure(self, e):
        self.events.append(e)

    def on_retry(self, e):
        self.events.append(e)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def metrics(clock):
    return CheckpointMetrics(run="memory://t", clock=clock, monotonic=clock)


def test_track_save_records_phases_bytes_throughput(metrics, clock):
    rec = Recorder()
    metrics.add_callback(rec)
    with metrics.track_save(10, "a" * 16) as save:
        with save.phase("upload"):
            clock.advance(4)
            save.add_bytes(4000)
        with save.phase("commit"):
            clock.advance(1)
    snap = metrics.snapshot()
    assert snap["last_committed_step"] == 10
    assert snap["last_committed_attempt"] == "a" * 16
    assert snap["last_save_bytes"] == 4000
    assert snap["last_throughput_bytes_per_second"] == pytest.approx(1000)
    assert snap["phases"]["upload"]["last_seconds"] == pytest.approx(4)
    assert snap["phases"]["commit"]["last_seconds"] == pytest.approx(1)
    assert snap["phases"]["save"]["last_seconds"] == pytest.approx(5)
    assert [e.kind for e in rec.events] == ["save_start", "commit"]
    assert rec.events[1].commit_seconds == pytest.approx(1)


def test_failed_save_names_phase_and_keeps_last_commit(metrics, clock):
    metrics.record_commit(5, "a" * 16, bytes=10)
    rec = Recorder()
    metrics.add_callback(rec)
    with pytest.raises(RuntimeError, match="boom"):
        with metrics.track_save(10, "b" * 16) as save:
            with save.phase("commit"):
                raise RuntimeError("boom")
    snap = metrics.snapshot()
    assert snap["failures"] == 1
    assert snap["last_committed_step"] == 5
    failure = rec.events[-1]
    assert (failure.kind, failure.phase, failure.error_type, failure.error) == (
        "failure",
        "commit",
        "RuntimeError",
        "boom",
    )


def test_unblocked_marks_blocking_part_of_async_save(metrics, clock):
    with metrics.track_save(1, "a" * 16) as save:
        clock.advance(2)
        save.unblocked()
        clock.advance(8)
    phases = metrics.snapshot()["phases"]
    assert phases["blocking"]["last_seconds"] == pytest.approx(2)
    assert phases["save"]["last_seconds"] == pytest.approx(10)


def test_time_since_commit_and_work_at_risk(metrics, clock):
    assert metrics.time_since_last_commit() is None
    assert metrics.work_at_risk() == (None, None)
    metrics.record_commit(100, "a" * 16)
    for step in range(101, 131):
        clock.advance(2)
        metrics.observe_step(step, seconds=2.0)
    assert metrics.time_since_last_commit() == pytest.approx(60)
    assert metrics.work_at_risk() == (30, pytest.approx(60))
    metrics.record_commit(130, "b" * 16)
    assert metrics.work_at_risk() == (0, 0)


def test_step_time_is_a_running_estimate():
    m = CheckpointMetrics(ema=0.5)
    m.observe_step(1, seconds=2.0)
    m.observe_step(2, seconds=4.0)
    assert m.snapshot()["step_seconds"] == pytest.approx(3.0)


def test_restore_restart_validation_counters(metrics):
    metrics.record_restart(step=40, reason="preempted")
    metrics.record_restore(40, "c" * 16, seconds=3.5, bytes=10, fell_back_from=50)
    metrics.record_validation_failure("CRC32C mismatch", step=50, key="data/x")
    snap = metrics.snapshot()
    assert (snap["restarts"], snap["restores"], snap["validation_failures"]) == (1, 1, 1)
    assert snap["last_committed_step"] == 40
    assert snap["phases"]["restore"]["last_seconds"] == 3.5


def test_store_retries_are_counted_via_listener(metrics):
    store = open_store("memory://retries")
    metrics.watch_store(store)
    rec = Recorder()
    metrics.add_callback(rec)
    calls = {"n": 0}
    real_put = store._put

    def flaky_put(key, data, mode, crc):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise TransientError("SlowDown", key=key, location=store.location)
        return real_put(key, data, mode, crc)

    store._put = flaky_put  # type: ignore[method-assign]
    store.retry = type(store.retry)(initial_backoff=0.0, max_backoff=0.0)
    store.put("k", b"x", mode=PutMode.CREATE)
    assert metrics.snapshot()["retries"] == 2
    assert [e.kind for e in rec.events] == ["retry", "retry"]
    assert rec.events[0].error_type == "TransientError"


def test_callback_errors_never_fail_the_save(metrics, caplog):
    class Broken(BaseMetricsCallback):
        def on_commit(self, e):
            raise ValueError("callback bug")

    metrics.add_callback(Broken())
    with caplog.at_level(logging.ERROR, logger="objckpt.metrics"):
        metrics.record_commit(1, "a" * 16)
    assert metrics.snapshot()["commits"] == 1
    assert "callback bug" in caplog.text


def test_partial_callbacks_are_fine(metrics):
    class OnlyCommit:
        def __init__(self):
            self.n = 0

        def on_commit(self, e):
            self.n += 1

    cb = OnlyCommit()
    metrics.add_callback(cb)
    metrics.record_save_start(1, "a" * 16)
    metrics.record_commit(1, "a" * 16)
    assert cb.n == 1
    assert isinstance(BaseMetricsCallback(), MetricsCallback)


def test_json_log_lines(metrics, caplog):
    metrics.add_callback(JsonLogCallback())
    with caplog.at_level(logging.INFO, logger="objckpt.metrics"):
        metrics.record_commit(7, "a" * 16, bytes=123, save_seconds=2.0)
        metrics.record_failure(8, "b" * 16, TransientError("SlowDown"), phase="upload")
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert lines[0]["event"] == "commit" and lines[0]["step"] == 7 and lines[0]["bytes"] == 123
    assert lines[1]["event"] == "failure" and lines[1]["phase"] == "upload"
    assert caplog.records[1].levelno == logging.WARNING


prom = pytest.importorskip("prometheus_client", reason="prometheus-client not installed")


def _sample(registry, name, labels=None):
    return registry.get_sample_value(name, labels or {})


def test_prometheus_collector_reads_live_values(metrics, clock):
    exporter = PrometheusExporter(metrics, labels={"run": "eta"})
    reg = exporter.registry
    assert _sample(reg, "objckpt_commits_total", {"run": "eta"}) == 0
    assert _sample(reg, "objckpt_last_committed_step", {"run": "eta"}) is None
    metrics.record_commit(20, "a" * 16, bytes=50, save_seconds=2, upload_seconds=1, commit_seconds=0.5)
    clock.advance(30)
    assert _sample(reg, "objckpt_last_committed_step", {"run": "eta"}) == 20
    assert _sample(reg, "objckpt_seconds_since_last_commit", {"run": "eta"}) == 30
    clock.advance(15)  # computed at scrape time
    assert _sample(reg, "objckpt_seconds_since_last_commit", {"run": "eta"}) == 45
    assert _sample(reg, "objckpt_saved_bytes_total", {"run": "eta"}) == 50
    assert _sample(reg, "objckpt_phase_seconds_count", {"run": "eta", "phase": "upload"}) == 1
    assert _sample(reg, "objckpt_last_phase_seconds", {"run": "eta", "phase": "commit"}) == 0.5
    assert _sample(reg, "objckpt_last_committed_info", {"run": "eta", "attempt": "a" * 16}) == 1


def test_prometheus_textfile(metrics, tmp_path):
    exporter = PrometheusExporter(metrics)
    metrics.record_commit(3, "a" * 16)
    path = tmp_path / "objckpt.prom"
    exporter.write_textfile(path)
    text = path.read_text()
    assert "objckpt_last_committed_step 3.0" in text
    assert [p.name for p in tmp_path.iterdir()] == ["objckpt.prom"]  # no temp file left


def test_prometheus_http_endpoint(metrics):
    exporter = PrometheusExporter(metrics)
    metrics.record_commit(4, "a" * 16)
    port = exporter.start_http_server(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
    finally:
        exporter.stop_http_server()
    assert "objckpt_last_committed_step 4.0" in body
