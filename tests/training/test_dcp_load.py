"""The DCP load engine (objckpt/training/dcp/_load.py): what it reads, hashes and copies.

Counted, never timed: every byte of a shard is CRC32C-hashed exactly once on load, a tensor that
fills its destination as stored is read into the destination's memory (no copy, no scratch), a
resharded slice is copied exactly once, big items are split into parallel reads whose CRCs are
combined, and a corrupted byte anywhere is caught.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

from objckpt import _crc  # noqa: E402
from objckpt.errors import ChecksumMismatchError  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.store.base import Store  # noqa: E402
from objckpt.store.wrappers import CountingStore  # noqa: E402
from objckpt.training.dcp import METADATA_SHARD, ObjckptStorageReader, ObjckptStorageWriter  # noqa: E402
from objckpt.training.dcp._load import LoadItem, plan_reads  # noqa: E402
from objckpt.training.dcp._metadata import _ItemLocation  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_dcp")


def item(key: str, start: int, length: int) -> LoadItem:
    return LoadItem(key, _ItemLocation(0, "s", start, length, "", "bytes"), [])


# ------------------------------------------------------------------------------ planning


def test_plan_coalesces_close_items_and_splits_big_ones() -> None:
    items = [item("a", 0, 10), item("a", 12, 10), item("a", 100, 50), item("b", 0, 5), item("a", 22, 0)]
    reads = plan_reads(items, cap=40, gap=4)
    # a[0,10) + gap 2 + a[12,22) coalesce; a[100,150) is alone and split at the cap; b alone
    assert [(r.key, r.start, r.end) for r in reads] == [
        ("a", 0, 22),
        ("a", 100, 140),
        ("a", 140, 150),
        ("b", 0, 5),
    ]
    first = reads[0].segments
    assert [(s.item is None, s.offset, s.size) for s in first] == [
        (False, 0, 10),
        (True, 0, 2),
        (False, 0, 10),
    ]
    assert [(s.offset, s.size) for s in reads[1].segments + reads[2].segments] == [(0, 40), (40, 10)]


def test_plan_respects_gap_and_cap_when_coalescing() -> None:
    far = plan_reads([item("a", 0, 10), item("a", 15, 10)], cap=100, gap=4)
    assert len(far) == 2  # the 5-byte gap exceeds 4
    capped = plan_reads([item("a", 0, 30), item("a", 30, 30)], cap=50, gap=4)
    assert [(r.start, r.end) for r in capped] == [(0, 30), (30, 60)]  # together they pass the cap
    for reads in (far, capped):
        for r in reads:
            assert sum(s.size for s in r.segments) == r.end - r.start <= 100


# ------------------------------------------------------------------------------ loading


def state(numel: int = 10_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(numel, generator=g),
        "m": torch.randn(40, 25, generator=g).bfloat16(),
        "i": torch.arange(300, dtype=torch.int64),
        "step": 7,  # a bytes item
    }


def zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def shard_bytes(store: Store, step: int) -> int:
    manifest = Reader(store).load(step)
    return sum(int(r.size) for r in manifest.shards)


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Store, dict[str, Any]]]:
    # a small part size: cap = 2 parts = 8 KiB, so "w" (40,000 bytes) is read in 5 pieces
    store = open_store(f"file://{tmp_path}/run", part_size="4096")
    sd = state()
    dcp.save(sd, storage_writer=ObjckptStorageWriter(store, step=1, dedup=False))
    yield store, sd
    store.close()


class Counter:
    def __init__(self) -> None:
        self.hashed = 0
        self.copies = 0


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts bytes CRC32C-hashed (every hash goes through ``crc32c_update``) and tensor copies."""
    counter = Counter()
    update = _crc.crc32c_update

    def counting_update(crc: int, data: Any) -> int:
        counter.hashed += memoryview(data).nbytes
        return update(crc, data)

    monkeypatch.setattr(_crc, "crc32c_update", counting_update)
    copy = torch.Tensor.copy_

    def counting_copy(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
        counter.copies += 1
        return copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    return counter


def test_load_hashes_each_byte_once_and_reads_into_the_destination(saved: Any, counted: Counter) -> None:
    store, sd = saved
    target = zeros_like(sd)
    pointers = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    counted.hashed = counted.copies = 0
    dcp.load(target, storage_reader=ObjckptStorageReader(store))
    for k, v in sd.items():
        assert torch.equal(target[k], v) if isinstance(v, torch.Tensor) else target[k] == v
    # the metadata shard (verified whole) and every data byte: each exactly once
    assert counted.hashed == shard_bytes(store, 1)
    # every tensor was read into its own memory: no copy, the same storage
    assert counted.copies == 0
    assert {k: target[k].data_ptr() for k in pointers} == pointers


def test_file_store_reads_with_preadv_not_chunks(saved: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    store, sd = saved
    calls = {"preadv": 0, "preadv_bytes": 0}
    preadv = os.preadv

    def counting_preadv(*args: Any) -> int:
        n = preadv(*args)
        calls["preadv"] += 1
        calls["preadv_bytes"] += n
        return n

    monkeypatch.setattr(os, "preadv", counting_preadv)
    target = zeros_like(sd)
    dcp.load(target, storage_reader=ObjckptStorageReader(store))
    assert torch.equal(target["w"], sd["w"])
    manifest = Reader(store).load(1)
    data = sum(int(r.size) for r in manifest.shards if r.name != METADATA_SHARD)
    # every data byte arrives by preadv straight into its destination, each once
    assert calls["preadv_bytes"] == data
    # "w" alone is 40,000 bytes, more than one 8 KiB read: several ranged reads in parallel
    assert calls["preadv"] >= 5


def test_resharded_slices_are_copied_once(saved: Any, counted: Counter) -> None:
    store, sd = saved
    # a destination of another dtype cannot take the bytes as stored: read, verify, copy once
    target = zeros_like(sd)
    target["w"] = torch.zeros(10_000, dtype=torch.float64)
    counted.copies = 0
    dcp.load(target, storage_reader=ObjckptStorageReader(store))
    assert torch.equal(target["w"], sd["w"].double())
    assert counted.copies == 1


def test_wrapped_store_reads_through_open_and_copies_each_chunk_once(saved: Any, counted: Counter) -> None:
    store, sd = saved
    counting = CountingStore(store)
    target = zeros_like(sd)
    counted.hashed = 0
    dcp.load(target, storage_reader=ObjckptStorageReader(counting))
    assert torch.equal(target["w"], sd["w"]) and torch.equal(target["m"], sd["m"])
    assert counted.hashed == shard_bytes(store, 1)
    # ranged reads, never a whole-shard GET for the data: one open per planned read
    opens = counting.counts.get("open", 0)
    assert opens >= 5


@pytest.mark.parametrize("offset_in_w", [0, 20_000, 39_999])
def test_a_corrupt_byte_in_any_piece_of_a_split_item_is_caught(saved: Any, offset_in_w: int) -> None:
    store, sd = saved
    reader = ObjckptStorageReader(store)
    reader.read_metadata()
    loc = next(v for k, v in reader._locations.items() if k.fqn == "w")
    key, _ = reader._keys[(loc.rank, loc.shard)]
    path = Path(store.root) / key  # type: ignore[attr-defined]
    before = path.stat()
    path.chmod(0o644)
    with open(path, "r+b") as f:  # in place, times restored: the shard's version still matches
        f.seek(loc.start + offset_in_w)
        byte = f.read(1)[0]
        f.seek(loc.start + offset_in_w)
        f.write(bytes([byte ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(CheckpointException) as info:
        dcp.load(zeros_like(sd), storage_reader=ObjckptStorageReader(store))
    errors = [f[0] if isinstance(f, tuple) else f for f in info.value.failures.values()]
    assert any(isinstance(e, ChecksumMismatchError) and "fail their CRC32C" in str(e) for e in errors)
