"""The coordination layer's decisions, without torch: the save and restore sessions on an
in-process world of 1, 2 and 16 ranks (threads), against memory stores.

Every property here is what each integration inherits: every rank gets the same outcome, damage
(and only damage) makes every rank fall back together, one rank resolves.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest

from objckpt import gc
from objckpt.coordination import RestoreSession, SaveSession, ThreadWorld
from objckpt.coordination.comm import LocalComm
from objckpt.errors import (
    CommitError,
    DistributedError,
    NoCheckpointError,
    PermissionDeniedError,
    TransientError,
)
from objckpt.gc import RetentionPolicy
from objckpt.metrics import CheckpointMetrics
from objckpt.reader import Reader
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from tests.protocol.helpers import FAST_RETRY, memory_store

WORLDS = [1, 2, 16]


def _payload(rank: int, step: int) -> bytes:
    return f"rank={rank} step={step} ".encode() * 10


def _save(store: Any, world: ThreadWorld, step: int, **session_options: Any) -> list[Any]:
    def body(comm: Any) -> Any:
        session = SaveSession(store, comm, **session_options)
        return session.save(step, lambda t: t.writer.write("part.bin", _payload(comm.rank, step)))

    return world.run(body)


def _restore(stores: Any, world: ThreadWorld, *, step: int | None = None) -> list[Any]:
    """Every rank restores through its own store object (``stores(rank)``) and returns (step,
    the bytes of its own shard)."""

    def body(comm: Any) -> Any:
        store = stores(comm.rank)
        reader = Reader(store)
        session = RestoreSession(store, comm)

        def stage(manifest: Any) -> bytes:
            return reader.read_shard(manifest.shard(comm.rank, "part.bin"))

        restored = session.restore(stage, step=step)
        return None if restored is None else (restored.step, restored.value, restored.fallbacks)

    return world.run(body)


def _same_error(results: list[Any], cls: type[BaseException]) -> str:
    assert all(isinstance(r, cls) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    return messages.pop()


# ---------------------------------------------------------------------------------- save


@pytest.mark.parametrize("world_size", WORLDS)
def test_every_rank_returns_the_same_committed_manifest(world_size: int) -> None:
    store = memory_store()
    results = _save(store, ThreadWorld(world_size), 10)
    assert {r.checksum for r in results} == {results[0].checksum}
    manifest = Reader(store).latest()
    assert manifest is not None and manifest.step == 10 and manifest.world_size == world_size
    assert sorted(s.rank for s in manifest.shards) == list(range(world_size))


@pytest.mark.parametrize("world_size", WORLDS)
def test_each_rank_parses_the_committed_manifest_once(world_size: int, monkeypatch: Any) -> None:
    # at 4,096 ranks the manifest is megabytes: a second parse per rank (once to learn its key,
    # once to decode it) doubled the commit's CPU on every rank
    import json

    real_loads = json.loads
    parsed: list[int] = []

    def counting_loads(s: Any, *args: Any, **kwargs: Any) -> Any:
        text = s.decode() if isinstance(s, (bytes, bytearray)) else s
        if isinstance(text, str) and '"format":"objckpt.manifest"' in text:
            parsed.append(len(text))
        return real_loads(s, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    _save(memory_store(), ThreadWorld(world_size), 10)
    assert len(parsed) == world_size  # one Manifest.decode of the broadcast body per rank


@pytest.mark.parametrize("world_size", WORLDS)
def test_a_rank_that_cannot_write_fails_the_save_on_every_rank_naming_it(world_size: int) -> None:
    store = memory_store()
    _save(store, ThreadWorld(world_size), 10)
    bad = world_size - 1

    def body(comm: Any) -> Any:
        def write(ticket: Any) -> None:
            if comm.rank == bad:
                raise OSError("disk on fire")
            ticket.writer.write("part.bin", b"x")

        return SaveSession(store, comm).save(20, write)

    results = ThreadWorld(world_size).run(body)
    message = _same_error(results, CommitError)
    assert f"rank {bad}: OSError: disk on fire" in message
    assert all(r.failures == {bad: "OSError: disk on fire"} for r in results)
    assert Reader(store).latest().step == 10  # nothing committed, the previous one stays


@pytest.mark.parametrize("world_size", [2, 16])
def test_ranks_saving_different_steps_raise_the_same_error(world_size: int) -> None:
    store = memory_store()

    def body(comm: Any) -> Any:
        step = 20 if comm.rank == 1 else 10
        return SaveSession(store, comm).save(step, lambda t: t.writer.write("p", b"x"))

    message = _same_error(ThreadWorld(world_size).run(body), DistributedError)
    assert "different steps" in message and "rank 1: 20" in message
    assert Reader(store).latest() is None


@pytest.mark.parametrize("world_size", [2, 16])
def test_a_rank_that_could_not_prepare_stops_every_rank_before_anything_is_written(
    world_size: int,
) -> None:
    store = CountingStore(memory_store())

    def body(comm: Any) -> Any:
        error = ValueError("tensor 'w' is on the meta device") if comm.rank == 1 else None
        return SaveSession(store, comm).save(10, lambda t: t.writer.write("p", b"x"), error=error)

    message = _same_error(ThreadWorld(world_size).run(body), ValueError)
    assert message.startswith("rank 1: ") and "meta device" in message
    assert store.counts["put"] == 0 and store.counts["create_upload"] == 0


@pytest.mark.parametrize("world_size", [2, 16])
def test_an_unseen_earlier_failure_comes_first_and_only_its_rank_raises_its_own(world_size: int) -> None:
    store = memory_store()
    earlier = CommitError("step 5 was never committed", {1: "upload failed"})

    def body(comm: Any) -> Any:
        pending = earlier if comm.rank == 1 else None
        try:
            return SaveSession(store, comm).begin(10, pending=pending)
        except CommitError as exc:
            return exc

    results = ThreadWorld(world_size).run(body)
    assert results[1] is earlier  # its own object: the caller can mark it seen
    _same_error(results, CommitError)
    assert Reader(store).latest() is None


@pytest.mark.parametrize("world_size", [2, 16])
def test_a_busy_rank_makes_every_rank_skip(world_size: int) -> None:
    store = memory_store()
    results = ThreadWorld(world_size).run(
        lambda comm: SaveSession(store, comm).begin(10, busy=comm.rank == world_size - 1)
    )
    assert all(t.skip and t.writer is None for t in results)
    assert len({t.attempt for t in results}) == 1


@pytest.mark.parametrize("world_size", [2, 16])
def test_values_that_must_agree_are_checked_on_rank_0(world_size: int) -> None:
    store = memory_store()

    def body(comm: Any) -> Any:
        digest = "b" if comm.rank == world_size - 1 else "a"
        return SaveSession(store, comm).begin(
            10,
            agree_on={"layout": digest},
            on_disagree=lambda name, rank, first, mine: TypeError(
                f"{name} of rank {rank}: {mine} != {first}"
            ),
        )

    message = _same_error(ThreadWorld(world_size).run(body), TypeError)
    assert message == f"layout of rank {world_size - 1}: b != a"


def test_ranks_on_different_run_roots_refuse_to_save() -> None:
    stores = [memory_store(), memory_store()]
    stores[1].location = "memory://elsewhere"

    def body(comm: Any) -> Any:
        return SaveSession(stores[comm.rank], comm).begin(10)

    message = _same_error(ThreadWorld(2).run(body), DistributedError)
    assert "rank 1 uses run root 'memory://elsewhere'" in message


def test_a_save_called_on_rank_0_alone_raises_instead_of_hanging() -> None:
    store = memory_store()
    world = ThreadWorld(2, timeout=0.5)
    (result,) = world.run(lambda comm: SaveSession(store, comm).begin(10), ranks=[0])
    assert isinstance(result, DistributedError) and "not every rank called it" in str(result)


def test_retention_runs_after_each_commit_on_rank_0() -> None:
    store = memory_store()
    world = ThreadWorld(2)
    for step in (10, 20, 30, 40):
        _save(store, world, step, retention=RetentionPolicy(keep_last=2))
    assert Reader(store).steps() == [30, 40]


@pytest.mark.parametrize("world_size", [2, 16])
def test_retention_after_a_commit_heads_none_of_the_shards_the_commit_verified(world_size: int) -> None:
    store = CountingStore(memory_store())
    world = ThreadWorld(world_size)
    keep_one = RetentionPolicy(keep_last=1)
    _save(store, world, 10, retention=keep_one)
    store.reset()
    _save(store, world, 20, retention=keep_one)
    assert Reader(store).steps() == [20]  # retention ran and collected step 10

    # the commit checked every shard of step 20 against the store (a LIST of its prefixes);
    # before, retention then HEADed each of them again (world_size HEADs) to find the newest
    # checkpoint that verifies
    def shard_heads() -> int:
        return sum(1 for op, key in store.calls if op == "head" and key.startswith("data/"))

    assert shard_heads() == 0
    # a retention run that did not make the commit still checks it (invariant 9)
    store.reset()
    gc.retain(store, keep_one)
    assert shard_heads() == world_size


@pytest.mark.parametrize("world_size", [1, 16])
def test_sessions_feed_the_metrics(world_size: int) -> None:
    store = memory_store()
    recorders = [CheckpointMetrics() for _ in range(world_size)]

    def body(comm: Any) -> Any:
        session = SaveSession(store, comm, metrics=recorders[comm.rank])
        session.save(10, lambda t: t.writer.write("part.bin", _payload(comm.rank, 10)))
        try:
            session.save(20, lambda t: (_ for _ in ()).throw(OSError("no")) if comm.rank == 0 else None)
        except CommitError:
            pass
        restore = RestoreSession(store, comm, metrics=recorders[comm.rank])
        return restore.restore(lambda m: None).step

    assert ThreadWorld(world_size).run(body) == [10] * world_size
    for rank, metrics in enumerate(recorders):
        snap = metrics.snapshot()
        assert snap["last_committed_step"] == 10 and snap["commits"] == 1 and snap["failures"] == 1
        assert snap["last_save_bytes"] == len(_payload(rank, 10))
        assert snap["restores"] == 1 and snap["restarts"] == 1
        assert {"save", "upload", "commit", "restore"} <= set(snap["phases"])


# ---------------------------------------------------------------------------------- restore


@pytest.mark.parametrize("world_size", WORLDS)
def test_restore_resolves_on_rank_0_only(world_size: int) -> None:
    base = memory_store()
    world = ThreadWorld(world_size)
    for step in (10, 20):
        _save(base, world, step)
    counters = [CountingStore(base, close_inner=False) for _ in range(world_size)]
    results = _restore(lambda rank: counters[rank], world)
    assert [r[:2] for r in results] == [(20, _payload(rank, 20)) for rank in range(world_size)]
    for rank, counter in enumerate(counters):
        manifest_reads = [k for op, k in counter.calls if k.startswith(("manifests/", "LATEST"))]
        if rank == 0:
            assert counter.counts["list_page"] == 2 and manifest_reads  # manifests/, timelines/
        else:  # no LIST, no pointer or manifest GET: the manifest came from rank 0
            assert counter.counts["list_page"] == 0 and manifest_reads == []


@pytest.mark.parametrize("world_size", WORLDS)
def test_damage_on_any_rank_makes_every_rank_fall_back_together(world_size: int) -> None:
    store = memory_store()
    world = ThreadWorld(world_size)
    _save(store, world, 10)
    newest = _save(store, world, 20)[0]
    victim = world_size - 1
    key = newest.shard(victim, "part.bin").key
    store.corrupt(key, b"X" * len(_payload(victim, 20)))  # same size: only the CRC32C sees it
    results = _restore(lambda rank: store, world)
    assert [r[:2] for r in results] == [(10, _payload(rank, 10)) for rank in range(world_size)]
    for r in results:
        assert [s for s, _ in r[2]] == [20] and f"rank {victim}" in r[2][0][1] and "CRC32C" in r[2][0][1]


@pytest.mark.parametrize("world_size", [1, 2, 16])
@pytest.mark.parametrize("error", [TransientError, PermissionDeniedError])
def test_an_outage_or_permission_error_is_raised_never_a_fallback(world_size: int, error: type) -> None:
    """Invariant 11b: only damage falls back; an outage past the retry budget would otherwise
    roll the job back silently."""
    store = memory_store()
    world = ThreadWorld(world_size)
    _save(store, world, 10)
    newest = _save(store, world, 20)[0]
    victim = world_size - 1
    faulty = FaultInjectingStore(
        store,
        [Fault(op="open", key=newest.shard(victim, "part.bin").key, error=error, times=None)],
        close_inner=False,
        retry=FAST_RETRY,
    )
    results = _restore(lambda rank: faulty if rank == victim else store, world)
    message = _same_error(results, error)
    assert message.startswith(f"rank {victim}: ") and "injected fault" in message


def test_an_explicit_damaged_step_is_refused_not_replaced() -> None:
    store = memory_store()
    world = ThreadWorld(2)
    _save(store, world, 10)
    newest = _save(store, world, 20)[0]
    store.corrupt(newest.shard(0, "part.bin").key, b"")
    message = _same_error(_restore(lambda rank: store, world, step=20), NoCheckpointError)
    assert "step 20 is damaged" in message and "rank 0" in message


def test_nothing_committed_restores_nothing_and_everything_damaged_says_so() -> None:
    store = memory_store()
    world = ThreadWorld(2)
    assert _restore(lambda rank: store, world) == [None, None]
    only = _save(store, world, 10)[0]
    store.corrupt(only.shard(1, "part.bin").key, b"")
    message = _same_error(_restore(lambda rank: store, world), NoCheckpointError)
    assert "none is usable" in message and "step 10" in message


def test_ranks_restoring_different_roots_or_steps_raise_the_same_error() -> None:
    stores = [memory_store(), memory_store()]
    stores[1].location = "memory://other"
    message = _same_error(_restore(lambda rank: stores[rank], ThreadWorld(2)), DistributedError)
    assert "run root" in message

    store = memory_store()

    def body(comm: Any) -> Any:
        return RestoreSession(store, comm).restore(lambda m: None, step=10 + comm.rank)

    assert "different steps" in _same_error(ThreadWorld(2).run(body), DistributedError)


def test_an_error_applying_the_checkpoint_is_raised_on_every_rank() -> None:
    store = memory_store()
    world = ThreadWorld(2)
    _save(store, world, 10)

    def body(comm: Any) -> Any:
        def apply(manifest: Any, staged: Any) -> None:
            if comm.rank == 1:
                raise RuntimeError("size mismatch for model.w")

        return RestoreSession(store, comm).restore(lambda m: None, apply)

    assert _same_error(world.run(body), RuntimeError) == "rank 1: size mismatch for model.w"


def test_the_coordination_layer_imports_no_torch() -> None:
    import subprocess

    code = (
        "import sys, objckpt.coordination, objckpt.errors, objckpt.gc, objckpt.reader;"
        "import objckpt.coordination.roots;"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_single_process_world_round_trips_values_like_the_wire() -> None:
    comm = LocalComm()
    assert comm.gather({"a": (1, 2)}, "x") == [{"a": [1, 2]}]  # JSON: tuples become lists
    with pytest.raises(TypeError):
        comm.broadcast({"a": object()}, "x")
