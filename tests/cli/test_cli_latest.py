""" "Latest" means the newest valid checkpoint in every command (ls, show, latest, verify, cp),
with the damaged newer ones shown as such; an outage is never taken for damage."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from objckpt.errors import TransientError
from objckpt.reader import Reader
from objckpt.store import open_store
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import Fault, FaultInjectingStore

from .conftest import commit_step, run_cli


def _path(uri: str, key: str) -> Path:
    return Path(uri.removeprefix("file://")) / key


@pytest.fixture
def damaged(file_root):
    """Steps 10..40 committed; one shard of the newest (40, LATEST's target) overwritten with
    other bytes of the same size, so its version no longer matches the receipt."""
    uri, store = file_root
    ms = {s: commit_step(store, s) for s in (10, 20, 30, 40)}
    bad = ms[40].shards[1]
    path = _path(uri, bad.key)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return uri, store, ms, bad


def _rows(out: str) -> dict[str, str]:
    return {ln.split()[0]: ln for ln in out.splitlines() if ln.strip()[:2].isdigit()}


def test_latest_ls_show_agree_on_the_newest_valid(damaged):
    uri, _, _, bad = damaged
    r = run_cli("latest", uri)
    assert (r.rc, r.out.strip()) == (0, "30"), r.err
    assert "skipped damaged checkpoint step 40" in r.err

    r = run_cli("ls", uri)
    assert r.rc == 0, r.err
    rows = _rows(r.out)
    assert "<- LATEST" in rows["30"] and "<- LATEST" not in rows["40"]
    assert "DAMAGED:" in rows["40"] and bad.key in rows["40"]
    assert "(LATEST pointer)" in rows["40"]  # the pointer still names 40: said, not followed
    d = run_cli("ls", uri, "--json").json()
    assert d["latest"] == 30 and d["pointer"]["step"] == 40
    by_step = {c["step"]: c for c in d["checkpoints"]}
    assert by_step[40]["damaged"] and by_step[40]["pointer"] and not by_step[40]["latest"]
    assert by_step[30]["latest"] and by_step[30]["damaged"] is None
    assert [s["step"] for s in d["skipped"]] == [40]
    assert [p["key"] for p in d["skipped"][0]["problems"]] == [bad.key]

    for target in (uri, f"{uri}@latest"):
        sh = run_cli("show", target, "--json").json()
        assert sh["step"] == 30 and [s["step"] for s in sh["skipped"]] == [40]
    r = run_cli("show", uri)
    assert r.rc == 0 and "skipped damaged checkpoint step 40" in r.err
    assert run_cli("show", f"{uri}@40", "--json").json()["step"] == 40  # named: shown as is


def test_cp_copies_the_newest_valid_and_says_what_it_skipped(damaged, tmp_path):
    uri, _, ms, _ = damaged
    dst = f"file://{tmp_path}/replica"
    r = run_cli("cp", uri, dst)
    assert r.rc == 0, r.err  # before: CRC32C mismatch copying 40
    assert "copied step 30" in r.out
    assert "skipped damaged checkpoint step 40" in r.err
    replica = Reader(open_store(dst))
    assert replica.steps() == [30]
    assert replica.latest().metadata["replicated_from"]["attempt"] == ms[30].attempt
    d = run_cli("cp", uri, f"file://{tmp_path}/again", "--json")
    assert d.rc == 0, d.err
    assert [s["step"] for s in d.json()["steps"]] == [30]
    assert [s["step"] for s in d.json()["skipped"]] == [40]


def test_verify_checks_the_newest_valid_and_reports_the_damaged_one(damaged):
    uri, _, _, bad = damaged
    r = run_cli("verify", uri)
    assert r.rc == 1
    assert "step 30: OK" in r.out and "step 40: DAMAGED" in r.out and bad.key in r.out
    d = run_cli("verify", uri, "--json").json()
    by_step = {s["step"]: s for s in d["steps"]}
    assert by_step[30]["ok"] and not by_step[40]["ok"] and by_step[40]["skipped"]
    assert d["error"]["exit_code"] == 1


def test_invalid_newer_manifest_is_reported_as_skipped(file_root):
    uri, store = file_root
    for s in (1, 2):
        commit_step(store, s, world_size=1, names=("m",), size=10)
    path = _path(uri, "manifests/00000000000000000002.json")
    path.write_bytes(path.read_bytes().replace(b'"epoch":0', b'"epoch":7'))
    d = run_cli("latest", uri, "--json").json()
    assert d["step"] == 1
    assert [(s["step"], s["invalid_manifest"]) for s in d["skipped"]] == [(2, True)]


def test_nothing_valid_exits_3_naming_the_damage(file_root):
    uri, store = file_root
    m = commit_step(store, 5, world_size=1, names=("m",), size=10)
    _path(uri, m.shards[0].key).unlink()
    r = run_cli("latest", uri)
    assert r.rc == 3
    assert "no valid committed checkpoint" in r.err and "step 5" in r.err and m.shards[0].key in r.err


def test_an_outage_is_not_damage():
    """A HEAD that keeps failing (past the retry budget) propagates: no fallback to step 1."""
    from objckpt._retry import RetryPolicy
    from objckpt.cli._latest import resolve_latest

    inner = MemoryStore("outage", retry=RetryPolicy(initial_backoff=0, max_backoff=0, max_attempts=2))
    commit_step(inner, 1, world_size=1, names=("m",), size=10)
    m2 = commit_step(inner, 2, world_size=1, names=("m",), size=10)
    flaky = FaultInjectingStore(
        inner, [Fault(op="head", key=m2.shards[0].key, error=TransientError, times=None)]
    )
    with pytest.raises(TransientError):
        resolve_latest(Reader(flaky))
    res = resolve_latest(Reader(inner))  # without the outage: step 2, nothing skipped
    assert res.step == 2 and res.skipped == []
