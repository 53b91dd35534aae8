"""DCP saves write only what changed: unchanged tensor items are located in the parent's object.

Single process (DCP's no-process-group path); counts and bytes only.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from objckpt.coordination import lineage  # noqa: E402
from objckpt.errors import CommitError  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store.memory import MemoryStore  # noqa: E402
from objckpt.store.wrappers import CountingStore  # noqa: E402
from objckpt.training import dedup  # noqa: E402
from objckpt.training.dcp import METADATA_SHARD, load_sharded, save_sharded  # noqa: E402

MiB = 1024 * 1024


pytestmark = pytest.mark.usefixtures("quiet_dcp")


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "frozen": {"embed": torch.randn(1024, 1024, generator=g)},  # 4 MiB that never changes
        "head": {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))},
        "step": seed,
    }


def zeros(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros(v) for k, v in sd.items()}
    return sd


def items(store: Any, manifest: Any) -> list[dict[str, Any]]:
    return json.loads(store.get(manifest.shard(0, METADATA_SHARD).key))["items"]


def test_an_unchanged_item_is_located_in_the_parent_and_restores_bit_exact() -> None:
    store = MemoryStore()
    save_sharded(state(1), store, 1)
    first = Reader(store).latest()
    counted = CountingStore(store, close_inner=False)
    save_sharded(state(2), counted, 2)
    second = Reader(store).latest()
    assert second.total_size < first.total_size - 4 * MiB + 64 * 1024
    assert [r.key for r in second.references] == [first.shard(0, "dcp-00000.bin").key]
    embed = next(i for i in items(store, second) if i["index"]["fqn"] == "frozen.embed")
    assert embed["from"] == [0, 1] and embed["hash"]
    # the coordinator indexed the parent from its own last commit: no metadata was read back
    assert not [k for op, k in counted.calls if op == "open" and k.startswith("data/")]
    for step, want in ((2, state(2)), (1, state(1))):
        out = zeros(state(9))
        assert load_sharded(out, store, step=step) == step
        assert torch.equal(out["frozen"]["embed"], want["frozen"]["embed"])
        assert torch.equal(out["head"]["w"], want["head"]["w"])
    # a third save references the same origin (a reference of a reference)
    save_sharded(state(3), store, 3)
    third = Reader(store).latest()
    assert third.references == second.references
    out = zeros(state(9))
    assert load_sharded(out, store) == 3 and torch.equal(out["frozen"]["embed"], state(0)["frozen"]["embed"])


def test_dedup_false_and_a_changed_item_write_everything() -> None:
    store = MemoryStore()
    save_sharded(state(1), store, 1)
    first = Reader(store).latest()
    save_sharded(state(1), store, 2, dedup=False)
    assert Reader(store).latest().references == ()
    changed = state(3)
    changed["frozen"]["embed"][0, 0] += 1
    save_sharded(changed, store, 3)
    third = Reader(store).latest()
    assert third.references == () and third.total_size >= first.total_size - 1024


def test_after_a_restore_the_next_save_reuses_the_restored_items() -> None:
    store = MemoryStore()
    save_sharded(state(1), store, 1)
    dedup.forget(store)
    lineage.forget(store)  # a new process
    out = zeros(state(9))
    assert load_sharded(out, store) == 1
    save_sharded(state(2), store, 2)
    assert Reader(store).latest().references


def test_a_reused_item_whose_object_is_damaged_is_refused_at_load() -> None:
    store = MemoryStore()
    save_sharded(state(1), store, 1)
    save_sharded(state(2), store, 2)
    first = Reader(store).load(1)
    key = first.shard(0, "dcp-00000.bin").key
    embed = next(i for i in items(store, first) if i["index"]["fqn"] == "frozen.embed")
    raw = bytearray(store.get(key))
    raw[embed["start"] + 100] ^= 0xFF  # inside the item step 2 reuses
    store.corrupt(key, bytes(raw))
    with pytest.raises(Exception, match="CRC32C|no valid|none is usable"):
        load_sharded(zeros(state(9)), store)


def test_a_forged_item_origin_is_refused_at_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    from objckpt.training.dcp import writer as dcp_writer

    store = MemoryStore()
    save_sharded(state(1), store, 1)
    real = dcp_writer.ObjckptStorageWriter._reference

    def forged(self: Any, loc: Any) -> Any:
        ref = real(self, loc)
        return type(ref)(ref.key, ref.size, ref.version, "AAAAAA==", *ref.identity)

    monkeypatch.setattr(dcp_writer.ObjckptStorageWriter, "_reference", forged)
    with pytest.raises(CommitError):
        save_sharded(state(2), store, 2)
    assert Reader(store).steps() == [1]


def test_a_changed_item_is_not_hashed_and_a_newly_frozen_one_is_reused_from_the_save_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryStore()
    hashed: list[int] = []
    real = dedup.chunk_hash
    monkeypatch.setattr(dedup, "chunk_hash", lambda b: hashed.append(memoryview(b).nbytes) or real(b))
    sd = state(1)
    save_sharded(sd, store, 1)  # nothing to compare with: every tensor item is hashed
    assert 4 * MiB in hashed
    hashed.clear()
    sd["frozen"]["embed"].add_(1.0)

    def embed() -> dict[str, Any]:
        return next(i for i in items(store, Reader(store).latest()) if i["index"]["fqn"] == "frozen.embed")

    save_sharded(sd, store, 2)  # its sample differs from the parent's: not hashed, written
    assert 4 * MiB not in hashed and "from" not in embed() and "hash" not in embed()
    save_sharded(sd, store, 3)  # unchanged now: hashed, but the parent has no hash to match
    assert 4 * MiB in hashed and "from" not in embed() and "hash" in embed()
    save_sharded(sd, store, 4)  # reused from here on
    assert embed()["from"] == [0, 3]
    out = zeros(state(9))
    assert load_sharded(out, store) == 4 and torch.equal(out["frozen"]["embed"], sd["frozen"]["embed"])
