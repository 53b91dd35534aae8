"""Write only what changed (CheckpointManager): content-addressed reuse of the parent's bytes.

Counts and bytes only, never timings.
"""

from __future__ import annotations

import json
import struct
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from objckpt import layout
from objckpt._crc import crc32c_of
from objckpt.commit import Coordinator
from objckpt.coordination import lineage
from objckpt.errors import CommitError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.manifest import Reference
from objckpt.reader import Reader
from objckpt.replicate import replicate, replicate_all
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore
from objckpt.training import dedup, serialization
from objckpt.training.manager import CheckpointManager
from objckpt.training.shards import replicated_receipts
from objckpt.writer import ShardWriter

MiB = 1024 * 1024


def lora_state(seed: int = 0) -> dict[str, Any]:
    """A frozen 32 MiB base and a small trainable adapter with its optimizer."""
    torch.manual_seed(seed)
    base = torch.nn.Linear(2048, 4096)  # 8 Mi float32 weights + bias: 32 MiB
    for p in base.parameters():
        p.requires_grad_(False)
    adapter = torch.nn.Sequential(torch.nn.Linear(64, 16, bias=False), torch.nn.Linear(16, 64, bias=False))
    opt = torch.optim.AdamW(adapter.parameters(), lr=0.01)
    return {"base": base, "adapter": adapter, "optimizer": opt}


def train(state: dict[str, Any], steps: int = 1) -> None:
    for _ in range(steps):
        state["adapter"](torch.randn(8, 64)).pow(2).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in ("base", "adapter"):
        for (ka, va), (kb, vb) in zip(
            a[name].state_dict().items(), b[name].state_dict().items(), strict=True
        ):
            assert ka == kb and torch.equal(va, vb), ka
    sa, sb = a["optimizer"].state_dict()["state"], b["optimizer"].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for pid in sa:
        for k in sa[pid]:
            assert torch.equal(torch.as_tensor(sa[pid][k]), torch.as_tensor(sb[pid][k]))


@pytest.fixture(autouse=True)
def _fresh_lineage() -> Any:
    yield
    # positions and header caches are per process; memory stores key them by object


def restore_step(store: Any, step: int | None = None) -> dict[str, Any]:
    fresh = lora_state(seed=99)
    mgr = CheckpointManager(store, keep_last=None)
    try:
        assert mgr.restore(fresh, step=step) == (step if step is not None else mgr.latest_step())
    finally:
        mgr.close()
    return fresh


def test_a_frozen_base_is_written_once_and_every_step_restores_bit_exact() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    state = lora_state()
    train(state)
    first = mgr.save(1, state)
    full = first.total_size
    assert full > 32 * MiB and first.references == ()
    train(state)
    counted = CountingStore(store, close_inner=False)
    mgr2 = CheckpointManager(counted, keep_last=None)
    second = mgr2.save(2, state)
    assert second.total_size <= full // 100  # <= 1% of the first (the manifest aside)
    # the frozen base lives in the first save's replicated pieces (a 32 MiB share is spread)
    base = replicated_receipts(first)
    assert len(base) > 1
    assert sorted(r.key for r in second.references) == sorted(r.key for r in base)
    assert second.referenced_size == sum(r.size for r in base)
    written = sum(1 for op, k in counted.calls if op in ("put", "upload_part") and k.startswith("data/"))
    assert written == len(second.shards)  # one small request a shard; the base was not sent again
    # the index came from this process's last commit: no shard header was read
    assert not [k for op, k in counted.calls if op == "open" and k.startswith("data/")]
    snapshot2 = {k: v.clone() for k, v in state["adapter"].state_dict().items()}
    train(state)
    third = mgr2.save(3, state)
    assert third.references == second.references  # a reference of a reference: same origin
    mgr.close()
    mgr2.close()

    at2 = restore_step(store, 2)
    assert all(torch.equal(v, snapshot2[k]) for k, v in at2["adapter"].state_dict().items())
    assert torch.equal(at2["base"].weight, state["base"].weight)
    assert_same(restore_step(store, 3), state)
    assert Reader(store).verify(third) == []


