"""objckpt.integrations.deepspeed: ObjckptCheckpointEngine.

The engine's protocol logic is tested in one process with DeepSpeed's call sequence
(create/save/commit, prepare_load/load) and needs only torch; the slow test runs real ZeRO-1/2
engines on 2 CPU gloo ranks and needs ``deepspeed`` (see docs/INTEGRATIONS.md for the install).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from objckpt.errors import ChecksumMismatchError, CommitError, NoCheckpointError  # noqa: E402
from objckpt.integrations.deepspeed import ObjckptCheckpointEngine, step_from_tag  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402

from .launch import logs_of, run_ranks  # noqa: E402
from .util import bitrot  # noqa: E402

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def info(tag: str, save_dir: Path) -> SimpleNamespace:
    """DeepSpeed's CheckpointCommitInfo (duck-typed, so these tests run without DeepSpeed)."""
    return SimpleNamespace(tag=tag, save_dir=str(save_dir), save_latest=True)


def model_states(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "module": {"w": torch.randn(3, 2, generator=g)},
        "global_steps": seed,
        "dp_world_size": 1,
        "param_shapes": [{"w": torch.Size([3, 2])}],
        "ds_version": "0.19.8",
    }


def deepspeed_save(engine: ObjckptCheckpointEngine, save_dir: Path, tag: str, files: dict) -> None:
    """What DeepSpeedEngine.save_checkpoint does with its checkpoint engine, on one rank."""
    i = info(tag, save_dir)
    engine.makedirs(str(save_dir), exist_ok=True)
    engine.create(i)
    for name, state in files.items():
        engine.save(state, str(save_dir / tag / name))
    if not engine.is_decoupled():
        engine.commit(i)


def test_step_from_tag() -> None:
    assert step_from_tag("global_step20") == 20
    assert step_from_tag("7") == 7
    with pytest.raises(ValueError, match="step_of_tag"):
        step_from_tag("best")


def test_save_commit_prepare_load_round_trip(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    engine = ObjckptCheckpointEngine(root)
    files = {
        "mp_rank_00_model_states.pt": model_states(5),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": {
            "optimizer_state_dict": {"fp32": torch.arange(6.0)},
            "ds_config": {"zero_optimization": {"stage": 1}},
        },
    }
    deepspeed_save(engine, tmp_path / "save", "global_step5", files)

    m = Reader(open_store(root)).latest()
    assert m is not None and m.step == 5 and m.metadata["deepspeed"] == {"tag": "global_step5"}
    assert sorted(s.name for s in m.shards) == sorted(files)
    # the local save_dir is scratch: no checkpoint data lands there
    assert not any(f.endswith(".pt") for _, _, fs in os.walk(tmp_path / "save") for f in fs)

    loader = ObjckptCheckpointEngine(root)  # a new process, an empty local folder
    load_dir = tmp_path / "load"
    assert loader.prepare_load(str(load_dir)) == "global_step5"
    assert (load_dir / "latest").read_text() == "global_step5"
    for name in files:
        marker = load_dir / "global_step5" / name
        assert marker.exists() and marker.stat().st_size == 0  # DeepSpeed globs for these
        got = loader.load(str(marker), map_location=lambda storage, loc: storage)
        assert got.keys() == files[name].keys()
    assert torch.equal(
        loader.load(str(load_dir / "global_step5" / "mp_rank_00_model_states.pt"))["module"]["w"],
        files["mp_rank_00_model_states.pt"]["module"]["w"],
    )
    with pytest.raises(FileNotFoundError):
        loader.load(str(load_dir / "global_step5" / "mp_rank_01_model_states.pt"))
    assert loader.prepare_load(str(load_dir), tag="global_step5") == "global_step5"
    with pytest.raises(NoCheckpointError):
        loader.prepare_load(str(load_dir), tag="global_step6")


def test_nothing_committed_prepares_nothing(tmp_path: Path) -> None:
    engine = ObjckptCheckpointEngine(f"file://{tmp_path}/run")
    assert engine.prepare_load(str(tmp_path / "load")) is None
    assert not (tmp_path / "load" / "latest").exists()


