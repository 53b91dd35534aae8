"""The reliability matrix's scenarios, shared by the tests and ``scripts/reliability.py``.

Each scenario sets up a known committed state, breaks something (a SIGKILL at a protocol point,
a corrupted object), then checks what a restarting job gets, and returns an :class:`Outcome`
for the report. A violated invariant raises ``AssertionError`` with what was expected and found;
the tests let it fail the test, the script records it as a failing cell.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.layout import POINTER_KEY, manifest_key, parse_shard_key
from objckpt.reader import Reader
from objckpt.store import PutMode, Store, open_store

from .harness import (
    FAST_RETRY,
    GRACE,
    Leg,
    after_grace,
    attempt_keys,
    payloads,
    restore,
    save,
)

REPO = Path(__file__).resolve().parents[2]

CRASH_WORLD = 2


def crash_sizes(leg: Leg) -> tuple[int, int]:
    """(part size, big shard size): every rank's big shard is 3 parts of the smallest size the
    server accepts (64 KiB on file:// and moto, 5 MiB on LocalStack)."""
    part = leg.min_part_size
    return part, 2 * part + part // 2 + 123


CRASH_POINTS = (
    "mid_part_upload",
    "before_complete",
    "after_complete",
    "before_manifest",
    "after_manifest",
    "gc_between_deletes",
)
CORRUPTIONS = ("flip_byte", "truncate_shard", "delete_shard", "swap_manifest", "corrupt_latest")


@dataclass
class Outcome:
    """One cell of the matrix."""

    scenario: str
    backend: str
    restored_step: int | None = None
    expected_step: int | None = None
    bytes_equal: bool | None = None
    orphans_swept: bool | None = None
    retries: int = 0
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def captured_warnings() -> Iterator[list[str]]:
    """Collect WARNING+ messages from every ``objckpt`` logger (the 'loud' fallbacks)."""
    messages: list[str] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _H(level=logging.WARNING)
    logger = logging.getLogger("objckpt")
    old = logger.level
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _counting(store: Store) -> list[int]:
    box = [0]

    def on_retry(exc: BaseException, n: int) -> None:
        box[0] += 1

    store.add_retry_listener(on_retry)
    return box


# ---------------------------------------------------------------------------------- crashes


def run_worker(args: list[str], point: str, timeout: float = 180.0) -> tuple[int, dict[str, Any], str]:
    """Run ``crash_worker`` as a real subprocess; returns (returncode, its report, its stderr)."""
    with tempfile.TemporaryDirectory(prefix="objckpt-crash-") as tmp:
        report_path = os.path.join(tmp, "report.json")
        env = {
            **os.environ,
            "OBJCKPT_CRASH_AT": point,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        proc = subprocess.run(
            [sys.executable, "-m", "tests.reliability.crash_worker", *args, report_path],
            cwd=REPO,
            env=env,
            timeout=timeout,
            capture_output=True,
            text=True,
        )
        report: dict[str, Any] = {}
        if os.path.exists(report_path):
            with open(report_path) as f:
                report = json.load(f)
        return proc.returncode, report, proc.stderr[-3000:]


def _uploads(store: Store) -> list[Any]:
    return list(store.list_uploads(""))


def crash_scenario(leg: Leg, point: str) -> Outcome:
    """Commit a known state, SIGKILL a worker at ``point``, then check restore and GC.

    After the crash a fresh reader must return the last committed state bit for bit (the new
    one for ``after_manifest``, by rolling forward over the pointer that was never moved), with
    every shard from one attempt; and ``plan_gc``/``run_gc`` with ``now`` past the grace period
    must sweep the abandoned attempt's objects and its pending multipart upload while leaving
    the committed state restorable.
    """
    part, big = crash_sizes(leg)
    uri, store = leg.new_root(part_size=part)
    out = Outcome(f"crash:{point}", leg.name)
    retries = _counting(store)
    try:
        if point == "gc_between_deletes":
            states = {s: payloads(s, CRASH_WORLD, big=big) for s in (10, 20, 30)}
            manifests = {s: save(store, s, states[s]) for s in states}
            rc, report, err = run_worker(["gc", uri, "1"], point)
            expected, want = 30, states[30]
        else:
            want10 = payloads(10, CRASH_WORLD, big=big)
            manifests = {10: save(store, 10, want10)}
            rc, report, err = run_worker(["save", uri, "20", str(CRASH_WORLD), str(big)], point)
            if point == "after_manifest":
                expected = 20
                want = payloads(20, CRASH_WORLD, big=big, big_ranks=tuple(range(CRASH_WORLD)))
            else:
                expected, want = 10, want10
        assert rc == -9 and report.get("crashed_at") == point, (
            f"worker did not die at {point}: rc={rc} report={report} stderr={err}"
        )
        out.expected_step = expected

        fresh = open_store(uri, retry=FAST_RETRY)
        retries_fresh = _counting(fresh)
        try:
            reader = Reader(fresh)
            got = restore(fresh)
            out.restored_step = got.step
            out.bytes_equal = got.shards == want
            own = (got.manifest.step, got.manifest.attempt)
            assert all(parse_shard_key(r.key)[:2] == own for r in got.manifest.shards), (
                "shards of attempts mixed"
            )
            assert got.step == expected, f"restored step {got.step}, expected {expected}"
            assert out.bytes_equal, f"step {got.step} restored with different bytes"
            pointer = reader.pointer()
            if point == "after_manifest":
                # the crash lost the pointer update: LATEST still names 10, resolution rolls forward
                assert pointer is not None and pointer.step == 10, f"pointer {pointer}"
                assert got.manifest.attempt == report["attempt"]
                out.detail = "rolled forward past LATEST=10 to the committed manifest 20"

            # What the crash left behind, then the sweep.
            if point == "gc_between_deletes":
                doomed = [(s, manifests[s].attempt) for s in (10, 20)]
                assert report.get("deleted_first") == [manifest_key(10), manifest_key(20)], report
                for s, _ in doomed:
                    assert not list(fresh.list(manifest_key(s))), f"manifest {s} survived GC"
                left = {s: attempt_keys(fresh, s, a) for s, a in doomed}
                assert all(left.values()), "shards were deleted with the manifests: crash point missed"
                out.extra["left_behind"] = sum(len(v) for v in left.values())
            else:
                doomed = [] if point == "after_manifest" else [(20, report["attempt"])]
                left = {s: attempt_keys(fresh, s, a) for s, a in doomed}
                out.extra["left_behind"] = sum(len(v) for v in left.values())
            pending = _uploads(fresh)
            out.extra["pending_uploads"] = len(pending)
            if point in ("mid_part_upload", "before_complete"):
                assert pending, "the killed multipart upload should be pending"

            keep = 1 if point == "gc_between_deletes" else 10
            now = after_grace()
            plan = plan_gc(fresh, RetentionPolicy(keep_last=keep), grace_period=GRACE, now=now)
            orphan_attempts = {(o.step, o.attempt) for o in plan.orphans}
            for s, a in doomed:
                if left.get(s):
                    assert (s, a) in orphan_attempts, (
                        f"GC did not plan to sweep step {s} attempt {a}: {plan.describe()}"
                    )
            assert not plan.manifests, f"GC would delete a committed step: {plan.describe()}"
            run_gc(fresh, plan)
            swept = all(not attempt_keys(fresh, s, a) for s, a in doomed) and not _uploads(fresh)
            out.orphans_swept = swept
            assert swept, (
                f"left after GC: {[attempt_keys(fresh, s, a) for s, a in doomed]}, uploads {_uploads(fresh)}"
            )
            again = restore(fresh)
            assert again.step == expected and again.shards == want, "GC damaged the committed state"
            out.retries = retries[0] + retries_fresh[0]
        finally:
            fresh.close()
    finally:
        store.close()
    return out


# ---------------------------------------------------------------------------------- corruption


def _local_path(uri: str, key: str) -> str:
    root = uri.split("://", 1)[1].split("?", 1)[0]
    return os.path.join(root, key)


def corruption_scenario(leg: Leg, kind: str) -> Outcome:
    """Commit 10 then 20, corrupt 20 in one way; the restore must detect it and fall back to 10
    (bit for bit), saying why -- except a corrupt LATEST, which only costs the O(1) hint: the
    reader lists ``manifests/`` and still restores 20."""
    uri, store = leg.new_root()
    out = Outcome(f"corrupt:{kind}", leg.name)
    try:
        p10 = payloads(10, 2)
        p20 = payloads(20, 2)
        save(store, 10, p10)
        m20 = save(store, 20, p20)
        victim = m20.shard(1, "state.bin")
        data = store.get(victim.key)
        if kind == "flip_byte":
            flipped = bytearray(data)
            flipped[len(flipped) // 2] ^= 0x01
            if leg.name == "file":
                # Bit rot: same size, same mtime, same xattr CRC -- the version token and the HEAD
                # check still match, so only the CRC32C verified while streaming can catch it.
                path = _local_path(uri, victim.key)
                st = os.stat(path)
                with open(path, "r+b") as f:
                    f.seek(len(flipped) // 2)
                    f.write(flipped[len(flipped) // 2 : len(flipped) // 2 + 1])
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                store.put(victim.key, bytes(flipped), mode=PutMode.OVERWRITE)
        elif kind == "truncate_shard":
            if leg.name == "file":
                os.truncate(_local_path(uri, victim.key), len(data) - 100)
            else:
                store.put(victim.key, data[:-100], mode=PutMode.OVERWRITE)
        elif kind == "delete_shard":
            store.delete([victim.key])
        elif kind == "swap_manifest":
            store.put(manifest_key(20), store.get(manifest_key(10)), mode=PutMode.OVERWRITE)
        elif kind == "corrupt_latest":
            store.put(
                POINTER_KEY, b'{"format": "objckpt.pointer", "step": 20, "garbage', mode=PutMode.OVERWRITE
            )
        else:
            raise ValueError(kind)

        fresh = open_store(uri, retry=FAST_RETRY)
        try:
            with captured_warnings() as warnings:
                got = restore(fresh)
            expected, want = (20, p20) if kind == "corrupt_latest" else (10, p10)
            out.expected_step = expected
            out.restored_step = got.step
            out.bytes_equal = got.shards == want
            loud = [w for w in warnings if ("20" in w or POINTER_KEY in w)]
            out.detail = loud[0][:160] if loud else "(no warning)"
            assert got.step == expected and out.bytes_equal, f"restored {got.step}, expected {expected}"
            assert loud, f"the fallback was silent; warnings: {warnings}"
            if kind in ("flip_byte", "truncate_shard", "delete_shard"):
                assert any(victim.key in w for w in warnings), f"no warning names {victim.key}: {warnings}"
        finally:
            fresh.close()
    finally:
        store.close()
    return out


# ---------------------------------------------------------------------------------- chaos

CHAOS_PART = 5 * 1024 * 1024  # S3's real minimum part size: moto runs with its default limits
CHAOS_FAULT_RATE = 0.08  # >= 5% of all requests broken, every kind, both phases


@dataclass
class ChaosLeg:
    """One backend behind a chaos proxy. ``store()`` opens a new run root through the proxy."""

    name: str
    proxy: Any  # ChaosProxy
    open: Any  # prefix -> Store
    #: (method, path fragment) of the request that writes a small object create-if-absent
    small_put: tuple[str, str | None]
    #: (method, path fragment) of the request that publishes a multipart/composite object
    complete: tuple[str, str]
    retries: list[tuple[str, int]] = field(default_factory=list)

    def store(self, prefix: str | None = None) -> Store:
        """A store on a new run root (or on ``prefix``), its retries recorded in ``retries``."""
        import uuid

        s = self.open(prefix or f"chaos-{uuid.uuid4().hex[:10]}")
        s.add_retry_listener(lambda exc, n: self.retries.append((repr(exc)[:200], n)))
        return s

    def reopen(self, store: Store) -> Store:
        """A second, independent store on ``store``'s run root (what a restarted job opens)."""
        return self.store(store.location.split("/", 3)[3])  # scheme://bucket/PREFIX


@contextlib.contextmanager
def chaos_leg(
    name: str, server: Any, bucket: str, *, seed: int, fault_rate: float = CHAOS_FAULT_RATE
) -> Iterator[ChaosLeg]:
    """``name`` is ``s3`` (``server``: a MotoServer) or ``gcs`` (a FakeGcsServer); ``bucket``
    must exist. The proxy stops when the block ends."""
    from objckpt.testing.chaos_proxy import ChaosProxy

    with ChaosProxy(
        server.endpoint_url,
        fault_rate=fault_rate,
        seed=seed,
        flavor="s3" if name == "s3" else "gcs",
        latency=(0.01, 0.1),
    ) as proxy:
        if name == "s3":
            opts = {**server.store_options, "endpoint_url": proxy.endpoint_url}
            yield ChaosLeg(
                "s3",
                proxy,
                lambda prefix: open_store(
                    f"s3://{bucket}/{prefix}", **opts, part_size=CHAOS_PART, retry=FAST_RETRY
                ),
                small_put=("PUT", None),
                complete=("POST", "uploadId="),
            )
        else:
            yield ChaosLeg(
                "gcs",
                proxy,
                lambda prefix: open_store(
                    f"gs://{bucket}/{prefix}",
                    endpoint_url=proxy.endpoint_url,
                    part_size=CHAOS_PART,
                    retry=FAST_RETRY,
                ),
                small_put=("POST", "uploadType=multipart"),
                complete=("POST", "/compose"),
            )


def _chaos_outcome(leg: ChaosLeg, scenario: str, **kw: Any) -> Outcome:
    stats = leg.proxy.stats
    out = Outcome(scenario, leg.name, retries=len(leg.retries), **kw)
    out.extra["faults"] = leg.proxy.faults
    out.extra["requests"] = stats["requests"]
    out.extra["kinds"] = {k: v for k, v in stats.items() if ":" in k and v}
    return out


def _chunks(data: bytes, size: int = 1024 * 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


def chaos_multipart(leg: ChaosLeg) -> Outcome:
    """3 x 5 MiB parts up and down (get and get_stream) byte-identical, with faults that fired."""
    import random

    store = leg.store()
    data = random.Random(7).randbytes(3 * CHAOS_PART)
    # Make sure the interesting cases fire at least once on top of the random ones: a part whose
    # response is lost (uploaded twice), and a download cut mid-body (get_stream must resume).
    leg.proxy.inject(
        "reset",
        phase="after",
        method="PUT" if leg.name == "s3" else "POST",
        path_contains="partNumber=2" if leg.name == "s3" else "upload",
    )
    leg.proxy.inject(
        "truncate", phase="after", method="GET", path_contains="alt=media" if leg.name == "gcs" else "/big"
    )
    try:
        meta = store.put_stream("big", _chunks(data))
        assert meta.size == len(data) and store.head("big").size == len(data)
        equal = store.get("big") == data
        streamed = b"".join(store.get_stream("big", expected_size=len(data), expected_crc32c=meta.crc32c))
        equal = equal and streamed == data
        equal = (
            equal
            and store.get("big", byte_range=(CHAOS_PART - 3, CHAOS_PART + 5))
            == data[CHAOS_PART - 3 : CHAOS_PART + 5]
        )
        assert equal, "bytes differ after the round trip"
        if leg.name == "s3":
            # completed: nothing pending (GCS may leave a temporary part whose delete failed
            # under the faults; that is documented as left for GC)
            assert store.list_uploads("") == []
    finally:
        store.close()
    assert leg.proxy.faults > 0, leg.proxy.stats
    assert len(leg.retries) > 0, leg.proxy.stats
    return _chaos_outcome(leg, "chaos:multipart 3x5MiB", bytes_equal=equal)


def chaos_protocol(leg: ChaosLeg) -> Outcome:
    """Two saves (4 ranks in threads, multipart shards) commit and restore bit for bit through
    the faults, from a second store (a restarted job); LATEST ends on the newer step."""
    store = leg.store()
    try:
        p10 = payloads(10, 4, big=2 * CHAOS_PART + 123)
        p20 = payloads(20, 4, big=CHAOS_PART + 7, big_ranks=(1, 3))
        save(store, 10, p10)
        m20 = save(store, 20, p20)
        assert m20.parent == 10
        fresh = leg.reopen(store)
        try:
            got = restore(fresh)
            assert got.step == 20 and got.rejected == [], got.rejected
            equal = got.shards == p20
            assert equal, "restored bytes differ"
            latest = Reader(fresh).latest()
            assert latest is not None and latest.attempt == m20.attempt
            pointer = Reader(fresh).pointer()
            assert pointer is not None and pointer.step == 20
        finally:
            fresh.close()
    finally:
        store.close()
    assert leg.proxy.faults > 0, leg.proxy.stats
    assert len(leg.retries) > 0, (leg.proxy.stats, leg.proxy.injections)
    return _chaos_outcome(
        leg, "chaos:save+commit+restore, 4 ranks", restored_step=20, expected_step=20, bytes_equal=equal
    )


def chaos_lost_manifest(leg: ChaosLeg, kind: str) -> Outcome:
    """The manifest's create-if-absent write is applied but its response lost (``reset``, or
    replaced by a 503 ``slowdown``): the retry meets the manifest it just wrote. The commit must
    return that same manifest, not raise CommitConflict, and exactly one manifest must exist."""
    from objckpt.commit import Coordinator
    from objckpt.layout import new_attempt_id
    from objckpt.manifest import Manifest

    from .harness import write_rank

    leg.proxy.set_fault_rate(0.0)  # only the targeted fault: the outcome must be exact
    store = leg.store()
    try:
        p = payloads(30, 2)
        attempt = new_attempt_id()
        reports = {r: write_rank(store, 30, attempt, r, p[r]) for r in p}
        method, fragment = leg.small_put
        # After the shards, the manifest is the next small create-if-absent write.
        leg.proxy.inject(
            kind, phase="after", method=method, path_contains="/manifests/" if leg.name == "s3" else fragment
        )
        m = Coordinator(store, world_size=2).commit(30, attempt, reports)
        assert leg.proxy.pending_injections() == 0 and leg.proxy.stats[f"{kind}:after"] == 1
        assert m.attempt == attempt and m.step == 30
        stored = Manifest.decode(store.get(manifest_key(30)), key=manifest_key(30))
        assert stored == m, "the stored manifest is not the one the commit returned"
        assert [k.key for k in store.list("manifests/")] == [manifest_key(30)]
        got = restore(store)
        equal = got.shards == p
        assert got.step == 30 and equal
    finally:
        leg.proxy.set_fault_rate(CHAOS_FAULT_RATE)
        store.close()
    assert len(leg.retries) > 0
    return _chaos_outcome(
        leg, f"chaos:lost manifest response ({kind})", restored_step=30, expected_step=30, bytes_equal=equal
    )


def chaos_lost_shard(leg: ChaosLeg, which: str) -> Outcome:
    """A shard's create-if-absent write -- one request (``small_put``) or the multipart
    completion (``complete``) -- is applied but its response lost; the retry meets the shard it
    wrote itself. The save must still commit and restore bit for bit."""
    leg.proxy.set_fault_rate(0.0)
    store = leg.store()
    try:
        p = payloads(40, 1, big=CHAOS_PART + 11)
        method, fragment = getattr(leg, which)
        if which == "small_put" and leg.name == "s3":
            fragment = "/state.bin"
        leg.proxy.inject("reset", phase="after", method=method, path_contains=fragment)
        m = save(store, 40, p)
        assert leg.proxy.pending_injections() == 0
        got = restore(store)
        equal = got.shards == p
        assert m.step == 40 and got.step == 40 and equal
    finally:
        leg.proxy.set_fault_rate(CHAOS_FAULT_RATE)
        store.close()
    assert len(leg.retries) > 0
    label = "single PUT" if which == "small_put" else "multipart completion"
    return _chaos_outcome(
        leg, f"chaos:lost shard response ({label})", restored_step=40, expected_step=40, bytes_equal=equal
    )


def chaos_read_path(leg: ChaosLeg, rate: float = 0.25) -> Outcome:
    """Resolution and reads (pointer GET, manifests LIST, manifest GET, shard HEAD/GET) at a
    high fault rate: a transient failure is never mistaken for a damaged checkpoint."""
    leg.proxy.set_fault_rate(0.0)
    store = leg.store()
    try:
        p = payloads(50, 3)
        save(store, 50, p)
        leg.proxy.set_fault_rate(rate, kinds=("slowdown", "internal", "reset", "truncate"))
        equal = True
        for _ in range(3):
            got = restore(store)
            assert got.step == 50 and got.rejected == [], got.rejected
            equal = equal and got.shards == p
        assert equal
    finally:
        leg.proxy.set_fault_rate(CHAOS_FAULT_RATE)
        store.close()
    assert leg.proxy.faults > 0 and len(leg.retries) > 0
    return _chaos_outcome(
        leg, f"chaos:restore x3 at {rate:.0%} faults", restored_step=50, expected_step=50, bytes_equal=equal
    )
