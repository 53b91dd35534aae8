"""Key spreading and spreadable commit verification through the save/restore sessions
(invariants 5, 10, 16), on a ThreadWorld; request counts per rank, never timings."""

from __future__ import annotations

from typing import Any

import pytest

from objckpt import layout
from objckpt.commit import NO_RANK, Coordinator
from objckpt.coordination import RestoreSession, SaveSession, ThreadWorld
from objckpt.defaults import VERIFY_SPREAD_ABOVE
from objckpt.errors import CommitError, PermissionDeniedError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.reader import Reader
from objckpt.store.base import PutMode
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
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


def _save_results(stores: list[Any], step: int, **options: Any) -> list[Any]:
    def body(comm: Any) -> Any:
        session = SaveSession(stores[comm.rank], comm, **options)
        return session.save(step, lambda ticket: ticket.writer.write("shard.bin", b"x"))

    return ThreadWorld(len(stores), timeout=30).run(body)


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


def test_verify_ranks_lists_each_spread_attempt_prefix_once_each_on_its_own_rank():
    inner = memory_store()
    stores = _counting(inner)
    manifest = _save(stores, 10, verify="ranks")[0]
    for rank, store in enumerate(stores):
        # rank r LISTs the whole spread attempt prefix of spread_of(r), nothing else under data/
        expected = [layout.attempt_prefix(10, manifest.attempt, layout.spread_of(rank))]
        assert _data_lists(store) == expected
    assert Reader(inner).check(Reader(inner).latest()) == []


def test_verify_ranks_above_256_ranks_the_first_256_list_and_the_others_none():
    inner = memory_store()
    stores = _counting(inner, 260)
    manifest = _save(stores, 10, verify="ranks")[0]
    assert [len(_data_lists(s)) for s in stores] == [1] * 256 + [0] * 4
    # ranks 0 and 256 share spread prefix 00: rank 0's one LIST held both
    assert layout.spread_of(256) == layout.spread_of(0)
    assert len(manifest.shards) == 3 * 260 and Reader(inner).latest() == manifest


def _stray_writer(step: int, stray: Any) -> Any:
    """A save body whose rank 1 also leaves an object ``stray(attempt)`` in the store."""

    def save(stores: list[Any], **options: Any) -> list[Any]:
        def body(comm: Any) -> Any:
            session = SaveSession(stores[comm.rank], comm, **options)

            def write(ticket: Any) -> None:
                ticket.writer.write("shard.bin", f"{comm.rank}".encode())
                if comm.rank == 1:
                    stores[1].put(stray(ticket.attempt), b"zombie", mode=PutMode.CREATE)

            return session.save(step, write)

        return ThreadWorld(len(stores), timeout=30).run(body)

    return save


@pytest.mark.parametrize("verify", ["coordinator", "ranks"])
def test_a_stray_outside_every_rank_prefix_fails_the_commit_in_either_mode(verify: str):
    """The ranks' slices cover the whole spread attempt prefix, not only the rank prefixes
    under it: a stray there (a zombie's object) fails the commit as the coordinator's own LIST
    does (invariant 5)."""
    where: dict[str, str] = {}

    def stray(attempt: str) -> str:
        where["key"] = layout.attempt_prefix(7, attempt, layout.spread_of(1)) + "stray.bin"
        return where["key"]

    inner = memory_store()
    results = _stray_writer(7, stray)(_counting(inner, 4), verify=verify)
    errors = [r for r in results if isinstance(r, CommitError)]
    assert len(errors) == 4, results  # every rank raises the same error
    assert NO_RANK in errors[0].failures and where["key"] in errors[0].failures[NO_RANK]
    assert Reader(inner).steps() == []


def test_verify_ranks_without_spreading_cuts_the_attempt_into_slices_that_catch_strays():
    n = layout.RANKS_PER_SLICE + 6  # two slices
    where: dict[str, str] = {}

    def stray(attempt: str) -> str:
        where["key"] = layout.attempt_prefix(7, attempt) + "zzz/stray.bin"  # after every rank prefix
        return where["key"]

    inner = memory_store()
    stores = _counting(inner, n)
    results = _stray_writer(7, stray)(stores, verify="ranks", key_spreading=False)
    assert all(isinstance(r, CommitError) for r in results), results[:3]
    assert where["key"] in results[0].failures[NO_RANK]
    assert [len(_data_lists(s)) for s in stores] == [1, 1] + [0] * (n - 2)

    # and without the stray, the two slices confirm every receipt and commit
    inner = memory_store()
    stores = _counting(inner, n)
    manifest = _save(stores, 8, verify="ranks", key_spreading=False)[0]
    assert [len(_data_lists(s)) for s in stores] == [1, 1] + [0] * (n - 2)
    assert len(manifest.shards) == 3 * n and Reader(inner).latest() == manifest


