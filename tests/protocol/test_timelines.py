"""Timelines (invariants 6, 8, 10, 15, T1-T3): rollback, re-save after a damaged step, and
restarts that never resume an abandoned branch -- on every backend, through the real save and
restore sessions on a 2-rank in-process world.

The three situations users hit before timelines existed:
1. a damaged latest checkpoint put an unattended job into a crash loop (fallback to 30, then
   ``save(40)`` raised CommitConflict on every restart);
2. rolling back (restore step 10, save 20) raised CommitConflict, or a restart resumed the
   abandoned 30, and retention deleted the rollback base while keeping the abandoned steps;
3. there was no way to set a bad step aside.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.coordination import RestoreSession, SaveSession, ThreadWorld, lineage
from objckpt.errors import CommitConflict, NoCheckpointError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.reader import Reader
from objckpt.store.wrappers import CountingStore
from objckpt.timelines import claim_timeline, quarantine, rollback
from tests.backends import GAP_ATOMIC_CONDITIONALS
from tests.conftest import expect_gap

from .helpers import memory_store, write_rank

WORLD = 2


def payload(rank: int, step: int) -> bytes:
    return f"rank={rank} step={step} ".encode() * 8


def save(store: Any, step: int, *, retention: RetentionPolicy | None = None) -> Any:
    def body(comm: Any) -> Any:
        session = SaveSession(store, comm, retention=retention)
        return session.save(step, lambda t: t.writer.write("state.bin", payload(comm.rank, step)))

    results = ThreadWorld(WORLD).run(body)
    assert not any(isinstance(r, BaseException) for r in results), results
    return results[0]


def restore(store: Any, step: int | None = None) -> Any:
    """Every rank restores and checks its own bytes; returns (manifest, fallbacks) of rank 0."""

    def body(comm: Any) -> Any:
        reader = Reader(store)
        restored = RestoreSession(store, comm).restore(
            lambda m: reader.read_shard(m.shard(comm.rank, "state.bin")), step=step
        )
        assert restored is not None
        return restored

    results = ThreadWorld(WORLD).run(body)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results[0]


def restart(store: Any) -> Any:
    """A new process: nothing remembered, resolve from the store alone."""
    lineage.forget(store)
    return restore(store)


def train(store: Any, steps: range, **kw: Any) -> None:
    for step in steps:
        save(store, step, **kw)


def flip_a_byte(store: Any, manifest: Any) -> None:
    key = manifest.shard(1, "state.bin").key
    data = bytearray(store.get(key))
    data[3] ^= 0xFF
    store.corrupt(key, bytes(data)) if hasattr(store, "corrupt") else _overwrite(store, key, bytes(data))


def _overwrite(store: Any, key: str, data: bytes) -> None:
    # Bit rot on a real server: the object changes behind the receipt (a new ETag, same size),
    # which the HEAD check or the CRC32C check catches.
    from objckpt.store.base import PutMode

    store.put(key, data, mode=PutMode.OVERWRITE)


@pytest.fixture
def root(backend: Any) -> Any:
    store = backend.new_store()
    lineage.forget(store)
    yield store
    lineage.forget(store)
    store.close()


# ---------------------------------------------------------------------------------- 1


def test_a_damaged_latest_checkpoint_never_causes_a_crash_loop(root: Any) -> None:
    train(root, range(10, 41, 10))
    flip_a_byte(root, Reader(root).load(40))
    restart(root)
    got = restore(root)
    assert got.step == 30 and [s for s, _ in got.fallbacks] == [40]
    m40 = save(root, 40)  # before timelines: CommitConflict on every rank, every restart
    assert (m40.timeline, m40.step, m40.parent_ref) == (1, 40, (0, 30))
    again = restart(root)
    assert (again.manifest.timeline, again.step, again.fallbacks) == (1, 40, [])
    assert again.value == payload(0, 40)
    assert Reader(root).line()[:3] == [(1, 40), (0, 30), (0, 20)]


# ---------------------------------------------------------------------------------- 2


def test_restoring_an_older_step_then_saving_starts_a_new_timeline(root: Any) -> None:
    train(root, (10, 20, 30))
    assert restore(root, step=10).step == 10
    m20 = save(root, 20)  # before timelines: CommitConflict
    assert (m20.timeline, m20.parent_ref) == (1, (0, 10))
    back = restart(root)
    assert (back.manifest.timeline, back.step) == (1, 20)  # never the abandoned 30
    assert Reader(root).steps() == [10, 20]  # the line; t0:20 and t0:30 are abandoned


def test_restoring_an_older_step_then_saving_a_new_step_never_resumes_the_abandoned_branch(root: Any) -> None:
    train(root, (10, 20, 30))
    restore(root, step=10)
    save(root, 15)
    back = restart(root)
    assert (back.manifest.timeline, back.step) == (1, 15)  # before timelines: 30


def test_retention_keeps_the_rollback_base_and_the_abandoned_branch_for_a_while(root: Any) -> None:
    keep3 = RetentionPolicy(keep_last=3)
    train(root, (10, 20, 30), retention=keep3)
    restore(root, step=10)
    train(root, (15, 20), retention=keep3)
    refs = set(Reader(root).checkpoints())
    assert {(0, 10), (1, 15), (1, 20)} <= refs  # the base survives (before: deleted)
    assert {(0, 20), (0, 30)} <= refs  # abandoned, kept for keep_abandoned (7 days)
    later = datetime.now(timezone.utc) + timedelta(days=8)
    plan = plan_gc(root, keep3, now=later)
    assert sorted((d.timeline, d.step) for d in plan.manifests) == [(0, 20), (0, 30)]
    run_gc(root, plan)
    assert set(Reader(root).checkpoints()) == {(0, 10), (1, 15), (1, 20)}
    assert restart(root).step == 20


# ---------------------------------------------------------------------------------- 3


def test_explicit_rollback_is_metadata_only_and_takes_effect_at_once(root: Any) -> None:
    train(root, (10, 20, 30))
    counted = CountingStore(root, close_inner=False)
    claim = rollback(counted, 10)
    writes = [(op, k) for op, k in counted.calls if op in ("put", "create_upload", "complete_upload")]
    assert [k for _, k in writes] == [layout.timeline_key(1), layout.POINTER_KEY]  # no shard copied
    assert claim.base_ref == (0, 10)
    assert restart(root).step == 10
    m = save(root, 20)
    assert (m.timeline, m.parent_ref) == (1, (0, 10))


def test_a_quarantined_checkpoint_is_skipped_and_saving_continues_on_a_new_timeline(root: Any) -> None:
    train(root, (10, 20, 30))
    quarantine(root, 30, reason="loss spike")
    got = restart(root)
    assert got.step == 20
    assert Reader(root).load(30).step == 30  # set aside, not deleted
    m = save(root, 30)
    assert (m.timeline, m.parent_ref) == (1, (0, 20))
    assert restart(root).manifest.timeline == 1


# ---------------------------------------------------------------------------------- safety


def test_a_zombie_on_the_old_timeline_never_moves_the_pointer_nor_becomes_latest(
    request: pytest.FixtureRequest, backend: Any, root: Any
) -> None:
    if backend.name == "s3_moto":  # its conditional writes are not atomic: a race can lose
        expect_gap(request, backend, GAP_ATOMIC_CONDITIONALS)
    train(root, (10, 20, 30))
    rollback(root, 10)
    restore(root)  # this job continues from the rollback; the zombie below does not know
    # A coordinator of the old incarnation, still alive, races the new timeline's save.
    zombie_attempt = layout.new_attempt_id()
    receipts = {r: write_rank(root, 50, zombie_attempt, r) for r in range(WORLD)}
    barrier = threading.Barrier(2)
    outcomes: dict[str, Any] = {}

    def zombie() -> None:
        barrier.wait()
        outcomes["zombie"] = Coordinator(root, world_size=WORLD).commit(
            50, zombie_attempt, receipts, timeline=0
        )

    def current() -> None:
        barrier.wait()
        outcomes["current"] = save(root, 20)

    threads = [threading.Thread(target=zombie), threading.Thread(target=current)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes["zombie"].ref == (0, 50)  # committed, on the abandoned line
    assert Reader(root).pointer().ref == (1, 20)
    assert Reader(root).latest().ref == (1, 20)
    assert restart(root).manifest.ref == (1, 20)
    assert (0, 50) not in Reader(root).line()


def test_two_concurrent_rollbacks_claim_different_timelines(root: Any) -> None:
    train(root, (10, 20, 30))
    n = 6
    barrier = threading.Barrier(n)
    claims: list[Any] = []
    lock = threading.Lock()

    def one(step: int) -> None:
        barrier.wait()
        c = rollback(root, step)
        with lock:
            claims.append(c)

    threads = [threading.Thread(target=one, args=((10, 20)[i % 2],)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    numbers = sorted(c.timeline for c in claims)
    assert numbers == list(range(1, n + 1))  # exactly one winner per number
    by_number = {c.timeline: c for c in claims}
    history = Reader(root).history
    for number, claim in by_number.items():
        assert history.claim(number) == claim  # what each claimant believes is what is stored
    # Commits on each timeline descend from that timeline's base only.
    head = history.resolve().timeline
    lineage.forget(root)
    restore(root)
    m = save(root, 40)
    assert m.timeline == head and m.parent_ref == by_number[head].base_ref


def test_a_commit_on_an_unclaimed_timeline_is_refused(root: Any) -> None:
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(root, 10, attempt, r) for r in range(WORLD)}
    with pytest.raises(Exception, match="not claimed"):
        Coordinator(root, world_size=WORLD).commit(10, attempt, receipts, timeline=3)
    assert Reader(root).latest() is None


def test_at_most_one_manifest_per_timeline_and_step(root: Any) -> None:
    train(root, (10,))
    restore(root, step=10)
    save(root, 10)  # the same step on the new timeline: allowed (a different (timeline, step))
    attempt = layout.new_attempt_id()
    receipts = {r: write_rank(root, 10, attempt, r) for r in range(WORLD)}
    with pytest.raises(CommitConflict):
        Coordinator(root, world_size=WORLD).commit(10, attempt, receipts, timeline=1)


# ---------------------------------------------------------------------------------- cost


def _resolve_counts(store: Any) -> dict[str, int]:
    counting = CountingStore(store, close_inner=False)
    assert Reader(counting).latest() is not None
    return dict(counting.counts)


def test_resolution_cost_is_constant_in_timelines_and_checkpoints() -> None:
    few, many = memory_store(), memory_store()
    for store, rollbacks in ((few, 1), (many, 40)):
        lineage.forget(store)
        train(store, (10, 20))
        for i in range(rollbacks):
            base = Reader(store).latest()
            claim_timeline(store, base, reason="test")
            lineage.forget(store)
            save(store, 30 + i)
    assert Reader(many).history.claim_numbers()[-1] == 40
    assert _resolve_counts(few) == _resolve_counts(many) == {"open": 2, "list_page": 2, "head": 1}


def test_a_lost_pointer_update_rolls_forward_onto_a_newer_timeline() -> None:
    store = memory_store()
    train(store, (10, 20))
    before = Reader(store).pointer()
    claim = claim_timeline(store, Reader(store).load(10), reason="test")
    store.put(layout.POINTER_KEY, before.encode())  # the pointer update after the claim was lost
    assert Reader(store).head().timeline == claim.timeline
    assert Reader(store).latest().ref == (0, 10)  # the new timeline's base is the head
    lineage.forget(store)
    m = save(store, 20)
    assert m.ref == (1, 20)
    store.put(layout.POINTER_KEY, before.encode())  # lost again, after a commit
    assert Reader(store).latest().ref == (1, 20)


def test_a_revision_1_run_root_is_timeline_0_and_continues() -> None:
    store = memory_store()
    train(store, (10, 20))
    assert all(k.startswith("manifests/000") for k in Reader(store).checkpoints().values())
    assert Reader(store).latest().timeline == 0
    restore(store, step=10)
    assert save(store, 20).key == "manifests/t0000000001-00000000000000000020.json"


def test_explicit_steps_name_the_line_first() -> None:
    store = memory_store()
    train(store, (10, 20, 30))
    restore(store, step=10)
    save(store, 20)
    reader = Reader(store)
    assert reader.load(20).ref == (1, 20)  # on the line
    assert reader.load(30).ref == (0, 30)  # abandoned, still addressable
    assert reader.load(20, timeline=0).ref == (0, 20)
    with pytest.raises(NoCheckpointError):
        reader.load(99)


def test_retention_never_collects_the_checkpoint_restores_use_when_the_head_is_quarantined() -> None:
    store = memory_store()
    train(store, (10, 20, 30))
    quarantine(store, 30, reason="loss spike")
    plan = plan_gc(store, RetentionPolicy(keep_last=1))
    kept = set(plan.kept)
    assert (0, 30) in kept and (0, 20) in kept  # 20 is what a restore uses now
    run_gc(store, plan)
    assert restart(store).step == 20
