"""Rank functions for the multi-process tests (imported by spawned processes: keep it light)."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from objckpt.errors import ObjckptError
from objckpt.store import open_store
from objckpt.store.wrappers import CountingStore
from objckpt.training.manager import CheckpointManager
from objckpt.training.sampler import ResumableDistributedSampler
from objckpt.training.serialization import dumps
from objckpt.training.state import TrainingProgress

N_SAMPLES = 128
DIM = 6
MICRO = 4
ACCUM = 2


class Synthetic(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(N_SAMPLES, DIM, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def build(rank: int, world_size: int) -> dict[str, Any]:
    """Model, optimizer, scheduler, scaler, sampler, progress and a NumPy generator."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
    )
    ddp = DDP(model) if world_size > 1 else model
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    sampler = ResumableDistributedSampler(N_SAMPLES, num_replicas=world_size, rank=rank, seed=7)
    return {
        "model": ddp,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": scaler,
        "sampler": sampler,
        "progress": TrainingProgress(),
        "noise": np.random.default_rng(100 + rank),
    }


def seed_rank(rank: int) -> None:
    random.seed(10 + rank)
    np.random.seed(20 + rank)
    torch.manual_seed(30 + rank)  # dropout differs per rank, as in real jobs


def train(
    mgr: CheckpointManager,
    state: dict[str, Any],
    total: int,
    *,
    crash_at: int | None = None,
    on_step: Any = None,
) -> list[list[int]]:
    """Train to ``total`` optimizer steps from wherever ``state`` is; return per-step sample ids."""
    ds = Synthetic()
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    sampler, progress, noise = state["sampler"], state["progress"], state["noise"]
    order: list[list[int]] = []
    current: list[int] = []
    while progress.global_step < total:
        sampler.set_epoch(progress.epoch)
        # its own generator: DataLoader draws a seed per iterator from it, not from the global RNG
        loader = DataLoader(ds, batch_size=MICRO, sampler=sampler, generator=torch.Generator())
        for x, y, idx in loader:
            current.extend(idx.tolist())
            # every RNG stream takes part: Python, NumPy legacy, a NumPy Generator, torch (dropout)
            x = (
                x * (1.0 + 0.01 * random.random())
                + torch.from_numpy(
                    0.01 * np.random.randn(*x.shape) + 0.01 * noise.standard_normal(x.shape)
                ).float()
            )
            sync = progress.accumulation_step == ACCUM - 1
            ctx = model.no_sync() if (not sync and hasattr(model, "no_sync")) else _null()
            with ctx:
                loss = torch.nn.functional.mse_loss(model(x), y) / ACCUM
                loss.backward()
            progress.samples_seen += len(idx)
            progress.accumulation_step += 1
            if progress.accumulation_step == ACCUM:
                opt.step()
                sched.step()
                opt.zero_grad()
                progress.accumulation_step = 0
                progress.global_step += 1
                order.append(current)
                current = []
                mgr.save(progress.global_step, state)
                if on_step is not None:
                    on_step(progress.global_step)
                if crash_at is not None and progress.global_step == crash_at:
                    os._exit(1)
                if progress.global_step >= total:
                    break
        else:
            progress.epoch += 1
    return order


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Final parameters, optimizer/scheduler/sampler/progress state and the next RNG draws."""
    model = state["model"].module if hasattr(state["model"], "module") else state["model"]
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": state["optimizer"].state_dict(),
        "scheduler": state["scheduler"].state_dict(),
        "sampler": state["sampler"].state_dict(),
        "progress": state["progress"].state_dict(),
        "next_python": random.random(),
        "next_numpy": np.random.rand(3),
        "next_generator": state["noise"].standard_normal(3),
        "next_torch": torch.rand(3),
    }


# ---------------------------------------------------------------------------------- scenarios


def resume_run(
    rank: int, world_size: int, root: str, out: str, total: int, every: int, crash_at: int | None
) -> None:
    """Train to ``total`` (restoring first); optionally crash the whole job at ``crash_at``."""
    state = build(rank, world_size)
    seed_rank(rank)
    mgr = CheckpointManager(root, every=every, keep_last=3, timeout=60, handshake_timeout=60)
    restored = mgr.restore(state)
    order = train(mgr, state, total, crash_at=crash_at)
    result = {"restored": restored, "order": order, **snapshot(state)}
    Path(out, f"rank{rank}.bin").write_bytes(dumps(result))
    mgr.close()


class KillingStore(CountingStore):
    """SIGKILLs this process when it uploads a part of ``victim`` (a key substring)."""

    def __init__(self, inner: Any, victim: str) -> None:
        super().__init__(inner)
        self.victim = victim

    def _invoke(self, op: str, key: str, keys: Any, fn: Any, *args: Any) -> Any:
        if op == "upload_part" and self.victim in key and args[1] >= 2:  # args: handle, part_number, ...
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._invoke(op, key, keys, fn, *args)


def killed_during_upload(rank: int, world_size: int, root: str, out: str) -> None:
    """Checkpoints at 10 and 20; at 30 rank 1 is SIGKILLed in the middle of a multipart upload."""
    state = build(rank, world_size)
    seed_rank(rank)
    # 256-byte parts: every replicated shard goes through a multipart upload
    store = open_store(root, part_size=256)
    if rank == 1:
        store = KillingStore(store, "00000000000000000030-")
    mgr = CheckpointManager(store, every=10, timeout=30, handshake_timeout=30)
    try:
        train(mgr, state, 30)
        outcome = "no error"
    except ObjckptError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps({"outcome": outcome}))
    os._exit(0)  # the peer is dead: skip the process-group teardown


def restore_only(rank: int, world_size: int, root: str, out: str, step: int | None = None) -> None:
    state = build(rank, world_size)
    seed_rank(rank)
    mgr = CheckpointManager(root, timeout=30, handshake_timeout=30)
    try:
        restored = mgr.restore(state, step=step)
        outcome = {"restored": restored, "fallbacks": mgr.fallbacks}
    except ObjckptError as exc:
        outcome = {"error": f"{type(exc).__name__}: {exc}"}
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))
    mgr.close()


def rank0_only_save(rank: int, world_size: int, root: str, out: str) -> None:
    """Rank 0 calls save() alone (the `if rank == 0: save()` bug); rank 1 stays alive."""
    state = build(rank, world_size)
    mgr = CheckpointManager(root, timeout=5, handshake_timeout=3)
    outcome = "returned"
    if rank == 0:
        try:
            mgr.save(1, state)
        except ObjckptError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        Path(out, "rank0.json").write_text(json.dumps({"outcome": outcome}))
    # meet on the default group (not the checkpoint groups): rank 1 waits here meanwhile
    dist.barrier()


def setup_two_checkpoints(rank: int, world_size: int, root: str, out: str) -> None:
    state = build(rank, world_size)
    seed_rank(rank)
    mgr = CheckpointManager(root, every=10, timeout=30, handshake_timeout=30)
    train(mgr, state, 20)
    mgr.close()


def disagree(rank: int, world_size: int, root: str, other_root: str, out: str) -> None:
    """Ranks ask for different steps, then read different roots, then restore normally."""
    results: dict[str, Any] = {}
    state = build(rank, world_size)
    mgr = CheckpointManager(root, timeout=30, handshake_timeout=30)
    try:
        mgr.restore(state, step=10 if rank == 0 else 20)
        results["different_steps"] = "no error"
    except ObjckptError as exc:
        results["different_steps"] = f"{type(exc).__name__}: {exc}"
    odd = CheckpointManager(root if rank == 0 else other_root, timeout=30, handshake_timeout=30)
    try:
        odd.restore(state)
        results["different_roots"] = "no error"
    except ObjckptError as exc:
        results["different_roots"] = f"{type(exc).__name__}: {exc}"
    # the newest checkpoint's rank-1 shard is corrupt: all ranks fall back to step 10 together
    try:
        results["restored"] = mgr.restore(state)
        results["fallbacks"] = mgr.fallbacks
        results["global_step"] = state["progress"].global_step
    except ObjckptError as exc:
        results["restored"] = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    mgr.close()
    odd.close()


# ---------------------------------------------------------------------------------- async saves


def capture(state: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of everything a checkpoint restores, RNG included, drawing nothing."""
    import copy

    model = state["model"].module if hasattr(state["model"], "module") else state["model"]
    return copy.deepcopy(
        {
            "params": model.state_dict(),
            "optimizer": state["optimizer"].state_dict(),
            "scheduler": state["scheduler"].state_dict(),
            "sampler": state["sampler"].state_dict(),
            "progress": state["progress"].state_dict(),
            "python_rng": random.getstate(),
            "numpy_rng": np.random.get_state(),
            "torch_rng": torch.get_rng_state(),
            "noise": state["noise"].bit_generator.state,
        }
    )


