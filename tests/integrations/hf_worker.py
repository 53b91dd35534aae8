"""One rank of a 2-process CPU (gloo) Hugging Face Trainer run (tests/integrations/launch.py).

``python -m tests.integrations.hf_worker ROOT_FULL ROOT_CUT OUT MODE``:

* ``first``: (a) train 6 steps uninterrupted, committing checkpoints 3 and 6 to ROOT_FULL;
  (b) the same training stopped after step 3 ("the crash"), checkpoint 3 committed to ROOT_CUT.
* ``resume``: on fresh processes and an empty local folder, ``download_checkpoint(ROOT_CUT)`` and
  ``trainer.train(resume_from_checkpoint=...)`` to step 6.

Rank 0 writes ``OUT/<run>.pt`` with the final parameters of each run.
"""

from __future__ import annotations

import sys
import warnings

import torch


class Tiny(torch.nn.Module):
    """A model made from code (no hub download): Trainer only needs forward() to return a loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.net(x)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


def main(root_full: str, root_cut: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from objckpt.integrations.huggingface import ObjckptCallback, download_checkpoint

    class StopAt(TrainerCallback):
        def __init__(self, step: int) -> None:
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step >= self.step:
                control.should_training_stop = True
                control.should_save = True

    def run(name: str, root: str, stop_at: int | None = None, resume: bool = False) -> None:
        args = TrainingArguments(
            output_dir=f"{out}/local-{name}",
            per_device_train_batch_size=4,
            max_steps=6,
            save_strategy="steps",
            save_steps=3,
            learning_rate=0.05,
            lr_scheduler_type="linear",
            logging_strategy="no",
            report_to=[],
            use_cpu=True,
            ddp_backend="gloo",
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        torch.manual_seed(0)
        callbacks: list = [ObjckptCallback(root, keep_last=5)]
        if stop_at is not None:
            callbacks.append(StopAt(stop_at))
        trainer = Trainer(model=Tiny(), args=args, train_dataset=Data(), callbacks=callbacks)
        path = None
        if resume:
            path = download_checkpoint(root, f"{out}/downloaded-{args.process_index}")
            assert path is not None and path.endswith("checkpoint-3"), path
        trainer.train(resume_from_checkpoint=path)
        if args.process_index == 0:
            torch.save(
                {
                    "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                    "global_step": trainer.state.global_step,
                    "resumed_from": path,
                },
                f"{out}/{name}.pt",
            )

    if mode == "first":
        run("full", root_full)
        run("cut", root_cut, stop_at=3)
    else:
        run("resumed", root_cut, resume=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
