"""A Prometheus scrape of a running job: ``CheckpointManager(metrics=...)`` feeds
``CheckpointMetrics``, ``PrometheusExporter.start_http_server`` serves it, and an HTTP GET of
``/metrics`` returns every metric the README's monitoring section lists, with the values the
saves and the restore produced (values and counts; durations only checked to be present)."""

from __future__ import annotations

import urllib.request

import pytest

torch = pytest.importorskip("torch")
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from objckpt import CheckpointManager, CheckpointMetrics, PrometheusExporter  # noqa: E402
from objckpt._retry import RetryPolicy  # noqa: E402
from objckpt.errors import TransientError  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import PutMode  # noqa: E402
from objckpt.store.memory import MemoryStore  # noqa: E402
from objckpt.store.wrappers import Fault, FaultInjectingStore  # noqa: E402

FAST_RETRY = RetryPolicy(deadline=10.0, max_attempts=5, initial_backoff=0.0001, max_backoff=0.001)
LABELS = {"run": "eta"}


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics like Prometheus does; samples by (name, labels without the run label)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            assert s.labels.get("run") == "eta", s  # constant labels on every series
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
            out[(s.name, labels)] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}


def test_scrape_after_saves_and_a_restore_that_fell_back() -> None:
    inner = MemoryStore("eta")
    # two transient upload failures, retried by the store's policy: counted as retries
    store = FaultInjectingStore(
        inner,
        [Fault(op="put", key="data/*", error=TransientError, times=2)],
        retry=FAST_RETRY,
        close_inner=False,
    )

    # ---------------------------------------------------------------- the training job
    metrics = CheckpointMetrics(run="eta")
    exporter = PrometheusExporter(metrics, labels=LABELS)
    port = exporter.start_http_server(0)
    try:
        ckpt = CheckpointManager(store, metrics=metrics, keep_last=3)
        live = state(0)
        m10 = ckpt.save(10, live)
        m20 = ckpt.save(20, live)
        metrics.observe_step(25, seconds=2.0)  # the loop reports its steps: work at risk
        ckpt.close()
        s = scrape(port)
    finally:
        exporter.stop_http_server()

    assert len(store.injected) == 2
    assert value(s, "objckpt_last_committed_step") == 20
    assert value(s, "objckpt_last_committed_info", attempt=m20.attempt) == 1
    assert value(s, "objckpt_commits_total") == 2
    assert value(s, "objckpt_save_failures_total") == 0
    assert value(s, "objckpt_last_save_bytes") == m20.total_size
    assert value(s, "objckpt_saved_bytes_total") == m10.total_size + m20.total_size
    assert value(s, "objckpt_store_retries_total") == 2
    assert value(s, "objckpt_work_at_risk_steps") == 5
    assert value(s, "objckpt_work_at_risk_seconds") == 10.0
    assert value(s, "objckpt_step_seconds") == 2.0
    assert value(s, "objckpt_restarts_total") == 0
    assert value(s, "objckpt_validation_failures_total") == 0
    for phase in ("save", "blocking", "upload", "commit"):
        assert value(s, "objckpt_phase_seconds_count", phase=phase) == 2
        assert value(s, "objckpt_phase_seconds_sum", phase=phase) >= 0
        assert value(s, "objckpt_last_phase_seconds", phase=phase) >= 0
    assert value(s, "objckpt_seconds_since_last_commit") >= 0
    assert value(s, "objckpt_last_commit_timestamp_seconds") > 0
    assert value(s, "objckpt_last_upload_throughput_bytes_per_second") > 0

    # ------------------------------------------- the job restarts; step 20 has rotted meanwhile
    shard = next(r for r in m20.shards if r.name == "replicated.bin")
    good = inner.get(shard.key)
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    inner.put(shard.key, bytes(bad), mode=PutMode.OVERWRITE)

    metrics = CheckpointMetrics(run="eta")
    exporter = PrometheusExporter(metrics, labels=LABELS)
    port = exporter.start_http_server(0)
    try:
        ckpt = CheckpointManager(store, metrics=metrics, keep_last=3)
        restored = state(1)
        assert ckpt.restore(restored) == 10  # fell back past the damaged step 20
        metrics.observe_step(12)
        ckpt.close()
        s = scrape(port)
    finally:
        exporter.stop_http_server()

    assert value(s, "objckpt_restores_total") == 1
    assert value(s, "objckpt_restarts_total") == 1
    assert value(s, "objckpt_validation_failures_total") == 1
    assert value(s, "objckpt_last_committed_step") == 10
    assert value(s, "objckpt_last_committed_info", attempt=m10.attempt) == 1
    assert value(s, "objckpt_work_at_risk_steps") == 2
    assert value(s, "objckpt_phase_seconds_count", phase="restore") == 1
    assert value(s, "objckpt_commits_total") == 0
    assert Reader(inner).latest().step == 20  # the damaged checkpoint is still committed: nothing deleted


def test_every_metric_the_readme_lists_is_served() -> None:
    """The names in README.md's monitoring table are what a scrape returns (after one save)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Monitoring", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(objckpt_[a-z_]+)`", section))
    assert documented, "the monitoring section lists no metric names"

    metrics = CheckpointMetrics(run="eta")
    exporter = PrometheusExporter(metrics, labels=LABELS)
    port = exporter.start_http_server(0)
    try:
        with CheckpointManager(MemoryStore("m"), metrics=metrics) as ckpt:
            ckpt.save(1, state(0))
            assert ckpt.restore(state(1)) == 1
        metrics.observe_step(3, seconds=1.0)
        s = scrape(port)
    finally:
        exporter.stop_http_server()
    served = {name for name, _ in s}
    families = served | {re.sub(r"_(count|sum|total)$", "", n) for n in served}
    missing = sorted(n for n in documented if n not in served and n not in families)
    assert not missing, f"README documents metrics a scrape does not return: {missing}"
