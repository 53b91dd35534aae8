"""The simulated world's byte exchange (``SimComm.all_gather_bytes``, the read-once restore's one
collective): the same list on every rank, and virtual time charged as the gloo transport sends
(broadcasts up to ``EXCHANGE_BROADCAST_MAX_WORLD`` ranks; above, ``exchange_rounds`` under
``EXCHANGE_BUDGET``, ``collective_s`` of each round's padded bytes)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from objckpt.coordination.comm import exchange_rounds
from objckpt.defaults import EXCHANGE_BROADCAST_MAX_WORLD, EXCHANGE_BUDGET
from objckpt.errors import DistributedError
from objckpt.testing.scale.model import NetworkModel
from objckpt.testing.scale.world import SimComm, SimWorld, shard_payloads

SIZES = [3, 0, 5, 1]


@pytest.mark.parametrize("shards", [False, True], ids=["bytes", "shard-payloads"])
@pytest.mark.parametrize("copies", [1, 3], ids=["4-ranks-broadcasts", "12-ranks-all-gather-rounds"])
def test_every_rank_leaves_at_the_last_arrival_plus_the_modelled_transport(shards: bool, copies: int) -> None:
    """Up to EXCHANGE_BROADCAST_MAX_WORLD ranks the gloo transport broadcasts each contribution
    (``collective_s`` of each one's bytes), above it all-gathers in padded rounds."""
    sizes = SIZES * copies
    world_size = len(sizes)
    network = NetworkModel(byte_scale=1 << 27)  # 5 bytes stand for 640 MiB: several rounds
    world = SimWorld(world_size, network=network)

    def rank(comm: SimComm) -> tuple[Sequence[bytes], float]:
        comm.timeline.advance(30.0 if comm.rank == world_size - 1 else 0.0)  # the last arrives at t = 30
        mine = bytes([comm.rank]) * sizes[comm.rank]
        if shards:
            with shard_payloads():
                got = comm.all_gather_bytes(mine, sizes, "x")
        else:
            got = comm.all_gather_bytes(mine, sizes, "x")
        return got, comm.timeline.now

    results = world.run(rank)
    scale = network.byte_scale if shards else 1
    modelled = [round(n * scale) for n in sizes]
    if world_size <= EXCHANGE_BROADCAST_MAX_WORLD:
        cost = sum(network.collective_s(world_size, n) for n in modelled if n)
    else:
        rounds = exchange_rounds(modelled, EXCHANGE_BUDGET)
        # 12 ranks x the largest (640 MiB) over the 256 MiB budget: 31 rounds of <= 21.3 MiB per rank
        assert len(rounds) == (31 if shards else 1) and EXCHANGE_BUDGET == 256 << 20
        cost = sum(network.collective_s(world_size, world_size * width) for _, width in rounds)
    lists = [got for got, _ in results]
    assert all(got is lists[0] for got in lists)  # one list for every rank, no copies
    assert list(lists[0]) == [bytes([r]) * n for r, n in enumerate(sizes)]
    assert all(t == pytest.approx(30.0 + cost) for _, t in results)


def test_hosted_ranks_cannot_exchange_and_say_why() -> None:
    world = SimWorld(4, threads=2)
    results = world.run(lambda comm: comm.all_gather_bytes(b"", [0] * 4, "x"))
    assert all(isinstance(r, DistributedError) and "one thread per rank" in str(r) for r in results)