def test_with_keep_last_1_the_base_lives_while_the_newest_references_it() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=1)
    state = lora_state()
    first = mgr.save(1, state)
    base_key = first.shard(0, "replicated.bin").key
    for step in (2, 3, 4):
        train(state)
        mgr.save(step, state)
    assert Reader(store).steps() == [4]
    assert store.head(base_key).size == first.shard(0, "replicated.bin").size  # manifest 1 is gone
    assert_same(restore_step(store), state)
    # the base changes: the next save writes it again, and then nothing needs the old object
    with torch.no_grad():
        for p in state["base"].parameters():
            p.add_(1.0)
    fifth = mgr.save(5, state)
    assert fifth.total_size > 32 * MiB
    assert not any(r.key == base_key for r in fifth.references)
    # nothing retained needs it any more: an orphan once the grace period is over
    run_gc(store, plan_gc(store, RetentionPolicy(keep_last=1), grace_period=timedelta(0)))
    assert not list(store.list(base_key))
    assert_same(restore_step(store), state)
    mgr.close()


def test_a_fully_changing_state_reuses_nothing_and_restores_bit_exact() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 2048)  # 4 MiB: one chunk per tensor and then some
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}

    def step() -> None:
        model(torch.randn(4, 512)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    first = mgr.save(1, state)
    step()
    second = mgr.save(2, state)
    assert second.references == ()
    assert second.total_size >= first.total_size - 64 * 1024
    fresh_model = torch.nn.Linear(512, 2048)
    fresh = {"model": fresh_model, "optimizer": torch.optim.AdamW(fresh_model.parameters(), lr=0.1)}
    assert CheckpointManager(store).restore(fresh) == 2
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(), strict=True)
    )
    mgr.close()


def test_one_changed_chunk_of_a_tensor_reuses_the_others() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    big = torch.nn.Linear(1280, 4096, bias=False)  # 20 MiB: five 4 MiB chunks
    state = {"model": big}
    first = mgr.save(1, state)
    with torch.no_grad():
        big.weight.view(-1)[(2 * 4 * MiB) // 4 + 5] += 1.0  # one float in the third chunk
    second = mgr.save(2, state)
    assert 4 * MiB <= second.total_size <= 4 * MiB + 64 * 1024  # one chunk and the headers
    header = serialization.read_header(
        lambda a, b: store.get(second.shard(0, "replicated.bin").key, byte_range=(a, b)),
        second.shard(0, "replicated.bin").size,
    )
    assert header is not None
    (weight,) = [a for a in header[0]["arrays"] if a["nbytes"] == 20 * MiB]
    assert ["ref" in c for c in weight["chunks"]] == [True, True, False, True, True]
    assert first.references == ()
    fresh = torch.nn.Linear(1280, 4096, bias=False)
    assert CheckpointManager(store).restore({"model": fresh}) == 2
    assert torch.equal(fresh.weight, big.weight)
    mgr.close()


def test_dedup_false_writes_every_byte_in_the_old_format() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None, dedup=False)
    state = lora_state()
    first = mgr.save(1, state)
    second = mgr.save(2, state)
    assert second.references == () and second.total_size == first.total_size
    raw = store.get(second.shard(0, "replicated.bin").key)
    assert json.loads(raw[16 : 16 + struct.unpack("<Q", raw[8:16])[0]])["version"] == 1
    mgr.close()


def test_after_a_restore_the_next_save_indexes_the_restored_headers_without_a_request() -> None:
    store = MemoryStore()
    state = lora_state()
    with CheckpointManager(store, keep_last=None) as mgr:
        mgr.save(1, state)
    dedup.forget(store)
    lineage.forget(store)  # a new process: nothing kept
    counted = CountingStore(store, close_inner=False)
    fresh = lora_state(seed=5)
    with CheckpointManager(counted, keep_last=None) as mgr:
        assert mgr.restore(fresh) == 1
        counted.reset()
        train(fresh)
        second = mgr.save(2, fresh)
    assert second.total_size < MiB and second.references
    # headers came from the restore: no shard was read again
    assert not [k for op, k in counted.calls if op == "open" and k.startswith("data/")]
    # a process that restored nothing of it reads each of its own shards' headers once
    dedup.forget(store)
    lineage.record(store, lineage.Position(second, second.timeline))
    counted.reset()
    train(fresh)
    with CheckpointManager(counted, keep_last=None) as mgr:
        third = mgr.save(3, fresh)
    assert third.total_size < MiB
    header_reads = [k for op, k in counted.calls if op == "open" and k.startswith("data/")]
    assert sorted(header_reads) == sorted(s.key for s in second.shards)


