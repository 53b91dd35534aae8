"""Launch a small gloo world of processes for a test, bounded by a timeout."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, store_file: str, args: tuple[Any, ...]
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 shared cores: keep each rank single-threaded
    os.environ["OBJCKPT_TEST_RANK"] = str(rank)
    dist.init_process_group(
        "gloo",
        # a FileStore rendezvous: no port to pick (and race other jobs for); gloo's own sockets
        # bind ephemeral ports
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # skip destroy_process_group: peers may be gone
    dist.destroy_process_group()


def run_world(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0, daemon: bool = True
) -> list[int | None]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes joined in one gloo
    group; return their exit codes (negative: killed by that signal). Processes still running
    after ``timeout`` seconds are killed and the test fails. ``daemon=False`` lets a rank start
    processes of its own (DataLoader workers)."""
    import tempfile
    import time

    # forkserver: one server process imports torch once and forks every rank from it (a spawned
    # rank would spend seconds importing torch); nothing of pytest's threads is inherited
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tests.training.workers"])
    store_dir = tempfile.mkdtemp(prefix="objckpt-world-")
    store_file = os.path.join(store_dir, "rendezvous")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, store_file, args), daemon=daemon)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    import shutil

    shutil.rmtree(store_dir, ignore_errors=True)
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout}s: killed")
    return [p.exitcode for p in procs]
