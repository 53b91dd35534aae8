"""Elastic restores and data-loader workers with real processes: gloo, DDP, file:// roots. Slow.

* a DDP model + AdamW saved by 2 and by 4 ranks restores bit for bit at 1, 3 and 2 ranks, on
  every rank; the rest of the interrupted epoch is split across the new ranks with no sample
  repeated or skipped;
* one process restores only the model of a 4-rank checkpoint: replicated (DDP) and FSDP2 (DCP);
* a 2-rank job with 2 loader workers per rank (ResumableDataLoader, torchdata's
  StatefulDataLoader) resumes bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from objckpt.training.manager import CheckpointManager
from objckpt.training.serialization import loads

from . import elastic_workers, loop, workers
from .mp import run_world
from .test_multiprocess import _assert_same

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 10  # the checkpoint step: mid-epoch at both saving world sizes


def _load(out: Path, rank: int) -> dict[str, Any]:
    return loads((out / f"rank{rank}.bin").read_bytes())


def _steps_per_epoch(world_size: int) -> int:
    return workers.N_SAMPLES // (world_size * workers.MICRO * workers.ACCUM)


def _consumed_in_epoch(saved: list[dict[str, Any]], world_size: int) -> list[int]:
    """The samples the saving ranks consumed in the epoch the checkpoint was taken in."""
    start = (STEPS // _steps_per_epoch(world_size)) * _steps_per_epoch(world_size)
    return [i for s in saved for step in s["order"][start:STEPS] for i in step]


def _check_restored(saved: list[dict[str, Any]], restored: list[dict[str, Any]], label: str) -> None:
    """Replicated state bit for bit on every rank; per-rank state (scheduler, scaler, progress)
    equal too (it is identical across the saving ranks, so every rule gives the same)."""
    for key in ("params", "optimizer", "scheduler", "scaler", "progress"):
        for r, s in enumerate(saved):
            _assert_same(saved[0][key], s[key], f"{label}: saving rank {r} {key}")
        for r, got in enumerate(restored):
            _assert_same(saved[0][key], got[key], f"{label}: restoring rank {r} {key}")


def _check_rng(saved: list[dict[str, Any]], restored: list[dict[str, Any]], label: str) -> None:
    """A rank that existed restores its own global RNG; a new rank gets a stream of its own."""
    for r, got in enumerate(restored):
        if r < len(saved):
            _assert_same(saved[r]["rng"], got["rng"], f"{label}: rank {r} rng")
        else:
            others = [s["rng"]["torch"] for s in saved] + [g["rng"]["torch"] for g in restored[:r]]
            assert all(not torch.equal(got["rng"]["torch"], o) for o in others), f"{label}: rank {r}"


def _check_epoch(saved: list[dict[str, Any]], restored: list[dict[str, Any]], world_size: int) -> None:
    before = _consumed_in_epoch(saved, world_size)
    after = [i for got in restored for step in got["order"] for i in step]
    assert len(before) + len(after) == workers.N_SAMPLES, (len(before), len(after))
    assert sorted(before + after) == list(range(workers.N_SAMPLES))  # no repeats, no gaps
    assert len({sum(map(len, got["order"])) for got in restored}) == 1  # the new ranks in lockstep


def test_ddp_adam_restores_bit_exactly_at_other_world_sizes(tmp_path: Path) -> None:
    root2, root4 = f"file://{tmp_path}/w2", f"file://{tmp_path}/w4"
    outs = {name: tmp_path / name for name in ("save2", "save4", "to3", "to2")}
    for d in outs.values():
        d.mkdir()
    assert run_world(elastic_workers.train_and_save, 2, root2, str(outs["save2"]), STEPS) == [0, 0]
    assert run_world(elastic_workers.train_and_save, 4, root4, str(outs["save4"]), STEPS) == [0] * 4
    saved2 = [_load(outs["save2"], r) for r in range(2)]
    saved4 = [_load(outs["save4"], r) for r in range(4)]

    # 2 -> 3
    assert run_world(elastic_workers.restore_and_finish_epoch, 3, root2, str(outs["to3"])) == [0] * 3
    to3 = [_load(outs["to3"], r) for r in range(3)]
    assert [g["restored"] for g in to3] == [STEPS] * 3
    assert "rank 2 is new" in to3[2]["per_rank"] and "rank 1 keeps its own" in to3[1]["per_rank"]
    _check_restored(saved2, to3, "2 -> 3")
    _check_rng(saved2, to3, "2 -> 3")
    _check_epoch(saved2, to3, 2)

    # 4 -> 2
    assert run_world(elastic_workers.restore_and_finish_epoch, 2, root4, str(outs["to2"])) == [0, 0]
    to2 = [_load(outs["to2"], r) for r in range(2)]
    _check_restored(saved4, to2, "4 -> 2")
    _check_rng(saved4, to2, "4 -> 2")
    _check_epoch(saved4, to2, 4)

    # 2 -> 1, in this process (no process group)
    workers.seed_rank(0)
    state = loop.build_with_loader(0, 1, "resumable", num_workers=0)
    with CheckpointManager(root2) as mgr:
        assert mgr.restore(state) == STEPS
    got = {"rng": elastic_workers._global_rng(), **elastic_workers._state_of(state)}
    got["order"] = loop.train(None, state, 10**9, until_epoch_end=True)
    _check_restored(saved2, [got], "2 -> 1")
    _check_rng(saved2, [got], "2 -> 1")
    _check_epoch(saved2, [got], 2)

    # one process, only the model, from the 4-rank checkpoint
    torch.manual_seed(123)
    model = workers.build(0, 1)["model"]
    with CheckpointManager(root4) as mgr:
        assert mgr.restore({"model": model}) == STEPS
    _assert_same(saved4[0]["params"], model.state_dict(), "model only")


def test_one_process_restores_the_model_of_a_4_rank_fsdp2_checkpoint(tmp_path: Path) -> None:
    import warnings

    from .test_dcp import _Net, _run_world

    root = f"file://{tmp_path}/fsdp"
    reference = _run_world(4, root, tmp_path / "w4", load_step=None, save_step=100)
    torch.manual_seed(7)
    net = _Net()  # a plain module: no process group, no sharding
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        with CheckpointManager(root) as mgr:
            assert mgr.restore({"model": net}) == 100
            report = mgr.last_restore
    assert report.saved_world_size == 4 and report.complete
    _assert_same(dict(reference["model"]), dict(net.state_dict()), "fsdp2 model")
    with CheckpointManager(root) as mgr, pytest.raises(Exception, match="only nn.Module entries"):
        mgr.restore({"model": _Net(), "optim": torch.optim.AdamW(_Net().parameters())})


@pytest.mark.parametrize("kind", ["resumable", "stateful"])
def test_bitwise_resume_with_two_workers_two_ranks(tmp_path: Path, kind: str) -> None:
    """Run A (2 ranks, 2 loader workers each) trains 40 steps saving every 10; run B restores
    A's step 20, taken while the workers had prefetched beyond it, and trains to 40."""
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    out_a.mkdir()
    out_b.mkdir()
    root_a, root_b = f"file://{tmp_path}/a-run", f"file://{tmp_path}/b-run"
    fn = elastic_workers.resume_with_workers
    # daemon=False: each rank starts its own loader workers
    assert run_world(fn, 2, kind, root_a, str(out_a), 40, None, None, daemon=False) == [0, 0]
    assert run_world(fn, 2, kind, root_b, str(out_b), 40, root_a, 20, daemon=False) == [0, 0]
    for rank in range(2):
        a, b = _load(out_a, rank), _load(out_b, rank)
        assert b["restored"] == 20
        assert b["order"] == a["order"][20:]
        for key in ("params", "optimizer", "scheduler", "sampler", "progress"):
            _assert_same(a[key], b[key], f"rank {rank} {key}")
        for key in ("next_python", "next_numpy", "next_generator", "next_torch"):
            _assert_same(a[key], b[key], f"rank {rank} {key}")
