"""Capture/restore of training state: RNG, accumulation boundary, staging checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from objckpt.training.serialization import decode, dumps
from objckpt.training.state import (
    TrainingProgress,
    TrainingStateError,
    apply_state,
    capture_global_rng,
    capture_item,
    check_restorable,
    check_step_boundary,
    classify,
    restore_global_rng,
)


def _draws(extra: list) -> list:
    return [random.random(), np.random.rand(), torch.rand(2).tolist()] + [
        g.standard_normal()
        if isinstance(g, np.random.Generator)
        else torch.rand(1, generator=g).item()
        if isinstance(g, torch.Generator)
        else g.random()
        for g in extra
    ]


def test_global_and_object_rng_round_trip_through_a_shard() -> None:
    gens = {
        "np": np.random.default_rng(1),
        "pcg": np.random.Generator(np.random.Philox(3)),
        "torch": torch.Generator().manual_seed(2),
        "py": random.Random(4),
    }
    random.gauss(0, 1)  # leave a cached gaussian in Python's state
    np.random.randn()
    saved = decode(
        dumps({"rng": capture_global_rng(), "items": {k: capture_item(k, g) for k, g in gens.items()}})
    )
    expected = _draws(list(gens.values()))
    # disturb everything, then restore
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    fresh = {
        "np": np.random.default_rng(9),
        "pcg": np.random.Generator(np.random.Philox(9)),
        "torch": torch.Generator().manual_seed(9),
        "py": random.Random(9),
    }
    check_restorable(fresh, saved["items"], rng=saved["rng"])
    apply_state(fresh, saved["items"], rng=saved["rng"])
    assert _draws(list(fresh.values())) == expected


def test_rng_is_restored_last() -> None:
    class DrawsOnLoad:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state: dict) -> None:
            torch.rand(5)  # e.g. an iterator re-seeding itself
            random.random()

    torch.manual_seed(0)
    random.seed(0)
    rng = capture_global_rng()
    expected = (torch.rand(1).item(), random.random())
    apply_state({"x": DrawsOnLoad()}, {"x": {}}, rng=rng)
    assert (torch.rand(1).item(), random.random()) == expected


def test_mismatched_generator_kind_is_refused() -> None:
    saved = {"g": capture_item("g", np.random.default_rng(0))}
    with pytest.raises(TrainingStateError, match="generator"):
        apply_state({"g": torch.Generator()}, saved)


def test_save_only_at_optimizer_step_boundary() -> None:
    progress = TrainingProgress(global_step=3, accumulation_step=1)
    with pytest.raises(TrainingStateError, match=r"accumulation_step is 1 .*optimizer.step\(\)"):
        check_step_boundary({"progress": progress})
    progress.accumulation_step = 0
    check_step_boundary({"progress": progress})


def test_wrong_shaped_model_is_refused_naming_the_tensor() -> None:
    saved = {"model": capture_item("model", torch.nn.Linear(4, 3))}
    other = torch.nn.Linear(5, 3)
    before = other.weight.detach().clone()
    with pytest.raises(
        TrainingStateError, match=r"tensor 'weight' has shape \(3, 4\) in the checkpoint but \(3, 5\)"
    ):
        check_restorable({"model": other}, saved)
    assert torch.equal(other.weight, before)
    with pytest.raises(TrainingStateError, match=r"missing keys \['2.weight'"):
        check_restorable(
            {"model": torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))},
            {"model": capture_item("m", torch.nn.Sequential(torch.nn.Linear(4, 3)))},
        )


def test_optimizer_mismatch_is_refused_before_loading() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    saved = {"opt": capture_item("opt", opt)}
    other = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(TrainingStateError, match="parameter group 0 has 2 parameter"):
        check_restorable({"opt": other}, saved)
    shaped = torch.optim.Adam(torch.nn.Linear(5, 2).parameters())
    with pytest.raises(TrainingStateError, match="exp_avg"):
        check_restorable({"opt": shaped}, saved)


def test_ddp_and_compile_wrappers_save_unwrapped_keys() -> None:
    class Wrapper(torch.nn.Module):  # what torch.compile returns: _orig_mod
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self._orig_mod = m

    inner = torch.nn.Linear(2, 2)
    assert set(capture_item("m", Wrapper(inner))) == {"weight", "bias"}


def test_values_that_cannot_be_restored_in_place() -> None:
    with pytest.raises(TrainingStateError, match="best_loss.*float"):
        classify("best_loss", 0.5)
    assert classify("d", {}) == "dict"
    assert classify("p", TrainingProgress()) == "stateful"


def test_missing_names_in_checkpoint() -> None:
    with pytest.raises(TrainingStateError, match=r"no state for \['extra'\]"):
        check_restorable({"extra": {}}, {})


def test_progress_round_trip() -> None:
    p = TrainingProgress(epoch=2, global_step=30, samples_seen=960, extra={"best": 0.25})
    q = TrainingProgress()
    q.load_state_dict(decode(dumps(p.state_dict())))
    assert q == p
    with pytest.raises(TrainingStateError, match="unknown fields"):
        q.load_state_dict({"epochs": 1})


def test_restore_global_rng_checks_cuda() -> None:
    rng = capture_global_rng()
    rng["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    if not torch.cuda.is_available():
        with pytest.raises(TrainingStateError, match="CUDA"):
            check_restorable({}, {}, rng=rng)
        with pytest.raises(TrainingStateError, match="CUDA"):
            restore_global_rng(rng)
