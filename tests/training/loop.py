"""A training loop over a data loader that lives in the checkpointed state (any num_workers),
shared by the one-process tests and the multi-process rank functions."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from objckpt.training.data import ResumableDataLoader
from objckpt.training.manager import CheckpointManager

from .workers import ACCUM, MICRO, Synthetic, _null, build


def with_loader(state: dict[str, Any], kind: str, *, num_workers: int = 2, **options: Any) -> dict[str, Any]:
    """``state`` plus ``state["loader"]`` over its sampler: ``"resumable"`` (objckpt's) or
    ``"stateful"`` (torchdata's StatefulDataLoader)."""
    sampler = state["sampler"]
    if kind == "resumable":
        loader: Any = ResumableDataLoader(
            Synthetic(), batch_size=MICRO, sampler=sampler, num_workers=num_workers, **options
        )
    else:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(
            Synthetic(),
            batch_size=MICRO,
            sampler=sampler,
            num_workers=num_workers,
            generator=torch.Generator(),
            **options,
        )
    return {**state, "loader": loader}


def build_with_loader(rank: int, world_size: int, kind: str, **options: Any) -> dict[str, Any]:
    return with_loader(build(rank, world_size), kind, **options)


def train(
    mgr: CheckpointManager | None,
    state: dict[str, Any],
    total: int,
    *,
    crash_at: int | None = None,
    until_epoch_end: bool = False,
) -> list[list[int]]:
    """Train to ``total`` optimizer steps (or, with ``until_epoch_end``, to the end of the
    current epoch); return the sample ids of each optimizer step."""
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    loader, progress, noise = state["loader"], state["progress"], state["noise"]
    order: list[list[int]] = []
    current: list[int] = []
    while progress.global_step < total:
        loader.sampler.set_epoch(progress.epoch)
        for x, y, idx in loader:
            current.extend(idx.tolist())
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
                if mgr is not None:
                    mgr.save(progress.global_step, state)
                if crash_at is not None and progress.global_step == crash_at:
                    os._exit(1)
                if progress.global_step >= total:
                    break
        else:
            progress.epoch += 1
            if until_epoch_end:
                break
    if current:
        order.append(current)
    return order
