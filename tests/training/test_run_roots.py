"""Two run roots on one bucket client, in one process, stay independent (counted, not timed).

Every ``s3://bucket/<root>`` is a ``PrefixStore`` over one bucket store; the process-wide lineage
(which checkpoint a save continues from) and the dedup header cache must be keyed by the run
root, not by the bucket, or a save on root B reuses objects of root A and its commit is refused.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

from objckpt.reader import Reader  # noqa: E402
from objckpt.store import PrefixStore, open_store  # noqa: E402
from objckpt.training.dcp import ObjckptStorageReader, ObjckptStorageWriter  # noqa: E402
from objckpt.training.manager import CheckpointManager  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_dcp():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def test_a_restore_on_one_root_is_not_the_parent_of_a_save_on_another(tmp_path: Path) -> None:
    bucket = open_store(f"file://{tmp_path}/bucket")
    model = torch.nn.Linear(64, 64)
    state = {"model": model}
    a = PrefixStore(bucket, "run-a", close_inner=False)
    with CheckpointManager(a, keep_last=None) as mgr:
        mgr.save(1, state)
        assert mgr.restore(state) == 1  # this process now continues from root A's step 1
    b = PrefixStore(bucket, "run-b", close_inner=False)
    with CheckpointManager(b, keep_last=None) as mgr:
        mgr.save(1, state)  # a fresh root: nothing to continue from, nothing referenced
    manifest = Reader(b).latest()
    assert manifest is not None and manifest.step == 1 and not manifest.references


def test_dcp_saves_on_two_roots_of_one_bucket(tmp_path: Path) -> None:
    bucket = open_store(f"file://{tmp_path}/bucket")
    sd = {"w": torch.arange(100.0)}
    for root in ("run-a", "run-b"):
        store = PrefixStore(bucket, root, close_inner=False)
        dcp.save(sd, storage_writer=ObjckptStorageWriter(store, step=1))
        target = {"w": torch.zeros(100)}
        dcp.load(target, storage_reader=ObjckptStorageReader(store))
        assert torch.equal(target["w"], sd["w"])
    assert Reader(PrefixStore(bucket, "run-b", close_inner=False)).latest().step == 1
