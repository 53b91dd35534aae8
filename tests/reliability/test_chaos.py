"""Store and protocol through a faulty network: the chaos proxy between the SDK and the server.

Why: the store contract tests use well-behaved servers, and ``FaultInjectingStore`` raises clean
``TransientError``s above the SDK. Real networks break *inside* the SDK: 503 SlowDown documents,
500s, connections reset mid-body, bodies shorter than their Content-Length, slow answers, and —
the dangerous one — a write the server applied whose response never arrived, so the retry meets
the writer's own object. These tests run the real backends (moto for S3, fake-gcs-server for
GCS) behind ``objckpt.testing.chaos_proxy.ChaosProxy`` with >= 5% of requests broken, both
before the upstream sees them and after it applied them, and require byte-identical results.
Every test also requires that retries actually happened, so a green run cannot be a run in which
no fault fired.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from objckpt.commit import Coordinator
from objckpt.layout import manifest_key, new_attempt_id
from objckpt.manifest import Manifest
from objckpt.reader import Reader
from objckpt.store import Store, open_store
from objckpt.testing.chaos_proxy import ChaosProxy

from .harness import FAST_RETRY, MiB, payloads, restore, save, write_rank

PART = 5 * MiB  # S3's real minimum part size: moto runs with its default limits here
FAULT_RATE = 0.08  # >= 5% of all requests broken, every kind, both phases


# ---------------------------------------------------------------------------------- legs


@dataclass
class ChaosLeg:
    """One backend behind a fresh proxy. ``store()`` opens a new run root through the proxy."""

    name: str
    proxy: ChaosProxy
    open: Callable[[str], Store]
    #: (method, path fragment) of the request that writes a small object create-if-absent
    small_put: tuple[str, str | None]
    #: (method, path fragment) of the request that publishes a multipart/composite object
    complete: tuple[str, str]
    retries: list[tuple[str, int]]

    def store(self, prefix: str | None = None) -> Store:
        """A store on a new run root (or on ``prefix``), its retries recorded in ``retries``."""
        s = self.open(prefix or f"chaos-{uuid.uuid4().hex[:10]}")
        s.add_retry_listener(lambda exc, n: self.retries.append((repr(exc)[:200], n)))
        return s

    def reopen(self, store: Store) -> Store:
        """A second, independent store on ``store``'s run root (what a restarted job opens)."""
        return self.store(store.location.split("/", 3)[3])  # scheme://bucket/PREFIX


@pytest.fixture(scope="module")
def moto_server() -> Iterator[Any]:
    from objckpt.testing.s3_servers import MotoServer, ServerStartError, create_bucket

    try:
        srv = MotoServer().start()
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


@pytest.fixture(params=["s3", "gcs"])
def leg(request: pytest.FixtureRequest) -> Iterator[ChaosLeg]:
    seed = 20240601  # fixed: a failing run replays the same fault sequence (request order aside)
    retries: list[tuple[str, int]] = []
    if request.param == "s3":
        srv = request.getfixturevalue("moto_server")
        with ChaosProxy(srv.endpoint_url, fault_rate=FAULT_RATE, seed=seed, flavor="s3",
                        latency=(0.01, 0.1)) as proxy:
            opts = {**srv.store_options, "endpoint_url": proxy.endpoint_url}
            yield ChaosLeg(
                "s3", proxy,
                lambda prefix: open_store(f"s3://chaos/{prefix}", **opts, part_size=PART,
                                          retry=FAST_RETRY),
                small_put=("PUT", None),
                complete=("POST", "uploadId="),
                retries=retries,
            )
    else:
        srv = request.getfixturevalue("gcs_server")
        with ChaosProxy(srv.endpoint_url, fault_rate=FAULT_RATE, seed=seed, flavor="gcs",
                        latency=(0.01, 0.1)) as proxy:
            yield ChaosLeg(
                "gcs", proxy,
                lambda prefix: open_store(f"gs://chaos/{prefix}", endpoint_url=proxy.endpoint_url,
                                          part_size=PART, retry=FAST_RETRY),
                small_put=("POST", "uploadType=multipart"),
                complete=("POST", "/compose"),
                retries=retries,
            )


def _chunks(data: bytes, size: int = 1 * MiB) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


# ---------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_multipart_round_trip_through_faults(leg: ChaosLeg) -> None:
    """3 x 5 MiB parts up and down (get and get_stream) byte-identical, with faults that fired."""
    store = leg.store()
    data = random.Random(7).randbytes(3 * PART)
    # Guarantee the interesting cases fire at least once on top of the random ones: a part whose
    # response is lost (uploaded twice), and a download cut mid-body (get_stream must resume).
    leg.proxy.inject("reset", phase="after", method="PUT" if leg.name == "s3" else "POST",
                     path_contains="partNumber=2" if leg.name == "s3" else "upload")
    leg.proxy.inject("truncate", phase="after", method="GET",
                     path_contains="alt=media" if leg.name == "gcs" else "/big")
    try:
        meta = store.put_stream("big", _chunks(data))
        assert meta.size == len(data)
        assert store.head("big").size == len(data)
        assert store.get("big") == data
        streamed = b"".join(store.get_stream("big", expected_size=len(data), expected_crc32c=meta.crc32c))
        assert streamed == data
        assert store.get("big", byte_range=(PART - 3, PART + 5)) == data[PART - 3 : PART + 5]
    finally:
        store.close()
    assert leg.proxy.faults > 0, leg.proxy.stats
    assert len(leg.retries) > 0, leg.proxy.stats
    assert not store.list_uploads("") or leg.name == "gcs"  # S3: the upload completed, none left


