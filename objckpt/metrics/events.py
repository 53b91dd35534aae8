"""The metrics events (what :class:`~objckpt.metrics.CheckpointMetrics` records) and the
callbacks that receive them (:class:`JsonLogCallback` writes one JSON line per event).
Importable from :mod:`objckpt.metrics`, where users find them."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

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