def test_a_forged_reference_is_refused_at_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    state = lora_state()
    first = mgr.save(1, state)
    good = Reference.to(first.shard(0, "replicated.bin"), first)
    forged = [
        Reference(good.key, good.size, good.version, "AAAAAA==", *good.identity),  # wrong CRC32C
        Reference(  # an object no ancestor committed, at a shard-shaped key
            layout.shard_key(1, "f" * 16, 0, "replicated.bin", spread=True),
            good.size,
            good.version,
            good.crc32c,
            *good.identity,
        ),
    ]
    for ref in forged:
        monkeypatch.setattr(dedup.ChunkIndex, "references_used", lambda self, used, r=ref: [r])
        train(state)
        with pytest.raises(CommitError, match="references are not what an ancestor committed"):
            mgr.save(2, state)
    assert Reader(store).steps() == [1]
    mgr.close()


def _rewrite_header(blob: bytes, change: Any) -> bytes:
    """``blob`` (a version-3 shard) with its header changed by ``change(header)``."""
    offset, length, _, magic = struct.unpack("<QQI4x8s", blob[-32:])
    header = json.loads(blob[offset : offset + length])
    change(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    return blob[:offset] + raw + struct.pack("<QQI4x8s", offset, len(raw), crc32c_of(raw), magic)


@pytest.mark.parametrize("lie", ["crc", "identity", "beyond"])
def test_a_forged_chunk_reference_is_refused_at_load(lie: str) -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    state = lora_state()
    mgr.save(1, state)
    train(state)
    second = mgr.save(2, state)
    mgr.close()
    blob = store.get(second.shard(0, "replicated.bin").key)

    def change(header: dict[str, Any]) -> None:
        chunk = next(c for a in header["arrays"] for c in a["chunks"] if "ref" in c)
        if lie == "crc":
            chunk["crc"] = "AAAAAA=="
        elif lie == "identity":
            chunk["ref"]["from"] = [0, 2]  # a checkpoint the manifest does not reference
        else:
            chunk["ref"]["offset"] = 10**9

    # commit the forged shard as step 3, with references the coordinator rightly accepts
    attempt = "a" * 16
    writer = ShardWriter(store, step=3, attempt=attempt, rank=0)
    writer.write("replicated.bin", _rewrite_header(blob, change))
    writer.write("rank.bin", store.get(second.shard(0, "rank.bin").key))
    Coordinator(store, world_size=1).commit(
        3, attempt, {0: writer.receipts}, topology=second.topology, after=second.ref,
        references={0: list(second.references)},
    )  # fmt: skip
    fresh = lora_state(seed=7)
    with CheckpointManager(store) as loader:
        assert loader.restore(fresh) == 2  # 3 is damaged: the restore falls back to its parent
        assert loader.fallbacks and loader.fallbacks[0][0] == 3
    assert_same(fresh, state)


def test_a_damaged_referenced_object_rejects_every_checkpoint_that_needs_it() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    state = lora_state()
    first = mgr.save(1, state)
    train(state)
    second = mgr.save(2, state)
    mgr.close()
    key = first.shard(0, "replicated.bin").key
    blob = bytearray(store.get(key))
    blob[1000] ^= 1
    store.corrupt(key, bytes(blob))
    assert [p.key for p in Reader(store).verify(second)] == [key]
    with pytest.raises(Exception, match="none is usable|no valid checkpoint"):
        CheckpointManager(store).restore(lora_state(seed=3))


def test_a_save_of_an_earlier_step_than_the_last_commit_reuses_nothing() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    state = lora_state()
    mgr.save(10, state)
    mgr.save(20, state)
    back = mgr.save(15, state)  # its parent is 10, not 20: references to 20 would be refused
    assert back.parent == 10
    assert all(r.origin_step == 10 for r in back.references) or back.references == ()
    mgr.close()


def test_a_save_after_restoring_an_older_step_reuses_its_bytes_on_the_new_timeline() -> None:
    store = MemoryStore()
    state = lora_state()
    with CheckpointManager(store, keep_last=None) as mgr:
        one = mgr.save(1, state)
        train(state)
        mgr.save(2, state)
    fresh = lora_state(seed=4)
    with CheckpointManager(store, keep_last=None) as mgr:
        assert mgr.restore(fresh, step=1) == 1
        train(fresh)
        again = mgr.save(2, fresh)  # re-save step 2 from 1: a new timeline based on 1
    assert again.timeline == 1 and again.parent_ref == one.ref
    assert sorted(r.key for r in again.references) == sorted(r.key for r in replicated_receipts(one))
    assert again.total_size < MiB


def test_gc_racing_a_save_that_references_an_old_object_keeps_it(backend: Any) -> None:
    if backend.name not in ("file", "s3_localstack"):
        pytest.skip("the race runs on file:// and LocalStack, whose conditional writes are atomic")
    store = backend.new_store()
    try:
        state = lora_state()
        with CheckpointManager(store, keep_last=None) as mgr:
            first = mgr.save(10, state)
            train(state)
            mgr.save(20, state)
        entered, release = threading.Event(), threading.Event()

        class Holding(CountingStore):
            def _invoke(self, op: str, key: str, keys: Any, fn: Any, *args: Any) -> Any:
                if op == "put" and key.startswith("manifests/") and key.endswith("30.json"):
                    entered.set()
                    release.wait(60)  # 30 is checked, its manifest not written yet
                return super()._invoke(op, key, keys, fn, *args)

        holding = Holding(store, close_inner=False)
        outcome: dict[str, Any] = {}
        train(state)
        saver_mgr = CheckpointManager(holding, keep_last=None)
        saver = threading.Thread(target=lambda: outcome.update(m=saver_mgr.save(30, state)))
        saver.start()
        assert entered.wait(120)
        run_gc(store, plan_gc(store, RetentionPolicy(keep_last=1)))  # collects 10 while 30 commits
        release.set()
        saver.join(120)
        saver_mgr.close()
        assert outcome["m"].step == 30 and outcome["m"].references
        run_gc(store, plan_gc(store, RetentionPolicy(keep_last=1)))  # now 20 goes too
        assert Reader(store).steps() == [30]
        base = first.shard(0, "replicated.bin")
        assert store.head(base.key).size == base.size
        lineage.forget(store)
        assert_same(restore_step(store), state)
    finally:
        lineage.forget(store)
        dedup.forget(store)
        store.close()


def test_copying_a_deduplicated_run_root_transfers_the_unique_bytes_once(tmp_path: Any) -> None:
    from objckpt.store import open_store

    src = MemoryStore()
    state = lora_state()
    with CheckpointManager(src, keep_last=None) as mgr:
        for step in (1, 2, 3):
            train(state)
            mgr.save(step, state)
    reader = Reader(src)
    unique = sum(reader.load(s).total_size for s in (1, 2, 3))
    logical = sum(reader.load(s).total_size + reader.load(s).referenced_size for s in (1, 2, 3))
    assert unique < logical / 2
    dst = open_store(f"file://{tmp_path}/copy")
    moved: list[int] = []
    results = replicate_all(src, dst, moved.append)
    assert [r.step for r in results] == [1, 2, 3] and all(r.copied for r in results)
    assert sum(moved) == unique  # each referenced object crossed once
    assert sum(m.size for m in dst.list("data/")) == unique
    copied = Reader(dst).load(3)
    assert copied.references and all(r.key.startswith("data/") for r in copied.references)
    lineage.forget(dst)
    assert_same(restore_step(dst), state)
    # copying again is a no-op
    assert not any(r.copied for r in replicate_all(src, dst))
    # a single step that references ancestors needs them at the destination first
    lone = open_store(f"file://{tmp_path}/lone")
    with pytest.raises(Exception, match="copy its ancestors first|ancestor"):
        replicate(src, lone, 3)
    dst.close()
    lone.close()


@pytest.mark.skipif(not __import__("objckpt.training.codec", fromlist=["x"]).available(), reason="zstandard")
def test_compression_round_trips_and_keeps_hashes_over_raw_bytes() -> None:
    store = MemoryStore()
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024).to(torch.bfloat16)
    state = {"model": model}
    with CheckpointManager(store, keep_last=None, compression="zstd") as mgr:
        first = mgr.save(1, state)
        second = mgr.save(2, state)  # unchanged: references the compressed chunks
    raw = 1024 * 1024 * 2
    assert first.total_size < raw * 0.95  # bf16 weights' exponent plane compresses
    assert second.total_size < 64 * 1024 and second.references
    header = serialization.read_header(
        lambda a, b: store.get(first.shard(0, "replicated.bin").key, byte_range=(a, b)),
        first.shard(0, "replicated.bin").size,
    )
    assert header is not None
    chunk = next(c for a in header[0]["arrays"] for c in a["chunks"] if "z" in c)
    assert chunk["z"] == "bp2+zstd"
    fresh = torch.nn.Linear(1024, 1024).to(torch.bfloat16)
    assert CheckpointManager(store).restore({"model": fresh}) == 2
    assert torch.equal(fresh.weight.view(torch.int16), model.weight.view(torch.int16))
    with pytest.raises(ValueError, match="compression"):
        CheckpointManager(MemoryStore(), compression="lz4")


