"""objckpt.integrations.lightning: ObjckptCheckpointIO (unit tests; one slow 2-process DDP test)."""

from __future__ import annotations

import argparse
import logging
import time
from collections import OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning", reason="lightning not installed (pip install 'lightning==2.6.*')")

from objckpt import layout  # noqa: E402
from objckpt.errors import CommitConflict, NoCheckpointError  # noqa: E402
from objckpt.integrations import _common  # noqa: E402
from objckpt.integrations.lightning import SHARD_NAME, ObjckptCheckpointIO, step_from_path  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.training.serialization import MAGIC, UnsupportedStateError  # noqa: E402

from .launch import logs_of, run_ranks  # noqa: E402
from .util import bitrot  # noqa: E402


def lightning_checkpoint(step: int, seed: int = 0) -> dict:
    """What Lightning 2.6's dump_checkpoint produces for a small model (same structure)."""
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict(w=torch.randn(4, 3, generator=g), b=torch.randn(4, generator=g))
    sd._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    return {
        "epoch": step // 4,
        "global_step": step,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": sd,
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.batch_progress": {
                    "total": {"ready": step, "completed": step},
                    "is_last_batch": False,
                },
            }
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {
                "best_model_score": None,
                "best_model_path": "",
                "kth_value": torch.tensor(float("inf")),
                "best_k_models": {},
                "dirpath": "/tmp/x",
            }
        },
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(4, 3)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "lr_schedulers": [
            {"step_size": 3, "gamma": 0.5, "base_lrs": [0.1], "last_epoch": 1, "_last_lr": [0.1]}
        ],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.1, "layers": [4, 3]},
    }


