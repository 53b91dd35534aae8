"""Ranks of the multi-process deduplication test (imported by the forkserver)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def lora(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    base = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB, frozen
    for p in base.parameters():
        p.requires_grad_(False)
    adapter = torch.nn.Linear(512, 8, bias=False)
    opt = torch.optim.AdamW(adapter.parameters(), lr=0.01)
    return {"base": base, "adapter": adapter, "optimizer": opt}


def two_saves_then_restore(rank: int, world_size: int, root: str, out: str) -> None:
    from objckpt.training.manager import CheckpointManager

    state = lora()
    report: dict[str, Any] = {}
    with CheckpointManager(root, keep_last=None) as mgr:
        first = mgr.save(1, state)
        torch.manual_seed(100)  # every rank trains the replicated adapter alike
        state["adapter"](torch.randn(4, 512)).pow(2).mean().backward()
        state["optimizer"].step()
        second = mgr.save(2, state)
        report["first"] = first.total_size
        report["second"] = second.total_size
        report["references"] = sorted([r.rank, r.name] for r in second.references)
        report["second_own"] = [s.size for s in second.shards_of(rank)]
    fresh = lora(seed=7)
    with CheckpointManager(root, keep_last=None) as mgr:
        report["restored"] = mgr.restore(fresh)
    report["same"] = all(
        torch.equal(a, b)
        for name in ("base", "adapter")
        for a, b in zip(state[name].state_dict().values(), fresh[name].state_dict().values(), strict=True)
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
