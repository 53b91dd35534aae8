"""What a background save costs a training loop: thread uploader vs an uploader process.

A toy CPU training loop (an MLP, forward + backward + SGD, fixed batch) runs steps while one save
of a separate ``--mib`` state is in flight on ``file://`` (no server in the way: what is measured
is contention in this process, the GIL above all). Each case starts the save, then runs training
steps until the save has committed:

=================  =============================================================================
``manager``        ``CheckpointManager.save_async`` (objckpt's thread uploader; one manager for
                   the run, so its staging buffer is reused as in a training loop)
``dcp_thread``     ``dcp.async_save`` (thread executor) with ``ObjckptStorageWriter``
``dcp_process``    ``dcp.async_save(async_checkpointer_type=PROCESS)`` with ``ObjckptStorageWriter``
                   opened from the URI (the writer is pickled and re-opens the store in DCP's
                   checkpoint process; that process is started by an untimed warm-up save)
=================  =============================================================================

Before every save the state's values change (untimed), so deduplication finds nothing to reuse.
Reported per case, median [min-max] over ``--runs`` saves: the training-step slowdown (median
step time while the save is in flight / median step time with no save, same process, measured
just before), the time ``save_async`` blocked the loop, and start-to-commit. Also measured: the
memcpy floor (``copy_`` of the state into preallocated buffers, timed in each run right before
the manager's ``save_async``, so the two are paired in time) and a synchronous
``CheckpointManager.save``, for the issue's "blocking vs floor" and "start to commit vs sync" rows.

    python -m benchmarks.async_bench --mib 256 --runs 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import MiB, Series, make_model, write_json

CASES = ("manager", "dcp_thread", "dcp_process")


def _training(width: int = 512, depth: int = 3, batch: int = 64) -> Any:
    import torch

    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)

    def step() -> float:
        t = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - t

    return step


def _steps_while(step: Any, busy: Any, at_least: int = 3) -> list[float]:
    times: list[float] = []
    while busy() or len(times) < at_least:
        times.append(step())
        if len(times) > 100_000:
            break
    return times


def bench(mib: int, runs: int, root: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from objckpt.training.dcp import ObjckptStorageWriter
    from objckpt.training.manager import CheckpointManager

    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=0, world_size=1, timeout=timedelta(seconds=120)
    )
    state = make_model(mib * MiB, 16)
    sd = state.state_dict()
    step = _training()
    for _ in range(20):  # warm-up of the training loop
        step()
    out: dict[str, Any] = {"mib": mib, "runs": runs, "cases": {}}

    # the memcpy floor: copy_ into preallocated buffers, touched once here (as the manager's
    # staging buffer is by its warm-up save), timed in every run right before the manager's
    # save_async it is paired with (until 2026-12-06 its runs were timed back to back before
    # every case, the first of them into untouched pages)
    bufs = [torch.empty_like(p) for p in sd.values()]
    for b, p in zip(bufs, sd.values(), strict=True):
        b.copy_(p)
    floor: list[float] = []
    out["memcpy_floor_s"] = floor
    sync = []
    for r in range(runs):  # a fresh root each time: nothing to deduplicate against
        with CheckpointManager(f"file://{root}/sync-{r}", keep_last=1) as mgr:
            t = time.perf_counter()
            mgr.save(1, {"model": state})
            sync.append(time.perf_counter() - t)
        shutil.rmtree(root / f"sync-{r}", ignore_errors=True)
    out["sync_save_s"] = sync

    # one manager for the whole run, as a training loop has: its staging buffer is allocated by
    # the warm-up save and reused by every later one (a fresh manager per save would time the
    # allocation and first touch of that buffer instead)
    manager = CheckpointManager(f"file://{root}/manager", keep_last=1)
    saves = iter(range(1, 1_000_000))

    def run_case(case: str, r: int) -> dict[str, float]:
        with torch.no_grad():  # new values: nothing to deduplicate against the last save
            for p in sd.values():
                p.add_(1)
        base = statistics.median(_steps_while(step, lambda: False, at_least=30))
        d = root / f"{case}-{r}"
        t0 = time.perf_counter()
        if case == "manager":
            t0 = time.perf_counter()
            for b, p in zip(bufs, sd.values(), strict=True):
                b.copy_(p)
            if r >= 0:  # not the warm-up
                floor.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            handle = manager.save_async(next(saves), {"model": state})
            blocked = time.perf_counter() - t0
            during = _steps_while(step, lambda: not handle.done())
            handle.wait()
            total = time.perf_counter() - t0
        else:
            kind = AsyncCheckpointerType.PROCESS if case == "dcp_process" else AsyncCheckpointerType.THREAD
            writer = ObjckptStorageWriter(f"file://{d}", step=1, dedup=False)
            t0 = time.perf_counter()
            resp = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind)
            blocked = time.perf_counter() - t0
            fut = getattr(resp, "upload_completion", resp)
            during = _steps_while(step, lambda: not fut.done())
            fut.result()
            total = time.perf_counter() - t0
            writer.close()
        shutil.rmtree(d, ignore_errors=True)
        return {
            "slowdown": statistics.median(during) / base,
            "steps": len(during),
            "blocked_s": blocked,
            "total_s": total,
        }

    # warm-up: DCP's checkpoint process is started by the first PROCESS save (seconds; untimed)
    for case in CASES:
        run_case(case, -1)
    for case in CASES:
        out["cases"][case] = []
    for r in range(runs):
        order = list(CASES[r % len(CASES) :] + CASES[: r % len(CASES)])
        for case in order:
            out["cases"][case].append(run_case(case, r))
    manager.close()
    dist.destroy_process_group()
    return out


def summary(res: dict[str, Any]) -> list[str]:
    lines = []
    floor, sync = Series(res["memcpy_floor_s"]), Series(res["sync_save_s"])
    lines.append(f"memcpy floor {floor.fmt(3, 's')}, sync CheckpointManager.save {sync.fmt(2, 's')}")
    for case, rows in res["cases"].items():
        sl = Series([r["slowdown"] for r in rows])
        bl = Series([r["blocked_s"] for r in rows])
        tt = Series([r["total_s"] for r in rows])
        lines.append(
            f"{case:<12} step slowdown {sl.fmt(2, 'x')}  blocking {bl.fmt(3, 's')}  start-to-commit {tt.fmt(2, 's')}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # one training thread: the uploader competes for what is left
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    root = Path(tempfile.mkdtemp(prefix="objckpt-async-bench-"))
    try:
        res = bench(args.mib, args.runs, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        write_json(args.out, res)
    print("\n".join(summary(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
