"""DCP's process-based ``async_save`` (``AsyncCheckpointerType.PROCESS``) with objckpt's writer.

DCP pickles the storage writer into its checkpoint process. A writer opened from a run-root URI
is re-opened there and commits the step; one given a ``Store`` object (or ``metrics``) is refused
with an error that says what to pass instead, never ``cannot pickle '_thread.lock'``.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

from objckpt.errors import ConfigError  # noqa: E402
from objckpt.metrics import CheckpointMetrics  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.training.dcp import ObjckptStorageReader, ObjckptStorageWriter  # noqa: E402
from tests.training.mp import run_world  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def test_writer_from_a_uri_pickles_and_reopens_its_store(tmp_path: Path) -> None:
    writer = ObjckptStorageWriter(f"file://{tmp_path}/run", step=4, store_options={"part_size": "65536"})
    clone = pickle.loads(pickle.dumps(writer))
    try:
        assert clone.store is not writer.store
        assert clone.store.location == writer.store.location and clone.store.part_size == 65536
        assert clone.step == 4 and clone.checkpoint_id == writer.checkpoint_id
        dcp.save({"w": torch.ones(3)}, storage_writer=clone)  # the clone commits on its own store
        assert Reader(writer.store).latest().step == 4
    finally:
        clone.close()
        writer.close()


def test_writer_on_a_store_object_is_refused_with_what_to_do(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    with pytest.raises(ConfigError, match="run-root URI"):
        pickle.dumps(ObjckptStorageWriter(store, step=1))
    with pytest.raises(ConfigError, match="metrics"):
        pickle.dumps(ObjckptStorageWriter(f"file://{tmp_path}/run", step=1, metrics=CheckpointMetrics()))


def _process_async_worker(rank: int, world_size: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    sd = {"w": torch.arange(1000, dtype=torch.float32) * (rank + 1), "n": 3}
    writer = ObjckptStorageWriter(f"file://{root}", step=5, dedup=False)
    response = dcp.async_save(
        sd, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS
    )
    getattr(response, "upload_completion", response).result(timeout=120)
    writer.close()


@pytest.mark.slow
def test_process_async_save_commits_from_the_checkpoint_process(tmp_path: Path) -> None:
    root = tmp_path / "run"
    # daemon=False: each rank starts DCP's checkpoint process of its own
    codes = run_world(_process_async_worker, 2, str(root), timeout=240, daemon=False)
    assert codes == [0, 0]
    store = open_store(f"file://{root}")
    assert Reader(store).latest().step == 5
    target = {"w": torch.zeros(1000), "n": 0}
    dcp.load(target, storage_reader=ObjckptStorageReader(store))
    assert target["n"] == 3
    assert torch.equal(target["w"], torch.arange(1000, dtype=torch.float32))  # rank 0's (replicated)


def test_reader_from_a_uri_pickles_and_loads_in_its_new_home(tmp_path: Path) -> None:
    dcp.save({"w": torch.arange(5.0)}, storage_writer=ObjckptStorageWriter(f"file://{tmp_path}/run", step=2))
    reader = ObjckptStorageReader(f"file://{tmp_path}/run", step=2)
    clone = pickle.loads(pickle.dumps(reader))
    target = {"w": torch.zeros(5)}
    dcp.load(target, storage_reader=clone)
    assert torch.equal(target["w"], torch.arange(5.0)) and clone.step == 2
    clone.close()
    reader.close()
    with pytest.raises(ConfigError, match="run-root URI"):
        pickle.dumps(ObjckptStorageReader(open_store(f"file://{tmp_path}/run")))