@pytest.mark.slow
def test_protocol_round_trip_through_faults(leg: ChaosLeg) -> None:
    """Two saves (4 ranks in threads, one multipart shard each save) commit and restore
    bit for bit through the faults; the pointer ends on the newer step."""
    store = leg.store()
    try:
        p10 = payloads(10, 4, big=2 * PART + 123)
        p20 = payloads(20, 4, big=PART + 7, big_ranks=(1, 3))
        m10 = save(store, 10, p10)
        m20 = save(store, 20, p20)
        assert m20.parent == 10
        fresh = leg.reopen(store)
        try:
            got = restore(fresh)
            assert got.step == 20 and got.rejected == []
            assert got.shards == p20
            latest = Reader(fresh).latest()
            assert latest is not None and latest.attempt == m20.attempt
            assert Reader(fresh).pointer().step == 20  # type: ignore[union-attr]
        finally:
            fresh.close()
    finally:
        store.close()
    assert leg.proxy.faults > 0, leg.proxy.stats
    assert len(leg.retries) > 0, (leg.proxy.stats, leg.proxy.injections)


@pytest.mark.parametrize("kind", ["reset", "slowdown"])
def test_lost_manifest_response_is_idempotent(leg: ChaosLeg, kind: str) -> None:
    """The manifest's create-if-absent write is applied but its response lost (reset, or replaced
    by a 503): the retry meets the manifest it just wrote. The commit must return that same
    manifest — not raise CommitConflict — and exactly one manifest must exist."""
    leg.proxy.set_fault_rate(0.0)  # only the targeted fault: the outcome must be exact
    store = leg.store()
    try:
        p = payloads(30, 2)
        attempt = new_attempt_id()
        reports = {r: write_rank(store, 30, attempt, r, p[r]) for r in p}
        method, fragment = leg.small_put
        # After the shards, the manifest is the next small create-if-absent write.
        if leg.name == "s3":
            leg.proxy.inject(kind, phase="after", method=method, path_contains="/manifests/")
        else:
            leg.proxy.inject(kind, phase="after", method=method, path_contains=fragment)
        m = Coordinator(store, world_size=2).commit(30, attempt, reports)
        assert leg.proxy.pending_injections() == 0 and leg.proxy.stats[f"{kind}:after"] == 1
        assert m.attempt == attempt and m.step == 30
        stored = Manifest.decode(store.get(manifest_key(30)), key=manifest_key(30))
        assert stored == m
        assert [k.key for k in store.list("manifests/")] == [manifest_key(30)]
        assert restore(store).shards == p
    finally:
        store.close()
    assert len(leg.retries) > 0


@pytest.mark.parametrize("which", ["small_put", "complete"])
def test_lost_shard_response_is_idempotent(leg: ChaosLeg, which: str) -> None:
    """A shard's create-if-absent write (single request, or the multipart completion) is applied
    but its response lost; the retry meets the shard it wrote itself. The save must still commit
    (the store recognises its own write by size and CRC32C) and restore bit for bit."""
    leg.proxy.set_fault_rate(0.0)
    store = leg.store()
    try:
        p = payloads(40, 1, big=PART + 11)
        method, fragment = getattr(leg, which)
        if which == "small_put" and leg.name == "s3":
            fragment = "/state.bin"
        leg.proxy.inject("reset", phase="after", method=method, path_contains=fragment)
        m = save(store, 40, p)
        assert leg.proxy.pending_injections() == 0
        assert m.step == 40
        assert restore(store).shards == p
    finally:
        store.close()
    assert len(leg.retries) > 0


def test_read_path_survives_faults(leg: ChaosLeg) -> None:
    """Resolution and reads (pointer GET, manifests LIST, manifest GET, shard HEAD/GET) under a
    high fault rate: the reader never mistakes a transient failure for a corrupt checkpoint."""
    leg.proxy.set_fault_rate(0.0)
    store = leg.store()
    try:
        p = payloads(50, 3)
        save(store, 50, p)
        leg.proxy.set_fault_rate(0.25, kinds=("slowdown", "internal", "reset", "truncate"))
        for _ in range(3):
            got = restore(store)
            assert got.step == 50 and got.rejected == [] and got.shards == p
    finally:
        leg.proxy.set_fault_rate(FAULT_RATE)
        store.close()
    assert leg.proxy.faults > 0 and len(leg.retries) > 0


def test_concurrent_readers_through_faults(leg: ChaosLeg) -> None:
    """Several readers at once over keep-alive connections, with faults: all agree, bit for bit."""
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