def test_verify_auto_spreads_above_the_threshold():
    assert not SaveSession(memory_store(), ThreadWorld(1).comm(0)).verifies_by_ranks(VERIFY_SPREAD_ABOVE)
    assert SaveSession(memory_store(), ThreadWorld(1).comm(0)).verifies_by_ranks(VERIFY_SPREAD_ABOVE + 1)
    inner = memory_store()
    stores = _counting(inner, VERIFY_SPREAD_ABOVE + 1)
    manifest = _save(stores, 10)[0]  # the default
    assert all(len(_data_lists(s)) == 1 for s in stores)  # every rank its own slice; rank 0 no more
    assert Reader(inner).latest() == manifest


def test_verify_ranks_a_rank_that_cannot_list_fails_the_commit_naming_it():
    inner = memory_store()
    stores: list[Any] = _counting(inner, 4)
    stores[2] = FaultInjectingStore(inner, [Fault(op="list_page", key="data/*", error=PermissionDeniedError)])
    results = _save_results(stores, 10, verify="ranks")
    assert all(isinstance(r, CommitError) for r in results), results
    assert set(results[0].failures) == {2} and "verification slice" in results[0].failures[2]
    assert Reader(inner).steps() == []


def test_verify_ranks_nobody_lists_when_a_rank_already_failed():
    inner = memory_store()
    stores = _counting(inner, 4)

    def body(comm: Any) -> Any:
        session = SaveSession(stores[comm.rank], comm, verify="ranks")

        def write(ticket: Any) -> None:
            ticket.writer.write("shard.bin", b"x")
            if comm.rank == 3:
                raise OSError("disk on fire")

        return session.save(5, write)

    results = ThreadWorld(4, timeout=30).run(body)
    assert all(isinstance(r, CommitError) and set(r.failures) == {3} for r in results), results
    assert all(_data_lists(s) == [] for s in stores)


def _receipts_and_slices(inner: Any, world: int, step: int) -> tuple[str, dict[int, Any], dict[int, Any]]:
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(inner, step, attempt, r, names=("a",)) for r in range(world)}
    listings = {
        s.lister: list(inner.list(s.prefix, start_after=s.after))
        for s in layout.verification_slices(step, attempt, world, spread=True)
    }
    return attempt, receipts, listings


def test_verify_ranks_a_slice_holds_every_rank_sharing_its_spread_prefix():
    """Above 256 ranks several ranks share a spread prefix; its one lister's LIST covers them
    all, and a shard missing from that listing is missing (named by its owner, not the lister)."""
    inner = memory_store()
    attempt, receipts, listings = _receipts_and_slices(inner, 300, 5)
    assert sorted(listings) == list(range(256))
    assert {layout.parse_shard_key(m.key)[2] for m in listings[0]} == {0, 256}
    coordinator_store = CountingStore(inner)
    manifest = Coordinator(coordinator_store, world_size=300).commit(5, attempt, receipts, listings=listings)
    assert len(manifest.shards) == 300 and _data_lists(coordinator_store) == []

    step, attempt, receipts, listings = 6, *_receipts_and_slices(inner, 300, 6)
    listings[0] = [m for m in listings[0] if layout.parse_shard_key(m.key)[2] != 256]
    with pytest.raises(CommitError) as ei:
        Coordinator(inner, world_size=300).commit(step, attempt, receipts, listings=listings)
    assert set(ei.value.failures) == {256} and "missing" in ei.value.failures[256]


def test_verify_ranks_refuses_listings_outside_their_slice_or_from_no_lister():
    inner = memory_store()
    attempt, receipts, listings = _receipts_and_slices(inner, 3, 5)
    listings[1] = listings[1] + listings[0][:1]  # rank 0's key, sent by rank 1
    del listings[2]
    with pytest.raises(CommitError) as ei:
        Coordinator(inner, world_size=3).commit(5, attempt, receipts, listings=listings)
    assert set(ei.value.failures) == {1, 2}
    assert "outside its verification slice" in ei.value.failures[1]
    assert "no listing" in ei.value.failures[2]
    attempt, receipts, listings = _receipts_and_slices(inner, 3, 6)
    listings[7] = []
    with pytest.raises(CommitError) as ei:
        Coordinator(inner, world_size=3).commit(6, attempt, receipts, listings=listings)
    assert set(ei.value.failures) == {7} and "verifies no slice" in ei.value.failures[7]


def test_verify_ranks_lists_itself_a_prefix_no_slice_covers():
    """A rank that wrote the other layout: its attempt prefix is in no slice, so the coordinator
    LISTs that one prefix itself rather than commit unverified keys."""
    inner = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(inner, 5, attempt, r, key_spreading=r != 1) for r in range(3)}
    listings = {
        s.lister: list(inner.list(s.prefix)) for s in layout.verification_slices(5, attempt, 3, spread=True)
    }
    coordinator_store = CountingStore(inner)
    manifest = Coordinator(coordinator_store, world_size=3).commit(5, attempt, receipts, listings=listings)
    assert _data_lists(coordinator_store) == [layout.attempt_prefix(5, attempt)]
    assert len(manifest.shards) == 3


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
