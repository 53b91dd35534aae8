"""Rank functions for tests/training/test_export.py (run in fresh processes by ``mp.run_world``)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class Net(torch.nn.Module):
    """Odd sizes (uneven FSDP row shards), an int and a float64 buffer, and (``tie=True``) the
    output layer tied to the embedding."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(9, 6)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 11), torch.nn.Linear(11, 6)])
        self.norm = torch.nn.LayerNorm(6)
        self.head = torch.nn.Linear(6, 9, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.arange(5, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))

    def forward(self, x: Any) -> Any:
        h = self.embed(x).mean(dim=1)
        h = self.layers[1](torch.relu(self.layers[0](h)))
        return self.head(self.norm(h)) * self.scale.sum().to(torch.float32)


def manager_save(rank: int, world: int, root: str, out: str) -> None:
    """Every rank saves one replicated model + AdamW through CheckpointManager; rank 0 writes the
    reference state dict."""
    from objckpt.training.manager import CheckpointManager

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randint(0, 9, (4, 3))).pow(2).sum().backward()
    opt.step()
    with CheckpointManager(root) as manager:
        manager.save(7, {"model": model, "optimizer": opt})
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(out, "reference.pt"))
    dist.barrier()


def fsdp_save(rank: int, world: int, root: str, out: str) -> None:
    """FSDP2 over a CPU mesh: one training step, then save_sharded of the model, the optimizer and
    DTensors sharded along dimension 1 and 2 (several runs per chunk); rank 0 writes the full
    state dicts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from objckpt.training.dcp import save_sharded

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = Net(tie=False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    model(torch.randint(0, 9, (4, 3))).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    g = torch.Generator().manual_seed(5)
    extra_full = {
        "cols": torch.randn(6, 10, generator=g),
        "cube": torch.randn(3, 9, 5, generator=g),
        "deep": torch.randn(2, 3, 11, generator=g),
    }
    extra = {
        "cols": distribute_tensor(extra_full["cols"], mesh, [Shard(1)]),
        "cube": distribute_tensor(extra_full["cube"], mesh, [Shard(1)]),
        "deep": distribute_tensor(extra_full["deep"], mesh, [Shard(2)]),
    }
    msd, osd = get_state_dict(model, opt)
    save_sharded({"model": msd, "optim": osd, "extra": extra}, root, step=30)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": full, "extra": extra_full}, Path(out, "reference.pt"))
    dist.barrier()
