"""The simulated world's byte exchange (``SimComm.all_gather_bytes``, the read-once restore's one
collective): the same list on every rank, and virtual time charged as the gloo transport's rounds
(``exchange_rounds`` under ``EXCHANGE_BUDGET``, ``collective_s`` of each round's padded bytes)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from objckpt.coordination.comm import exchange_rounds
from objckpt.defaults import EXCHANGE_BUDGET
from objckpt.errors import DistributedError
from objckpt.testing.scale.model import NetworkModel
from objckpt.testing.scale.world import SimComm, SimWorld, shard_payloads

SIZES = [3, 0, 5, 1]


@pytest.mark.parametrize("shards", [False, True], ids=["bytes", "shard-payloads"])
def test_every_rank_leaves_at_the_last_arrival_plus_the_modelled_rounds(shards: bool) -> None:
    network = NetworkModel(byte_scale=1 << 27)  # 5 bytes stand for 640 MiB: several rounds
    world = SimWorld(len(SIZES), network=network)

    def rank(comm: SimComm) -> tuple[Sequence[bytes], float]:
        comm.timeline.advance(10.0 * comm.rank)  # rank 3 arrives last, at t = 30
        mine = bytes([comm.rank]) * SIZES[comm.rank]
        if shards:
            with shard_payloads():
                got = comm.all_gather_bytes(mine, SIZES, "x")
        else:
            got = comm.all_gather_bytes(mine, SIZES, "x")
        return got, comm.timeline.now

    results = world.run(rank)
    scale = network.byte_scale if shards else 1
    rounds = exchange_rounds([round(n * scale) for n in SIZES], EXCHANGE_BUDGET)
    # 4 ranks x the largest (640 MiB) over the 256 MiB budget: 10 rounds of 64 MiB per rank
    assert len(rounds) == (10 if shards else 1) and EXCHANGE_BUDGET == 256 << 20
    cost = sum(network.collective_s(4, 4 * width) for _, width in rounds)
    lists = [got for got, _ in results]
    assert all(got is lists[0] for got in lists)  # one list for every rank, no copies
    assert list(lists[0]) == [bytes([r]) * n for r, n in enumerate(SIZES)]
    assert all(t == pytest.approx(30.0 + cost) for _, t in results)


def test_hosted_ranks_cannot_exchange_and_say_why() -> None:
    world = SimWorld(4, threads=2)
    results = world.run(lambda comm: comm.all_gather_bytes(b"", [0] * 4, "x"))
    assert all(isinstance(r, DistributedError) and "one thread per rank" in str(r) for r in results)
