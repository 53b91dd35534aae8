"""``ls`` / ``runs`` on a prefix that holds run roots, and ``rm ROOT@STEP``."""

from __future__ import annotations

from pathlib import Path

import pytest

from objckpt.layout import manifest_key
from objckpt.reader import Reader
from objckpt.store import open_store

from .conftest import commit_step, run_cli


@pytest.fixture
def tree(tmp_path):
    """runs/a (10, 20); runs/team/b (5, and 6 with a missing shard); runs/team/c/deep/x (too
    deep for the default depth); runs/d (only an uncommitted save's data, no manifests/)."""
    base = f"file://{tmp_path}/runs"
    a = open_store(f"{base}/a")
    for s in (10, 20):
        commit_step(a, s, world_size=1, names=("m",), size=10)
    b = open_store(f"{base}/team/b")
    commit_step(b, 5, world_size=1, names=("m",), size=10)
    m6 = commit_step(b, 6, world_size=1, names=("m",), size=10)
    (tmp_path / "runs/team/b" / m6.shards[0].key).unlink()
    commit_step(open_store(f"{base}/team/c/deep/x"), 1, world_size=1, names=("m",), size=10)
    open_store(f"{base}/d").put("data/00000000000000000001-0123456789abcdef/rank-0/m", b"x")
    return base


def test_ls_on_a_parent_lists_the_run_roots(tree):
    r = run_cli("ls", tree)
    assert r.rc == 0, r.err
    assert "no committed checkpoints" in r.out
    assert f"{tree}/a" in r.out and f"{tree}/team/b" in r.out
    assert "deep" not in r.out and f"{tree}/d" not in r.out
    d = run_cli("ls", tree, "--json").json()
    assert d["checkpoints"] == []
    assert {x["root"]: x["head_step"] for x in d["run_roots"]} == {f"{tree}/a": 20, f"{tree}/team/b": 6}
    assert {x["source"] for x in d["run_roots"]} == {"LATEST pointer"}


def test_runs_lists_roots_with_head_step_source_and_age(tree):
    d = run_cli("runs", tree, "--json").json()
    assert d["depth"] == 2 and d["shards_checked"] is True
    runs = {x["root"]: x for x in d["runs"]}
    assert set(runs) == {f"{tree}/a", f"{tree}/team/b"}
    assert runs[f"{tree}/a"]["head_step"] == 20 and runs[f"{tree}/a"]["source"] == "newest valid"
    b = runs[f"{tree}/team/b"]
    assert (b["head_step"], b["pointer_step"], b["skipped"]) == (5, 6, [6])  # 6 is damaged
    assert b["age_seconds"] is not None and b["created_at"]

    fast = {x["root"]: x for x in run_cli("runs", tree, "--no-check-shards", "--json").json()["runs"]}
    assert fast[f"{tree}/team/b"]["head_step"] == 6 and fast[f"{tree}/team/b"]["source"] == "LATEST pointer"

    deep = run_cli("runs", tree, "--depth", "4", "--json").json()["runs"]
    assert f"{tree}/team/c/deep/x" in {x["root"] for x in deep}
    assert [x["root"] for x in run_cli("runs", tree, "--depth", "1", "--json").json()["runs"]] == [
        f"{tree}/a"
    ]

    r = run_cli("runs", tree)
    assert r.rc == 0, r.err
    line = next(ln for ln in r.out.splitlines() if ln.startswith(f"{tree}/team/b"))
    assert line.split()[1:4] == ["5", "newest", "valid"] and "skipped damaged step(s) 6" in line
    assert run_cli("runs", f"{tree}@3").rc == 2