def test_usage_reports_logical_and_newly_written_bytes_per_checkpoint() -> None:
    from objckpt import usage

    assert (usage._FOOTER.format, usage._FOOTER_MAGIC) == (
        serialization._FOOTER.format,
        serialization.FOOTER_MAGIC,
    )
    store = MemoryStore()
    state = lora_state()
    with CheckpointManager(store, keep_last=None) as mgr:
        first = mgr.save(1, state)
        train(state)
        second = mgr.save(2, state)
    rows = usage.run_usage(store)
    assert [(r.step, r.exact) for r in rows] == [(1, True), (2, True)]
    one, two = rows
    assert one.written_bytes == one.logical_bytes == first.total_size and one.referenced_bytes == 0
    assert two.written_bytes == second.total_size
    # a restore of 2 reads its own shards and the base's chunks it references (not the whole object)
    assert 32 * MiB <= two.referenced_bytes <= sum(r.size for r in replicated_receipts(first))
    assert two.logical_bytes == two.written_bytes + two.referenced_bytes and two.written_fraction < 0.01
    rough = usage.checkpoint_usage(store, second, exact=False)
    assert not rough.exact and rough.referenced_bytes == second.referenced_size
    assert usage.stored_bytes([first, second]) == first.total_size + second.total_size


def _chunks(store: Any, manifest: Any, name: str = "replicated.bin") -> list[dict[str, Any]]:
    shard = manifest.shard(0, name)
    got = serialization.read_header(lambda a, b: store.get(shard.key, byte_range=(a, b)), shard.size)
    assert got is not None
    return [c for a in got[0]["arrays"] for c in a["chunks"] if "s" in c]


