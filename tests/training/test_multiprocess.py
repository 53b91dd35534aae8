"""Multi-process tests: gloo on CPU, 2 ranks, file:// run roots. Slow (process start-up)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import torch

from objckpt import layout
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.reader import Reader
from objckpt.store import open_store
from objckpt.training.serialization import loads

from . import workers
from .mp import run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _load(out: Path, rank: int) -> dict:
    return loads((out / f"rank{rank}.bin").read_bytes())


def _json(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def _assert_same(a: object, b: object, path: str = "") -> None:
    """Bitwise equality of nested state (tensors by bytes, floats by value incl. NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        if a.numel():
            as_bytes = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
            assert torch.equal(as_bytes(a), as_bytes(b)), path
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.tobytes() == b.tobytes(), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
        return
    assert a == b, f"{path}: {a!r} != {b!r}"


def test_crash_and_resume_is_bitwise_identical(tmp_path: Path) -> None:
    """Run A trains 40 steps; run B crashes at step 27 (last checkpoint 20) and resumes: at step
    40 parameters, optimizer state, the next draws of every RNG on every rank and the sample
    order are identical."""
    out_a, out_b1, out_b2 = tmp_path / "a", tmp_path / "b1", tmp_path / "b2"
    for d in (out_a, out_b1, out_b2):
        d.mkdir()
    root_a, root_b = f"file://{tmp_path}/run-a", f"file://{tmp_path}/run-b"

    assert run_world(workers.resume_run, 2, root_a, str(out_a), 40, 10, None) == [0, 0]
    codes = run_world(workers.resume_run, 2, root_b, str(out_b1), 40, 10, 27)
    assert codes == [1, 1]  # both ranks crashed (os._exit(1)) after step 27
    assert Reader(open_store(root_b)).steps() == [10, 20]
    assert run_world(workers.resume_run, 2, root_b, str(out_b2), 40, 10, None) == [0, 0]

    for rank in range(2):
        a, b = _load(out_a, rank), _load(out_b2, rank)
        assert a["restored"] is None and b["restored"] == 20
        # steps 21..40 saw the same samples in the same order
        assert b["order"] == a["order"][20:]
        for key in (
            "params",
            "optimizer",
            "scheduler",
            "sampler",
            "progress",
            "next_python",
            "next_numpy",
            "next_generator",
            "next_torch",
        ):
            _assert_same(a[key], b[key], f"rank {rank} {key}")
    # the ranks really differ from each other (per-rank RNG was restored per rank)
    assert _load(out_a, 0)["next_torch"].tolist() != _load(out_a, 1)["next_torch"].tolist()


def test_rank_sigkilled_mid_upload_leaves_no_manifest_and_gc_sweeps_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    root = f"file://{tmp_path}/run"
    codes = run_world(workers.killed_during_upload, 2, root, str(out))
    assert codes[1] == -9  # SIGKILL during a part upload of step 30
    rank0 = _json(out, 0)["outcome"]
    assert rank0.startswith(("DistributedError", "CommitError")), rank0

    store = open_store(root)
    reader = Reader(store)
    assert reader.steps() == [10, 20]  # no manifest for step 30

    def step_30_prefixes() -> list[str]:  # either layout: spread keys lie under several prefixes
        keys = [m.key for m in store.list(layout.DATA_PREFIX)]
        return sorted(
            {layout.attempt_prefix_of(k) for k in keys if (layout.parse_shard_key(k) or (0,))[0] == 30}
        )

    orphan = step_30_prefixes()
    assert len(orphan) >= 1 and len({layout.parse_attempt_prefix(p) for p in orphan}) == 1

    # every rank restores the previous committed step
    out2 = tmp_path / "out2"
    out2.mkdir()
    assert run_world(workers.restore_only, 2, root, str(out2)) == [0, 0]
    assert [_json(out2, r)["restored"] for r in range(2)] == [20, 20]

    # GC: within the grace period the orphan is left alone; after it, swept
    policy = RetentionPolicy(keep_last=3)
    young = plan_gc(store, policy, grace_period=timedelta(hours=1))
    assert not young.orphans and any("grace period" in n for n in young.notes)
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    plan = plan_gc(store, policy, grace_period=timedelta(hours=1), now=later)
    assert sorted(o.prefix for o in plan.orphans) == orphan
    run_gc(store, plan)
    assert not step_30_prefixes()
    assert store.list_uploads("") == []  # the killed rank's staged upload is aborted too
    assert reader.steps() == [10, 20]


def test_rank0_only_save_raises_instead_of_hanging(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert run_world(workers.rank0_only_save, 2, f"file://{tmp_path}/run", str(out), timeout=120) == [0, 0]
    outcome = _json(out, 0)["outcome"]
    assert outcome.startswith("DistributedError") and "every rank" in outcome, outcome
    assert Reader(open_store(f"file://{tmp_path}/run")).steps() == []


def test_disagreeing_ranks_and_collective_fallback(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    root = f"file://{tmp_path}/run"
    other = f"file://{tmp_path}/empty"
    assert run_world(workers.setup_two_checkpoints, 2, root, str(out)) == [0, 0]
    store = open_store(root)
    newest = Reader(store).load(20)
    # bit rot in rank 1's own shard of step 20: same size, same mtime, so HEAD checks pass and
    # only rank 1 notices (its CRC32C while streaming)
    victim = Path(tmp_path, "run", newest.shard(1, "rank.bin").key)
    st = victim.stat()
    with open(victim, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))

    assert run_world(workers.disagree, 2, root, other, str(out)) == [0, 0]
    for rank in range(2):
        r = _json(out, rank)
        assert (
            r["different_steps"].startswith("DistributedError") and "different steps" in r["different_steps"]
        )
        assert r["different_roots"].startswith("DistributedError") and "rank 1" in r["different_roots"]
        assert r["restored"] == 10 and r["global_step"] == 10
        assert [f[0] for f in r["fallbacks"]] == [20] and "rank 1" in r["fallbacks"][0][1]
