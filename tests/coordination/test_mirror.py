"""Mirror: every commit re-committed on a second run root in the background, and restores that
take the mirror's copy when the primary cannot give one (memory and file stores; the emulator
tests with the primary's server stopped are in tests/reliability/test_mirror_clouds.py)."""

from __future__ import annotations

import logging

import pytest

from objckpt._retry import RetryPolicy
from objckpt.coordination import LocalComm, RestoreSession, ThreadWorld
from objckpt.coordination.mirror import Mirror, mirror_checkpoint, save_session, source_ref
from objckpt.errors import NoCheckpointError, TransientError
from objckpt.gc import RetentionPolicy
from objckpt.metrics import CheckpointMetrics
from objckpt.reader import Reader
from objckpt.store import PutMode
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import Fault, FaultInjectingStore
from objckpt.timelines import rollback

QUICK = RetryPolicy(deadline=0.3, initial_backoff=0.01, max_backoff=0.05)


def _payload(step: int, rank: int = 0) -> bytes:
    return f"step {step} rank {rank} ".encode() * 50


def _save(session, step: int) -> None:  # type: ignore[no-untyped-def]
    session.save(step, lambda t: t.writer.write("state.bin", _payload(step, t.rank)))


def _restore(primary, mirror=None, step=None):  # type: ignore[no-untyped-def]
    session = RestoreSession(primary, LocalComm(), mirror=mirror)
    return session.restore(lambda m: session.reader.read_shard(m.shard(0, "state.bin")), step=step)


def _setup(policy: str = "wait", metrics: CheckpointMetrics | None = None):  # type: ignore[no-untyped-def]
    primary = FaultInjectingStore(MemoryStore("primary"), retry=QUICK)
    copy = MemoryStore("mirror")
    mirror = Mirror(primary, copy, policy=policy, metrics=metrics)
    return primary, copy, mirror, save_session(primary, LocalComm(), mirror=mirror)


def test_every_commit_is_recommitted_on_the_mirror_by_the_protocol() -> None:
    metrics = CheckpointMetrics()
    primary, copy, mirror, session = _setup(metrics=metrics)
    for step in (10, 20, 30):
        _save(session, step)
    assert mirror.wait(30)
    assert mirror.counts == {"mirrored": 3, "already": 0, "skipped": 0, "failed": 0}
    reader = Reader(copy)
    assert reader.steps() == [10, 20, 30]
    for step in (10, 20, 30):
        m = reader.load(step)
        assert m.attempt != Reader(primary).load(step).attempt  # a fresh attempt of its own
        assert source_ref(m) == (0, step)
        assert m.metadata["replicated_from"]["checksum"] == Reader(primary).load(step).checksum
        assert reader.read_shard(m.shard(0, "state.bin")) == _payload(step)
    assert reader.check(reader.load(30)) == []
    snap = metrics.snapshot()
    assert snap["mirrored"] == 3 and snap["mirrored_step"] == 30 and snap["mirror_lag_seconds"] is not None
    assert snap["mirror_pending_step"] is None
    mirror.close()


def test_mirroring_is_idempotent() -> None:
    primary, copy, mirror, session = _setup()
    _save(session, 10)
    mirror.wait(30)
    m = Reader(primary).load(10)
    again, copied = mirror_checkpoint(primary, m, copy)
    assert not copied and again.key == Reader(copy).load(10).key
    mirror.close()


def test_latest_policy_coalesces_and_never_blocks() -> None:
    """One in flight, one waiting: a commit arriving while one waits replaces it."""
    primary = MemoryStore("p")
    copy = MemoryStore("m")
    metrics = CheckpointMetrics()
    mirror = Mirror(primary, copy, policy="latest", metrics=metrics)
    session = save_session(primary, LocalComm())
    manifests = []
    for step in (10, 20, 30, 40):
        _save(session, step)
        manifests.append(Reader(primary).load(step))
    with mirror._cond:  # hold the worker: everything queues behind the first
        for m in manifests:
            mirror.submit(m)
        assert mirror.counts["skipped"] == len(manifests) - 1
        assert metrics.snapshot()["mirror_pending_step"] == 40
    assert mirror.wait(30)
    assert Reader(copy).steps() == [40]  # the mirror converged on the newest
    assert metrics.snapshot()["mirror_skipped"] == 3
    mirror.close()


def test_a_failed_replication_is_loud_and_the_next_commit_catches_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    primary = MemoryStore("p2")
    inner = MemoryStore("m2")
    copy = FaultInjectingStore(
        inner, [Fault(op="put", key="manifests/*", times=1)], retry=RetryPolicy(deadline=0)
    )
    metrics = CheckpointMetrics()
    mirror = Mirror(primary, copy, policy="wait", metrics=metrics)
    session = save_session(primary, LocalComm(), mirror=mirror)
    with caplog.at_level(logging.ERROR, logger="objckpt.mirror"):
        _save(session, 10)
        mirror.wait(30)
    assert "MIRROR FAILED" in caplog.text and mirror.counts["failed"] == 1
    assert metrics.snapshot()["mirror_failures"] == 1
    assert metrics.snapshot()["mirror_pending_step"] == 10  # still waiting: the lag keeps growing
    _save(session, 20)
    mirror.wait(30)
    assert Reader(inner).steps() == [20]
    assert metrics.snapshot()["mirror_pending_step"] is None
    mirror.close()


