"""The data position is what the training loop consumed, with any number of loader workers."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from objckpt.reader import Reader
from objckpt.store.memory import MemoryStore
from objckpt.training.data import ResumableDataLoader
from objckpt.training.manager import CheckpointManager
from objckpt.training.sampler import ResumableDistributedSampler
from objckpt.training.serialization import decode, dumps
from objckpt.training.state import TrainingStateError

from . import loop, workers

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

DATA = list(range(103))  # 25 batches of 4 and a tail of 3


def _batches(loader: Any, n: int | None = None) -> list[list[int]]:
    out = []
    for i, b in enumerate(loader):
        out.append(b.tolist() if isinstance(b, torch.Tensor) else b)
        if n is not None and i + 1 == n:
            break
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"num_workers": 0},
        {"num_workers": 2},
        {"num_workers": 2, "prefetch_factor": 4},
        {"num_workers": 2, "persistent_workers": True},
        {"num_workers": 1, "drop_last": True},
        {"num_workers": 2, "batch_size": None},
    ],
    ids=str,
)
def test_position_is_what_the_loop_consumed(options: dict[str, Any]) -> None:
    options = {"batch_size": 4, **options}
    full = _batches(ResumableDataLoader(DATA, seed=3, **options))
    loader = ResumableDataLoader(DATA, seed=3, **options)
    head = _batches(loader, 10)
    state = loader.state_dict()
    per_batch = 1 if options["batch_size"] is None else 4
    # what the loop received, however far the workers prefetched (with 2 workers and the default
    # prefetch_factor, 4 batches ahead)
    assert state["sampler"]["position"] == 10 * per_batch
    assert loader.sampler._drawn >= state["sampler"]["position"]
    resumed = ResumableDataLoader(DATA, seed=3, **options)
    resumed.load_state_dict(decode(dumps(state)))
    assert head + _batches(resumed) == full  # exactly the next batch of the uninterrupted run


def test_a_finished_epoch_resumes_as_finished_and_repeats_if_iterated_again() -> None:
    loader = ResumableDataLoader(DATA, batch_size=4, seed=1, num_workers=2, drop_last=True)
    epoch = _batches(loader)
    assert len(epoch) == 25 and loader.sampler.position == loader.sampler.num_samples
    resumed = ResumableDataLoader(DATA, batch_size=4, seed=1, num_workers=2, drop_last=True)
    resumed.load_state_dict(loader.state_dict())
    assert _batches(resumed) == []  # nothing was left of the epoch
    assert _batches(loader) == epoch  # iterating again without set_epoch repeats it
    loader.set_epoch(1)
    assert loader.sampler.position == 0 and _batches(loader) != epoch


def test_the_loader_leaves_the_global_rng_alone() -> None:
    loader = ResumableDataLoader(DATA, batch_size=4, num_workers=0)
    before = torch.get_rng_state()
    _batches(loader, 3)
    iter(loader)
    assert torch.equal(torch.get_rng_state(), before)
    plain = DataLoader(DATA, batch_size=4)
    iter(plain)  # what it replaces: a plain DataLoader draws a seed from the global RNG
    assert not torch.equal(torch.get_rng_state(), before)


def test_configurations_that_cannot_be_exact_are_refused() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(4))

    with pytest.raises(ValueError, match="map-style"):
        ResumableDataLoader(Stream())
    with pytest.raises(ValueError, match="batch_sampler"):
        ResumableDataLoader(DATA, batch_sampler=[[0, 1]])
    with pytest.raises(ValueError, match="in_order=True"):
        ResumableDataLoader(DATA, num_workers=2, in_order=False)
    with pytest.raises(TypeError, match="ResumableDistributedSampler"):
        ResumableDataLoader(DATA, sampler=torch.utils.data.SequentialSampler(DATA))
    with pytest.raises(ValueError, match="to the sampler"):
        ResumableDataLoader(DATA, sampler=ResumableDistributedSampler(DATA), seed=4)


def test_a_plain_dataloader_with_workers_is_refused_at_save_time() -> None:
    """The documented setup before ResumableDataLoader: its position counted prefetched samples."""
    store = MemoryStore()
    sampler = ResumableDistributedSampler(DATA, seed=2)
    with pytest.warns(RuntimeWarning, match="num_workers=2.*prefetches"):
        head = _batches(DataLoader(DATA, batch_size=4, sampler=sampler, num_workers=2), 5)
    assert sampler.position > 5 * 4 and not sampler.exact  # the workers' prefetch, not the loop's
    with CheckpointManager(store) as mgr:
        with pytest.raises(
            TrainingStateError, match=r"step 7 exactly on rank 0: state\['sampler'\].*num_workers=2"
        ):
            mgr.save(7, {"sampler": sampler})
    assert Reader(store).steps() == []
    # a loader without workers draws exactly when it builds a batch: exact, saved as before
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _batches(DataLoader(DATA, batch_size=4, sampler=sampler), 1)
    assert sampler.exact
    with CheckpointManager(store) as mgr:
        assert mgr.save(8, {"sampler": sampler}) is not None
    assert len(head) == 5


def test_stateful_dataloader_state_is_saved_per_rank_and_resumes_exactly() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> tuple[Any, ResumableDistributedSampler]:
        s = ResumableDistributedSampler(DATA, seed=4)
        return StatefulDataLoader(DATA, batch_size=4, sampler=s, num_workers=2), s

    full = _batches(make()[0])
    store = MemoryStore()
    loader, sampler = make()
    head = _batches(loader, 9)
    with CheckpointManager(store) as mgr:
        # the sampler alone would be inexact (prefetched); saved with its loader it is restored
        # from the loader's snapshot
        with pytest.raises(TrainingStateError, match="StatefulDataLoader and save the loader"):
            mgr.save(1, {"sampler": sampler})
        mgr.save(2, {"loader": loader, "sampler": sampler})
    m = Reader(store).load(2)
    assert m.topology["per_rank"] == ["loader", "sampler"]
    fresh, fresh_sampler = make()
    with CheckpointManager(store) as mgr:
        assert mgr.restore({"loader": fresh, "sampler": fresh_sampler}) == 2
    assert head + _batches(fresh) == full


# ------------------------------------------------------------------ bitwise resume, one rank


def _run(kind: str, root: Any, total: int, *, restore_from: Any = None, step: int | None = None) -> dict:
    workers.seed_rank(0)
    state = loop.build_with_loader(0, 1, kind)
    if restore_from is not None:
        with CheckpointManager(restore_from) as mgr:
            assert mgr.restore(state, step=step) == step
    with CheckpointManager(root, every=10, keep_last=None) as mgr:
        order = loop.train(mgr, state, total)
    return {"order": order, **workers.snapshot(state)}


def _same(a: Any, b: Any, path: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        raw = lambda t: bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # noqa: E731
        assert raw(a) == raw(b), path
    elif isinstance(a, np.ndarray):
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("kind", ["resumable", "stateful"])
def test_bitwise_resume_with_two_workers_one_rank(kind: str) -> None:
    """Run A trains 40 steps with 2 loader workers, saving every 10; run B restores A's step 20
    (taken while the workers had prefetched beyond it) into fresh objects and trains to 40:
    the same samples in the same order, and bitwise the same parameters, optimizer state and
    next draws of every RNG."""
    root_a, root_b = MemoryStore(), MemoryStore()
    a = _run(kind, root_a, 40)
    b = _run(kind, root_b, 40, restore_from=root_a, step=20)
    assert b["order"] == a["order"][20:]
    for key in ("params", "optimizer", "scheduler", "sampler", "progress"):
        _same(a[key], b[key], key)
    for key in ("next_python", "next_numpy", "next_generator", "next_torch"):
        _same(a[key], b[key], key)