def assert_same(a: object, b: object, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture
def root(tmp_path: Path) -> str:
    return f"file://{tmp_path}/run"


def test_step_from_path() -> None:
    assert step_from_path("/ckpt/epoch=0-step=10.ckpt") == 10
    assert step_from_path("step=7.ckpt") == 7
    assert step_from_path("last.ckpt") is None
    assert step_from_path("epoch=1-mystep=3.ckpt") is None


def test_save_commits_step_and_load_round_trips(root: str) -> None:
    io = ObjckptCheckpointIO(root)
    ckpt = lightning_checkpoint(10)
    io.save_checkpoint(ckpt, "/local/ckpts/epoch=2-step=10.ckpt")

    reader = Reader(open_store(root))
    m = reader.latest()
    assert m is not None and m.step == 10 and m.world_size == 1
    assert [s.name for s in m.shards] == [SHARD_NAME]
    assert m.metadata["lightning"]["name"] == "epoch=2-step=10.ckpt"
    assert m.progress == {"global_step": 10, "epoch": 2}
    # pickle-free on the wire: objckpt's container, not a torch.save zip / pickle stream
    assert reader.read_shard(m.shards[0])[:8] == MAGIC

    fresh = ObjckptCheckpointIO(root)  # another process: resolves by the step in the name
    for path in ("/elsewhere/epoch=2-step=10.ckpt", "latest", "last", "/x/last.ckpt", root):
        loaded = fresh.load_checkpoint(path, weights_only=False)  # weights_only cannot enable pickle
        assert_same(ckpt, loaded)
    assert fresh.load_checkpoint("latest")["state_dict"]._metadata == {"": {"version": 1}}


def test_same_step_saved_twice_is_one_commit(root: str) -> None:
    """ModelCheckpoint saves the top-k file and last.ckpt of one step separately."""
    io = ObjckptCheckpointIO(root)
    io.save_checkpoint(lightning_checkpoint(4), "/c/epoch=0-step=4.ckpt")
    io.save_checkpoint(lightning_checkpoint(4), "/c/last.ckpt")
    store = open_store(root)
    assert Reader(store).steps() == [4]
    attempts = {layout.parse_shard_key(m.key)[:2] for m in store.list("data/")}
    assert len(attempts) == 1  # no second attempt was even written


def test_step_committed_by_another_run_conflicts(root: str) -> None:
    ObjckptCheckpointIO(root).save_checkpoint(lightning_checkpoint(4, seed=1), "/c/epoch=0-step=4.ckpt")
    other = ObjckptCheckpointIO(root)
    with pytest.raises(CommitConflict, match="already committed"):
        other.save_checkpoint(lightning_checkpoint(4, seed=2), "/c/epoch=0-step=4.ckpt")
    loaded = other.load_checkpoint("epoch=0-step=4.ckpt")
    assert_same(lightning_checkpoint(4, seed=1)["state_dict"], loaded["state_dict"])


def test_unsupported_value_fails_the_save_and_commits_nothing(root: str) -> None:
    io = ObjckptCheckpointIO(root)
    ckpt = lightning_checkpoint(4)
    ckpt["hyper_parameters"]["args"] = argparse.Namespace(lr=0.1)
    with pytest.raises(UnsupportedStateError, match=r"hyper_parameters.*args.*Namespace"):
        io.save_checkpoint(ckpt, "/c/epoch=0-step=4.ckpt")
    assert Reader(open_store(root)).steps() == []


def test_name_without_step_is_found_by_recorded_name(root: str) -> None:
    io = ObjckptCheckpointIO(root)
    io.save_checkpoint(lightning_checkpoint(7), "/c/best.ckpt")
    io.save_checkpoint(lightning_checkpoint(9), "/c/other.ckpt")
    assert ObjckptCheckpointIO(root).load_checkpoint("/z/best.ckpt")["global_step"] == 7
    with pytest.raises(NoCheckpointError):
        ObjckptCheckpointIO(root).load_checkpoint("/z/nope.ckpt")
    with pytest.raises(NoCheckpointError):
        ObjckptCheckpointIO(root).load_checkpoint("/z/epoch=9-step=99.ckpt")


def test_damaged_latest_falls_back_but_a_named_step_does_not(
    root: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    io = ObjckptCheckpointIO(root)
    io.save_checkpoint(lightning_checkpoint(4, seed=4), "/c/epoch=0-step=4.ckpt")
    io.save_checkpoint(lightning_checkpoint(8, seed=8), "/c/epoch=1-step=8.ckpt")
    m8 = Reader(open_store(root)).load(8)
    bitrot(tmp_path / "run", m8.shards[0].key, offset=-3)  # inside the tensor bytes

    fresh = ObjckptCheckpointIO(root)
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        loaded = fresh.load_checkpoint("latest")
    assert loaded["global_step"] == 4
    assert any("rejecting checkpoint step 8" in r.message for r in caplog.records)
    with pytest.raises(NoCheckpointError, match="step 8.*damaged"):
        fresh.load_checkpoint("epoch=1-step=8.ckpt")


def test_a_pickle_in_the_store_is_never_unpickled(root: str, tmp_path: Path) -> None:
    """Invariant 12: a committed shard holding a pickle (torch.save) is rejected, not run."""
    marker = tmp_path / "pwned"
    payload = _pickle_that_touches(marker)
    store = open_store(root)
    _common.commit_single_writer(
        store, 5, [(SHARD_NAME, payload)], metadata={"lightning": {"name": "x.ckpt"}}
    )
    io = ObjckptCheckpointIO(root)
    with pytest.raises(NoCheckpointError, match="pickle"):
        io.load_checkpoint("epoch=0-step=5.ckpt", weights_only=False)
    with pytest.raises(NoCheckpointError):
        io.load_checkpoint("latest")
    assert not marker.exists()


def _touch(path: str) -> None:
    open(path, "w").close()


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (_touch, (self.path,))


def _pickle_that_touches(marker: Path) -> bytes:
    import io as _io

    buf = _io.BytesIO()
    torch.save({"state_dict": {}, "x": _Evil(str(marker))}, buf)
    return buf.getvalue()


def test_remove_checkpoint_never_deletes_the_newest_and_retries_after_commit(root: str) -> None:
    io = ObjckptCheckpointIO(root)
    store = open_store(root)
    for step in (4, 8):
        io.save_checkpoint(lightning_checkpoint(step), f"/c/epoch=0-step={step}.ckpt")
    io.remove_checkpoint("/c/epoch=0-step=4.ckpt")
    assert Reader(store).steps() == [8]
    assert all(layout.parse_shard_key(m.key)[0] != 4 for m in store.list("data/"))  # shards gone too

    io.remove_checkpoint("/c/epoch=0-step=8.ckpt")  # the newest: kept, pending
    assert Reader(store).steps() == [8]
    io.save_checkpoint(lightning_checkpoint(12), "/c/epoch=0-step=12.ckpt")
    assert Reader(store).steps() == [12]  # removed once 12 was committed
    io.remove_checkpoint("/c/epoch=0-step=99.ckpt")  # never saved: nothing happens
    assert Reader(store).steps() == [12]


def test_async_checkpoint_io_wrapper(root: str) -> None:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    io = ObjckptCheckpointIO(root)
    wrapped = AsyncCheckpointIO(io)
    ckpt = lightning_checkpoint(4)
    wrapped.save_checkpoint(ckpt, "/c/epoch=0-step=4.ckpt")
    ckpt["state_dict"]["w"].add_(1.0)  # the wrapper cloned the tensors before returning
    wrapped.remove_checkpoint("/c/epoch=0-step=4.ckpt")  # newest: deferred, never deleted
    wrapped.teardown()  # waits for the save thread
    assert Reader(open_store(root)).steps() == [4]
    assert_same(lightning_checkpoint(4)["state_dict"], io.load_checkpoint("latest")["state_dict"])


def test_storage_options_and_map_location(root: str) -> None:
    io = ObjckptCheckpointIO(root)
    with pytest.raises(TypeError):
        io.save_checkpoint(lightning_checkpoint(4), "/c/epoch=0-step=4.ckpt", storage_options={"x": 1})
    io.save_checkpoint(lightning_checkpoint(4), "/c/epoch=0-step=4.ckpt")
    assert io.load_checkpoint("latest", map_location="cpu")["state_dict"]["w"].device.type == "cpu"
    with pytest.raises(TypeError):
        io.load_checkpoint("latest", map_location=lambda s, loc: s)


def test_save_and_load_on_s3_moto(backend_s3_moto) -> None:  # type: ignore[no-untyped-def]
    uri, store = backend_s3_moto.new_root()
    io = ObjckptCheckpointIO(uri)
    io.save_checkpoint(lightning_checkpoint(3), "/c/epoch=0-step=3.ckpt")
    assert Reader(store).steps() == [3]
    assert_same(lightning_checkpoint(3), ObjckptCheckpointIO(uri).load_checkpoint("latest"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddp_fit_and_resume_through_ckpt_path(tmp_path: Path) -> None:
    """2 CPU ranks (gloo DDP): fit 1 epoch saving through AsyncCheckpointIO(ObjckptCheckpointIO);
    a new pair of processes resumes with fit(ckpt_path="epoch=0-step=4.ckpt") and starts from
    exactly the committed weights, optimizer and scheduler state, then commits step 8."""
    root = f"file://{tmp_path}/run"
    module = "tests.integrations.lightning_worker"
    started = time.monotonic()
    for mode in ("first", "resume"):
        codes = run_ranks(module, [root, str(tmp_path), mode], log_dir=tmp_path / "logs" / mode, timeout=180)
        assert codes == [0, 0], logs_of(module, tmp_path / "logs" / mode)
        if mode == "first":
            assert Reader(open_store(root)).steps() == [4]
    assert Reader(open_store(root)).steps() == [4, 8]
    first = torch.load(tmp_path / "first.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resume.pt", weights_only=True)
    assert first["end"]["step"] == 4 and resumed["start"]["step"] == 4 and resumed["end"]["step"] == 8
    assert_same(first["end"]["params"], resumed["start"]["params"])
    assert_same(first["end"]["optimizer"], resumed["start"]["optimizer"])
    assert_same(first["end"]["scheduler"], resumed["start"]["scheduler"])
    # nothing was written to Lightning's local checkpoint folder
    assert not (tmp_path / "ckpt-first").exists() or not any((tmp_path / "ckpt-first").iterdir())
    print(f"lightning ddp fit+resume: {time.monotonic() - started:.1f}s")


def test_an_outage_while_loading_latest_is_raised_never_a_fallback(root: str) -> None:
    """Invariant 11b through the plug-in: an outage past the retry budget must not roll the
    job back to an older checkpoint."""
    from objckpt.errors import TransientError
    from objckpt.store.wrappers import Fault, FaultInjectingStore
    from tests.protocol.helpers import FAST_RETRY

    io = ObjckptCheckpointIO(root)
    io.save_checkpoint(lightning_checkpoint(4, seed=4), "/c/epoch=0-step=4.ckpt")
    io.save_checkpoint(lightning_checkpoint(8, seed=8), "/c/epoch=1-step=8.ckpt")
    key = Reader(open_store(root)).load(8).shards[0].key
    flaky = FaultInjectingStore(
        open_store(root), [Fault(op="open", key=key, error=TransientError, times=None)], retry=FAST_RETRY
    )
    with pytest.raises(TransientError):
        ObjckptCheckpointIO(flaky).load_checkpoint("latest")