def _scribble(state: dict[str, Any]) -> None:
    """Change every parameter in place, the same way on every rank."""
    model = state["model"].module if hasattr(state["model"], "module") else state["model"]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-2.0).add_(3.0)


class HoldingStore(CountingStore):
    """Holds this rank's shard writes until the file ``signal`` exists (60 s at most)."""

    def __init__(self, inner: Any, signal: str) -> None:
        super().__init__(inner)
        self.signal = signal

    def _invoke(self, op: str, key: str, keys: Any, fn: Any, *args: Any) -> Any:
        if op in ("put", "create_upload") and key.startswith("data/"):
            import time

            deadline = time.monotonic() + 60
            while not os.path.exists(self.signal) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super()._invoke(op, key, keys, fn, *args)


def async_round_trip(rank: int, world_size: int, root: str, failing: str, abandoned: str, out: str) -> None:
    """save_async under DDP while training (and in-place changes) go on; restore both
    checkpoints into fresh objects; a save whose rank-1 upload fails; an abandoned save."""
    from objckpt.errors import PermissionDeniedError
    from objckpt.store.wrappers import Fault, FaultInjectingStore

    result: dict[str, Any] = {}
    state = build(rank, world_size)
    seed_rank(rank)
    # every=1000: train()'s own save() calls are never due; the saves below are forced
    mgr = CheckpointManager(root, every=1000, keep_last=None, timeout=60, handshake_timeout=60)
    train(mgr, state, 5)
    result["at_save"] = capture(state)
    first = mgr.save_async(5, state, force=True)
    _scribble(state)  # right after the call: must not reach the checkpoint
    train(mgr, state, 8)  # DDP all-reduces on the default group while the save uploads
    assert first.wait(timeout=120).step == 5
    result["at_final"] = capture(state)
    second = mgr.save_async(8, state, force=True)
    _scribble(state)
    mgr.close()  # waits for the save in flight
    assert second.committed
    result["attempts"] = [first.attempt, second.attempt]

    fresh = build(rank, world_size)
    mgr2 = CheckpointManager(root, timeout=60, handshake_timeout=60)
    steps = [mgr2.restore(fresh, step=5)]
    result["restored_save"] = capture(fresh)
    steps.append(mgr2.restore(fresh))
    result["restored_final"] = capture(fresh)
    result["restored_steps"] = steps
    mgr2.close()

    # rank 1 cannot write: both ranks' handles fail with the same CommitError naming rank 1
    store = open_store(failing)
    if rank == 1:
        store = FaultInjectingStore(
            store, [Fault(op="put", key="data/*/rank.bin", error=PermissionDeniedError, times=None)]
        )
    mgr3 = CheckpointManager(store, timeout=60, handshake_timeout=60)
    err = mgr3.save_async(1, state).exception(timeout=120)
    result["failure"] = f"{type(err).__name__}: {err}"
    mgr3.close()

    # rank 0 abandons while rank 1's upload is held: nothing is committed, on either rank
    signal = os.path.join(out, "abandon-requested")
    store = open_store(abandoned)
    if rank == 1:
        store = HoldingStore(store, signal)
    mgr4 = CheckpointManager(store, timeout=60, handshake_timeout=60)
    handle = mgr4.save_async(1, state)
    if rank == 0:
        handle.abandon()
        Path(signal).touch()
        mgr4.close(abandon=True)
    err = handle.exception(timeout=120)
    result["abandon"] = f"{type(err).__name__}: {err}"
    mgr4.close()  # rank 1: the outcome was seen above, so close raises nothing
    Path(out, f"rank{rank}.bin").write_bytes(dumps(result))
