"""``on_save_error``: what a save that did not commit does to the training loop.

Before: any failed save ended the training loop (``save`` raised; a failed ``save_async`` raised
from the next save). ``"warn"`` keeps training, logs loudly with the last valid checkpoint and how
long ago it was committed, counts the failure in the metrics, and the next due checkpoint tries
again. ``"raise"`` (default) keeps the old behaviour.
"""

from __future__ import annotations

import logging

import pytest
import torch

from objckpt.errors import CommitError, PermissionDeniedError, TrainingStateError
from objckpt.metrics import CheckpointMetrics
from objckpt.reader import Reader
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import Fault, FaultInjectingStore
from objckpt.training.manager import CheckpointManager
from objckpt.training.state import TrainingProgress


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(3, 2), "progress": TrainingProgress()}


def _store() -> FaultInjectingStore:
    return FaultInjectingStore(MemoryStore("on-save-error"))


def _deny_next_shard_write(store: FaultInjectingStore) -> None:
    store.add(Fault(op="put", key="data/*", error=PermissionDeniedError, times=1))


def test_raise_is_the_default(caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    with CheckpointManager(store) as mgr:
        assert mgr.on_save_error == "raise"
        mgr.save(10, _state())
        _deny_next_shard_write(store)
        with pytest.raises(CommitError):
            mgr.save(20, _state())


def test_warn_keeps_training_and_the_next_checkpoint_retries(caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    metrics = CheckpointMetrics()
    state = _state()
    with CheckpointManager(store, on_save_error="warn", metrics=metrics) as mgr:
        assert mgr.save(10, state) is not None
        _deny_next_shard_write(store)
        with caplog.at_level(logging.ERROR, logger="objckpt.training"):
            assert mgr.save(20, state) is None  # not committed; no exception
        loud = [r.getMessage() for r in caplog.records if "CHECKPOINT NOT SAVED" in r.getMessage()]
        assert len(loud) == 1
        assert "step 20" in loud[0] and "last valid checkpoint is step 10" in loud[0] and " s ago" in loud[0]
        assert metrics.snapshot()["failures"] == 1
        assert mgr.save(30, state) is not None  # the next checkpoint goes through
    assert Reader(store).steps() == [10, 30]


def test_warn_without_any_valid_checkpoint_says_everything_is_at_risk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = _store()
    with CheckpointManager(store, on_save_error="warn") as mgr:
        _deny_next_shard_write(store)
        with caplog.at_level(logging.ERROR, logger="objckpt.training"):
            assert mgr.save(10, _state()) is None
    assert "everything trained so far is at risk" in caplog.text


def test_warn_covers_save_async_outcomes(caplog: pytest.LogCaptureFixture) -> None:
    store = _store()
    metrics = CheckpointMetrics()
    state = _state()
    mgr = CheckpointManager(store, on_save_error="warn", metrics=metrics)
    mgr.save_async(10, state).wait()
    _deny_next_shard_write(store)
    with caplog.at_level(logging.ERROR, logger="objckpt.training"):
        failed = mgr.save_async(20, state)
        # whoever asks still gets the error...
        with pytest.raises(CommitError):
            failed.wait()
        # ...but the next save does not raise it again, and commits
        assert mgr.save_async(30, state).wait() is not None
        failed2 = None
        _deny_next_shard_write(store)
        failed2 = mgr.save_async(40, state)
        mgr.close()  # nobody looked at step 40's failure: logged, not raised, on close
    assert failed2 is not None and failed2.done()
    assert caplog.text.count("CHECKPOINT NOT SAVED") == 2
    assert "last valid checkpoint is step 30" in caplog.text
    assert metrics.snapshot()["failures"] == 2
    assert Reader(store).steps() == [10, 30]


def test_raise_keeps_raising_an_unseen_async_failure_at_the_next_save() -> None:
    store = _store()
    state = _state()
    mgr = CheckpointManager(store)
    _deny_next_shard_write(store)
    mgr.save_async(10, state)
    with pytest.raises(CommitError):
        mgr.save_async(20, state)
    mgr.close()


def test_warn_never_hides_errors_in_the_state_itself() -> None:
    with CheckpointManager(_store(), on_save_error="warn") as mgr:
        with pytest.raises(TrainingStateError):
            mgr.save(10, {"model": torch.nn.Linear(2, 2), "bad": object()})


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="on_save_error"):
        CheckpointManager(MemoryStore("x"), on_save_error="ignore")
