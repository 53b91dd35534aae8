"""``mirror=`` on the plug-ins and on ``save_sharded``/``load_sharded``: commits are re-committed
on the mirror, and a load takes the mirror's copy when the primary cannot be read (one process,
file:// roots; the primary made unreachable by a fault-injecting wrapper)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from objckpt._retry import RetryPolicy  # noqa: E402
from objckpt.errors import TransientError  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.store.wrappers import Fault, FaultInjectingStore  # noqa: E402

QUICK = RetryPolicy(deadline=0.2, initial_backoff=0.01, max_backoff=0.05)


def _roots(tmp_path: Path) -> tuple[FaultInjectingStore, str]:
    primary = FaultInjectingStore(open_store(f"file://{tmp_path}/primary"), retry=QUICK)
    return primary, f"file://{tmp_path}/mirror"


def _down(store: FaultInjectingStore) -> None:
    store.add(Fault(op="*", error=TransientError, times=None))


def test_save_sharded_and_load_sharded_with_a_mirror(tmp_path: Path) -> None:
    from objckpt.training.dcp import load_sharded, save_sharded

    primary, mirror = _roots(tmp_path)
    saved = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2)}
    assert save_sharded(saved, primary, 10, mirror=mirror) == 10
    with open_store(mirror) as m:
        assert Reader(m).steps() == [10]  # re-committed before save_sharded returned
    _down(primary)
    loaded = {"w": torch.zeros(3, 4), "b": torch.zeros(2)}
    with pytest.raises(TransientError):
        load_sharded(loaded, primary)  # no mirror: the outage is an error
    assert load_sharded(loaded, primary, mirror=mirror) == 10
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["b"], saved["b"])


def test_lightning_checkpoint_io_with_a_mirror(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="lightning not installed")
    from objckpt.integrations.lightning import ObjckptCheckpointIO

    from .test_lightning import assert_same, lightning_checkpoint

    primary, mirror = _roots(tmp_path)
    io = ObjckptCheckpointIO(primary, mirror=mirror)
    ckpt = lightning_checkpoint(10)
    io.save_checkpoint(ckpt, "/c/epoch=2-step=10.ckpt")
    io.teardown()  # waits for the mirror
    with open_store(mirror) as m:
        assert Reader(m).steps() == [10]
    _down(primary)
    fresh = ObjckptCheckpointIO(primary, mirror=mirror)
    assert_same(fresh.load_checkpoint("/c/epoch=2-step=10.ckpt"), ckpt)


def test_deepspeed_engine_loads_from_the_mirror(tmp_path: Path) -> None:
    from objckpt.integrations.deepspeed import ObjckptCheckpointEngine

    from .test_deepspeed import deepspeed_save

    primary, mirror = _roots(tmp_path)
    engine = ObjckptCheckpointEngine(primary, mirror=mirror)
    state = {"module": {"w": torch.arange(6.0)}}
    deepspeed_save(engine, tmp_path / "save", "global_step10", {"mp_rank_00_model_states.pt": state})
    engine.cleanup()
    engine._sessions.close()  # waits for the mirror
    with open_store(mirror) as m:
        assert Reader(m).steps() == [10]
    _down(primary)
    fresh = ObjckptCheckpointEngine(primary, mirror=mirror)
    load_dir = tmp_path / "load"
    assert fresh.prepare_load(str(load_dir)) == "global_step10"
    loaded = fresh.load(str(load_dir / "global_step10" / "mp_rank_00_model_states.pt"))
    assert torch.equal(loaded["module"]["w"], state["module"]["w"])
