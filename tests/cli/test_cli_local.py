"""The real ``objckpt`` console script against file:// run roots (subprocess per command)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from objckpt.layout import manifest_key
from objckpt.reader import Reader

from .conftest import commit_step, run_cli, shard_bytes


@pytest.fixture
def committed(file_root):
    """A file:// root with steps 10, 20, 30 committed (2 ranks x 2 shards each)."""
    uri, store = file_root
    manifests = {s: commit_step(store, s) for s in (10, 20, 30)}
    return uri, store, manifests


def _path(uri: str, key: str) -> Path:
    return Path(uri.removeprefix("file://")) / key


# ------------------------------------------------------------------------------ help / usage


def test_help_documents_commands_and_exit_codes():
    r = run_cli("--help")
    assert r.rc == 0
    for word in (
        "ls",
        "show",
        "latest",
        "verify",
        "gc",
        "cp",
        "plan",
        "demo",
        "exit codes",
        "verification or commit failure",
        "not found",
        "store or permission error",
    ):
        assert word in r.out
    for sub in ("ls", "show", "latest", "verify", "gc", "cp", "plan"):
        r = run_cli(sub, "--help")
        assert r.rc == 0 and "usage: objckpt " + sub in r.out


def test_no_command_is_usage_error():
    assert run_cli().rc == 2


