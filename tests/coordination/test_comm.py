"""``Comm.all_gather_bytes``: every rank's bytes on every rank in one collective, sizes known in
advance (issue 13: the read-once restore's exchange). On LocalComm, ThreadWorld and the default
built on ``broadcast_bytes``; the gloo implementation is tested in real processes
(``tests/training/test_scale_mp.py``). Counts, never timings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from objckpt.coordination import ThreadWorld
from objckpt.coordination.comm import Comm, LocalComm, exchange_rounds
from objckpt.errors import DistributedError


def _payload(rank: int, n: int) -> bytes:
    return bytes((rank * 7 + i) % 256 for i in range(n))


class _OnlyBroadcasts(Comm):
    """The primitives of ``inner`` and nothing else: the ABC's default ``all_gather_bytes``."""

    def __init__(self, inner: Comm) -> None:
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.byte_broadcasts = 0

    def gather(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return self.inner.gather(obj, what, handshake=handshake)

    def broadcast(self, obj: Any, what: str, *, handshake: bool = False) -> Any:
        return self.inner.broadcast(obj, what, handshake=handshake)

    def broadcast_bytes(self, data: bytes | None, what: str, *, src: int = 0) -> bytes:
        self.byte_broadcasts += 1
        return self.inner.broadcast_bytes(data, what, src=src)


SIZES = [5, 0, 300, 1, 64]


@pytest.mark.parametrize("default", [False, True], ids=["ThreadComm", "default"])
def test_every_rank_gets_every_ranks_bytes_in_rank_order(default: bool) -> None:
    world = ThreadWorld(len(SIZES), timeout=30)

    def rank(comm: Comm) -> tuple[Sequence[bytes], int]:
        c = _OnlyBroadcasts(comm) if default else comm
        mine = _payload(comm.rank, SIZES[comm.rank]) if SIZES[comm.rank] else None
        got = c.all_gather_bytes(mine, SIZES, "x")
        assert mine is None or got[comm.rank] is mine  # its own entry: not a copy
        return got, c.byte_broadcasts if isinstance(c, _OnlyBroadcasts) else 0

    results = world.run(rank)
    expected = [_payload(r, n) for r, n in enumerate(SIZES)]
    assert all(list(got) == expected for got, _ in results)
    if default:  # one broadcast per contributing rank; none for the empty one
        assert all(n == len([s for s in SIZES if s]) for _, n in results)
        assert world.collectives == 4  # one byte broadcast each (ThreadComm's byte path)
    else:
        assert world.collectives == 1


def test_thread_ranks_share_one_list_that_a_later_exchange_never_changes() -> None:
    world = ThreadWorld(4, timeout=30)

    def rank(comm: Comm) -> tuple[Sequence[bytes], list[bytes], Sequence[bytes]]:
        first = comm.all_gather_bytes(bytes([comm.rank]) * 3, [3] * 4, "x")
        snapshot = list(first)
        second = comm.all_gather_bytes(bytes([9 - comm.rank]), [1] * 4, "y")
        return first, snapshot, second

    results = world.run(rank)
    assert all(first is results[0][0] for first, _, _ in results)  # no copy per receiver
    assert all(second is results[0][2] and second is not first for first, _, second in results)
    assert all(
        list(first) == snapshot == [bytes([r]) * 3 for r in range(4)] for first, snapshot, _ in results
    )


def test_a_rank_of_the_wrong_size_takes_part_then_raises_and_the_others_get_the_agreed_size() -> None:
    world = ThreadWorld(3, timeout=30)

    def rank(comm: Comm) -> Sequence[bytes]:
        mine = b"toolong!" if comm.rank == 1 else bytes([comm.rank]) * 4
        return comm.all_gather_bytes(mine, [4, 4, 4], "x")

    results = world.run(rank)
    assert isinstance(results[1], ValueError) and "rank 1 contributed 8 bytes" in str(results[1])
    assert results[0] == results[2] == [b"\0" * 4, b"tool", b"\2" * 4]


def test_sizes_that_do_not_describe_the_world_raise_before_any_collective() -> None:
    comm = LocalComm()
    with pytest.raises(ValueError, match="1 non-negative ints"):
        comm.all_gather_bytes(b"", [0, 0], "x")
    with pytest.raises(ValueError, match="1 non-negative ints"):
        comm.all_gather_bytes(b"", [-1], "x")
    assert list(comm.all_gather_bytes(b"abc", [3], "x")) == [b"abc"]
    world = ThreadWorld(2, timeout=0.5)
    results = world.run(lambda c: c.all_gather_bytes(b"", [0], "x"))
    assert all(isinstance(r, ValueError) for r in results)
    assert world.collectives == 0  # nobody waited: nobody broke the barrier
    assert world.run(lambda c: list(c.all_gather_bytes(b"", [0, 0], "x"))) == [[b"", b""]] * 2


def test_a_rank_that_never_comes_breaks_the_exchange_on_every_other_rank() -> None:
    world = ThreadWorld(3, timeout=0.5)
    results = world.run(lambda c: c.all_gather_bytes(b"a", [1, 1, 1], "the exchange"), ranks=[0, 1])
    assert all(isinstance(r, DistributedError) and "the exchange" in str(r) for r in results)


@pytest.mark.parametrize("world_size", [1, 2, 16, 1024, 16384])
def test_bounded_rounds_cover_every_byte_and_their_number_does_not_grow_with_the_world(
    world_size: int,
) -> None:
    """The gloo exchange's plan: for a fixed budget and a fixed total (W contributions of
    total/W bytes, as ``assign`` balances them), the same number of rounds at every W, each
    gathering at most ``max(budget, W)`` padded bytes."""
    budget, total = 1 << 20, 8 << 20
    sizes = [total // world_size] * world_size
    sizes[-1] += total % world_size
    rounds = exchange_rounds(sizes, budget)
    assert len(rounds) <= math.ceil(total / budget) + 1
    assert all(world_size * width <= max(budget, world_size) for _, width in rounds)
    covered = 0
    for offset, width in rounds:
        assert offset == covered and width >= 1
        covered += width
    assert covered == max(sizes)
    assert exchange_rounds([0] * world_size, budget) == []


# ------------------------------------------------------------------ broadcast_into (Comm default)


def test_broadcast_into_writes_the_sources_bytes_into_every_other_ranks_buffer() -> None:
    world = ThreadWorld(3, timeout=30)

    def rank(comm: Comm) -> tuple[bytes, int]:
        c = _OnlyBroadcasts(comm)
        buffer = bytearray(_payload(9, 100)) if comm.rank == 1 else bytearray(100)
        c.broadcast_into(memoryview(buffer), "x", src=1)
        c.broadcast_into(memoryview(bytearray(0)), "empty", src=0)  # nothing to send: no collective
        return bytes(buffer), c.byte_broadcasts

    results = world.run(rank)
    assert [got for got, _ in results] == [_payload(9, 100)] * 3
    assert [n for _, n in results] == [1, 1, 1]


def test_broadcast_into_a_buffer_of_another_size_raises_on_the_receiver() -> None:
    world = ThreadWorld(2, timeout=30)

    def rank(comm: Comm) -> str:
        buffer = bytearray(10 if comm.rank == 0 else 12)
        try:
            comm.broadcast_into(memoryview(buffer), "x", src=0)
        except DistributedError as exc:
            return str(exc)
        return "ok"

    assert world.run(rank) == ["ok", "x: rank 1 expected 12 bytes from rank 0, got 10"]
    local = bytearray(b"abc")
    LocalComm().broadcast_into(memoryview(local), "x", src=0)  # one rank: its own bytes stay
    assert local == b"abc"
