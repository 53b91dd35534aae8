"""Fault-tolerant data-parallel training with objckpt under torchrun.

Run (CPU, gloo)::

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 --max-restarts 2 \\
        examples/train_torchrun.py --uri file:///tmp/objckpt-example --steps 40 --every 10 \\
        --crash-rank 1 --crash-at 27

Every rank restores the last committed checkpoint (if any), trains, and checkpoints every
``--every`` steps. With ``--crash-rank/--crash-at`` one rank ``os._exit(1)`` s after that step on
the first run only; torchrun's agent stops the other ranks and restarts the job
(``TORCHELASTIC_RESTART_COUNT`` is then 1), which resumes from the last committed step and
reports the steps lost. Rank 0 finally prints ``final step N params sha256 ...`` so two runs can be
compared.

Launcher settings that make restarts reliable on torch 2.13 (CPU, gloo):

* ``--standalone`` (or ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` across nodes): the
  default *static* rendezvous keeps one TCP store across restarts and restarted workers read the
  previous round's gloo addresses, so ``init_process_group`` fails or hangs;
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the c10d rendezvous's shared store, a restarted
  job's gloo initialisation hung in 10 of 13 runs; with a store per round it did not.

Bitwise resume with DDP and more than 2 ranks: DDP rebuilds its gradient buckets after the first
iteration of every process and the all-reduce's float sum order depends on the layout, so pass
``--pin-ddp-buckets`` (``find_unused_parameters=True`` keeps the constructor's layout).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from objckpt.training.manager import CheckpointManager, hash_config
from objckpt.training.sampler import ResumableDistributedSampler
from objckpt.training.state import TrainingProgress


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--uri", required=True, help="run root: s3://bucket/run, gs://..., file:///abs/path")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="checkpoint every K optimizer steps")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--crash-rank", type=int, default=None, help="rank that exits after --crash-at (first run only)"
    )
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--pin-ddp-buckets", action="store_true", help="bitwise resume with > 2 ranks (see above)")
    p.add_argument(
        "--status-file", default=None, help="where rank 0 records the last step reached (default: tmp)"
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # env:// from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    status = Path(
        args.status_file
        or Path(
            tempfile.gettempdir(),
            f"objckpt-example-{hashlib.sha256(args.uri.encode()).hexdigest()[:12]}.json",
        )
    )

    # Synthetic regression data, identical on every rank.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 12, generator=g)
    y = (x @ torch.randn(12, 1, generator=g)).sin()
    data = TensorDataset(x, y)

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        ),
        find_unused_parameters=args.pin_ddp_buckets,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    sampler = ResumableDistributedSampler(data, seed=1)
    progress = TrainingProgress()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "progress": progress}
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(1000 + rank)

    config = {
        k: v for k, v in vars(args).items() if k not in ("crash_rank", "crash_at", "status_file", "uri")
    }
    mgr = CheckpointManager(
        args.uri, every=args.every, keep_last=args.keep_last, config_hash=hash_config(config)
    )

    t0 = time.monotonic()
    restored = mgr.restore(state)  # every rank; RNG, sampler position, everything
    if rank == 0:
        if restart == 0 and restored is None:
            print(f"[example] fresh start, {world} ranks", flush=True)
        else:
            reached = json.loads(status.read_text())["step"] if status.exists() else None
            lost = f"{reached - (restored or 0)}" if reached is not None else "unknown"
            print(
                f"[example] restart {restart}: resumed from step {restored} in {time.monotonic() - t0:.2f} s; "
                f"steps lost: {lost} (the previous run reached step {reached})",
                flush=True,
            )
    resumed_at, recomputing_until = time.monotonic(), None
    if rank == 0 and status.exists() and restored is not None:
        recomputing_until = json.loads(status.read_text())["step"]

    while progress.global_step < args.steps:
        sampler.set_epoch(progress.epoch)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator())
        for xb, yb in loader:
            xb = xb + 0.01 * torch.from_numpy(np.random.randn(*xb.shape)).float() * random.random()
            last_micro = progress.accumulation_step == args.accumulate - 1
            # skip the gradient all-reduce on all but the last micro-batch
            with model.no_sync() if not last_micro else _Nothing():
                loss = torch.nn.functional.mse_loss(model(xb), yb) / args.accumulate
                loss.backward()
            progress.accumulation_step += 1
            progress.samples_seen += len(xb) * world
            if progress.accumulation_step < args.accumulate:
                continue
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            progress.accumulation_step = 0
            progress.global_step += 1
            step = progress.global_step
            if rank == 0:
                status.write_text(json.dumps({"step": step}))
                if recomputing_until is not None and step == recomputing_until:
                    print(
                        f"[example] recomputed the lost steps in {time.monotonic() - resumed_at:.2f} s",
                        flush=True,
                    )
            if restart == 0 and rank == args.crash_rank and step == args.crash_at:
                print(f"[example] rank {rank}: simulated crash after step {step}", flush=True)
                os._exit(1)
            manifest = mgr.save(step, state)  # only at optimizer-step boundaries; None if not due
            if manifest is not None and rank == 0:
                print(
                    f"[example] step {step}: checkpoint committed ({manifest.total_size} bytes), loss {loss.item() * args.accumulate:.4f}",
                    flush=True,
                )
            if step >= args.steps:
                break
        else:
            progress.epoch += 1

    if rank == 0:
        digest = hashlib.sha256()
        for k, v in model.module.state_dict().items():
            digest.update(k.encode())
            digest.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        print(f"[example] final step {progress.global_step} params sha256 {digest.hexdigest()}", flush=True)
        status.unlink(missing_ok=True)
    mgr.close()
    dist.destroy_process_group()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
