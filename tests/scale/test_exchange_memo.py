"""``charged_exchange``: inside a read-once restore's ``read_shared`` the plan
(``plan_shared``) and the check of what was received (``check_received``) run once per distinct
input object (every rank plans from the same receipts object and receives the very same gathered
objects), each caller's clock charged the measured CPU; the restore's counts are those of every
rank computing for itself."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from objckpt._crc import crc32c_b64
from objckpt.coordination import exchange
from objckpt.manifest import ShardReceipt
from objckpt.testing.scale import ScaleOptions, clock, run_scenario
from objckpt.testing.scale.decoding import charged_exchange


def _receipts(world: int, size: int = 64) -> tuple[list[ShardReceipt], list[bytes]]:
    blobs = [bytes([r]) * size for r in range(world)]
    receipts = [
        ShardReceipt(
            key=f"data/1-0/{r:05d}/replicated.bin",
            size=size,
            version="v",
            crc32c=crc32c_b64(blobs[r]),
            rank=r,
            name="replicated.bin",
        )
        for r in range(world)
    ]
    return receipts, blobs


def _counting(monkeypatch: Any, name: str) -> list[Any]:
    calls: list[Any] = []
    real = getattr(exchange, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1:])
        return real(*args, **kwargs)

    monkeypatch.setattr(exchange, name, counting)
    return calls


def test_each_distinct_object_is_planned_and_checked_once_and_every_caller_is_charged(
    monkeypatch: Any,
) -> None:
    plans = _counting(monkeypatch, "plan_shared")
    checks = _counting(monkeypatch, "check_received")
    receipts, blobs = _receipts(4)
    with charged_exchange(True):
        tls = [clock.Timeline(0.0, r, 0) for r in range(4)]
        got = []
        for rank, tl in enumerate(tls):
            with clock.acting_as(tl):
                plan = exchange.plan_shared(receipts, 4)
                got.append(exchange.check_received(blobs, plan, skip=rank))
    assert exchange.plan_shared.__name__ == "counting"  # restored to what it was
    assert len(plans) == 1 and len(checks) == 1  # one plan, one check, for four ranks
    for rank, (verified, corrupt) in enumerate(got):
        assert corrupt == []
        # the caller's own shard is not in what it was given, every other one is, as a view
        assert sorted(verified) == sorted(r.key for r in receipts if r.rank != rank)
        assert all(bytes(verified[r.key]) == blobs[r.rank] for r in receipts if r.rank != rank)
    assert all(tl.now > 0.0 for tl in tls)


def test_a_corrupt_source_is_reported_to_every_rank_but_its_own(monkeypatch: Any) -> None:
    receipts, blobs = _receipts(3)
    blobs[1] = b"\xff" + blobs[1][1:]
    with charged_exchange(True):
        plan = exchange.plan_shared(receipts, 3)
        outcomes = [exchange.check_received(blobs, plan, skip=rank) for rank in range(3)]
    assert [[src for src, _ in corrupt] for _, corrupt in outcomes] == [[1], [], [1]]
    assert all(receipts[1].key not in verified for verified, _ in outcomes)


def test_memoized_exchange_changes_no_count_of_a_read_once_restore() -> None:
    options = ScaleOptions(
        world_size=16, shard_bytes=512, replicated_bytes=64 * 1024, saves=1, replicated_read_once=True
    )
    memo = run_scenario(options)
    real = run_scenario(replace(options, memoize_exchange=False))
    assert memo.restore is not None and real.restore is not None
    assert memo.restore.outcome == real.restore.outcome == "restored"
    assert memo.restore.requests == real.restore.requests
    assert memo.restore.bytes_read == real.restore.bytes_read


def test_concurrent_first_callers_wait_for_one_computation(monkeypatch: Any) -> None:
    calls: list[int] = []
    real = exchange.plan_shared

    def slow(receipts: Any, world_size: int) -> exchange.SharedPlan:
        calls.append(world_size)
        time.sleep(0.2)  # every other thread arrives while the first computes
        return real(receipts, world_size)

    monkeypatch.setattr(exchange, "plan_shared", slow)
    receipts, _ = _receipts(8)
    start = threading.Barrier(8)
    got: list[exchange.SharedPlan] = []

    def rank() -> None:
        start.wait()
        got.append(exchange.plan_shared(receipts, 8))

    with charged_exchange(True):
        threads = [threading.Thread(target=rank) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(got) == 8 and all(p is got[0] for p in got)
    assert calls == [8]  # one computation for eight concurrent callers


def test_a_read_once_restore_plans_and_checks_once_with_the_memo(monkeypatch: Any) -> None:
    """Each of the W ranks plans and checks for itself without the memo; with it, one plan and
    one check of the one gathered list."""
    plans = _counting(monkeypatch, "plan_shared")
    checks = _counting(monkeypatch, "check_received")
    world = 16
    options = ScaleOptions(
        world_size=world, shard_bytes=512, replicated_bytes=64 * 1024, saves=1, replicated_read_once=True
    )
    assert run_scenario(options).restore.outcome == "restored"  # type: ignore[union-attr]
    assert (len(plans), len(checks)) == (1, 1)
    plans.clear()
    checks.clear()
    assert run_scenario(replace(options, memoize_exchange=False)).restore.outcome == "restored"  # type: ignore[union-attr]
    assert (len(plans), len(checks)) == (world, world)  # every rank plans and checks for itself
