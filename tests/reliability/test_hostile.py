"""Hostile and broken inputs: each gets a clear error, and nothing is written or lost.

A missing bucket or denied access must fail at once (no retry storm) with a message naming the
location, and must never look like "no checkpoint yet" (a job would silently start from
scratch). Forged or damaged manifests -- not JSON, an unknown format version, keys escaping the
run root, absurd sizes -- are rejected before a single shard request is made, and the restore
falls back to the parent. A full disk fails the save cleanly, leaving the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from objckpt.commit import Coordinator
from objckpt.errors import (
    CommitConflict,
    CommitError,
    ManifestError,
    NotFoundError,
    PermissionDeniedError,
)
from objckpt.layout import manifest_key, new_attempt_id, parse_shard_key
from objckpt.manifest import Manifest, ShardReceipt, canonical_json
from objckpt.reader import Reader
from objckpt.store import PutMode, Store, open_store
from objckpt.store.wrappers import CountingStore

from .harness import FAST_RETRY, KiB, Leg, file_leg, payloads, restore, save, write_rank
from .scenarios import captured_warnings


def _s3_only(leg: Leg) -> Any:
    server = leg.extra.get("server")
    if server is None:
        pytest.skip(f"{leg.name}: no bucket to get wrong (a file:// run root is created on first write)")
    return server


def _retry_counter(store: Store) -> list[int]:
    box = [0]
    store.add_retry_listener(lambda exc, n: box.__setitem__(0, box[0] + 1))
    return box


# ---------------------------------------------------------------------------------- the store


def test_missing_bucket_is_a_clear_error_not_an_empty_run(mleg: Leg) -> None:
    server = _s3_only(mleg)
    store = open_store(server.uri("no-such-bucket-objckpt", "run"), retry=FAST_RETRY)
    retries = _retry_counter(store)
    try:
        with pytest.raises(NotFoundError, match="no-such-bucket-objckpt"):
            Reader(store).latest()  # never None: "nothing committed" would restart from scratch
        with pytest.raises(CommitError) as info:
            save(store, 10, payloads(10, 2))
        assert set(info.value.failures) == {0, 1}
        assert all("no-such-bucket-objckpt" in why for why in info.value.failures.values())
        with pytest.raises(NotFoundError):
            list(store.list(""))
        assert retries[0] == 0, "a missing bucket is permanent: it must not be retried"
    finally:
        store.close()


@pytest.fixture(scope="module")
def auth_moto() -> Iterator[Any]:
    """A moto server that enforces authentication (``INITIAL_NO_AUTH_ACTION_COUNT=0``): our
    dummy credentials are unknown to it, so every request is denied with 403."""
    from objckpt.testing.s3_servers import MotoServer, ServerStartError

    class AuthMoto(MotoServer):
        def _env(self) -> dict[str, str]:
            return {**super()._env(), "INITIAL_NO_AUTH_ACTION_COUNT": "0"}

    srv = AuthMoto()
    try:
        srv.start()
    except ServerStartError as exc:
        pytest.skip(f"moto server unavailable: {exc}")
    try:
        yield srv
    finally:
        srv.stop()


def test_access_denied_is_permanent_and_writes_nothing(auth_moto: Any) -> None:
    """moto with authentication enforced rejects our (unknown) credentials with 403. LocalStack
    (community) and file:// as root enforce no permissions, so this runs on moto only."""
    store = open_store(auth_moto.uri("denied-bucket", "run"), retry=FAST_RETRY)
    retries = _retry_counter(store)
    try:
        with pytest.raises(PermissionDeniedError, match=r"s3://denied-bucket/run"):
            Reader(store).latest()
        with pytest.raises(CommitError) as info:
            save(store, 10, payloads(10, 2, big=0))
        assert all("access denied" in why for why in info.value.failures.values()), info.value
        assert retries[0] == 0
    finally:
        store.close()
    with urllib.request.urlopen(f"{auth_moto.endpoint_url}/moto-api/data.json", timeout=10) as resp:
        state = json.load(resp)["s3"]
    assert state["FakeKey"] == [] and state["FakeMultipart"] == [] and state["FakeBucket"] == []


# ---------------------------------------------------------------------------------- manifests


@pytest.fixture
def committed(mleg: Leg) -> Iterator[tuple[Leg, str, Store, dict[int, Any]]]:
    """A run root with steps 10 and 20 committed."""
    uri, store = mleg.new_root()
    try:
        ms = {s: save(store, s, payloads(s, 2)) for s in (10, 20)}
        yield mleg, uri, store, ms
    finally:
        store.close()


def _forge(m: Manifest, **changes: Any) -> bytes:
    """``m`` with fields changed and its self-checksum recomputed: a well-formed forgery."""
    body = m.body()
    for path, value in changes.items():
        target = body
        *parents, last = path.split(".")
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        target[int(last) if last.isdigit() else last] = value
    return canonical_json({**body, "checksum": hashlib.sha256(canonical_json(body)).hexdigest()})


def _restore_expecting_parent(uri: str, reason: str) -> list[tuple[str, str]]:
    """Restore from a fresh store: must be step 10 bit for bit, with a warning matching
    ``reason``. Returns the store calls made (op, key), to check nothing hostile was fetched."""
    fresh = CountingStore(open_store(uri, retry=FAST_RETRY))
    try:
        with captured_warnings() as warnings:
            got = restore(fresh)
        assert got.step == 10 and got.shards == payloads(10, 2)
        assert any(reason in w for w in warnings), warnings
        return list(fresh.calls)
    finally:
        fresh.close()


