"""``charged_exchange``: inside a read-once restore's ``read_shared`` the CRC32C check of each
received shard and the ``assign`` plan run once per distinct input object (every rank receives
the very same gathered objects), each caller's clock charged the measured CPU; the restore's
counts are those of every rank computing for itself."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

from objckpt._crc import crc32c_b64
from objckpt.coordination import exchange
from objckpt.testing.scale import ScaleOptions, clock, run_scenario
from objckpt.testing.scale.decoding import charged_exchange


def test_each_distinct_object_is_computed_once_and_every_caller_is_charged() -> None:
    calls: list[int] = []
    real = exchange.assign

    def counting(receipts: object, world_size: int) -> dict[str, int]:
        calls.append(world_size)
        return real(receipts, world_size)  # type: ignore[arg-type]

    blob = b"x" * 4096
    exchange.assign = counting
    try:
        with charged_exchange(True):
            tls = [clock.Timeline(0.0, r, 0) for r in range(3)]
            crcs = []
            for tl in tls:
                with clock.acting_as(tl):
                    crcs.append(getattr(exchange, "crc32c_b64")(blob))  # noqa: B009
                    exchange.assign([], 4)
            assert getattr(exchange, "crc32c_b64")(bytes(blob)) == crc32c_b64(blob)  # noqa: B009
    finally:
        exchange.assign = real
    assert crcs == [crc32c_b64(blob)] * 3
    assert calls == [4]  # one plan for three ranks
    assert all(tl.now > 0.0 for tl in tls) and len({tl.now for tl in tls}) == 1  # the same CPU each
    assert getattr(exchange, "crc32c_b64") is crc32c_b64  # noqa: B009 - restored


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


def test_concurrent_first_callers_wait_for_one_computation() -> None:
    calls: list[int] = []
    real = getattr(exchange, "crc32c_b64")  # noqa: B009

    def slow(data: bytes) -> str:
        calls.append(len(data))
        time.sleep(0.2)  # every other thread arrives while the first computes
        return str(real(data))

    blob = b"y" * 1024
    start = threading.Barrier(8)
    got: list[str] = []

    def rank() -> None:
        start.wait()
        got.append(getattr(exchange, "crc32c_b64")(blob))  # noqa: B009

    setattr(exchange, "crc32c_b64", slow)  # noqa: B010
    try:
        with charged_exchange(True):
            threads = [threading.Thread(target=rank) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        setattr(exchange, "crc32c_b64", real)  # noqa: B010
    assert got == [crc32c_b64(blob)] * 8
    assert calls == [1024]  # one computation for eight concurrent callers


def test_a_read_once_restore_checks_each_received_shard_once_with_the_memo(monkeypatch: Any) -> None:
    """read_shared checks the views it slices from each received blob (not copies): the memo must
    still see one computation per source blob, not one per receiving rank."""
    calls: list[int] = []
    real_crc = getattr(exchange, "crc32c_b64")  # noqa: B009 - not exported

    def counting(data: Any) -> str:
        calls.append(memoryview(data).nbytes)
        return str(real_crc(data))

    monkeypatch.setattr(exchange, "crc32c_b64", counting)
    world = 16
    options = ScaleOptions(
        world_size=world, shard_bytes=512, replicated_bytes=64 * 1024, saves=1, replicated_read_once=True
    )
    assert run_scenario(options).restore.outcome == "restored"  # type: ignore[union-attr]
    memoized = len(calls)
    calls.clear()
    assert run_scenario(replace(options, memoize_exchange=False)).restore.outcome == "restored"  # type: ignore[union-attr]
    assert len(calls) == world * (world - 1)  # every rank checks every other rank's shard
    assert memoized == world  # one check per source blob
