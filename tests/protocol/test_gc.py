"""Garbage collection (invariants 15 and 9)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

import objckpt.store.memory as memory_module
from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.errors import PermissionDeniedError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.reader import Reader
from objckpt.store.base import PutMode
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore

from .helpers import attempts_in_data, keys_of_attempt, memory_store, save, set_pointer, write_rank

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
GRACE = timedelta(hours=6)


@pytest.fixture
def clock(monkeypatch):
    """Controls the modification times the memory store records."""
    now = [T0]

    class FakeDatetime(datetime):
        @classmethod
        def now(cls, tz=None):
            return now[0]

    monkeypatch.setattr(memory_module, "datetime", FakeDatetime)

    class Clock:
        def set(self, t: datetime) -> None:
            now[0] = t

        def advance(self, d: timedelta) -> datetime:
            now[0] = now[0] + d
            return now[0]

        @property
        def now(self) -> datetime:
            return now[0]

    return Clock()


def committed_steps(store) -> list[int]:
    return Reader(store).steps()


def assert_no_manifest_points_at_missing_data(store) -> None:
    reader = Reader(store)
    for step in reader.steps():
        assert reader.check(reader.load(step)) == [], f"step {step} lost data"


def collect(store, policy, now=None):
    plan = plan_gc(store, policy, grace_period=GRACE, now=now)
    run_gc(store, plan)
    return plan


def test_retention_is_decided_from_manifests_not_key_patterns():
    store = memory_store()
    for step in (10, 20, 30):
        save(store, step)
    for step in (40, 50, 60):  # failed saves: shards under data/ but never committed
        write_rank(store, step, layout.new_attempt_id(), 0)
    collect(store, RetentionPolicy(keep_last=3))
    assert committed_steps(store) == [10, 20, 30]
    assert_no_manifest_points_at_missing_data(store)


def test_keep_last_every_and_pinned():
    store = memory_store()
    for step in range(10, 101, 10):
        save(store, step)
    plan = collect(store, RetentionPolicy(keep_last=2, keep_every=30, pinned=frozenset({20})))
    assert committed_steps(store) == [20, 30, 60, 90, 100]
    assert sorted(d.step for d in plan.manifests) == [10, 40, 50, 70, 80]
    assert_no_manifest_points_at_missing_data(store)
    # the collected checkpoints' shards are gone too
    assert all(
        not k.startswith(f"data/{s:020d}-")
        for s in (10, 40, 50, 70, 80)
        for k in (m.key for m in store.list("data/"))
    )


def test_gc_never_collects_the_pointer_target_or_the_newest():
    store = memory_store()
    for step in (10, 20, 30, 40, 50):
        save(store, step)
    set_pointer(store, Reader(store).load(30))  # pointer updates for 40 and 50 were lost
    plan = collect(store, RetentionPolicy(keep_last=0))
    assert sorted(d.step for d in plan.manifests) == [10, 20, 40]
    assert committed_steps(store) == [30, 50]


def test_gc_keeps_the_parent_until_the_newest_verifies():
    store = memory_store()
    for step in (10, 20, 30):
        save(store, step)
    newest = Reader(store).load(30)
    store.delete([newest.shards[0].key])  # the newest does not verify
    plan = collect(store, RetentionPolicy(keep_last=1))
    assert committed_steps(store) == [20, 30]
    assert "verifies" in plan.kept[(0, 20)]
    assert Reader(store).latest_valid().step == 20


@pytest.mark.parametrize("spread", [True, False], ids=["spread-keys", "old-layout"])
def test_gc_keeps_the_save_in_progress_and_removes_orphans_only_after_the_grace_period(clock, spread):
    store = memory_store()
    save(store, 10)
    orphan = layout.new_attempt_id()  # a crashed save: shards, no manifest
    write_rank(store, 20, orphan, 0, key_spreading=spread)
    clock.advance(GRACE - timedelta(minutes=1))
    in_progress = layout.new_attempt_id()
    write_rank(store, 30, in_progress, 0, key_spreading=spread)

    plan = collect(store, RetentionPolicy(), now=clock.now)  # orphan is still younger than grace
    assert plan.orphans == []
    assert keys_of_attempt(store, 20, orphan)

    now = clock.advance(timedelta(minutes=2))
    plan = collect(store, RetentionPolicy(), now=now)
    spread_digits = layout.spread_of(0) if spread else None
    assert [o.prefix for o in plan.orphans] == [layout.attempt_prefix(20, orphan, spread_digits)]
    assert keys_of_attempt(store, 20, orphan) == []
    assert keys_of_attempt(store, 30, in_progress)  # the save in progress
    assert committed_steps(store) == [10]
    assert_no_manifest_points_at_missing_data(store)


def test_gc_aborts_only_stale_incomplete_uploads(clock):
    store = memory_store()
    stale = store._create_upload(layout.shard_key(5, layout.new_attempt_id(), 0, "a"), PutMode.CREATE)
    clock.advance(GRACE)
    young = store._create_upload(layout.shard_key(6, layout.new_attempt_id(), 0, "a"), PutMode.CREATE)
    plan = collect(store, RetentionPolicy(), now=clock.advance(timedelta(minutes=1)))
    assert [u.upload_id for u in plan.uploads] == [stale.upload_id]
    assert [u.upload_id for u in store.list_uploads()] == [young.upload_id]


def test_gc_deletes_each_manifest_before_its_shards():
    inner = memory_store()
    for step in (10, 20, 30):
        save(inner, step)
    doomed = Reader(inner).load(10)
    store = CountingStore(inner)
    collect(store, RetentionPolicy(keep_last=2))
    deletes = [k for op, k in store.calls if op == "delete_batch"]
    assert deletes.index(doomed.key) < min(deletes.index(s.key) for s in doomed.shards)


@pytest.mark.parametrize("crash_on", ["manifests/*", "data/*"])
def test_a_crash_during_gc_leaves_no_manifest_pointing_at_missing_data(crash_on, clock):
    inner = memory_store()
    for step in (10, 20, 30):
        save(inner, step)
    store = FaultInjectingStore(inner, [Fault(op="delete_batch", key=crash_on, error=PermissionDeniedError)])
    with pytest.raises(PermissionDeniedError):
        collect(store, RetentionPolicy(keep_last=1))
    assert_no_manifest_points_at_missing_data(inner)
    # a later run, past the grace period, finishes the job
    collect(inner, RetentionPolicy(keep_last=1), now=clock.advance(GRACE + timedelta(seconds=1)))
    assert committed_steps(inner) == [30]
    assert attempts_in_data(inner) == {(30, Reader(inner).load(30).attempt)}


def test_dry_run_plans_without_changing_anything():
    store = memory_store()
    for step in (10, 20, 30):
        save(store, step)
    before = {m.key: m.version for m in store.list()}
    plan = plan_gc(store, RetentionPolicy(keep_last=1), grace_period=GRACE)
    text = "\n".join(plan.describe())
    assert "delete step 10" in text and "delete step 20" in text and "keep step 30" in text
    assert {m.key: m.version for m in store.list()} == before


def test_an_orphan_committed_after_planning_is_not_deleted(clock):
    store = memory_store()
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(store, 10, attempt, r) for r in range(2)}
    plan = plan_gc(store, RetentionPolicy(), grace_period=GRACE, now=clock.advance(GRACE * 2))
    # one orphan prefix per spread prefix the attempt's ranks wrote under
    assert {o.attempt for o in plan.orphans} == {attempt}
    assert sorted(o.prefix for o in plan.orphans) == sorted(
        {layout.attempt_prefix(10, attempt, layout.spread_of(r)) for r in range(2)}
    )
    Coordinator(store, world_size=2).commit(10, attempt, receipts)  # a slow save commits now
    result = run_gc(store, plan)
    assert result.skipped and result.deleted_objects == 0
    assert_no_manifest_points_at_missing_data(store)


def test_gc_leaves_unreadable_manifests_and_their_data_alone(clock):
    store = memory_store()
    for step in (10, 20, 30):
        save(store, step)
    m10 = Reader(store).load(10)
    store.delete([m10.key])
    store.put(m10.key, b"{corrupt", mode=PutMode.CREATE)
    plan = collect(store, RetentionPolicy(keep_last=1), now=clock.advance(GRACE * 2))
    assert (0, 10) in plan.kept and store.get(m10.key) == b"{corrupt"
    assert all(store.head(s.key) for s in m10.shards)
    assert committed_steps(store) == [10, 30]
