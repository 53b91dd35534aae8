"""A DCP save hashes each byte it writes once (CRC32C), counted, never timed.

The item CRCs recorded for load, each part's CRC sent to the server, the shard's whole-object CRC
and the receipt all come from one pass (``put_stream`` hashes pieces and combines), and parts
that straddle tensors are sent as views of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.training.dcp import METADATA_SHARD, ObjckptStorageReader, ObjckptStorageWriter  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_dcp")


def test_dcp_save_hashes_each_written_byte_once(tmp_path: Path, hashed: list[int]) -> None:
    # 4 KiB parts: the 12 tensors (1,000 to 30,000 bytes) straddle parts every way
    store = open_store(f"file://{tmp_path}/run", part_size="4096")
    g = torch.Generator().manual_seed(1)
    sd: dict[str, Any] = {f"t{i}": torch.randn(250 * (i + 1) * (1 + i % 3), generator=g) for i in range(12)}
    sd["step"] = 3  # a bytes item
    hashed[0] = 0
    dcp.save(sd, storage_writer=ObjckptStorageWriter(store, step=1, dedup=False))
    written = sum(meta.size for meta in store.list(""))
    # every object of the save (shards, metadata, manifest, pointer): each byte hashed once
    assert hashed[0] == written
    # and the item CRCs derived from that pass verify on load
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(target, storage_reader=ObjckptStorageReader(store))
    assert all(torch.equal(target[k], sd[k]) for k in sd if k != "step") and target["step"] == 3


def test_a_large_rank_spreads_its_items_over_shards_written_at_once(tmp_path: Path) -> None:
    # 4 KiB parts: 8 tensors of 16 KiB = 32 parts, so min(max_in_flight=8, 32) = 8 shards (of one
    # request each: tests/training/test_dcp_requests.py), on an object store (file:// keeps one)
    store = open_store(f"memory://{tmp_path.name}/run", part_size="4096", max_in_flight="8")
    sd = {f"t{i}": torch.full((4096,), float(i)) for i in range(8)}
    dcp.save(sd, storage_writer=ObjckptStorageWriter(store, step=1, dedup=False))
    data = [r for r in Reader(store).load(1).shards if r.name != METADATA_SHARD]
    assert len(data) == 8 and all(r.size == 16384 for r in data)
    target = {k: torch.zeros(4096) for k in sd}
    dcp.load(target, storage_reader=ObjckptStorageReader(store))
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    # a small rank keeps one shard
    small = open_store(f"memory://{tmp_path.name}/small", part_size="4096")
    dcp.save({"w": torch.ones(100)}, storage_writer=ObjckptStorageWriter(small, step=1, dedup=False))
    assert len([r for r in Reader(small).load(1).shards if r.name != METADATA_SHARD]) == 1
