"""Prometheus export of a :class:`~objckpt.metrics.CheckpointMetrics` (needs the optional
``prometheus-client``). Importable from :mod:`objckpt.metrics`, where users find it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from . import CheckpointMetrics

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
