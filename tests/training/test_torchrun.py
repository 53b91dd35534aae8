"""End to end under torchrun: a rank os._exit(1)s, torchrun restarts the job, it resumes from the
last committed step and ends bitwise equal to an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_torchrun.py"


def _torchrun(tmp: Path, name: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        # --standalone: c10d rendezvous on a free local port, a fresh key prefix per restart
        # round (torch 2.13's static rendezvous hands restarted workers the previous round's
        # gloo addresses: init_process_group fails or hangs)
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        str(SCRIPT),
        "--uri",
        f"file://{tmp}/{name}",
        "--steps",
        "40",
        "--every",
        "10",
        "--status-file",
        str(tmp / f"{name}.status"),
        *extra,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=REPO)


def _digest(out: str) -> str:
    m = re.search(r"final step 40 params sha256 ([0-9a-f]{64})", out)
    assert m, out[-3000:]
    return m.group(1)


def test_torchrun_restart_resumes_from_last_commit(tmp_path: Path) -> None:
    crashed = _torchrun(tmp_path, "crashed", "--crash-rank", "1", "--crash-at", "27")
    out = crashed.stdout + crashed.stderr
    assert crashed.returncode == 0, out[-3000:]
    assert "rank 1: simulated crash after step 27" in out
    assert "restart 1: resumed from step 20" in out and "steps lost: 7" in out
    assert out.count("simulated crash") == 1  # only on the first run

    reference = _torchrun(tmp_path, "reference")
    ref_out = reference.stdout + reference.stderr
    assert reference.returncode == 0, ref_out[-3000:]
    assert "restart" not in reference.stdout
    assert _digest(out) == _digest(ref_out)


def test_a_damaged_latest_checkpoint_is_resaved_on_a_new_timeline_across_torchrun_restarts(
    tmp_path: Path,
) -> None:
    """Issue 11's crash loop, end to end: step 40 is damaged; the job falls back to 30, saves 40
    again (a new timeline, no CommitConflict), crashes, and the restart resumes the NEW 40."""
    from objckpt.reader import Reader
    from objckpt.store import open_store

    first = _torchrun(tmp_path, "run", "--steps", "40")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    store = open_store(f"file://{tmp_path}/run")
    damaged = Reader(store).load(40)
    shard = tmp_path / "run" / damaged.shard(1, "rank.bin").key
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the CRC32C check while restoring sees it
    shard.write_bytes(bytes(raw))

    second = _torchrun(tmp_path, "run", "--steps", "60", "--crash-rank", "1", "--crash-at", "45")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert "CommitConflict" not in out
    assert "restart 0: resumed from step 30" in out or "resumed from step 30" in out
    assert "restart 1: resumed from step 40" in out  # the new 40, not the damaged one
    head = Reader(store).latest()
    assert (head.timeline, head.step) == (1, 60)
    assert Reader(store).line()[:4] == [(1, 60), (1, 50), (1, 40), (0, 30)]
