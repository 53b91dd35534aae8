"""Lightning: an unserialisable ``save_hyperparameters()`` value fails when ``fit`` starts (the
``ObjckptHyperparametersCheck`` callback), not at the first checkpoint after a whole epoch."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip(
    "lightning.pytorch", reason="lightning not installed (pip install 'lightning==2.6.*')"
)

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from objckpt.errors import UnsupportedStateError  # noqa: E402
from objckpt.integrations.lightning import (  # noqa: E402
    ObjckptCheckpointIO,
    ObjckptHyperparametersCheck,
    check_hyperparameters,
)
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, args: object = None, schedule: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)
        self.steps = 0

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.steps += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(pl.LightningDataModule):
    def __init__(self, root: object = "data") -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4
        )


def fit(tmp_path: Path, model: pl.LightningModule, *, check: bool, data: Data | None = None) -> str:
    root = f"file://{tmp_path}/run"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        plugins=[ObjckptCheckpointIO(root)],
        callbacks=[ObjckptHyperparametersCheck()] if check else [],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / "pl"),
    )
    trainer.fit(model, datamodule=data or Data())
    return root


def test_fit_fails_before_the_first_epoch_naming_the_hyperparameter(tmp_path: Path) -> None:
    model = Tiny(args=argparse.Namespace(lr=0.1, layers=[4, 1]))
    with pytest.raises(UnsupportedStateError, match=r"hparams\['args'\].*argparse\.Namespace") as info:
        fit(tmp_path, model, check=True)
    assert "Tiny.save_hyperparameters()" in str(info.value)
    assert model.steps == 0  # not one training step was spent
    assert Reader(open_store(f"file://{tmp_path}/run")).latest() is None


def test_without_the_callback_it_fails_only_at_the_first_checkpoint(tmp_path: Path) -> None:
    # what the callback prevents: a whole epoch trained, then the save fails
    model = Tiny(args=argparse.Namespace(lr=0.1))
    with pytest.raises(UnsupportedStateError, match=r"\['args'\]"):
        fit(tmp_path, model, check=False)
    assert model.steps == 4


def test_nested_paths_and_the_datamodule_are_named(tmp_path: Path) -> None:
    model = Tiny(schedule={"warmup": [1, Path("/tmp/x")]})
    with pytest.raises(UnsupportedStateError, match=r"hparams\['schedule'\]\['warmup'\]\[1\].*Path"):
        fit(tmp_path, model, check=True)
    assert model.steps == 0
    with pytest.raises(UnsupportedStateError, match=r"datamodule\.hparams\['root'\].*Path"):
        fit(tmp_path, Tiny(), check=True, data=Data(root=Path("/data")))


def test_serialisable_hyperparameters_train_and_commit(tmp_path: Path) -> None:
    model = Tiny(args={"lr": 0.1, "layers": (4, 1)})
    root = fit(tmp_path, model, check=True)
    assert model.steps == 8
    latest = Reader(open_store(root)).latest()
    assert latest is not None and latest.step == 8


def test_check_hyperparameters_without_a_trainer() -> None:
    check_hyperparameters(Tiny(lr=0.1))  # fine
    with pytest.raises(UnsupportedStateError, match=r"hparams\['args'\]"):
        check_hyperparameters(Tiny(args=object()))
