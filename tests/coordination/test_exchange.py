"""Shards every rank needs are read from the store once per job and shared over the comm
(invariant 16; ``objckpt.coordination.exchange``), on a ThreadWorld of 4 ranks.

Counts, never timings: how often each shard is opened, by which rank, and what every rank ends up
holding; errors follow the one damage rule on every rank.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from objckpt import layout
from objckpt.coordination import ThreadWorld
from objckpt.coordination.comm import Comm, ThreadComm
from objckpt.coordination.exchange import assign, check_received, plan_shared, read_shared
from objckpt.coordination.restore import RestoreSession
from objckpt.errors import (
    ChecksumMismatchError,
    DistributedError,
    NotFoundError,
    PermissionDeniedError,
    is_damage,
)
from objckpt.manifest import Manifest, ShardReceipt
from objckpt.reader import Reader
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from tests.protocol.helpers import memory_store, save

WORLD = 4


def _write_shared(store: Any, sizes: list[int]) -> list[ShardReceipt]:
    from objckpt.writer import ShardWriter

    attempt = layout.new_attempt_id()
    out = []
    for rank, size in enumerate(sizes):
        w = ShardWriter(store, step=5, attempt=attempt, rank=rank)
        out.append(w.write("replicated.bin", bytes([rank % 251 + 1]) * size))
    return out


def _run(world_size: int, fn: Any) -> list[Any]:
    return ThreadWorld(world_size, timeout=30).run(fn)


def test_the_plan_is_each_ranks_own_shards_in_key_order_and_the_same_for_any_order():
    receipts = [
        ShardReceipt(key=f"data/k{i:03d}", size=size, version="v", crc32c="AAAAAA==", rank=i, name="x")
        for i, size in enumerate([900, 10, 500, 500, 400, 300, 300, 100, 50, 40])
    ]
    plan = plan_shared([*receipts, receipts[3]], WORLD)  # a key named twice counts once
    assert plan == plan_shared(list(reversed(receipts)), WORLD)
    assert [r.key for r in plan.ordered] == sorted(r.key for r in receipts)
    for rank, owned in enumerate(plan.owned):
        assert [r.key for r in owned] == sorted(k for k, v in plan.owners.items() if v == rank)
        assert plan.sizes[rank] == sum(r.size for r in owned)
    assert plan.digest != plan_shared(receipts[:-1], WORLD).digest


def test_received_shards_are_views_of_the_blobs_and_the_callers_own_is_not_checked():
    from objckpt._crc import crc32c_b64

    data = [bytes([r + 1]) * (100 + r) for r in range(3)]
    receipts = [
        ShardReceipt(key=f"data/k{r}", size=len(d), version="v", crc32c=crc32c_b64(d), rank=r, name="x")
        for r, d in enumerate(data)
    ]
    plan = plan_shared(receipts, 3)
    blobs = [b"".join(data[int(r.key[-1])] for r in owned) for owned in plan.owned]
    owner_of_k0 = plan.owners["data/k0"]
    damaged = list(blobs)
    damaged[owner_of_k0] = b"\0" + blobs[owner_of_k0][1:]
    verified, corrupt = check_received(damaged, plan, skip=owner_of_k0)
    assert corrupt == [] and "data/k0" not in verified  # its own contribution: not checked, not returned
    verified, corrupt = check_received(damaged, plan)
    assert [src for src, _ in corrupt] == [owner_of_k0] and "data/k0" in corrupt[0][1]
    assert "data/k0" not in verified
    for key, view in verified.items():
        assert isinstance(view, memoryview) and view.obj is damaged[plan.owners[key]]  # no copy
        assert bytes(view) == data[int(key[-1])]


def test_assignment_balances_bytes_and_is_the_same_for_every_caller():
    receipts = [
        ShardReceipt(key=f"data/k{i:03d}", size=size, version="v", crc32c="AAAAAA==", rank=i, name="x")
        for i, size in enumerate([900, 10, 500, 500, 400, 300, 300, 100, 50, 40])
    ]
    owners = assign(receipts, WORLD)
    assert owners == assign(list(reversed(receipts)), WORLD)  # order of the list does not matter
    assert set(owners) == {r.key for r in receipts}
    loads = [sum(r.size for r in receipts if owners[r.key] == rank) for rank in range(WORLD)]
    assert max(loads) - min(loads) <= max(r.size for r in receipts)
    assert sorted(loads) == [700, 700, 800, 900]  # largest first, each to the least-loaded rank


def test_every_rank_gets_every_shard_and_each_is_downloaded_once():
    inner = memory_store()
    receipts = _write_shared(inner, [4000, 3000, 2500, 1000, 900, 800, 700, 100])
    stores = [CountingStore(inner) for _ in range(WORLD)]

    def rank(comm: Comm) -> dict[str, bytes]:
        return read_shared(comm, Reader(stores[comm.rank]), receipts, "test")

    results = _run(WORLD, rank)
    expected = {r.key: inner.get(r.key) for r in receipts}
    assert all(got == expected for got in results)
    opened = [[k for op, k in s.calls if op == "open"] for s in stores]
    # each shard opened by exactly one rank, once
    assert sorted(k for per_rank in opened for k in per_rank) == sorted(expected)
    per_rank_bytes = [sum(len(expected[k]) for k in keys) for keys in opened]
    total = sum(per_rank_bytes)
    assert total == sum(r.size for r in receipts)  # the job reads each unique byte once
    assert max(per_rank_bytes) <= total / WORLD + max(r.size for r in receipts)
    assert all(s.counts["list_page"] == 0 for s in stores)


class _Spy(ThreadComm):
    """A ThreadComm that keeps what this rank handed to the byte exchange."""

    sent: Any = None

    def all_gather_bytes(self, data: Any, sizes: Sequence[int], what: str) -> Sequence[Any]:
        self.sent = data
        return super().all_gather_bytes(data, sizes, what)


def _read_spied(store: Any, receipts: list[ShardReceipt]) -> tuple[list[Any], dict[int, _Spy]]:
    """``read_shared`` on every rank, each through a :class:`_Spy`: the results and the spies."""
    spies: dict[int, _Spy] = {}

    def rank(comm: Comm) -> Any:
        assert isinstance(comm, ThreadComm)
        spy = spies[comm.rank] = _Spy(comm.world, comm.rank)
        return read_shared(spy, Reader(store), receipts, "test")

    return _run(WORLD, rank), spies


def test_a_rank_streams_its_shards_into_one_writable_buffer_and_sends_that_very_buffer():
    """Issue 14: a rank's own shards are streamed straight into one buffer (no joined copy of
    them: it was ``b"".join`` per shard, then one more join for the contribution); that buffer is
    what the exchange sends, and what the rank returns for those shards are views into it,
    writable, so the decoder can build the staged tensors on it instead of copying."""
    inner = memory_store()
    receipts = _write_shared(inner, [4000, 3000, 2500, 1000, 900, 800, 700, 100])
    owners = assign(receipts, WORLD)
    results, spies = _read_spied(inner, receipts)
    for r, got in enumerate(results):
        assert got == {x.key: inner.get(x.key) for x in receipts}
        mine = [x for x in receipts if owners[x.key] == r]
        sent = spies[r].sent
        assert mine and isinstance(sent, memoryview) and sent.nbytes == sum(x.size for x in mine)
        for x in mine:
            view = got[x.key]
            assert isinstance(view, memoryview) and not view.readonly
            assert view.obj is sent.obj  # a view into the buffer sent, not a copy of it
    assert max(sum(owners[x.key] == r for x in receipts) for r in range(WORLD)) >= 2  # one holds several


def test_only_a_large_contribution_gets_an_mmap_of_its_own(monkeypatch: Any):
    """An anonymous mmap is a kernel mapping of its own: thousands of ranks in one process (the
    scale simulator) each holding one for a few hundred bytes would near the map limit, so a
    contribution below ``comm.MMAP_FROM`` is ordinary memory."""
    import mmap

    from objckpt.coordination import comm as comm_module

    monkeypatch.setattr(comm_module, "MMAP_FROM", 2000)
    inner = memory_store()
    receipts = _write_shared(inner, [2500, 1000, 300, 0])
    owners = assign(receipts, WORLD)
    results, spies = _read_spied(inner, receipts)
    assert all(got == {x.key: inner.get(x.key) for x in receipts} for got in results)
    for r in range(WORLD):
        size = sum(x.size for x in receipts if owners[x.key] == r)
        sent = spies[r].sent
        if size >= 2000:
            assert isinstance(sent, memoryview) and isinstance(sent.obj, mmap.mmap)
        elif size:
            assert isinstance(sent, memoryview) and isinstance(sent.obj, bytearray)


def test_a_shard_larger_than_a_part_is_read_by_ranged_gets_in_place_and_verified():
    """Issue 14: a rank's own shard larger than one of the store's parts is read by parallel
    ranged GETs of at most ``part_size`` (it was one streamed GET: at 2 ranks x 256 MiB on
    LocalStack, one stream per rank was the slowest leg of the restore), each straight into
    its place; the bytes still verified against the receipt (a corrupt one is damage)."""
    part = 4096
    inner = memory_store(part_size=part)
    receipts = _write_shared(inner, [5 * part + 7, 3 * part, part - 1, 2 * part + 1])
    stores = [CountingStore(inner) for _ in range(WORLD)]

    def rank(comm: Comm) -> Any:
        return read_shared(comm, Reader(stores[comm.rank]), receipts, "test")

    results = _run(WORLD, rank)
    assert all(got == {x.key: inner.get(x.key) for x in receipts} for got in results)
    opened = collections.Counter(k for s in stores for op, k in s.calls if op == "open")
    assert opened == {x.key: max(1, -(-x.size // part)) if x.size > part else 1 for x in receipts}

    bad = receipts[0]  # the largest: read by ranges
    inner.delete([bad.key])
    inner.put(bad.key, b"\x00" * bad.size)  # same size, other bytes
    results = _run(WORLD, lambda comm: read_shared(comm, Reader(inner), receipts, "test"))
    assert all(isinstance(r, ChecksumMismatchError) and is_damage(r) for r in results), results


def test_a_damaged_shard_is_the_same_damage_on_every_rank():
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900, 800, 700])
    inner.delete([receipts[2].key])
    owner = assign(receipts, WORLD)[receipts[2].key]

    results = _run(WORLD, lambda comm: read_shared(comm, Reader(inner), receipts, "test"))
    assert all(isinstance(r, NotFoundError) and is_damage(r) for r in results), results
    assert all(str(r).startswith(f"rank {owner}:") for r in results)


def test_corrupt_bytes_in_the_store_are_damage_on_every_rank():
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900])
    bad = receipts[0]
    inner.delete([bad.key])
    inner.put(bad.key, b"\x00" * bad.size)  # same size, other bytes
    results = _run(WORLD, lambda comm: read_shared(comm, Reader(inner), receipts, "test"))
    assert all(isinstance(r, ChecksumMismatchError) for r in results), results


def test_a_permission_error_is_raised_on_every_rank_never_damage():
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900, 800, 700])
    store = FaultInjectingStore(
        inner, [Fault(op="open", key=receipts[1].key, error=PermissionDeniedError, times=None)]
    )
    results = _run(WORLD, lambda comm: read_shared(comm, Reader(store), receipts, "test"))
    assert all(isinstance(r, PermissionDeniedError) and not is_damage(r) for r in results), results


def test_a_rank_that_failed_before_still_takes_part_and_every_rank_raises_its_error():
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900])

    def rank(comm: Comm) -> Any:
        failed = NotFoundError("my own shard is not in the manifest") if comm.rank == 3 else None
        return read_shared(comm, Reader(inner), receipts, "test", error=failed)

    results = _run(WORLD, rank)
    assert all(isinstance(r, NotFoundError) and "rank 3:" in str(r) for r in results), results


def test_ranks_asking_for_different_shards_raise_instead_of_hanging():
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900])

    def rank(comm: Comm) -> Any:
        mine = receipts if comm.rank != 1 else receipts[:1]
        return read_shared(comm, Reader(inner), mine, "test")

    results = _run(WORLD, rank)
    assert all(isinstance(r, DistributedError) and "ranks [1]" in str(r) for r in results), results


class _Basic(Comm):
    """A comm with only the abstract primitives and ``broadcast_bytes`` of ``inner``: what a
    Comm that does not override ``all_gather_bytes`` gets (the default, in terms of them)."""

    def __init__(self, inner: Comm) -> None:
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.calls: collections.Counter[str] = collections.Counter()

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        self.calls["gather"] += 1
        return self.inner.gather(obj, what, handshake=handshake)

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        self.calls["broadcast"] += 1
        return self.inner.broadcast(obj, what, handshake=handshake)

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        self.calls["broadcast_bytes"] += 1
        return self.inner.broadcast_bytes(data, what, src=src)


class _Counting(_Basic):
    """Counts the calls of each collective, and passes ``all_gather_bytes`` through."""

    def all_gather_bytes(self, data: bytes | None, sizes: Sequence[int], what: str) -> Sequence[bytes]:
        self.calls["all_gather_bytes"] += 1
        return self.inner.all_gather_bytes(data, sizes, what)


class _Flipping(_Counting):
    """A comm whose byte path corrupts what one rank receives from the others (a broken
    transport): the first byte of each, or (``cut``) the last byte dropped."""

    def __init__(self, inner: Comm, victim: int, *, cut: bool = False) -> None:
        super().__init__(inner)
        self.victim, self.cut = victim, cut

    def all_gather_bytes(self, data: bytes | None, sizes: Sequence[int], what: str) -> Sequence[bytes]:
        got = super().all_gather_bytes(data, sizes, what)
        if self.rank != self.victim:
            return got
        return [
            b if src == self.rank or not b else b[:-1] if self.cut else bytes([b[0] ^ 1]) + b[1:]
            for src, b in enumerate(got)
        ]


@pytest.mark.parametrize("cut", [False, True])
def test_bytes_corrupted_in_transit_are_caught_by_the_receiver_and_are_not_damage(cut: bool):
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900, 800, 700])

    def rank(comm: Comm) -> Any:
        return read_shared(_Flipping(comm, victim=2, cut=cut), Reader(inner), receipts, "test")

    results = _run(WORLD, rank)
    assert isinstance(results[2], DistributedError) and not is_damage(results[2])
    assert "rank 2 received" in str(results[2])
    assert ("expected" in str(results[2])) == cut  # a contribution of the wrong size: named so
    assert all(isinstance(r, dict) and len(r) == 4 for i, r in enumerate(results) if i != 2)


@pytest.mark.parametrize(("world_size", "shards"), [(2, 2), (4, 4), (4, 16), (8, 8), (8, 40)])
def test_the_exchange_is_one_collective_whatever_the_world_and_the_shards(world_size: int, shards: int):
    """Issue 13: the bytes cross the process group in one all-gather, not one broadcast per
    shard (which at W owners was >= W collectives, ~2W over gloo). The read-once protocol is
    the agreement on the reads (a gather and a broadcast) plus that one exchange."""
    inner = memory_store()
    receipts = _write_shared(inner, [100 + 37 * i for i in range(shards)])
    world = ThreadWorld(world_size, timeout=30)
    comms: list[_Counting] = []

    def rank(comm: Comm) -> Any:
        counting = _Counting(comm)
        comms.append(counting)
        return read_shared(counting, Reader(inner), receipts, "test")

    results = world.run(rank)
    assert all(r == {x.key: inner.get(x.key) for x in receipts} for r in results)
    assert world.collectives == 3  # gather + broadcast (agree) + one all-gather
    assert all(c.calls == {"gather": 1, "broadcast": 1, "all_gather_bytes": 1} for c in comms)


def test_a_comm_without_a_byte_exchange_of_its_own_gets_the_same_bytes_by_broadcasts():
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900, 800, 700, 600, 20])
    comms: list[_Basic] = []

    def rank(comm: Comm) -> Any:
        basic = _Basic(comm)
        comms.append(basic)
        return read_shared(basic, Reader(inner), receipts, "test")

    results = _run(WORLD, rank)
    assert all(r == {x.key: inner.get(x.key) for x in receipts} for r in results)
    # the default: one broadcast per rank that contributes (not per shard)
    assert all(c.calls["broadcast_bytes"] == WORLD for c in comms)


def test_restore_falls_back_on_every_rank_when_a_shared_shard_is_damaged():
    """Through the restore session: the damage verdict of the reading rank becomes a fallback to
    the parent on all ranks together."""
    store = memory_store()
    parent = save(store, 10, world_size=WORLD)
    newest = save(store, 20, world_size=WORLD)
    store.delete([newest.shards[3].key])

    def rank(comm: Comm) -> Any:
        session = RestoreSession(store, comm)

        def stage(m: Manifest) -> int:
            got = read_shared(comm, session.reader, list(m.shards), f"restore(step={m.step})")
            return len(got)

        restored = session.restore(stage)
        assert restored is not None
        return restored.step, restored.value, [s for s, _ in restored.fallbacks]

    results = _run(WORLD, rank)
    assert results == [(parent.step, WORLD, [newest.step])] * WORLD


@pytest.mark.parametrize("world", [1, 3])
def test_one_rank_or_more_ranks_than_shards(world: int):
    inner = memory_store()
    receipts = _write_shared(inner, [1000, 900])
    results = _run(world, lambda comm: read_shared(comm, Reader(inner), receipts, "test"))
    assert all(r == {x.key: inner.get(x.key) for x in receipts} for r in results)


class _Together(CountingStore):
    """Every shard open waits until ``parties`` opens are under way: shards read one after
    another break the barrier (its timeout) instead of passing it."""

    def __init__(self, inner: Any, parties: int) -> None:
        super().__init__(inner, close_inner=False)
        self.barrier = threading.Barrier(parties, timeout=10)

    def _invoke(self, op: str, key: str, keys: Any, fn: Any, *args: Any) -> Any:
        if op == "open" and key.startswith("data/"):
            self.barrier.wait()
        return super()._invoke(op, key, keys, fn, *args)


def test_a_contribution_of_many_small_shards_is_read_several_at_once():
    # a replicated share spread over one-request pieces: 8 shards of one part each for one
    # rank, read 8 at once (read_window) as one large shard's 8 ranged GETs would be
    from objckpt.writer import ShardWriter

    store = memory_store(part_size=1024, max_in_flight=8)
    writer = ShardWriter(store, step=5, attempt=layout.new_attempt_id(), rank=0)
    data = [bytes([k + 1]) * 1000 for k in range(8)]
    receipts = [
        writer.write("replicated.bin" if k == 0 else f"replicated.{k}.bin", d) for k, d in enumerate(data)
    ]
    together = _Together(store, parties=8)

    def rank(comm: Comm) -> dict[str, Any]:
        return read_shared(comm, Reader(together), receipts, "test")

    (got,) = _run(1, rank)
    assert {k: bytes(v) for k, v in got.items()} == {r.key: d for r, d in zip(receipts, data, strict=True)}
    assert together.counts["open"] == 8  # each shard once
