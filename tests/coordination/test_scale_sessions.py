"""Key spreading and spreadable commit verification through the save/restore sessions
(invariants 5, 10, 16), on a ThreadWorld; request counts per rank, never timings."""

from __future__ import annotations

from typing import Any

import pytest

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.coordination import RestoreSession, SaveSession, ThreadWorld
from objckpt.errors import CommitError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.reader import Reader
from objckpt.store.base import ObjectMeta, PutMode
from objckpt.store.wrappers import CountingStore
from tests.protocol.helpers import attempts_in_data, memory_store, write_rank

WORLD = 8


def _save(stores: list[Any], step: int, **options: Any) -> list[Any]:
    def body(comm: Any) -> Any:
        session = SaveSession(stores[comm.rank], comm, **options)

        def write(ticket: Any) -> None:
            for i in range(3):
                ticket.writer.write(f"shard-{i}.bin", f"{step}/{comm.rank}/{i}".encode() * 10)

        return session.save(step, write)

    results = ThreadWorld(len(stores), timeout=30).run(body)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _counting(inner: Any, n: int = WORLD) -> list[CountingStore]:
    return [CountingStore(inner) for _ in range(n)]


def _data_lists(store: CountingStore) -> list[str]:
    return [k for op, k in store.calls if op == "list_page" and k.startswith(layout.DATA_PREFIX)]


def test_one_save_spreads_its_keys_over_many_prefixes_and_restores():
    inner = memory_store()
    manifest = _save(_counting(inner), 10)[0]
    spreads = {s.key.split("/")[1] for s in manifest.shards}
    assert len(spreads) > 1
    assert all(layout.parse_shard_key(s.key)[:2] == (10, manifest.attempt) for s in manifest.shards)
    for rank in range(WORLD):  # one rank's shards stay under one prefix
        assert len({s.key.split("/")[1] for s in manifest.shards if s.rank == rank}) == 1
    assert Reader(inner).check(Reader(inner).latest()) == []


def test_key_spreading_off_writes_the_old_layout_under_one_prefix():
    inner = memory_store()
    manifest = _save(_counting(inner), 10, key_spreading=False)[0]
    assert {s.key.split("/")[1] for s in manifest.shards} == {f"{10:020d}-{manifest.attempt}"}


def test_an_old_run_root_stays_readable_and_collectable_after_spread_saves():
    inner = memory_store()
    old = _save(_counting(inner), 10, key_spreading=False)[0]
    new = _save(_counting(inner), 20)[0]
    reader = Reader(inner)
    assert reader.steps() == [10, 20]
    assert reader.check(reader.load(10)) == [] and reader.check(reader.load(20)) == []
    assert reader.load(10).shards == old.shards
    # retention removes the old-layout checkpoint's shards, keeps the spread one's
    run_gc(inner, plan_gc(inner, RetentionPolicy(keep_last=1)))
    assert attempts_in_data(inner) == {(20, new.attempt)}


def test_coordinator_verification_lists_each_spread_prefix_used_once():
    inner = memory_store()
    stores = _counting(inner)
    manifest = _save(stores, 10)[0]
    used = sorted({layout.attempt_prefix_of(s.key) for s in manifest.shards})
    assert sorted(_data_lists(stores[0])) == used  # one LIST (page) per prefix, 3 shards each
    assert all(_data_lists(s) == [] for s in stores[1:])  # verify="coordinator": rank 0 only


def test_verify_ranks_spreads_the_listing_over_the_ranks_and_rank_0_lists_no_data():
    inner = memory_store()
    stores = _counting(inner)
    manifest = _save(stores, 10, verify="ranks")[0]
    for rank, store in enumerate(stores):
        # each rank: one LIST of its own rank prefix, nothing else under data/
        assert _data_lists(store) == [layout.rank_prefix(10, manifest.attempt, rank, spread=True)]
    assert Reader(inner).check(Reader(inner).latest()) == []


def test_verify_ranks_still_catches_what_the_store_does_not_hold():
    """The coordinator checks every rank's receipts against that rank's listing: a shard
    deleted after its write (or never landed) fails the commit naming the rank."""
    inner = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(inner, 5, attempt, r, names=("a", "b")) for r in range(3)}

    def listing(rank: int) -> list[ObjectMeta]:
        return list(inner.list(layout.rank_prefix(5, attempt, rank, spread=True)))

    listings = {r: listing(r) for r in range(3)}
    listings[1] = [m for m in listings[1] if not m.key.endswith("/b")]  # rank 1's "b" is gone
    stray = layout.shard_key(5, attempt, 2, "zombie", spread=True)
    inner.put(stray, b"z", mode=PutMode.CREATE)
    listings[2] = listing(2)
    coordinator_store = CountingStore(inner)
    with pytest.raises(CommitError) as ei:
        Coordinator(coordinator_store, world_size=3).commit(5, attempt, receipts, listings=listings)
    assert set(ei.value.failures) == {1, 2}
    assert "missing" in ei.value.failures[1] and stray in ei.value.failures[2]
    assert _data_lists(coordinator_store) == []
    # a rank that sends no listing fails too; another rank's key in a listing is not vouched for
    listings = {0: listing(0), 1: listing(1) + listing(0)[:1]}
    with pytest.raises(CommitError) as ei:
        Coordinator(inner, world_size=3).commit(5, attempt, receipts, listings=listings)
    assert set(ei.value.failures) == {1, 2}
    assert "no listing" in ei.value.failures[2]


def test_verify_ranks_commits_what_the_listings_confirm():
    inner = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(inner, 5, attempt, r) for r in range(3)}
    listings = {r: list(inner.list(layout.rank_prefix(5, attempt, r, spread=True))) for r in range(3)}
    manifest = Coordinator(inner, world_size=3).commit(5, attempt, receipts, listings=listings)
    assert Reader(inner).latest() == manifest


def test_non_coordinator_ranks_neither_list_nor_get_a_manifest_on_restore():
    inner = memory_store()
    _save(_counting(inner), 10)
    _save(_counting(inner), 20)
    stores = _counting(inner)

    def body(comm: Any) -> Any:
        session = RestoreSession(stores[comm.rank], comm)
        return session.restore(
            lambda m: [session.reader.read_shard(s) for s in m.shards if s.rank == comm.rank]
        )

    results = ThreadWorld(WORLD, timeout=30).run(body)
    assert all(not isinstance(r, BaseException) and r.step == 20 for r in results), results
    for store in stores[1:]:
        assert store.counts["list_page"] == 0 and store.counts["list_prefixes"] == 0
        assert [
            k for op, k in store.calls if k.startswith(layout.MANIFEST_PREFIX) or k == layout.POINTER_KEY
        ] == []
    assert stores[0].counts["list_page"] >= 1  # rank 0 resolved


def test_invalid_verify_mode_is_refused():
    with pytest.raises(ValueError, match="verify"):
        SaveSession(memory_store(), ThreadWorld(1).comm(0), verify="nobody")
