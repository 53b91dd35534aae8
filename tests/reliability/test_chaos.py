"""Store and protocol through a faulty network: the chaos proxy between the SDK and the server.

Why: the store contract tests use well-behaved servers, and ``FaultInjectingStore`` raises clean
``TransientError``s above the SDK. Real networks break *inside* the SDK: 503 SlowDown documents,
500s, connections reset mid-body, bodies shorter than their Content-Length, slow answers, and --
the dangerous one -- a write the server applied whose response never arrived, so the retry meets
the writer's own object. These tests run the real backends (moto and LocalStack for S3, fake-gcs-server for
GCS) behind ``objckpt.testing.chaos_proxy.ChaosProxy`` with >= 5% of requests broken, both
before the upstream sees them and after it applied them, and require byte-identical results.
Every scenario also requires that retries actually happened, so a green run cannot be one in
which no fault fired. The scenario bodies live in ``scenarios.py`` (``scripts/reliability.py``
runs the same ones for RELIABILITY.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from .harness import payloads, restore, save
from .scenarios import (
    ChaosLeg,
    chaos_leg,
    chaos_lost_manifest,
    chaos_lost_shard,
    chaos_multipart,
    chaos_protocol,
    chaos_read_path,
)

SEED = 20240601  # fixed: a failing run replays the same fault sequence (request order aside)


@pytest.fixture(scope="module")
def moto_server() -> Iterator[Any]:
    from objckpt.testing.s3_servers import MotoServer, ServerStartError, create_bucket

    try:
        srv = MotoServer().start()  # default limits: 5 MiB minimum parts, like S3
    except ServerStartError as exc:
        pytest.skip(f"moto server unavailable: {exc}")
    try:
        create_bucket(srv.endpoint_url, "chaos")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[Any]:
    mod = pytest.importorskip("objckpt.testing.gcs_server", reason="GCS emulator launcher not available")
    pytest.importorskip("objckpt.store.gcs", reason="GCS backend not available")
    try:
        srv = mod.FakeGcsServer().start()
    except mod.ServerStartError as exc:
        pytest.skip(f"fake-gcs-server unavailable: {exc}")
    try:
        srv.create_bucket("chaos")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def localstack_server() -> Iterator[Any]:
    """LocalStack, the faithful S3 (atomic conditional writes, verified checksums): moto's
    conditional writes are not atomic, so the chaos run must also hold against a server where
    a lost response meets a real precondition check."""
    from objckpt.testing.s3_servers import LocalStackServer, ServerStartError, create_bucket

    from .harness import localstack_unavailable

    why = localstack_unavailable()
    if why:
        pytest.skip(why)
    try:
        srv = LocalStackServer().start()
    except ServerStartError as exc:
        pytest.skip(f"LocalStack did not start: {str(exc)[:300]}")
    try:
        create_bucket(srv.endpoint_url, "chaos")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(
    params=["s3", pytest.param("s3_localstack", marks=[pytest.mark.localstack, pytest.mark.slow]), "gcs"]
)
def leg(request: pytest.FixtureRequest) -> Iterator[ChaosLeg]:
    server = request.getfixturevalue(
        {"s3": "moto_server", "s3_localstack": "localstack_server", "gcs": "gcs_server"}[request.param]
    )
    flavor = "gcs" if request.param == "gcs" else "s3"
    with chaos_leg(flavor, server, "chaos", seed=SEED) as leg:
        yield leg


@pytest.mark.slow
def test_multipart_round_trip_through_faults(leg: ChaosLeg) -> None:
    """put_stream of 3 x 5 MiB parts, get / get_stream / ranged get byte-identical."""
    out = chaos_multipart(leg)
    assert out.bytes_equal and out.retries > 0 and out.extra["faults"] > 0


@pytest.mark.slow
def test_protocol_round_trip_through_faults(leg: ChaosLeg) -> None:
    """save -> commit -> resolve -> read, 4 ranks in threads, twice, byte-identical."""
    out = chaos_protocol(leg)
    assert out.restored_step == 20 and out.bytes_equal and out.retries > 0


@pytest.mark.parametrize("kind", ["reset", "slowdown"])
def test_lost_manifest_response_is_idempotent(leg: ChaosLeg, kind: str) -> None:
    """The manifest's create-if-absent lands but its answer is lost: same manifest returned,
    no CommitConflict, exactly one manifest."""
    out = chaos_lost_manifest(leg, kind)
    assert out.restored_step == 30 and out.bytes_equal


@pytest.mark.parametrize("which", ["small_put", "complete"])
def test_lost_shard_response_is_idempotent(leg: ChaosLeg, which: str) -> None:
    """A shard's create-if-absent (one request, or the multipart completion) lands but its answer
    is lost: the store must recognise its own write, so the save still commits."""
    out = chaos_lost_shard(leg, which)
    assert out.restored_step == 40 and out.bytes_equal


def test_read_path_survives_faults(leg: ChaosLeg) -> None:
    """25% of reads broken: never a checkpoint rejected for a transient error."""
    out = chaos_read_path(leg)
    assert out.restored_step == 50 and out.bytes_equal


def test_concurrent_readers_through_faults(leg: ChaosLeg) -> None:
    """Four readers at once over shared keep-alive connections, with faults: all agree."""
    leg.proxy.set_fault_rate(0.0)
    store = leg.store()
    try:
        p = payloads(60, 2, small=200 * 1024)
        save(store, 60, p)
        leg.proxy.set_fault_rate(0.15)
        results: list[Any] = []

        def one() -> None:
            try:
                results.append(restore(store).shards == p)
            except Exception as exc:  # noqa: BLE001 - reported below
                results.append(exc)

        ts = [threading.Thread(target=one) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert results == [True] * 4
    finally:
        store.close()
