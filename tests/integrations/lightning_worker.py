"""One rank of a 2-process CPU DDP Lightning run (launched by tests/integrations/launch.py).

``python -m tests.integrations.lightning_worker ROOT OUT MODE`` where MODE is ``first`` (fit 1
epoch from scratch, checkpoint at its end through ``AsyncCheckpointIO(ObjckptCheckpointIO)``) or
``resume`` (fit to 2 epochs from ``ckpt_path="epoch=0-step=4.ckpt"`` with a plain
``ObjckptCheckpointIO``). Rank 0 writes to ``OUT/<MODE>.pt`` the parameters and optimizer state
when training started and ended, and the step it started at.
"""

from __future__ import annotations

import copy
import sys
import warnings

import torch


def main(root: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    from objckpt.integrations.lightning import ObjckptCheckpointIO

    class Tiny(pl.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            self.at_start: dict = {}

        def on_train_start(self) -> None:
            self.at_start = snapshot(self)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]

    def snapshot(module: pl.LightningModule) -> dict:
        opt = module.trainer.optimizers[0]
        return {
            "step": module.trainer.global_step,
            "params": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "optimizer": copy.deepcopy(opt.state_dict()),
            "lr": opt.param_groups[0]["lr"],
            "scheduler": copy.deepcopy(module.trainer.lr_scheduler_configs[0].scheduler.state_dict()),
        }

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    torch.manual_seed(1)
    model = Tiny()
    io = ObjckptCheckpointIO(root)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        max_epochs=1 if mode == "first" else 2,
        plugins=[AsyncCheckpointIO(io) if mode == "first" else io],
        callbacks=[ModelCheckpoint(dirpath=f"{out}/ckpt-{mode}", save_top_k=-1, every_n_epochs=1)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=f"{out}/root-{mode}",
    )
    # 32 samples, batch 4 per rank, 2 ranks: 4 optimizer steps per epoch
    loader = DataLoader(data, batch_size=4)
    trainer.fit(model, loader, ckpt_path="epoch=0-step=4.ckpt" if mode == "resume" else None)
    if trainer.global_rank == 0:
        torch.save({"start": model.at_start, "end": snapshot(model)}, f"{out}/{mode}.pt")
    # Lightning destroys the default group only for nccl; a gloo group left to the interpreter's
    # finalization can abort the process at exit. A well-behaved script destroys it once done.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
