"""How a DCP save spreads one rank's bytes over shards and requests: counted, never timed.

``split_into_shards`` has three regimes (its docstring): one shard for a rank of at most two
parts; up to ``max_in_flight`` single-request shards for a rank of at most ``max_in_flight``
requests of ``part_size x max_in_flight`` bytes; beyond that, ``max_in_flight`` multipart shards
of at least four parts. Requests are counted through a ``CountingStore`` (each retry counts), on memory:// (an object
store's rules); file://, where a multipart upload is as cheap as one request
(``Store.cheap_multipart``), keeps one shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402

from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.store.wrappers import CountingStore  # noqa: E402
from objckpt.training.dcp import METADATA_SHARD, ObjckptStorageReader, ObjckptStorageWriter  # noqa: E402

PART = 4096


pytestmark = pytest.mark.usefixtures("quiet_dcp")


def _save(
    tmp_path: Path, sd: dict[str, Any], max_in_flight: int, scheme: str = "memory"
) -> tuple[CountingStore, Any]:
    root = f"file://{tmp_path}/run" if scheme == "file" else f"memory://{tmp_path.name}/run"
    store = open_store(root, part_size=str(PART), max_in_flight=str(max_in_flight))
    counting = CountingStore(store)
    dcp.save(sd, storage_writer=ObjckptStorageWriter(counting, step=1, dedup=False))
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(target, storage_reader=ObjckptStorageReader(counting))
    assert all(torch.equal(target[k], sd[k]) for k in sd)
    return counting, Reader(store).load(1)


WRITES = ("put", "create_upload", "upload_part", "complete_upload")


def _data_writes(counting: CountingStore) -> dict[str, int]:
    """Write requests for the rank's data shards (not DCP's metadata shard), by op."""
    ops: dict[str, int] = {}
    for op, key in counting.calls:
        if op in WRITES and key.startswith("data/") and not key.endswith(METADATA_SHARD):
            ops[op] = ops.get(op, 0) + 1
    return ops


def test_a_rank_of_up_to_max_in_flight_requests_writes_each_shard_in_one_request(tmp_path: Path) -> None:
    # 8 tensors of 4 parts (128 KiB) with 8 in flight: one request may carry 8 parts (32 KiB) and
    # 8 such requests 256 KiB, so 8 shards of 16 KiB, one PUT each: 8 requests where a multipart
    # upload per shard would make 8 x (create + 4 parts + complete) = 48
    sd = {f"t{i}": torch.full((PART,), float(i)) for i in range(8)}
    counting, manifest = _save(tmp_path, sd, max_in_flight=8)
    assert _data_writes(counting) == {"put": 8}
    shards = [s for s in manifest.shards if s.name != METADATA_SHARD]
    assert len(shards) == 8 and all(s.size == 4 * PART and s.parts == 1 for s in shards)


def test_a_rank_of_a_few_parts_spreads_them_over_as_many_single_requests(tmp_path: Path) -> None:
    # 3 parts' worth: 3 shards of one part each, written at once, one request each
    sd = {f"t{i}": torch.full((PART // 4,), float(i)) for i in range(3)}
    counting, manifest = _save(tmp_path, sd, max_in_flight=8)
    assert _data_writes(counting) == {"put": 3}
    assert len([s for s in manifest.shards if s.name != METADATA_SHARD]) == 3


def test_a_rank_beyond_max_in_flight_requests_writes_multipart_shards(tmp_path: Path) -> None:
    # 2 in flight: one request may carry 2 parts (8 KiB), 2 of them 16 KiB; 128 KiB is beyond
    # that, so 2 shards of 16 parts each go as multipart uploads (memory stays bounded)
    sd = {f"t{i}": torch.full((PART,), float(i)) for i in range(8)}
    counting, manifest = _save(tmp_path, sd, max_in_flight=2)
    assert _data_writes(counting) == {"create_upload": 2, "upload_part": 32, "complete_upload": 2}
    shards = [s for s in manifest.shards if s.name != METADATA_SHARD]
    assert len(shards) == 2 and all(s.parts == 16 for s in shards)


def test_a_single_item_larger_than_one_request_is_a_multipart_upload(tmp_path: Path) -> None:
    # one tensor of 12 parts among small ones, 8 in flight: its shard exceeds one request's
    # 8 parts, so put_stream sends it as a multipart upload; the small shards stay single PUTs
    sd = {"big": torch.ones(3 * PART)} | {f"s{i}": torch.full((PART // 4,), float(i)) for i in range(4)}
    counting, manifest = _save(tmp_path, sd, max_in_flight=8)
    writes = _data_writes(counting)
    assert writes["create_upload"] == 1 and writes["complete_upload"] == 1 and writes["upload_part"] == 12
    assert writes["put"] == len([s for s in manifest.shards if s.name != METADATA_SHARD]) - 1


def test_on_file_a_rank_keeps_one_multipart_shard(tmp_path: Path) -> None:
    # file://: a multipart upload is parallel pwrites into one file, measured faster than
    # several files at once; the same 128 KiB that spreads over 8 objects above is one shard
    sd = {f"t{i}": torch.full((PART,), float(i)) for i in range(8)}
    counting, manifest = _save(tmp_path, sd, max_in_flight=8, scheme="file")
    assert _data_writes(counting) == {"create_upload": 1, "upload_part": 32, "complete_upload": 1}
    assert len([s for s in manifest.shards if s.name != METADATA_SHARD]) == 1
