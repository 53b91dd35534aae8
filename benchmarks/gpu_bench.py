"""GPU leg: device-to-host staging and ``save_async`` blocking on CUDA tensors.

Runs only where ``torch.cuda.is_available()``; elsewhere it returns ``{"skipped": <why>}`` and
the report says so. On a CUDA machine, for a ``--mib`` state of 16 float32 CUDA tensors:

* ``staging``: objckpt's ``StagingArea`` (one reusable pinned buffer, non-blocking copies, one
  synchronize per device) vs the floor, ``cudaMemcpy`` into preallocated pinned memory
  (``pinned.copy_(t, non_blocking=True)`` then ``torch.cuda.synchronize()``);
* ``save_async``: how long ``CheckpointManager.save_async`` blocks the caller on CUDA tensors
  (file://), against the same floor.

Ratios are floor time / objckpt time, median [min-max] over ``--runs``; > 1 would beat the floor.

    python -m benchmarks.gpu_bench --mib 512 --runs 5
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import MiB, Series, paired_ratios, write_json


def skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device here (torch {torch.__version__}, torch.cuda.is_available() is False)"
    return None


def bench(mib: int, runs: int) -> dict[str, Any]:
    why = skip_reason()
    if why:
        return {"skipped": why}
    import torch

    from objckpt.training.manager import CheckpointManager
    from objckpt.training.staging import StagingArea

    n = 16
    tensors = [torch.randn(mib * MiB // 4 // n, device="cuda") for _ in range(n)]
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    area = StagingArea(pin=True)
    plan = area.plan([tensors])
    area.stage(plan)  # warm-up: allocates and pins the buffer once

    def floor() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for p, d in zip(pinned, tensors, strict=True):
            p.copy_(d, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def staging() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        area.stage(plan)
        return time.perf_counter() - t

    floors, stages, blocks = [], [], []
    root = Path(tempfile.mkdtemp(prefix="objckpt-gpu-bench-"))
    try:
        state = {f"t{i}": t for i, t in enumerate(tensors)}
        with CheckpointManager(f"file://{root}/warm", keep_last=1) as mgr:
            mgr.save_async(1, state).wait()
        for r in range(runs):
            floors.append(floor())
            stages.append(staging())
            with CheckpointManager(f"file://{root}/r{r}", keep_last=1) as mgr:
                torch.cuda.synchronize()
                t = time.perf_counter()
                handle = mgr.save_async(1, state)
                blocks.append(time.perf_counter() - t)
                handle.wait()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "mib": mib,
        "device": torch.cuda.get_device_name(0),
        "floor_s": floors,
        "staging_s": stages,
        "save_async_blocking_s": blocks,
    }


def summary(res: dict[str, Any]) -> list[str]:
    if "skipped" in res:
        return [f"GPU leg skipped: {res['skipped']}"]
    floor = res["floor_s"]
    return [
        f"{res['device']}, {res['mib']} MiB: cudaMemcpy floor {Series(floor).fmt(3, 's')}",
        f"StagingArea.stage {Series(res['staging_s']).fmt(3, 's')}, floor/ours "
        f"{paired_ratios(floor, res['staging_s']).fmt(2, 'x')}",
        f"save_async blocking {Series(res['save_async_blocking_s']).fmt(3, 's')}, floor/ours "
        f"{paired_ratios(floor, res['save_async_blocking_s']).fmt(2, 'x')}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = bench(args.mib, args.runs)
    if args.out:
        write_json(args.out, res)
    print("\n".join(summary(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
