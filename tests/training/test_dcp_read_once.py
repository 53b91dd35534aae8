"""The DCP reader reads the items every rank loads once per job, not once per rank (invariant
16), sharing them over the process group; damage is the same error on every rank, and bytes the
process group corrupts are refused by the receiving rank's CRC32C check."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem  # noqa: E402

from objckpt.store import open_store  # noqa: E402
from objckpt.store.wrappers import CountingStore  # noqa: E402
from objckpt.training.dcp import ObjckptStorageReader, ObjckptStorageWriter  # noqa: E402
from objckpt.training.dcp._metadata import _ItemLocation  # noqa: E402
from objckpt.training.dcp._read_once import assign_owners  # noqa: E402
from tests.training.mp import run_world  # noqa: E402

N_TENSORS = 6
NUMEL = 64 * 1024  # 256 KiB each: several ranged reads per rank


@pytest.fixture(autouse=True)
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


class ByteCountingStore(CountingStore):
    """Counts the bytes of every ranged read under ``data/`` (the items, not the metadata)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.data_bytes = 0
        self._bytes_lock = threading.Lock()

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        n = super()._read_into(key, start, buffers)
        if key.startswith("data/") and not key.endswith("metadata.json"):
            with self._bytes_lock:
                self.data_bytes += n
        return n


def _state(fill: bool) -> dict[str, Any]:
    tensors = {
        f"w{i}": (torch.arange(NUMEL, dtype=torch.float32) + 1000 * i) if fill else torch.zeros(NUMEL)
        for i in range(N_TENSORS)
    }
    return {
        "model": tensors,
        "only_rank0": torch.full((1000,), 7.0) if fill else torch.zeros(1000),
        "progress": {"step": 5 if fill else 0},  # a bytes item every rank loads: shared too
    }


def _save(root: Path) -> int:
    dcp.save(_state(True), storage_writer=ObjckptStorageWriter(f"file://{root}", step=1, dedup=False))
    return N_TENSORS * NUMEL * 4


