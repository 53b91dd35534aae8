"""SimComm's JSON collectives (``gather``, ``broadcast``, so ``agree``) meet on
``SimWorld._meet``, not on the ``ThreadWorld`` barrier: the same values on every rank as the
barrier path (a JSON round trip each), the same virtual times (rank 0 leaves a gather at the last
arrival plus the modelled cost, a sender at its own arrival plus the latency; a broadcast at rank
0's arrival plus the cost), and a failing or absent rank breaks the world instead of leaving the
others waiting."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from objckpt.coordination.comm import Comm, ThreadWorld, agree
from objckpt.errors import DistributedError
from objckpt.testing.scale.model import NetworkModel
from objckpt.testing.scale.world import SimComm, SimWorld

W = 6


def _script(comm: Comm) -> list[Any]:
    """A few collectives whose values depend on the rank (tuples and int keys: the JSON round
    trip turns them into lists and str keys)."""
    out: list[Any] = []
    out.append(comm.gather({"rank": comm.rank, "pair": (comm.rank, "x"), 1: [comm.rank] * comm.rank}, "g"))
    out.append(comm.broadcast({"from": comm.rank, "t": (1, 2)}, "b"))
    out.append(agree(comm, comm.rank * 10, lambda xs: {"sum": sum(xs), "n": len(xs)}, "a"))
    out.append(comm.broadcast_bytes(b"abc" if comm.rank == 2 else None, "bb", src=2))
    out.append(list(comm.all_gather_bytes(bytes([comm.rank]) * comm.rank, list(range(W)), "ag")))
    return out


def test_values_are_those_of_the_thread_world_and_skip_its_barrier() -> None:
    expected = ThreadWorld(W).run(_script)
    world = SimWorld(W)
    got = world.run(_script)
    assert got == expected
    assert json.dumps(got[0][0]) == json.dumps(expected[0][0])  # str keys, lists: the wire's types
    assert world.threads_world.collectives == 0  # no barrier round at all


def test_every_receiver_decodes_its_own_copy() -> None:
    world = SimWorld(4)
    got = world.run(lambda comm: comm.broadcast({"v": [1, 2]}, "b"))
    assert all(g == {"v": [1, 2]} for g in got)
    assert len({id(g) for g in got}) == 4  # no rank can change what another received


def test_virtual_times_are_the_last_arrival_plus_the_modelled_cost() -> None:
    net = NetworkModel()
    world = SimWorld(4, network=net)

    def rank(comm: SimComm) -> tuple[float, float]:
        comm.timeline.advance(10.0 * comm.rank)  # rank 3 arrives last, at t = 30
        comm.gather("x" * (comm.rank + 1), "g")
        after_gather = comm.timeline.now
        comm.broadcast("y" * 5 if comm.rank == 0 else None, "b")
        return after_gather, comm.timeline.now

    results = world.run(rank)
    sent = sum(len(json.dumps(["x" * (r + 1)], separators=(",", ":"))) for r in range(4))
    root_t = 30.0 + net.collective_s(4, sent)
    assert results[0][0] == pytest.approx(root_t)
    for r in (1, 2, 3):
        assert results[r][0] == pytest.approx(10.0 * r + net.collective_latency_s)
    bcast = root_t + net.collective_s(4, len(json.dumps("y" * 5)))
    assert results[0][1] == pytest.approx(bcast)
    for r in (1, 2):  # arrived before rank 0's value: leave with it
        assert results[r][1] == pytest.approx(bcast)
    assert results[3][1] == pytest.approx(max(bcast, 30.0 + net.collective_latency_s))


def test_hosted_ranks_gather_their_reports_in_rank_order() -> None:
    world = SimWorld(6, threads=3)  # two ranks per thread

    def rank(comm: SimComm) -> Any:
        world.report(comm.rank + 1, {"hosted": comm.rank + 1})
        return comm.gather({"first": comm.rank}, "g")

    got = world.run(rank)
    assert got[0] == [{"first": 0}, {"hosted": 1}, {"first": 2}, {"hosted": 3}, {"first": 4}, {"hosted": 5}]
    assert got[1] is None and got[2] is None


def test_a_failing_rank_breaks_the_world_and_every_rank_says_which() -> None:
    world = SimWorld(W, timeout=30.0)

    def rank(comm: SimComm) -> Any:
        if comm.rank == 2:
            raise RuntimeError("boom")
        return agree(comm, comm.rank, len, "a")

    results = world.run(rank)
    assert isinstance(results[2], RuntimeError)
    for r in (0, 1, 3, 4, 5):  # released at once, naming the failure (not a barrier timeout)
        assert isinstance(results[r], DistributedError), results[r]
        assert "rank 2 failed: RuntimeError: boom" in str(results[r])


def test_a_rank_that_never_arrives_times_out_and_breaks_the_world() -> None:
    world = SimWorld(4, timeout=0.5)

    def rank(comm: SimComm) -> Any:
        if comm.rank == 3:
            time.sleep(2.0)  # past the timeout: the others must not wait for it
            return "late"
        return comm.all_gather_bytes(b"", [0] * 4, "ag")

    results = world.run(rank)
    assert results[3] == "late"
    for r in (0, 1, 2):
        assert isinstance(results[r], DistributedError) and "not every rank took part within 0.5s" in str(
            results[r]
        )