def test_discovery_never_lists_data(tree, monkeypatch, capsys):
    from objckpt import cli
    from objckpt.store.wrappers import CountingStore

    seen = []
    real_open = cli._open

    def counting_open(u, options):
        s = CountingStore(real_open(u, options))
        seen.append(s)
        return s

    monkeypatch.setattr(cli, "_open", counting_open)
    assert cli.main(["runs", tree, "--depth", "4", "--json"]) == 0
    calls = [c for s in seen for c in s.calls]
    listed = [key for op, key in calls if op in ("list_page", "list_prefixes")]
    assert listed and not [k for k in listed if "data/" in k], listed
    # a run root's own prefixes are never searched for run roots
    own = ("manifests/", "timelines/", "quarantine/")
    assert not [k for op, k in calls if op == "list_prefixes" and k.endswith(own)], calls
    # object listings only of manifests/ and timelines/ (the reader's bounded LISTs), never
    # anything else
    assert all(k.endswith(("manifests/", "timelines/")) for op, k in calls if op == "list_page"), calls


def test_runs_on_an_empty_prefix(tmp_path):
    r = run_cli("runs", f"file://{tmp_path}/nothing")
    assert r.rc == 0 and "no run roots" in r.out
    assert run_cli("runs", f"file://{tmp_path}/nothing", "--json").json()["runs"] == []


# ------------------------------------------------------------------------------ rm


@pytest.fixture
def committed(file_root):
    uri, store = file_root
    return uri, store, {s: commit_step(store, s) for s in (10, 20, 30)}


def _exists(uri: str, key: str) -> bool:
    return (Path(uri.removeprefix("file://")) / key).exists()


def test_rm_refuses_the_head_pointer_target_and_newest_valid(committed):
    uri, store, _ = committed
    r = run_cli("rm", f"{uri}@30")
    assert r.rc == 1
    for why in ("newest committed step", "target of LATEST", "newest valid checkpoint", "--force"):
        assert why in r.err
    assert Reader(store).steps() == [10, 20, 30]
    assert run_cli("rm", f"{uri}@30", "--dry-run").rc == 1
    assert run_cli("rm", uri).rc == 2  # no step
    r = run_cli("rm", f"{uri}@25")
    assert r.rc == 3 and "step 25" in r.err


def test_rm_dry_run_then_delete_one_step(committed):
    uri, store, ms = committed
    r = run_cli("rm", f"{uri}@20", "--dry-run")
    assert r.rc == 0, r.err
    assert "dry run" in r.out and "delete step 20" in r.out and "keep step" not in r.out
    assert Reader(store).steps() == [10, 20, 30]
    d = run_cli("rm", f"{uri}@20", "--json")
    assert d.rc == 0, d.err
    assert d.json()["result"]["deleted_manifests"] == [manifest_key(20)]
    assert d.json()["result"]["deleted_objects"] == len(ms[20].shards)
    assert Reader(store).steps() == [10, 30]
    assert not any(_exists(uri, s.key) for s in ms[20].shards)
    assert all(_exists(uri, s.key) for s in ms[10].shards + ms[30].shards)
    assert run_cli("verify", uri, "--all").rc == 0


def test_rm_deletes_the_manifest_before_its_shards(committed, monkeypatch, capsys):
    from objckpt import cli
    from objckpt.store.wrappers import CountingStore

    uri, _, ms = committed
    seen = []
    real_open = cli._open
    monkeypatch.setattr(cli, "_open", lambda u, o: seen.append(CountingStore(real_open(u, o))) or seen[-1])
    assert cli.main(["rm", f"{uri}@10"]) == 0
    deleted = [key for op, key in seen[0].calls if op == "delete_batch"]
    assert deleted[0] == manifest_key(10)
    assert set(deleted[1:]) == {s.key for s in ms[10].shards}


def test_rm_force_deletes_the_head_and_latest_falls_back(committed):
    uri, store, ms = committed
    r = run_cli("rm", f"{uri}@30", "--force")
    assert r.rc == 0, r.err
    assert "forced: it is the target of LATEST" in r.out
    assert Reader(store).steps() == [10, 20]
    assert not any(_exists(uri, s.key) for s in ms[30].shards)
    assert run_cli("latest", uri).out.strip() == "20"