def test_manifest_that_is_not_json(committed: Any) -> None:
    leg, uri, store, ms = committed
    store.put(manifest_key(20), b"\x00\xff{not json", mode=PutMode.OVERWRITE)
    _restore_expecting_parent(uri, "not JSON")
    # A coordinator committing step 20 again must not overwrite what it cannot read.
    p = payloads(20, 2, salt="retry")
    att = new_attempt_id()
    reports = {r: write_rank(store, 20, att, r, p[r]) for r in p}
    with pytest.raises(CommitConflict, match="not a valid manifest"):
        Coordinator(store, world_size=2).commit(20, att, reports)
    assert store.get(manifest_key(20)) == b"\x00\xff{not json"


def test_unknown_format_version(committed: Any) -> None:
    leg, uri, store, ms = committed
    store.put(manifest_key(20), _forge(ms[20], format_version=99), mode=PutMode.OVERWRITE)
    with pytest.raises(ManifestError, match="format_version 99"):
        Reader(store).load(20)
    _restore_expecting_parent(uri, "format_version 99")


@pytest.mark.parametrize(
    "bad_key",
    [
        "../../escape/data/x",
        "/etc/passwd",
        "s3://other-bucket/run/data/x",
        "data/00000000000000000020-0000000000000000/../../../x",
        "data\\..\\..\\x",
    ],
)
def test_shard_keys_escaping_the_run_root(committed: Any, bad_key: str) -> None:
    leg, uri, store, ms = committed
    store.put(manifest_key(20), _forge(ms[20], **{"shards.0.key": bad_key}), mode=PutMode.OVERWRITE)
    with pytest.raises(ManifestError) as info:
        Reader(store).load(20)
    assert "manifests/00000000000000000020.json" in str(info.value)
    calls = _restore_expecting_parent(uri, "manifests/00000000000000000020.json")
    assert not any(bad_key in key or "other-bucket" in key for _, key in calls), calls
    with pytest.raises(ValueError):  # nor can such a receipt be built to read from
        ShardReceipt(key=bad_key, size=1, version="v", crc32c="AAAAAA==", rank=0, name="x")


@pytest.mark.parametrize(
    "field,value,reason",
    [
        ("shards.0.size", 2**62, "size"),
        ("shards.0.size", -1, "size"),
        ("shards.0.size", 10**12, "receipt says"),  # in range, but not what the store holds
        ("shards.0.parts", 10**9, "parts"),
        ("world_size", 10**9, "world_size"),
        ("step", 10**21, "step"),
    ],
)
def test_absurd_sizes(committed: Any, field: str, value: int, reason: str) -> None:
    leg, uri, store, ms = committed
    store.put(manifest_key(20), _forge(ms[20], **{field: value}), mode=PutMode.OVERWRITE)
    calls = _restore_expecting_parent(uri, reason)
    # Never a download of a shard of the forged step (a HEAD may run for an in-range size).
    assert not any(op in ("get", "open") and (parse_shard_key(key) or (0,))[0] == 20 for op, key in calls)


# ---------------------------------------------------------------------------------- disk full


@contextlib.contextmanager
def _small_disk(path: str, size: str = "1m") -> Iterator[bool]:
    """A tmpfs of ``size`` at ``path`` when this process may mount (root in a container that
    allows it); yields False when it cannot, and the caller simulates ENOSPC instead."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        yield False
        return
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", path], capture_output=True, timeout=30)


def test_full_disk_fails_the_save_and_keeps_the_last_checkpoint(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _small_disk(str(tmp_path / "disk")) as mounted:
        leg = file_leg(str(tmp_path / "disk"))
        uri, store = leg.new_root(part_size=64 * KiB)
        try:
            p10 = payloads(10, 2)
            save(store, 10, p10)
            if not mounted:  # no tmpfs here: every write past this point hits ENOSPC
                real = os.pwrite, os.write

                def full(*a: Any, **k: Any) -> Any:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

                monkeypatch.setattr(os, "pwrite", full)
                monkeypatch.setattr(os, "write", full)
            attempt = new_attempt_id()
            with pytest.raises(CommitError) as info:
                save(store, 20, payloads(20, 2, big=3 * 1024 * KiB, big_ranks=(0, 1)), attempt=attempt)
            if not mounted:
                monkeypatch.setattr(os, "pwrite", real[0])
                monkeypatch.setattr(os, "write", real[1])
            assert any("full" in why.lower() for why in info.value.failures.values()), info.value
            big_keys = [
                k.key
                for k in store.list("data/")
                if (parse_shard_key(k.key) or ())[:2] == (20, attempt) and k.key.endswith("big.bin")
            ]
            assert big_keys == [], "a partial shard became visible"
            assert store.list_uploads("") == [], "the failed upload left its staging file"
            assert not list(store.list(manifest_key(20)))
            got = restore(store)
            assert got.step == 10 and got.shards == p10
        finally:
            store.close()
    if not mounted:
        pytest.skip("could not mount a tmpfs here; ran with a simulated ENOSPC instead")
