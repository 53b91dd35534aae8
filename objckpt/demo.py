"""``objckpt demo``: kill a rank mid-training, resume from S3, prove nothing was lost.

What it does, on CPU, in about a minute:

1. starts an embedded S3 endpoint (moto on 127.0.0.1) and creates a bucket;
2. trains a small MLP with 4 data-parallel ranks (gloo, a resumable sampler, AdamW, a LR schedule,
   dropout and data augmentation drawing from every RNG), checkpointing every K steps to
   ``s3://<bucket>/demo-run`` through :class:`~objckpt.training.CheckpointManager`;
3. SIGKILLs one rank between two checkpoints; like torchrun, the launcher stops the other ranks
   and restarts the job, which restores the last committed step and trains to the end;
4. runs the same training uninterrupted, and checks that the resumed run ends bitwise equal
   to it (parameters and optimizer state on every rank).

Exit status 0 only if the resumed run matches. The S3 server is stopped at the end, on failure
too. Run it with ``python -m objckpt.demo`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["main", "missing_requirements"]

BUCKET = "objckpt-demo"

#: what the demo needs beyond objckpt itself: (module, what it is for, the extra providing it)
_REQUIREMENTS = (
    ("torch", "the training", "torch"),
    ("numpy", "the training", "torch"),
    ("boto3", "the s3:// backend", "s3"),
    ("moto", "the embedded S3 server", "dev"),
    ("flask", "the embedded S3 server (moto[server])", "dev"),
)


def missing_requirements() -> str | None:
    """Which packages the demo lacks and the extras to install, in one line; None if none.

    Asked before anything starts, so a missing moto is named as such rather than surfacing as
    the embedded server's ``ServerStartError``.
    """
    missing: dict[str, list[str]] = {}
    for module, purpose, extra in _REQUIREMENTS:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.setdefault(extra, []).append(f"{module} ({purpose})")
    if not missing:
        return None
    what = ", ".join(m for ms in missing.values() for m in ms)
    return f"the demo needs {what}: install with pip install 'objckpt[{','.join(sorted(missing))}]'"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="objckpt demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4, help="ranks (processes), default 4")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps, default 60")
    p.add_argument("--every", type=int, default=10, help="checkpoint every K steps, default 10")
    p.add_argument("--kill-at", type=int, default=37, help="SIGKILL a rank after this step, default 37")
    p.add_argument("--kill-rank", type=int, default=None, help="which rank to kill (default: the last)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a run is declared hung")
    return p


# ---------------------------------------------------------------------------------- the worker


def _worker(rank: int, world_size: int, store_file: str, cfg: dict[str, Any]) -> None:
    """One rank: restore, train to cfg['steps'] checkpointing every cfg['every'], report."""
    try:
        _train(rank, world_size, store_file, cfg)
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback per surviving rank
        first = str(exc).splitlines()[0] if str(exc) else ""
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's source-location prefix
        print(f"[{cfg['phase']}] rank {rank} stopped: {type(exc).__name__}: {first[:90]}", flush=True)
        os._exit(1)


def _train(rank: int, world_size: int, store_file: str, cfg: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from objckpt.training.manager import CheckpointManager, hash_config
    from objckpt.training.sampler import ResumableDistributedSampler
    from objckpt.training.serialization import dumps
    from objckpt.training.state import TrainingProgress

    torch.set_num_threads(1)
    # moto decides conditional writes without a lock; harmless with one coordinator, so keep the
    # demo's output to what matters
    logging.getLogger("objckpt.commit").setLevel(logging.ERROR)
    dist.init_process_group(
        # FileStore rendezvous: no TCP port to pick; gloo's sockets use ephemeral ports
        "gloo",
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    out = Path(cfg["out"])

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 1, generator=g)).tanh() + 0.05 * torch.randn(512, 1, generator=g)
    data = TensorDataset(x, y)
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=cfg["steps"])
    sampler = ResumableDistributedSampler(data, seed=1)
    progress = TrainingProgress()
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(100 + rank)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "progress": progress}

    mgr = CheckpointManager(
        cfg["uri"],
        every=cfg["every"],
        keep_last=3,
        config_hash=hash_config({k: cfg[k] for k in ("steps", "every")}),
        timeout=60,
        handshake_timeout=60,
    )
    t0 = time.monotonic()
    restored = mgr.restore(state)
    if rank == 0 and cfg["phase"] == "restart":
        print(
            f"[{cfg['phase']}] restored step {restored} (the last committed) in {time.monotonic() - t0:.2f} s",
            flush=True,
        )
    resumed_at = time.monotonic()
    recompute_s = None
    while progress.global_step < cfg["steps"]:
        sampler.set_epoch(progress.epoch)
        loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())
        for xb, yb in loader:
            # augmentation from the global Python/NumPy RNGs, dropout from torch's
            xb = (
                xb * (1 + 0.01 * random.random())
                + torch.from_numpy(0.01 * np.random.randn(*xb.shape)).float()
            )
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
            # Data parallelism by hand: average each gradient over the ranks. (DDP does the same
            # in buckets, but rebuilds its bucket layout after the first iteration of every
            # process; with more than 2 ranks the all-reduce's float sum order depends on that
            # layout, so a restarted DDP job differs from an uninterrupted one in the last bits
            # unless the layout is pinned, e.g. with find_unused_parameters=True.)
            for p in model.parameters():
                assert p.grad is not None  # backward() gave every parameter a gradient
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            progress.global_step += 1
            progress.samples_seen += len(xb)
            step = progress.global_step
            if cfg.get("reached") and step == cfg["reached"] and recompute_s is None:
                recompute_s = time.monotonic() - resumed_at
            if cfg.get("kill_at") == step and rank == cfg["kill_rank"]:
                print(
                    f"[{cfg['phase']}] rank {rank}: SIGKILL after step {step} (between checkpoints)",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)
            if rank == 0:
                (out / "reached.json").write_text(json.dumps({"step": step}))
            manifest = mgr.save(step, state)
            if manifest is not None and rank == 0:
                print(
                    f"[{cfg['phase']}] step {step}: committed {len(manifest.shards)} shards, "
                    f"{manifest.total_size / 1024:.0f} KiB, save {mgr.last_save['seconds']:.2f} s, loss {loss.item():.4f}",
                    flush=True,
                )
            if step >= cfg["steps"]:
                break
        else:
            progress.epoch += 1

    final = {
        "restored": restored,
        "recompute_s": recompute_s,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
    }
    (out / f"final-rank{rank}.bin").write_bytes(dumps(final))
    mgr.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- launcher


def _run_job(ctx: Any, target: Any, world_size: int, cfg: dict[str, Any], timeout: float) -> list[int | None]:
    """Start ``world_size`` ranks; when one fails, stop the rest (as torchrun's agent does).
    Returns the exit codes."""
    store_file = os.path.join(cfg["out"], "rendezvous")  # a fresh file per job
    procs = [
        ctx.Process(target=target, args=(r, world_size, store_file, cfg), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        # a failed rank leaves its peers blocked in a collective: give them 5 s to notice, then
        # stop them; and never wait past the overall deadline
        if (failed_at is not None and now - failed_at > 5) or now > deadline:
            for p in procs:
                if p.is_alive():
                    p.kill()
        time.sleep(0.1)
    for p in procs:
        p.join()
    if time.monotonic() > deadline:
        raise RuntimeError(f"run timed out after {timeout:.0f} s")
    return [p.exitcode for p in procs]


def _compare(a_dir: Path, b_dir: Path, world_size: int) -> list[str]:
    """Differences between two runs' final states (bitwise), per rank."""
    import torch

    from objckpt.training.serialization import loads

    problems: list[str] = []

    def same(x: Any, y: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            if not (
                isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            ):
                problems.append(path)
        elif isinstance(x, dict):
            if not isinstance(y, dict) or list(x) != list(y):
                problems.append(path)
            else:
                for k in x:
                    same(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            if not isinstance(y, (list, tuple)) or len(x) != len(y):
                problems.append(path)
            else:
                for i, (u, v) in enumerate(zip(x, y, strict=True)):
                    same(u, v, f"{path}/{i}")
        elif x != y:
            problems.append(path)

    for rank in range(world_size):
        a = loads((a_dir / f"final-rank{rank}.bin").read_bytes())
        b = loads((b_dir / f"final-rank{rank}.bin").read_bytes())
        for key in ("params", "optimizer", "scheduler"):
            same(a[key], b[key], f"rank {rank} {key}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Run the demo; return the process exit status (0: the resumed run matches)."""
    args = _parser().parse_args(argv)
    if args.world_size < 2 or args.every < 1 or not 0 < args.kill_at < args.steps:
        print("objckpt demo: need --world-size >= 2, --every >= 1, 0 < --kill-at < --steps", file=sys.stderr)
        return 2
    if args.kill_at % args.every == 0:
        print("objckpt demo: --kill-at must fall between two checkpoints", file=sys.stderr)
        return 2
    kill_rank = args.world_size - 1 if args.kill_rank is None else args.kill_rank
    problem = missing_requirements()
    if problem:
        print(f"objckpt demo: {problem}", file=sys.stderr)
        return 2

    import multiprocessing as mp

    from objckpt import demo as this  # workers pickle by reference: objckpt.demo._worker, not __main__
    from objckpt.testing.s3_servers import MotoServer, create_bucket

    started = time.monotonic()
    # forkserver: the server imports torch once and forks every rank from it (fast, and no
    # threads of this process are inherited)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "objckpt.training.manager", "objckpt.store.s3"])
    print(
        f"objckpt demo: {args.world_size} ranks (gloo, CPU), MLP, {args.steps} steps, checkpoint every "
        f"{args.every}; rank {kill_rank} will be SIGKILLed after step {args.kill_at}",
        flush=True,
    )
    try:
        with MotoServer() as srv, tempfile.TemporaryDirectory(prefix="objckpt-demo-") as tmp:
            create_bucket(srv.endpoint_url, BUCKET)
            print(f"[s3] embedded S3 endpoint {srv.endpoint_url}, bucket s3://{BUCKET}", flush=True)
            base = {"steps": args.steps, "every": args.every, "kill_rank": kill_rank}
            crashed, resumed, reference = Path(tmp, "crashed"), Path(tmp, "resumed"), Path(tmp, "reference")
            for d in (crashed, resumed, reference):
                d.mkdir()
            uri = srv.uri(BUCKET, "demo-run")

            codes = _run_job(
                ctx,
                this._worker,
                args.world_size,
                {**base, "uri": uri, "out": str(crashed), "phase": "run", "kill_at": args.kill_at},
                args.timeout,
            )
            if codes[kill_rank] != -signal.SIGKILL:
                print(
                    f"objckpt demo: FAILED: rank {kill_rank} was not killed (exit codes {codes})", flush=True
                )
                return 1
            reached = json.loads((crashed / "reached.json").read_text())["step"]
            print(
                f"[run] job failed (exit codes {codes}); restarting all {args.world_size} ranks", flush=True
            )

            codes = _run_job(
                ctx,
                this._worker,
                args.world_size,
                {**base, "uri": uri, "out": str(resumed), "phase": "restart", "reached": reached},
                args.timeout,
            )
            if any(codes):
                print(f"objckpt demo: FAILED: the restarted job exited with {codes}", flush=True)
                return 1
            print("[reference] same training, uninterrupted", flush=True)
            codes = _run_job(
                ctx,
                this._worker,
                args.world_size,
                {
                    **base,
                    "uri": srv.uri(BUCKET, "demo-reference"),
                    "out": str(reference),
                    "phase": "reference",
                },
                args.timeout,
            )
            if any(codes):
                print(f"objckpt demo: FAILED: the reference job exited with {codes}", flush=True)
                return 1

            from objckpt.training.serialization import loads

            r0 = loads((resumed / "final-rank0.bin").read_bytes())
            restored, recompute = r0["restored"], r0["recompute_s"]
            problems = _compare(resumed, reference, args.world_size)
    except Exception as exc:  # noqa: BLE001 - the demo reports, it does not trace back
        hint = ""
        if "No module named" in str(exc):  # e.g. the server's interpreter lacks moto[server]
            hint = " (install the demo's packages with pip install 'objckpt[dev,torch,s3]')"
        print(f"objckpt demo: FAILED: {type(exc).__name__}: {exc}{hint}", flush=True)
        return 1

    lost = reached - (restored or 0)
    print(f"last committed step: {restored}")
    print(f"steps lost: {lost} (the crashed job had reached step {reached})")
    print(f"recompute time: {recompute:.2f} s" if recompute is not None else "recompute time: n/a")
    print(f"total demo time: {time.monotonic() - started:.1f} s")
    if problems:
        print(f"resumed run matches uninterrupted run: NO ({len(problems)} differences, e.g. {problems[:3]})")
        return 1
    print(
        f"resumed run matches uninterrupted run: YES (parameters and optimizer state bitwise equal on all {args.world_size} ranks)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