def _load_worker(rank: int, world_size: int, root: str, out: str, read_once: bool, mode: str) -> None:
    store = ByteCountingStore(open_store(f"file://{root}"))
    store.cheap_reads = False  # as on an object store: the default (read_once=None) reads once
    target = _state(False)
    if rank != 0:
        del target["only_rank0"]  # rank 0 alone loads it: read by rank 0, never exchanged
    if mode == "corrupt_transport" and rank == 1:
        from objckpt.training.dist import DistComm

        sent = DistComm.broadcast_into

        def flip(self: Any, buffer: memoryview, what: str, *, src: int) -> None:
            sent(self, buffer, what, src=src)
            view = memoryview(buffer).cast("B")
            if src != self.rank and view.nbytes:
                view[0] ^= 0xFF  # the process group delivered one wrong byte

        DistComm.broadcast_into = flip  # type: ignore[method-assign]
    result: dict[str, Any] = {}
    if mode == "load_sharded":  # the restore session on top: a damaged newest step falls back
        from objckpt.training.dcp import load_sharded

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            result["step"] = load_sharded(target, store)
        result["w1"] = target["model"]["w1"][:3].tolist()
        result["data_bytes"] = store.data_bytes
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        return
    planner = None
    if mode == "unmatched" and rank == 1:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        class DropsAnItem(DefaultLoadPlanner):  # changes its plan after the global plan
            def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
                items = [i for i in central_plan.items if i.storage_index.fqn != "progress.step"]
                return super().finish_plan(dataclasses.replace(central_plan, items=items))

        planner = DropsAnItem()
        target["progress"]["step"] = 5  # not loaded on this rank: what the check expects
    try:
        dcp.load(target, storage_reader=ObjckptStorageReader(store, read_once=read_once), planner=planner)
        want = _state(True)
        result["equal"] = (
            all(torch.equal(target["model"][k], want["model"][k]) for k in want["model"])
            and (rank != 0 or torch.equal(target["only_rank0"], want["only_rank0"]))
            and target["progress"] == {"step": 5}
        )
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["data_bytes"] = store.data_bytes
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run(tmp_path: Path, name: str, root: Path, read_once: bool, mode: str = "") -> list[dict[str, Any]]:
    out = tmp_path / name
    out.mkdir()
    codes = run_world(_load_worker, 2, str(root), str(out), read_once, mode, timeout=240)
    assert codes == [0, 0], codes
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_items_every_rank_loads_are_read_once_per_job_and_shared(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state_bytes = _save(root)
    once = _run(tmp_path, "once", root, read_once=True)
    per_rank = _run(tmp_path, "per-rank", root, read_once=False)
    for results in (once, per_rank):
        assert all(r.get("equal") is True for r in results), results
    # per rank: every rank reads the replicated state; read once: about one copy in all
    assert all(r["data_bytes"] >= state_bytes for r in per_rank), per_rank
    total = sum(r["data_bytes"] for r in once)
    assert state_bytes <= total <= state_bytes + 8192, (total, state_bytes)  # + rank 0's own item
    assert all(r["data_bytes"] < state_bytes for r in once), once  # each rank read a share


def _corrupt_one_item(root: Path) -> None:
    shards = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > NUMEL]
    shard = max(shards, key=lambda p: p.stat().st_size)
    before = shard.stat()
    with open(shard, "r+b") as f:  # in place, and the same mtime: the object's version is
        f.seek(before.st_size // 2)  # unchanged, so only the bytes' CRC32C can tell (bit rot)
        byte = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.slow
def test_damage_read_by_one_rank_is_the_same_damage_error_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _save(root)
    _corrupt_one_item(root)
    results = _run(tmp_path, "damaged", root, read_once=True)
    for r in results:  # no rank hangs in the exchange, and none loads quietly
        assert "error" in r and "CRC32C" in r["error"] and "ChecksumMismatchError" in r["error"], results


@pytest.mark.slow
def test_bytes_the_process_group_corrupts_are_refused_by_the_receiver(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _save(root)
    results = _run(tmp_path, "transport", root, read_once=True, mode="corrupt_transport")
    assert "process group corrupted them" in results[1].get("error", ""), results
    assert "error" in results[0], results  # DCP fails the load on every rank


# ------------------------------------------------------------------------------ the plan (pure)


def _plan(*fqns: str) -> LoadPlan:
    return LoadPlan(
        [
            ReadItem(
                type=None,
                dest_index=None,
                dest_offsets=None,
                storage_index=MetadataIndex(f),
                storage_offsets=None,
                lengths=None,
            )
            for f in fqns
        ]  # type: ignore[arg-type]
    )


def _loc(start: int, length: int) -> _ItemLocation:
    return _ItemLocation(rank=0, shard="s", start=start, length=length, crc32c="", kind="tensor")


def test_owners_are_the_items_every_plan_requests_in_runs_of_equal_bytes() -> None:
    sizes = {"a": 100, "b": 60, "c": 40, "d": 100, "e": 0, "x": 5}
    locations, start = {}, 0
    for fqn, n in sizes.items():
        locations[MetadataIndex(fqn)] = _loc(start, n)
        start += n
    plans = [_plan("a", "b", "c", "d", "e", "x"), _plan("d", "c", "b", "a", "e")]
    owners = assign_owners(plans, locations)
    # "x" is rank 0's alone, "e" is empty: neither is shared; the rest in storage order, cut
    # into two runs of 150 bytes each (by where each item's first byte falls)
    assert owners == {
        MetadataIndex("a"): 0,
        MetadataIndex("b"): 0,
        MetadataIndex("c"): 1,
        MetadataIndex("d"): 1,
    }
    assert assign_owners(list(reversed(plans)), locations) == owners  # the same on every coordinator
    assert assign_owners(plans[:1], locations) == {}


@pytest.mark.slow
def test_a_damaged_newest_step_falls_back_on_every_rank_together(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _save(root)  # step 1
    newer = _state(True)
    newer["model"] = {k: v + 0.5 for k, v in newer["model"].items()}
    dcp.save(newer, storage_writer=ObjckptStorageWriter(f"file://{root}", step=2, dedup=False))
    (attempt_dir,) = root.glob("data/*/00000000000000000002-*")  # step 2's shards
    _corrupt_one_item(attempt_dir)
    results = _run(tmp_path, "fallback", root, read_once=True, mode="load_sharded")
    assert [r["step"] for r in results] == [1, 1], results
    assert all(r["w1"] == [1000.0, 1001.0, 1002.0] for r in results), results  # step 1's values


@pytest.mark.slow
def test_a_plan_changed_after_the_global_plan_makes_every_rank_read_its_own_items(tmp_path: Path) -> None:
    root = tmp_path / "run"
    state_bytes = _save(root)
    results = _run(tmp_path, "unmatched", root, read_once=True, mode="unmatched")
    assert all(r.get("equal") is True for r in results), results  # no hang, nothing lost
    assert all(r["data_bytes"] >= state_bytes for r in results), results  # no exchange: per rank


def test_read_once_is_on_by_default_for_object_stores_and_off_where_reads_are_page_cache_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import objckpt.training.dcp.reader as reader_module

    monkeypatch.setattr(reader_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(reader_module.dist, "get_world_size", lambda: 2)
    local = open_store(f"file://{tmp_path}/run")
    assert local.cheap_reads and CountingStore(local).cheap_reads  # wrappers say what they wrap
    remote_like = CountingStore(local)
    remote_like.cheap_reads = False
    assert not ObjckptStorageReader(local)._reads_once(2)
    assert ObjckptStorageReader(remote_like)._reads_once(2)
    assert ObjckptStorageReader(local, read_once=True)._reads_once(2)
    assert not ObjckptStorageReader(remote_like, read_once=False)._reads_once(2)
    assert not ObjckptStorageReader(remote_like)._reads_once(1)  # one rank: nothing to share


def test_small_items_travel_packed_and_large_ones_alone_by_owner() -> None:
    from objckpt.training.dcp._read_once import PACK_BYTES, SMALL_ITEM, exchange_batches

    small, large = 1024, SMALL_ITEM
    owners = {MetadataIndex(f"s{i:04d}"): i % 2 for i in range(2000)}  # 2,000 small items
    owners[MetadataIndex("big")] = 0
    sizes = {i: (large if i.fqn == "big" else small) for i in owners}
    batches = exchange_batches(owners, sizes)
    # one broadcast per owner's small items and one for the large item: 3, not 2,001
    assert len(batches) == 3
    assert (0, [MetadataIndex("big")]) in batches
    assert sorted(i.fqn for _, b in batches for i in b) == sorted(i.fqn for i in owners)  # each once
    assert all(owners[i] == src for src, b in batches for i in b)  # a batch comes from one owner
    many = {MetadataIndex(f"m{i:03d}"): 0 for i in range(100)}
    packs = exchange_batches(many, dict.fromkeys(many, SMALL_ITEM - 1))
    assert all(len(b) * (SMALL_ITEM - 1) <= PACK_BYTES for _, b in packs) and len(packs) > 1
