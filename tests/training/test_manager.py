"""CheckpointManager in one process (memory:// store): the fast half of its contract."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.errors import CommitConflict, CommitError, NoCheckpointError, PermissionDeniedError
from objckpt.reader import Reader
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import Fault, FaultInjectingStore
from objckpt.training.manager import CheckpointManager, hash_config
from objckpt.training.replicated import assign as _assign
from objckpt.training.sampler import ResumableDistributedSampler
from objckpt.training.state import TrainingProgress, TrainingStateError
from objckpt.writer import ShardWriter


def _state(seed: int = 0, width: int = 8) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
        "sampler": ResumableDistributedSampler(64, seed=2),
        "progress": TrainingProgress(),
        "rng": np.random.default_rng(seed),
        "extra": {"best": float(seed)},
    }


def _step(state: dict, n: int = 1) -> None:
    for _ in range(n):
        x = torch.randn(8, 4)
        state["model"](x).pow(2).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["scheduler"].step()
        state["progress"].global_step += 1
        state["rng"].random()


def _same(a: dict, b: dict) -> None:
    for (ka, va), (kb, vb) in zip(
        a["model"].state_dict().items(), b["model"].state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)
    oa, ob = a["optimizer"].state_dict(), b["optimizer"].state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    for pid in oa["state"]:
        for k in oa["state"][pid]:
            assert torch.equal(oa["state"][pid][k], ob["state"][pid][k])
    assert a["scheduler"].state_dict() == b["scheduler"].state_dict()
    assert a["progress"] == b["progress"] and a["extra"] == b["extra"]
    assert a["rng"].random() == b["rng"].random()


def test_save_then_restore_into_fresh_objects() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, config_hash=hash_config({"lr": 0.05}), dataset_snapshot="ds-1")
    assert mgr.restore(_state(1)) is None  # nothing yet: nothing modified
    a = _state(0)
    _step(a, 3)
    a["extra"]["best"] = 0.5
    m = mgr.save(3, a)
    assert m is not None and m.step == 3 and m.world_size == 1
    assert {s.name for s in m.shards} == {"replicated.bin", "rank.bin"}
    assert m.run["config_hash"] == hash_config({"lr": 0.05}) and m.run["dataset_snapshot"] == "ds-1"
    assert m.run["software"]["torch"] == torch.__version__ and m.run["world_size"] == 1
    assert m.progress["global_step"] == 3
    assert m.topology["replicated"] == ["model", "optimizer"]

    b = _state(1)
    assert CheckpointManager(store).restore(b) == 3
    _same(a, b)
    for x in (a, b):  # and they keep training identically
        torch.manual_seed(5)
        _step(x)
    _same(a, b)


def test_every_skips_steps_that_are_not_due() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, every=5)
    s = _state()
    assert mgr.save(3, s) is None
    assert mgr.save(5, s).step == 5
    assert mgr.save(7, s, force=True).step == 7
    assert Reader(store).steps() == [5, 7]


def test_saving_mid_accumulation_is_refused_and_writes_nothing() -> None:
    store = MemoryStore()
    s = _state()
    s["progress"].accumulation_step = 2
    with pytest.raises(TrainingStateError, match="gradient accumulation"):
        CheckpointManager(store).save(1, s)
    assert list(store.list("")) == []


def test_unserializable_value_is_refused_before_any_write() -> None:
    store = MemoryStore()
    s = _state()
    s["extra"]["callback"] = print
    with pytest.raises(TypeError, match=r"state\['extra'\]\['callback'\]"):
        CheckpointManager(store).save(1, s)
    assert list(store.list("")) == []


def test_failed_shard_write_is_a_commit_error_and_no_manifest() -> None:
    store = FaultInjectingStore(
        MemoryStore(), [Fault(op="put", key="data/*/rank.bin", error=PermissionDeniedError, times=None)]
    )
    with pytest.raises(CommitError, match=r"failing ranks \[0\].*PermissionDenied") as info:
        CheckpointManager(store).save(1, _state())
    assert set(info.value.failures) == {0}
    assert Reader(store).steps() == []


def test_second_attempt_for_a_committed_step_conflicts() -> None:
    store = MemoryStore()
    CheckpointManager(store).save(4, _state())
    with pytest.raises(CommitConflict):
        CheckpointManager(store).save(4, _state())


def test_corrupt_newest_falls_back_to_parent_loudly(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store)
    s = _state()
    _step(s, 2)
    mgr.save(2, s)
    _step(s, 2)
    m4 = mgr.save(4, s)
    shard = m4.shard(0, "replicated.bin")
    data = bytearray(store.get(shard.key))
    data[-5] ^= 1
    store.corrupt(shard.key, bytes(data))  # same size and metadata: only the CRC32C catches it

    fresh = _state(3)
    with caplog.at_level(logging.WARNING, logger="objckpt.training"):
        assert CheckpointManager(store).restore(fresh) == 2
    assert "step 4" in caplog.text and "CRC32C" in caplog.text
    assert fresh["progress"].global_step == 2

    # asking for the damaged step explicitly does not fall back
    with pytest.raises(NoCheckpointError, match="step 4"):
        CheckpointManager(store).restore(_state(3), step=4)
    # every checkpoint damaged: an error, not a silent fresh start
    m2 = Reader(store).load(2)
    key = m2.shard(0, "rank.bin").key
    store.corrupt(key, b"\x00" * len(store.get(key)))
    with pytest.raises(NoCheckpointError, match="none is usable"):
        CheckpointManager(store).restore(_state(3))


def test_checkpoint_that_does_not_fit_changes_nothing() -> None:
    store = MemoryStore()
    CheckpointManager(store).save(1, _state())
    wrong = _state(2, width=16)
    before = {k: v.clone() for k, v in wrong["model"].state_dict().items()}
    sched_before = wrong["scheduler"].state_dict()
    with pytest.raises(
        TrainingStateError, match=r"tensor '0.weight' has shape \(8, 4\) in the checkpoint but \(16, 4\)"
    ):
        CheckpointManager(store).restore(wrong)
    assert all(torch.equal(before[k], v) for k, v in wrong["model"].state_dict().items())
    assert wrong["scheduler"].state_dict() == sched_before and wrong["progress"].global_step == 0


def test_restoring_a_subset_for_evaluation() -> None:
    store = MemoryStore()
    s = _state()
    _step(s, 2)
    CheckpointManager(store).save(2, s)
    model = _state(9)["model"]
    assert CheckpointManager(store).restore({"model": model}) == 2
    assert torch.equal(model[0].weight, s["model"][0].weight)


class _Boom:
    def __reduce__(self) -> tuple:
        return (exec, ("import os; os._exit(42)",))


def test_pickle_in_a_committed_shard_is_never_executed() -> None:
    """A checkpoint whose shards are pickles (correct CRC32C: committed by someone else) is
    rejected as damaged; the payload never runs."""
    store = MemoryStore()
    attempt = layout.new_attempt_id()
    writer = ShardWriter(store, step=1, attempt=attempt, rank=0)
    writer.write("rank.bin", pickle.dumps({"x": _Boom()}))
    writer.write("replicated.bin", pickle.dumps({"x": _Boom()}))
    Coordinator(store, world_size=1).commit(
        1, attempt, {0: writer.receipts}, topology={"layout": "objckpt.training/1", "replicated": ["model"]}
    )
    with pytest.raises(NoCheckpointError, match="pickle"):
        CheckpointManager(store).restore(_state())


def test_retention_keeps_the_last_n() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=2)
    s = _state()
    for step in (1, 2, 3, 4):
        mgr.save(step, s)
    assert Reader(store).steps() == [3, 4]
    # what is left is what the retained manifests need (their shards, and with deduplication the
    # ancestors' objects they reference: this state never changed, so 3 and 4 reuse step 1's)
    needed = {k for m in map(Reader(store).load, (3, 4)) for k in m.object_keys}
    assert {m.key for m in store.list("data/")} == needed


def test_replicated_tensors_are_split_across_ranks_by_size() -> None:
    tensors = [torch.zeros(n) for n in (100, 10, 60, 50, 1, 1)]
    split = _assign(tensors, 2)
    assert split == _assign(tensors, 2)  # deterministic: every rank computes the same split
    assert sorted(i for part in split for i in part) == list(range(6))
    loads = [sum(tensors[i].numel() for i in part) for part in split]
    assert max(loads) - min(loads) <= 10
    assert _assign(tensors, 8)[7] == []  # more ranks than tensors: some write none


def test_the_manager_feeds_its_metrics_with_no_user_code(tmp_path) -> None:
    from objckpt.metrics import CheckpointMetrics

    metrics = CheckpointMetrics()
    root = f"file://{tmp_path}/run"
    state = {"counters": {"n": 0}}
    with CheckpointManager(root, every=5, metrics=metrics) as mgr:
        for step in range(1, 11):
            state["counters"]["n"] = step
            mgr.save(step, state)
    snap = metrics.snapshot()
    assert snap["last_committed_step"] == 10 and snap["commits"] == 2 and snap["current_step"] == 10
    assert snap["work_at_risk_steps"] == 0 and snap["seconds_since_last_commit"] is not None
    assert snap["bytes_total"] > 0 and {"save", "upload", "commit"} <= set(snap["phases"])
    with CheckpointManager(root, metrics=metrics) as mgr:
        assert mgr.restore(state) == 10
    snap = metrics.snapshot()
    assert snap["restores"] == 1 and snap["restarts"] == 1 and snap["last_restored_step"] == 10


def test_store_options_are_accepted_as_keyword_arguments(tmp_path) -> None:
    from objckpt.errors import ConfigError

    with CheckpointManager(f"file://{tmp_path}/run", part_size="8MiB") as mgr:
        assert mgr.store.part_size == 8 * 1024 * 1024
    with pytest.raises(ConfigError, match="path_style"):
        CheckpointManager(f"file://{tmp_path}/run", path_style=True)