def test_retention_applies_to_the_mirror_too() -> None:
    primary = MemoryStore("p3")
    copy = MemoryStore("m3")
    mirror = Mirror(primary, copy, policy="wait", retention=RetentionPolicy(keep_last=2))
    session = save_session(primary, LocalComm(), mirror=mirror)
    for step in (10, 20, 30, 40):
        _save(session, step)
        mirror.wait(30)
    assert Reader(copy).steps() == [30, 40]
    mirror.close()


# ------------------------------------------------------------------ restore from the mirror


def test_primary_unreachable_restores_from_the_mirror_loudly(caplog: pytest.LogCaptureFixture) -> None:
    primary, copy, mirror, session = _setup()
    for step in (10, 20):
        _save(session, step)
    mirror.wait(30)
    primary.add(Fault(op="*", error=TransientError, times=None))  # the primary is down
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        restored = _restore(primary, copy)
    assert restored is not None and restored.step == 20 and restored.source == "mirror"
    assert restored.value == _payload(20)
    assert "RESTORING FROM THE MIRROR" in caplog.text and "RESTORED FROM THE MIRROR" in caplog.text
    # without a mirror the outage is an error, never a fallback (invariant 11b)
    with pytest.raises(TransientError, match="retry budget"):
        _restore(primary)
    mirror.close()


def test_a_damaged_checkpoint_on_the_primary_is_taken_from_the_mirror_not_its_parent() -> None:
    primary, copy, mirror, session = _setup()
    for step in (10, 20):
        _save(session, step)
    mirror.wait(30)
    victim = Reader(primary).load(20).shard(0, "state.bin")
    primary.inner.put(victim.key, b"rotten", mode=PutMode.OVERWRITE)
    restored = _restore(primary, copy)
    assert restored is not None and restored.step == 20 and restored.source == "mirror"
    assert restored.value == _payload(20) and restored.fallbacks and restored.fallbacks[0][0] == 20
    # without a mirror: its parent, as before
    plain = _restore(primary)
    assert plain is not None and plain.step == 10 and plain.source == "primary"
    # an explicit step takes the mirror's copy of that step
    explicit = _restore(primary, copy, step=20)
    assert explicit is not None and explicit.source == "mirror" and explicit.value == _payload(20)
    with pytest.raises(NoCheckpointError):
        _restore(primary, step=20)
    mirror.close()


def test_a_healthy_primary_costs_the_mirror_no_request() -> None:
    from objckpt.store.wrappers import CountingStore

    primary, copy, mirror, session = _setup()
    _save(session, 10)
    mirror.wait(30)
    counted = CountingStore(copy, close_inner=False)
    restored = _restore(primary, counted)
    assert restored is not None and restored.source == "primary"
    assert sum(counted.counts.values()) == 0
    mirror.close()


def test_a_mirror_newer_than_a_damaged_primary_wins_but_never_a_step_rolled_back_from() -> None:
    primary, copy, mirror, session = _setup()
    for step in (10, 20, 30):
        _save(session, step)
    mirror.wait(30)
    rollback(primary, 10)  # the primary abandons 20 and 30
    # the head is now step 10 (on timeline 1); damage it on the primary
    victim = Reader(primary).load(10).shard(0, "state.bin")
    primary.inner.put(victim.key, b"rotten", mode=PutMode.OVERWRITE)
    restored = _restore(primary, copy)
    # the mirror's 30 and 20 are copies of abandoned steps: its copy of 10 is restored
    assert restored is not None and restored.step == 10 and restored.source == "mirror"
    assert restored.value == _payload(10)
    mirror.close()


def test_a_rollback_on_the_primary_becomes_a_new_timeline_on_the_mirror() -> None:
    primary = MemoryStore("p4")
    copy = MemoryStore("m4")
    mirror = Mirror(primary, copy, policy="wait")
    session = save_session(primary, LocalComm(), mirror=mirror)
    for step in (10, 20, 30):
        _save(session, step)
    mirror.wait(30)
    rollback(primary, 10)
    from objckpt.coordination import lineage

    lineage.forget(primary)
    session2 = save_session(primary, LocalComm(), mirror=mirror)
    session2.save(20, lambda t: t.writer.write("state.bin", b"the new 20"))
    mirror.wait(30)
    assert mirror.counts["failed"] == 0
    reader = Reader(copy)
    head = reader.latest()
    assert head is not None and head.step == 20 and head.timeline >= 1
    assert reader.read_shard(head.shard(0, "state.bin")) == b"the new 20"
    restored = _restore(copy)
    assert restored is not None and restored.value == b"the new 20"
    mirror.close()


def test_every_rank_stages_from_the_mirror() -> None:
    primary, copy, mirror, _ = _setup()
    world = ThreadWorld(3)

    def save(comm):  # type: ignore[no-untyped-def]
        s = save_session(primary, comm, mirror=mirror)
        s.save(10, lambda t: t.writer.write("state.bin", _payload(10, t.rank)))

    world.run(save)
    mirror.wait(30)
    primary.add(Fault(op="*", error=TransientError, times=None))

    def restore(comm):  # type: ignore[no-untyped-def]
        session = RestoreSession(primary, comm, mirror=copy)
        r = session.restore(lambda m: session.reader.read_shard(m.shard(comm.rank, "state.bin")))
        return r.source, r.value

    results = world.run(restore)
    assert results == [("mirror", _payload(10, r)) for r in range(3)]
    mirror.close()
