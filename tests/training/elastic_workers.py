"""Rank functions of the elastic and data-loader multi-process tests (test_elastic_mp.py)."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import torch

from objckpt.training.manager import CheckpointManager
from objckpt.training.serialization import dumps

from . import loop, workers


def _state_of(state: dict[str, Any]) -> dict[str, Any]:
    """What must restore bit for bit at any world size, deep-copied; draws no random number."""
    model = state["model"].module if hasattr(state["model"], "module") else state["model"]
    return copy.deepcopy(
        {
            "params": model.state_dict(),
            "optimizer": state["optimizer"].state_dict(),
            "scheduler": state["scheduler"].state_dict(),
            "scaler": state["scaler"].state_dict(),
            "progress": state["progress"].state_dict(),
        }
    )


def _global_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def train_and_save(rank: int, world_size: int, root: str, out: str, steps: int) -> None:
    """Train ``steps`` optimizer steps (ResumableDataLoader, no workers) and save the last one."""
    workers.seed_rank(rank)
    state = loop.build_with_loader(rank, world_size, "resumable", num_workers=0)
    with CheckpointManager(root, every=steps, timeout=60, handshake_timeout=60) as mgr:
        order = loop.train(mgr, state, steps)
    # nothing drew a random number since the save at ``steps``: this is the RNG it holds
    result = {"order": order, "rng": _global_rng(), **_state_of(state)}
    Path(out, f"rank{rank}.bin").write_bytes(dumps(result))


def restore_and_finish_epoch(rank: int, world_size: int, root: str, out: str) -> None:
    """Restore the latest checkpoint at this world size into fresh objects, record what was
    restored, then train to the end of the epoch recording the samples."""
    workers.seed_rank(rank)
    state = loop.build_with_loader(rank, world_size, "resumable", num_workers=0)
    with CheckpointManager(root, timeout=60, handshake_timeout=60) as mgr:
        restored = mgr.restore(state)
        report = mgr.last_restore
    got = {"rng": _global_rng(), **_state_of(state)}
    order = loop.train(None, state, 10**9, until_epoch_end=True)
    Path(out, f"rank{rank}.bin").write_bytes(
        dumps({"restored": restored, "per_rank": report.per_rank, "order": order, **got})
    )


def resume_with_workers(
    rank: int,
    world_size: int,
    kind: str,
    root: str,
    out: str,
    total: int,
    restore_root: str | None,
    step: int | None,
) -> None:
    """Train to ``total`` with a 2-worker loader of ``kind`` (saving every 10), after restoring
    ``restore_root`` at ``step`` when given."""
    workers.seed_rank(rank)
    state = loop.build_with_loader(rank, world_size, kind, num_workers=2)
    restored = None
    if restore_root is not None:
        with CheckpointManager(restore_root, timeout=60, handshake_timeout=60) as mgr:
            restored = mgr.restore(state, step=step)
    with CheckpointManager(root, every=10, keep_last=None, timeout=60, handshake_timeout=60) as mgr:
        order = loop.train(mgr, state, total)
    result = {"restored": restored, "order": order, **workers.snapshot(state)}
    Path(out, f"rank{rank}.bin").write_bytes(dumps(result))
