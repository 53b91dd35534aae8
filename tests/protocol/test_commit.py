"""The coordinator's commit (invariants 5, 6, 7 (parent), 8, 9)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.errors import CommitConflict, CommitError, NotSupportedError, PermissionDeniedError
from objckpt.manifest import Manifest
from objckpt.reader import Reader
from objckpt.store.base import Capabilities, PutMode, Store
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from objckpt.writer import ShardWriter

from .helpers import FAST_RETRY, memory_store, race_two_attempts, save, write_rank


def manifests_in(store) -> list[str]:
    return [m.key for m in store.list(layout.MANIFEST_PREFIX)]


def pointer_step(store) -> int | None:
    p = Reader(store).pointer()
    return p.step if p else None


# -- invariant 5: every rank, checked against the store, or no manifest


def test_commit_with_one_rank_shard_missing_writes_no_manifest():
    store = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(store, 5, attempt, r) for r in (0, 2)}  # rank 1 never reported
    with pytest.raises(CommitError) as ei:
        Coordinator(store, world_size=3).commit(5, attempt, receipts)
    assert set(ei.value.failures) == {1}
    assert "rank 1" in str(ei.value)
    assert manifests_in(store) == [] and pointer_step(store) is None


def test_commit_error_names_every_failing_rank():
    store = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {
        0: OSError("disk full"),
        1: write_rank(store, 5, attempt, 1),
        2: "CUDA error: out of memory",
        # 3: missing
        4: write_rank(store, 5, attempt, 4),
    }
    with pytest.raises(CommitError) as ei:
        Coordinator(store, world_size=5).commit(5, attempt, receipts)
    assert set(ei.value.failures) == {0, 2, 3}
    assert "disk full" in ei.value.failures[0] and "out of memory" in ei.value.failures[2]
    assert manifests_in(store) == []


def test_commit_refuses_a_receipt_outside_its_ranks_prefix():
    store = memory_store()
    attempt = layout.new_attempt_id()
    r0 = write_rank(store, 5, attempt, 0)
    other = write_rank(store, 5, layout.new_attempt_id(), 1)  # rank 1's shard of another attempt
    with pytest.raises(CommitError) as ei:
        Coordinator(store, world_size=2).commit(5, attempt, {0: r0, 1: other})
    assert set(ei.value.failures) == {1} and "outside" in ei.value.failures[1]
    assert manifests_in(store) == []


@pytest.mark.parametrize("lie", ["deleted", "size", "version"])
def test_commit_checks_receipts_against_the_store(lie):
    store = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(store, 5, attempt, r) for r in range(2)}
    bad = receipts[1][0]
    if lie == "deleted":
        store.delete([bad.key])
    elif lie == "size":
        receipts[1] = [replace(bad, size=bad.size + 1)]
    else:
        receipts[1] = [replace(bad, version="stale-etag")]
    with pytest.raises(CommitError) as ei:
        Coordinator(store, world_size=2).commit(5, attempt, receipts)
    assert set(ei.value.failures) == {1} and bad.key in ei.value.failures[1]
    assert manifests_in(store) == []


@pytest.mark.parametrize("spread", [True, False], ids=["spread-keys", "old-layout"])
def test_zombie_extra_key_in_the_attempt_prefix_refuses_the_commit(spread):
    store = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(store, 5, attempt, r, key_spreading=spread) for r in range(2)}
    stray = layout.shard_key(5, attempt, 0, "late-zombie-write.pt", spread=spread)
    store.put(stray, b"zombie", mode=PutMode.CREATE)
    with pytest.raises(CommitError) as ei:
        Coordinator(store, world_size=2).commit(5, attempt, receipts)
    assert stray in ei.value.failures[0]
    assert manifests_in(store) == []


@pytest.mark.parametrize("spread", [True, False], ids=["spread-keys", "old-layout"])
def test_store_check_costs_one_list_per_1000_shards_and_no_heads(spread):
    inner = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {}
    for rank in range(5):  # 2,500 shards, written directly for speed
        w = ShardWriter(inner, step=5, attempt=attempt, rank=rank, key_spreading=spread)
        for i in range(500):
            w.write(f"s{i}", b"")
        receipts[rank] = w.receipts
    store = CountingStore(inner)
    Coordinator(store, world_size=5).commit(5, attempt, receipts)
    data_lists = [k for op, k in store.calls if op == "list_page" and k.startswith("data/")]
    if spread:  # one LIST per spread prefix used (500 shards each: one page), nothing else
        used = sorted({layout.attempt_prefix(5, attempt, layout.spread_of(r)) for r in range(5)})
        assert sorted(data_lists) == used
    else:
        assert data_lists == [layout.attempt_prefix(5, attempt)] * 3
    assert store.counts["head"] == 1  # the pointer's, never a shard's


# -- invariant 6: create-if-absent manifest, idempotent or conflict


def test_two_attempts_one_step_exactly_one_manifest():
    store = memory_store()
    outcomes = race_two_attempts(store, 9)
    winners = [o for o in outcomes if isinstance(o, Manifest)]
    losers = [o for o in outcomes if isinstance(o, CommitConflict)]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert manifests_in(store) == [layout.manifest_key(9)]
    assert Reader(store).load(9).attempt == winners[0].attempt


def test_second_attempt_of_a_committed_step_is_a_conflict():
    store = memory_store()
    first = save(store, 9)
    with pytest.raises(CommitConflict, match=first.attempt):
        save(store, 9)
    assert Reader(store).load(9) == first


def test_commit_is_idempotent_after_a_lost_manifest_write_response():
    inner = memory_store()
    # The manifest PUT succeeds on the server but the response is lost; the retry finds it.
    store = FaultInjectingStore(inner, [Fault(op="put", key="manifests/*", after=True)])
    m = save(inner, 3, coordinator_store=store)
    assert store.injected == [("put", layout.manifest_key(3))]
    assert Reader(inner).load(3) == m
    assert pointer_step(inner) == 3


def test_recommitting_the_same_attempt_returns_the_existing_manifest():
    store = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(store, 4, attempt, r) for r in range(2)}
    coord = Coordinator(store, world_size=2)
    first = coord.commit(4, attempt, receipts)
    assert coord.commit(4, attempt, receipts) == first


def test_coordinator_refuses_stores_without_conditional_writes():
    for caps in (
        replace(Capabilities.ALL, create_if_absent=False),
        replace(Capabilities.ALL, compare_and_swap=False),
    ):
        with pytest.raises(NotSupportedError):
            Coordinator(MemoryStore("x", capabilities=caps), world_size=1)


class _Undeclared(Store):
    """A backend that forgets to declare what it guarantees. Its primitives delegate to a memory
    store, which would enforce everything: only the missing declaration differs."""

    def __init__(self) -> None:
        super().__init__(location="undeclared://x")
        self.m = MemoryStore("x")

    def _put(self, key, data, mode, crc32c):
        return self.m._put(key, data, mode, crc32c)

    def _open(self, key, start, end):
        return self.m._open(key, start, end)

    def _head(self, key):
        return self.m._head(key)

    def _list_page(self, prefix, start_after, limit):
        return self.m._list_page(prefix, start_after, limit)

    def _list_prefixes(self, prefix):
        return self.m._list_prefixes(prefix)

    def _delete_batch(self, keys):
        return self.m._delete_batch(keys)

    def _create_upload(self, key, mode):
        return self.m._create_upload(key, mode)

    def _upload_part(self, handle, part_number, offset, data, crc32c):
        return self.m._upload_part(handle, part_number, offset, data, crc32c)

    def _complete_upload(self, handle, parts, size, crc32c):
        return self.m._complete_upload(handle, parts, size, crc32c)

    def _abort_upload(self, handle):
        return self.m._abort_upload(handle)

    def _list_uploads(self, prefix):
        return self.m._list_uploads(prefix)


def test_a_store_that_declares_no_capabilities_cannot_commit():
    store = _Undeclared()
    assert store.capabilities == Capabilities.NONE  # fail closed: nothing declared, nothing assumed
    store.put("plain", b"overwrite needs no guarantee")
    assert store.get("plain") == b"overwrite needs no guarantee"
    with pytest.raises(NotSupportedError):
        Coordinator(store, world_size=1)
    with pytest.raises(NotSupportedError):
        store.put("k", b"x", mode=PutMode.CREATE)


# -- invariant 7 (parent)


def test_manifest_parent_is_the_previous_committed_step_even_if_the_pointer_lags():
    inner = memory_store()
    assert save(inner, 10).parent is None
    lossy = FaultInjectingStore(inner, [Fault(op="put", key=layout.POINTER_KEY, error=PermissionDeniedError)])
    save(inner, 20, coordinator_store=lossy)  # committed, pointer left at 10
    assert pointer_step(inner) == 10
    assert save(inner, 30).parent == 20
    assert save(inner, 25).parent == 20  # a late, older step gets the newest step below it


# -- invariant 8: pointer after the manifest, forward only, compare-and-swap


def test_pointer_moves_only_after_the_manifest_exists():
    inner = memory_store()
    store = CountingStore(inner)
    save(inner, 1, coordinator_store=store)
    puts = [k for op, k in store.calls if op == "put"]
    assert puts == [layout.manifest_key(1), layout.POINTER_KEY]
    # and a manifest write that fails leaves the pointer alone
    failing = FaultInjectingStore(inner, [Fault(op="put", key="manifests/*", error=PermissionDeniedError)])
    with pytest.raises(CommitError):
        save(inner, 2, coordinator_store=failing)
    assert pointer_step(inner) == 1 and manifests_in(inner) == [layout.manifest_key(1)]


def test_pointer_never_moves_backwards():
    store = memory_store()
    save(store, 20)
    save(store, 10)  # a stale coordinator committing an older step later
    assert pointer_step(store) == 20
    save(store, 30)
    assert pointer_step(store) == 30


class _InterleavingStore(MemoryStore):
    """Runs ``hook`` once, just before the first conditional write of LATEST is applied."""

    hook = None

    def _put(self, key, data, mode, crc32c):
        if key == layout.POINTER_KEY and mode.kind != "overwrite" and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return super()._put(key, data, mode, crc32c)


def test_pointer_compare_and_swap_loses_no_concurrent_update():
    store = _InterleavingStore("race", retry=FAST_RETRY)
    save(store, 10)
    # Coordinator B (step 20) has read the pointer (step 10) and is about to swap it; meanwhile
    # coordinator A commits step 30 and moves the pointer. B's swap must fail and B must yield.
    store.hook = lambda: save(store, 30)
    save(store, 20)
    assert pointer_step(store) == 30
    assert Reader(store).latest().step == 30


def test_pointer_update_failure_is_not_a_failed_commit(caplog):
    inner = memory_store()
    save(inner, 1)
    lossy = FaultInjectingStore(inner, [Fault(op="put", key=layout.POINTER_KEY, error=PermissionDeniedError)])
    with caplog.at_level(logging.WARNING, logger="objckpt.commit"):
        m = save(inner, 2, coordinator_store=lossy)
    assert m.step == 2 and "readers roll forward" in caplog.text
    assert pointer_step(inner) == 1
    assert Reader(inner).latest().step == 2


def test_corrupt_pointer_is_replaced_forward():
    store = memory_store()
    save(store, 1)
    store.put(layout.POINTER_KEY, b"garbage")
    save(store, 2)
    assert pointer_step(store) == 2


# -- invariant 9: the commit path never deletes


def test_commit_never_deletes_and_leaves_the_previous_checkpoint_intact():
    inner = memory_store()
    store = CountingStore(inner)
    first = save(inner, 1, coordinator_store=store)
    before = {m.key: m.version for m in inner.list()}
    save(inner, 2, coordinator_store=store)
    with pytest.raises(CommitConflict):
        save(inner, 2, coordinator_store=store)
    attempt = layout.new_attempt_id()
    with pytest.raises(CommitError):
        Coordinator(store, world_size=2).commit(3, attempt, {0: write_rank(inner, 3, attempt, 0)})
    assert store.counts["delete_batch"] == 0
    after = {m.key: m.version for m in inner.list()}
    assert all(after.get(k) == v for k, v in before.items() if k != layout.POINTER_KEY)
    assert Reader(inner).check(first) == []
