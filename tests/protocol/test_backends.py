"""The protocol on every backend: a two-rank round trip, and the properties that depend on what
the server enforces (conditional writes, listings, modification times, pending uploads)."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.errors import AlreadyExistsError, CommitConflict
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.manifest import Manifest
from objckpt.reader import Reader
from objckpt.store.base import PutMode
from objckpt.writer import ShardWriter
from tests.backends import GAP_CONDITIONAL_COMPLETE
from tests.conftest import expect_gap

from .helpers import attempts_in_data, race_two_attempts, save, write_rank

WORLD = 2
# S3's minimum part size (and a multiple of GCS's 256 KiB resumable chunk), so one part size
# exercises multipart on every backend
PART = 5 * 1024 * 1024


def rank_payload(step: int, rank: int) -> dict[str, bytes]:
    return {
        "model.pt": bytes([rank, step % 256]) * (PART // 2 + 4096),  # two parts
        "rng/state.json": f'{{"rank": {rank}, "step": {step}}}'.encode(),
    }


def two_rank_save(store, step: int):
    attempt = layout.new_attempt_id()  # rank 0 draws it and broadcasts it
    reports: dict[int, object] = {}

    def rank_main(rank: int) -> None:
        try:
            w = ShardWriter(store, step=step, attempt=attempt, rank=rank, part_size=PART, max_in_flight=2)
            for name, data in rank_payload(step, rank).items():
                w.write(name, data)
            reports[rank] = w.receipts
        except Exception as exc:  # gathered to the coordinator like a rank's error
            reports[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Coordinator(store, world_size=WORLD).commit(
        step, attempt, reports, progress={"global_step": step}, run={"config_hash": "cfg"}
    )


def test_two_rank_save_commit_resolve_load_round_trip(store):
    first = two_rank_save(store, 100)
    second = two_rank_save(store, 200)
    assert (first.parent, second.parent) == (None, 100)

    reader = Reader(store)
    assert reader.latest() == second
    assert reader.latest_valid() == second
    assert reader.pointer().step == 200
    assert reader.steps() == [100, 200]
    assert reader.verify(second) == []
    assert reader.load(100) == first
    for rank in range(WORLD):
        for name, data in rank_payload(200, rank).items():
            assert reader.read_shard(second.shard(rank, name)) == data
    assert second.shard(0, "model.pt").parts > 1
    assert [m.step for m in reader.candidates()] == [200, 100]


@pytest.mark.parametrize("multipart", [False, True], ids=["single-put", "multipart"])
def test_shards_are_never_overwritten(store, backend, request, multipart):
    if multipart:
        expect_gap(request, backend, GAP_CONDITIONAL_COMPLETE)
    attempt = layout.new_attempt_id()
    w = ShardWriter(store, step=1, attempt=attempt, rank=0, part_size=PART)
    store.put(w.key_for("model.pt"), b"original", mode=PutMode.CREATE)
    data = b"r" * (PART + 1) if multipart else b"replacement"
    with pytest.raises(AlreadyExistsError):
        w.write("model.pt", data)
    assert store.get(w.key_for("model.pt")) == b"original"


def test_two_attempts_one_step_exactly_one_manifest(store):
    outcomes = race_two_attempts(store, 9)
    assert sorted(type(o).__name__ for o in outcomes) == ["CommitConflict", "Manifest"], outcomes
    winner = next(o for o in outcomes if isinstance(o, Manifest))
    assert Reader(store).steps() == [9] and Reader(store).load(9) == winner
    assert any(isinstance(o, CommitConflict) for o in outcomes)


def test_pointer_only_moves_forward(store):
    save(store, 20)
    save(store, 10)
    assert Reader(store).pointer().step == 20
    assert Reader(store).latest().step == 20


def test_a_checkpoint_with_a_missing_shard_falls_back_to_its_parent(store):
    parent = save(store, 10)
    newest = save(store, 20)
    store.delete([newest.shards[1].key])
    assert Reader(store).latest_valid() == parent


def test_gc_collects_old_steps_orphans_and_stale_uploads(store, backend):
    for step in (10, 20, 30):
        save(store, step)
    orphan = layout.new_attempt_id()
    write_rank(store, 40, orphan, 0)
    pending = store._create_upload(layout.shard_key(50, layout.new_attempt_id(), 0, "x"), PutMode.CREATE)
    assert [u.upload_id for u in store.list_uploads()] == [pending.upload_id]

    # now: everything is young, so only retention applies
    plan = plan_gc(store, RetentionPolicy(keep_last=1), grace_period=timedelta(hours=6))
    assert (sorted(d.step for d in plan.manifests), plan.orphans) == ([10, 20], [])
    if backend.name != "s3_moto":  # moto reports every upload as initiated in 2010
        assert plan.uploads == []
    # seven hours on, the orphan and the pending upload are past the grace period too
    later = datetime.now(timezone.utc) + timedelta(hours=7)
    plan = plan_gc(store, RetentionPolicy(keep_last=1), grace_period=timedelta(hours=6), now=later)
    assert [o.attempt for o in plan.orphans] == [orphan]
    assert [u.upload_id for u in plan.uploads] == [pending.upload_id]
    run_gc(store, plan)
    reader = Reader(store)
    assert reader.steps() == [30] and reader.check(reader.load(30)) == []
    assert attempts_in_data(store) == {(30, reader.load(30).attempt)}
    assert store.list_uploads() == []