@pytest.mark.parametrize(
    "args, needle",
    [
        (("ls", "not-a-uri"), "not a run-root URI"),
        (("ls", "ftp://host/x"), "unsupported URI scheme"),
        (("ls", "file://relative/path"), "file://"),
        (("show", "file:///tmp/x@abc"), "bad step"),
        (("ls", "file:///tmp/x?bogus=1"), "unknown option"),
        (("gc", "file:///tmp/x", "--keep-last", "2", "--grace", "soon"), "not a duration"),
        (("plan",), "--save"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(args, needle):
    r = run_cli(*args)
    assert r.rc == 2, r
    assert needle in r.err
    assert "Traceback" not in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_secrets_are_never_printed():
    r = run_cli("ls", "s3://BAD_Bucket/run?secret_access_key=SUPERSECRET123&access_key_id=AKIAXYZ")
    assert r.rc == 2
    assert "SUPERSECRET123" not in r.err + r.out
    assert "AKIAXYZ" not in r.err + r.out
    assert "invalid bucket name" in r.err


def test_debug_shows_traceback_but_still_redacts():
    r = run_cli("--debug", "ls", "s3://BAD_Bucket/run?secret_access_key=SUPERSECRET123")
    assert r.rc == 2
    assert "Traceback" in r.err
    assert "SUPERSECRET123" not in r.err


# ------------------------------------------------------------------------------ ls / show / latest


def test_ls_lists_committed_steps_and_pointer(committed):
    uri, _, manifests = committed
    r = run_cli("ls", uri)
    assert r.rc == 0, r.err
    lines = [ln for ln in r.out.splitlines() if ln.strip()[:2].isdigit()]
    assert [ln.split()[0] for ln in lines] == ["10", "20", "30"]
    assert "LATEST" in lines[-1] and "LATEST" not in lines[0]
    assert manifests[30].attempt in lines[-1]
    assert "11.7 KiB" in lines[0]

    data = run_cli("ls", uri, "--json").json()
    pointer = data["pointer"]  # revision 2 adds the pointer's timeline and manifest key
    assert {k: pointer[k] for k in ("step", "attempt")} == {"step": 30, "attempt": manifests[30].attempt}
    assert (pointer["timeline"], pointer["manifest"]) == (0, manifest_key(30))
    assert data["latest"] == 30
    rows = {c["step"]: c for c in data["checkpoints"]}
    assert rows[20]["bytes"] == 4 * 3000 and rows[20]["shards"] == 4 and rows[20]["world_size"] == 2
    assert rows[20]["parent"] == 10 and rows[30]["pointer"] and not rows[10]["pointer"]


def test_ls_reads_manifests_only_never_data(committed, monkeypatch, capsys):
    # In-process so the store can be wrapped and every request seen.
    from objckpt import cli
    from objckpt.store.wrappers import CountingStore

    uri, _, manifests = committed
    seen = []
    real_open = cli._open

    def counting_open(u, options):
        s = CountingStore(real_open(u, options))
        seen.append(s)
        return s

    monkeypatch.setattr(cli, "_open", counting_open)
    assert cli.main(["ls", uri, "--json"]) == 0
    calls = seen[0].calls
    assert calls, "no requests recorded"
    # data/ is never listed: the only data/ requests are the HEAD checks of the shards of the
    # newest valid checkpoint ("<- LATEST" marks the newest valid one).
    data_calls = [c for c in calls if c[1].startswith("data/")]
    assert {op for op, _ in data_calls} <= {"head"}, calls
    assert {key for _, key in data_calls} == {s.key for s in manifests[30].shards}
    assert {op for op, _ in calls} <= {"open", "list_page", "head"}


def test_ls_empty_root(file_root):
    uri, _ = file_root
    r = run_cli("ls", uri)
    assert r.rc == 0 and "no committed checkpoints" in r.out
    assert run_cli("ls", uri, "--json").json()["checkpoints"] == []


def test_ls_flags_invalid_manifest(committed):
    uri, _, _ = committed
    path = _path(uri, manifest_key(20))
    path.write_bytes(path.read_bytes().replace(b'"epoch":0', b'"epoch":9'))
    data = run_cli("ls", uri, "--json").json()
    row = {c["step"]: c for c in data["checkpoints"]}[20]
    assert row["valid"] is False and "checksum" in row["error"]
    r = run_cli("ls", uri)
    assert "INVALID" in r.out


def test_show_latest_and_step(committed):
    uri, _, manifests = committed
    r = run_cli("show", uri)
    assert r.rc == 0, r.err
    fields = dict(ln.split(None, 1) for ln in r.out.splitlines() if ln.strip() and " " in ln.strip())
    assert fields["step"].strip() == "30" and fields["parent"].strip() == "20"
    assert manifests[30].attempt in r.out and "cafef00d" in r.out
    d = run_cli("show", f"{uri}@20", "--json", "--shards").json()
    assert d["step"] == 20 and d["attempt"] == manifests[20].attempt
    # revision 2: the parent names its timeline too
    assert d["parent"] == {"timeline": 0, "step": 10} and d["parent_label"] == "10"
    assert d["timeline"] == 0 and d["world_size"] == 2 and d["shard_count"] == 4
    assert d["total_size"] == 12000 and d["progress"]["global_step"] == 20
    assert {s["name"] for s in d["shards"]} == {"model.pt", "optim.pt"}
    assert "shards" not in run_cli("show", f"{uri}@20", "--json").json()
    r = run_cli("show", f"{uri}@20", "--shards")
    assert manifests[20].shards[0].key in r.out


def test_show_missing_step_exits_3(committed):
    uri, _, _ = committed
    r = run_cli("show", f"{uri}@25")
    assert r.rc == 3
    # @25 may be on any timeline: the error names the step and the root; @t0:25 names one key
    assert "step 25" in r.err and uri in r.err
    r = run_cli("show", f"{uri}@t0:25")
    assert r.rc == 3
    assert "step 25" in r.err and "manifests/00000000000000000025.json" in r.err


def test_latest(committed):
    uri, _, manifests = committed
    r = run_cli("latest", uri)
    assert (r.rc, r.out.strip()) == (0, "30")
    d = run_cli("latest", uri, "--json").json()
    assert d["step"] == 30 and d["attempt"] == manifests[30].attempt and d["pointer_step"] == 30


def test_latest_falls_back_past_a_broken_checkpoint(committed):
    uri, _, manifests = committed
    _path(uri, manifests[30].shards[0].key).unlink()
    assert run_cli("latest", uri).out.strip() == "20"
    assert run_cli("latest", uri, "--no-check-shards").out.strip() == "30"


def test_latest_on_empty_root_exits_3(file_root):
    uri, _ = file_root
    r = run_cli("latest", uri)
    assert r.rc == 3 and "no committed" in r.err and uri in r.err


# ------------------------------------------------------------------------------ verify


def test_verify_ok(committed):
    uri, _, _ = committed
    r = run_cli("verify", uri)
    assert r.rc == 0, r.err
    assert "step 30: OK" in r.out
    d = run_cli("verify", uri, "--all", "--json").json()
    assert d["ok"] and [s["step"] for s in d["steps"]] == [10, 20, 30]


def test_verify_flipped_byte_exits_1_naming_the_object(committed):
    uri, _, manifests = committed
    bad = manifests[20].shards[1]
    path = _path(uri, bad.key)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[1234] ^= 0x01
    path.write_bytes(bytes(data))
    # Same size, same mtime (so the version token and the HEAD check still match): only the
    # downloaded bytes' CRC32C can tell.
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = run_cli("verify", f"{uri}@20")
    assert r.rc == 1
    assert bad.key in r.out and "CRC32C" in r.out
    assert "verification failed" in r.err and "step(s) 20" in r.err
    r = run_cli("verify", uri, "--all", "--json")
    assert r.rc == 1
    d = r.json()
    assert not d["ok"]
    by_step = {s["step"]: s for s in d["steps"]}
    assert by_step[10]["ok"] and by_step[30]["ok"] and not by_step[20]["ok"]
    assert [p["key"] for p in by_step[20]["problems"]] == [bad.key]
    assert by_step[20]["problems"][0]["url"].endswith(bad.key)


def test_verify_names_every_bad_object(committed):
    uri, _, manifests = committed
    gone = [s.key for s in manifests[30].shards[:2]]
    for key in gone:
        _path(uri, key).unlink()
    r = run_cli("verify", uri)
    assert r.rc == 1
    for key in gone:
        assert key in r.out


def test_verify_with_progress_bar(committed):
    uri, _, _ = committed
    r = run_cli("verify", uri, "--progress")
    assert r.rc == 0 and "verify step 30" in r.err


# ------------------------------------------------------------------------------ gc


def test_gc_dry_run_then_run(committed):
    uri, store, manifests = committed
    r = run_cli("gc", uri, "--keep-last", "1", "--dry-run")
    assert r.rc == 0, r.err
    assert "dry run" in r.out
    assert "delete step 10" in r.out and "delete step 20" in r.out
    assert "keep step 30" in r.out
    assert Reader(store).steps() == [10, 20, 30]  # nothing deleted
    plan = run_cli("gc", uri, "--keep-last", "1", "--pin", "10", "--dry-run", "--json").json()
    assert [d["step"] for d in plan["plan"]["delete"]] == [20]
    assert plan["plan"]["kept"]["10"] == "pinned"

    r = run_cli("gc", uri, "--keep-last", "1", "--json")
    assert r.rc == 0, r.err
    res = r.json()["result"]
    assert sorted(res["deleted_manifests"]) == [manifest_key(10), manifest_key(20)]
    assert res["deleted_objects"] == 8
    assert Reader(store).steps() == [30]
    assert Reader(store).latest().step == 30  # LATEST's target kept and still valid
    for s in manifests[10].shards + manifests[20].shards:
        assert not _path(uri, s.key).exists()
    assert run_cli("verify", uri).rc == 0


def test_gc_keep_every(file_root):
    uri, store = file_root
    for s in (100, 150, 200, 250):
        commit_step(store, s, world_size=1, names=("m",), size=10)
    r = run_cli("gc", uri, "--keep-last", "1", "--keep-every", "100")
    assert r.rc == 0, r.err
    assert Reader(store).steps() == [100, 200, 250]


# ------------------------------------------------------------------------------ cp


def test_cp_file_to_file_round_trip_and_idempotence(committed, tmp_path):
    uri, store, manifests = committed
    dst = f"file://{tmp_path}/replica"
    r = run_cli("cp", f"{uri}@20", dst)
    assert r.rc == 0, r.err
    assert "copied step 20" in r.out
    from objckpt.store import open_store

    dst_store = open_store(dst)
    m = Reader(dst_store).latest()
    assert m.step == 20 and m.attempt != manifests[20].attempt
    assert m.metadata["replicated_from"]["attempt"] == manifests[20].attempt
    for s in m.shards:
        assert Reader(dst_store).read_shard(s) == shard_bytes(20, s.rank, s.name)
    assert run_cli("verify", dst).rc == 0
    again = run_cli("cp", f"{uri}@20", dst, "--json")
    assert again.rc == 0, again.err
    assert again.json()["steps"][0]["copied"] is False
    assert "already" in run_cli("cp", f"{uri}@20", dst).out
    # default step is the latest; pointer moves forward on the replica
    assert run_cli("cp", uri, dst).rc == 0
    assert run_cli("latest", dst).out.strip() == "30"


def test_cp_all_copies_every_step_in_order(committed, tmp_path):
    uri, _, _ = committed
    dst = f"file://{tmp_path}/all"
    r = run_cli("cp", uri, dst, "--all", "--json")
    assert r.rc == 0, r.err
    assert [s["step"] for s in r.json()["steps"]] == [10, 20, 30]
    ls = run_cli("ls", dst, "--json").json()
    assert [c["step"] for c in ls["checkpoints"]] == [10, 20, 30] and ls["pointer"]["step"] == 30


def test_cp_conflict_exits_1(committed, tmp_path):
    uri, _, _ = committed
    from objckpt.store import open_store

    dst = f"file://{tmp_path}/other"
    commit_step(open_store(dst), 20, world_size=1, names=("different",))
    r = run_cli("cp", f"{uri}@20", dst)
    assert r.rc == 1
    assert "different checkpoint at step 20" in r.err


def test_cp_corrupt_source_commits_nothing(committed, tmp_path):
    uri, _, manifests = committed
    bad = manifests[30].shards[0]
    path = _path(uri, bad.key)
    path.write_bytes(b"X" * bad.size)
    dst = f"file://{tmp_path}/never"
    r = run_cli("cp", f"{uri}@30", dst)  # named: without @STEP cp copies the newest valid (20)
    assert r.rc == 1
    assert "mismatch" in r.err
    from objckpt.store import open_store

    dst_store = open_store(dst)
    assert Reader(dst_store).steps() == []
    assert list(dst_store.list("data/")) == []  # the fresh attempt's shards were removed


def test_cp_missing_source_exits_3(file_root, tmp_path):
    uri, _ = file_root
    r = run_cli("cp", uri, f"file://{tmp_path}/x")
    assert r.rc == 3 and "no committed checkpoint" in r.err


# ------------------------------------------------------------------------------ plan / demo


def test_plan_reproduces_the_seed_figures():
    r = run_cli("plan", "--save", "12s")
    assert r.rc == 0, r.err
    rows = {
        ln.split()[0]: ln.split() for ln in r.out.splitlines() if ln.strip().startswith(("5min", "20min"))
    }
    assert rows["20min"][1:3] == ["1.0%", "~10min"]
    assert rows["5min"][1:3] == ["4.0%", "~2.5min"]
    assert "Daly" in r.out and "recommended" in r.out
    d = run_cli("plan", "--save", "12s", "--mtbf", "24h", "--step-time", "2s", "--json").json()
    by_interval = {row["interval_s"]: row for row in d["rows"]}
    assert by_interval[1200]["overhead"] == pytest.approx(0.01)
    assert by_interval[1200]["expected_loss_s"] == pytest.approx(600)
    assert by_interval[300]["overhead"] == pytest.approx(0.04)
    assert by_interval[300]["expected_loss_s"] == pytest.approx(150)
    assert by_interval[1200]["every_steps"] == 600
    assert d["recommended_interval_seconds"] == pytest.approx(d["daly_interval_seconds"], abs=2)


def test_plan_failure_rate_and_custom_intervals():
    d = run_cli(
        "plan", "--save", "30s", "--failures-per-day", "4", "--restart", "5m", "--interval", "15m", "--json"
    ).json()
    assert d["mtbf_seconds"] == 21600
    plain = [r for r in d["rows"] if not r["label"]]
    assert [r["interval_s"] for r in plain] == [900]
    assert plain[0]["expected_loss_s"] == pytest.approx(450 + 300)


def test_demo_subcommand_reaches_the_demo():
    """`objckpt demo --help` is the demo's own help (the demo itself runs in tests/training)."""
    r = run_cli("demo", "--help")
    assert r.rc == 0, r.err
    assert "rank" in r.out.lower() and "Traceback" not in r.err