def test_a_save_where_everything_changed_hashes_nothing_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    model = torch.nn.Linear(1024, 2048)  # 8 MiB + 8 KiB: 3 sampled chunks
    state = {"model": model}
    hashed: list[int] = []
    real = dedup.chunk_hash
    big = {4 * MiB, 8 * 1024}  # the model's chunks (the RNG state in rank.bin is hashed too)

    def counting(b: Any) -> bytes:
        if memoryview(b).nbytes in big:
            hashed.append(memoryview(b).nbytes)
        return real(b)

    monkeypatch.setattr(dedup, "chunk_hash", counting)
    with CheckpointManager(store, keep_last=None) as mgr:
        first = mgr.save(1, state)  # no parent: every chunk is hashed, so the next save can reuse
        assert len(hashed) == 3 and all("h" in c for c in _chunks(store, first))
        hashed.clear()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        second = mgr.save(2, state)  # every sample differs from the parent's: no full hash
        assert hashed == [] and not any("h" in c for c in _chunks(store, second))
        # unchanged from here on: the samples match, so the chunks are hashed; their parent has no
        # hash to confirm them, so they are written once more, and reused from the next save on
        third = mgr.save(3, state)
        assert len(hashed) == 3 and third.references == ()
        fourth = mgr.save(4, state)
        assert fourth.total_size < 64 * 1024 and fourth.references
    fresh = torch.nn.Linear(1024, 2048)
    assert CheckpointManager(store).restore({"model": fresh}) == 4
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_the_usage_functions_are_torch_free() -> None:
    import subprocess
    import sys

    code = "import sys, objckpt.usage, objckpt.replicate; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