def test_failed_save_is_reported_at_commit_and_commits_nothing(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    engine = ObjckptCheckpointEngine(root)
    i = info("global_step3", tmp_path / "save")
    engine.create(i)
    engine.save(model_states(1), str(tmp_path / "save" / "global_step3" / "ok.pt"))
    engine.save(model_states(2), str(tmp_path / "save" / "pytorch_model.bin"))  # save_16bit_model-style
    with pytest.raises(CommitError, match=r"rank 0.*outside the checkpoint folder"):
        engine.commit(i)
    assert Reader(open_store(root)).steps() == []
    # the engine is usable again: the next save commits
    deepspeed_save(engine, tmp_path / "save", "global_step4", {"ok.pt": model_states(4)})
    assert Reader(open_store(root)).steps() == [4]


def test_tag_without_a_step_fails_the_save(tmp_path: Path) -> None:
    engine = ObjckptCheckpointEngine(f"file://{tmp_path}/run")
    with pytest.raises(CommitError, match="step_of_tag"):
        engine.create(info("best", tmp_path))
    custom = ObjckptCheckpointEngine(f"file://{tmp_path}/run2", step_of_tag=lambda tag: 42)
    deepspeed_save(custom, tmp_path / "s", "best", {"a.pt": model_states(1)})
    assert Reader(custom.store).steps() == [42]
    assert (
        ObjckptCheckpointEngine(f"file://{tmp_path}/run2", step_of_tag=lambda tag: 42).prepare_load(
            str(tmp_path / "l"), tag="best"
        )
        == "best"
    )


def test_decoupled_commits_at_commit_or_cleanup(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    engine = ObjckptCheckpointEngine(root, decoupled=True)
    assert engine.is_decoupled()
    state = model_states(1)
    deepspeed_save(engine, tmp_path / "s", "global_step1", {"a.pt": state})
    state["module"]["w"].add_(1.0)  # save() already took its snapshot
    pending = engine.get_commit_info()
    assert pending is not None and pending.tag == "global_step1"
    assert Reader(open_store(root)).steps() == []  # not committed before DeepSpeed's next step
    engine.commit(pending)  # what DeepSpeed does at the next optimizer step
    assert engine.get_commit_info() is None and Reader(open_store(root)).steps() == [1]

    deepspeed_save(engine, tmp_path / "s", "global_step2", {"a.pt": model_states(2)})
    deepspeed_save(engine, tmp_path / "s", "global_step3", {"a.pt": model_states(3)})  # commits 2 first
    assert Reader(open_store(root)).steps() == [1, 2]
    engine.cleanup()  # engine.destroy(): commits the pending one
    assert Reader(open_store(root)).steps() == [1, 2, 3]
    got = ObjckptCheckpointEngine(root)
    got.prepare_load(str(tmp_path / "l"), tag="global_step1")
    w = got.load(str(tmp_path / "l" / "global_step1" / "a.pt"))["module"]["w"]
    assert torch.equal(w, model_states(1)["module"]["w"])


def test_load_verifies_bytes_before_unpickling(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    engine = ObjckptCheckpointEngine(root)
    deepspeed_save(engine, tmp_path / "s", "global_step1", {"a.pt": model_states(1)})
    m = Reader(open_store(root)).latest()
    assert m is not None
    bitrot(tmp_path / "run", m.shards[0].key, offset=100)
    loader = ObjckptCheckpointEngine(root)
    loader.prepare_load(str(tmp_path / "l"))  # HEAD still matches
    with pytest.raises(ChecksumMismatchError):
        loader.load(str(tmp_path / "l" / "global_step1" / "a.pt"))


def _touch(path: str) -> None:
    open(path, "w").close()


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (_touch, (self.path,))


def test_globals_outside_the_allow_list_are_never_run(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    marker = tmp_path / "pwned"
    engine = ObjckptCheckpointEngine(root)
    deepspeed_save(engine, tmp_path / "s", "global_step1", {"a.pt": {"x": _Evil(str(marker))}})
    loader = ObjckptCheckpointEngine(root)
    loader.prepare_load(str(tmp_path / "l"))
    with pytest.raises(pickle.UnpicklingError):
        loader.load(str(tmp_path / "l" / "global_step1" / "a.pt"))
    assert not marker.exists()


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed")
def test_deepspeed_state_classes_are_allowed(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    root = f"file://{tmp_path}/run"
    engine = ObjckptCheckpointEngine(root)
    state = {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.gradients}
    deepspeed_save(engine, tmp_path / "s", "global_step1", {"z.pt": state})
    loader = ObjckptCheckpointEngine(root)
    loader.prepare_load(str(tmp_path / "l"))
    got = loader.load(str(tmp_path / "l" / "global_step1" / "z.pt"))
    assert isinstance(got["loss_scaler"], LossScaler) and got["zero_stage"] == ZeroStageEnum.gradients


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(
    not HAVE_DEEPSPEED, reason="deepspeed not installed (DS_BUILD_OPS=0 pip install 'deepspeed==0.19.*')"
)
def test_zero_1_and_2_save_load_on_two_gloo_ranks(tmp_path: Path) -> None:
    """Real DeepSpeed engines (ZeRO-1 synchronous, ZeRO-2 decoupled) on 2 CPU ranks: save through
    the store, load into fresh engines from an empty local folder, continue training: parameters
    and every rank's optimizer partition are bitwise equal to the uninterrupted run."""
    module = "tests.integrations.deepspeed_worker"
    started = time.monotonic()
    codes = run_ranks(
        module,
        [f"file://{tmp_path}/run", str(tmp_path)],
        log_dir=tmp_path / "logs",
        timeout=300,
        env={"DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cpu"},
    )
    assert codes == [0, 0], logs_of(module, tmp_path / "logs")
    import json

    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for stage in ("zero1", "zero2"):
            r = report[stage]
            assert r["committed"] == [3] and r["global_steps"] == 5
            assert r["load_path"].endswith("global_step3/mp_rank_00_model_states.pt")
            assert not r["bad_load"] and not r["bad_resume"] and r["n_tensors"] >= 6
        assert report["zero1"]["after_save"] == [3] and report["zero2"]["after_save"] == []
    print(f"deepspeed zero1+zero2 save/load: {time.monotonic() - started:.1f}s")
