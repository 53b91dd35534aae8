"""Timelines through the real console script: ``ls`` as a tree, ``@tN:STEP``, ``rollback``,
``quarantine`` (and ``verify``'s report of it), ``rm`` refusing bases, ``gc --keep-abandoned``,
and "latest" never resuming an abandoned branch."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from objckpt import cli, layout
from objckpt._json import canonical_json, sha256_of
from objckpt.coordination import LocalComm, RestoreSession, SaveSession, lineage
from objckpt.reader import Reader
from objckpt.store import PutMode
from objckpt.timelines import rollback

from .conftest import commit_step, run_cli


def _path(uri: str, key: str) -> Path:
    return Path(uri.removeprefix("file://")) / key


def _save(store, step: int):
    """One save through the real session on a 1-rank world (it picks the timeline itself)."""
    return SaveSession(store, LocalComm()).save(
        step, lambda t: t.writer.write("state.bin", b"s%d" % step * 50)
    )


def _restart_and_restore(store):
    """A new process: nothing remembered; restore the newest usable checkpoint."""
    lineage.forget(store)
    reader = Reader(store)
    return RestoreSession(store, LocalComm()).restore(lambda m: reader.read_shard(m.shard(0, "state.bin")))


@pytest.fixture
def forked(file_root):
    """t0: 10, 20, 30; a rollback to 10 (timeline 1): 15, 20; t1:20 then damaged, a restart
    falls back to t1:15 and saves 20 again (timeline 2, a fallback-resave). The line is
    t2:20 <- t1:15 <- 10; 20, 30 and t1:20 are abandoned."""
    uri, store = file_root
    lineage.forget(store)
    for step in (10, 20, 30):
        _save(store, step)
    rollback(store, 10)
    assert _restart_and_restore(store).step == 10
    for step in (15, 20):
        _save(store, step)
    t1_20 = Reader(store).load(20)
    assert t1_20.timeline == 1
    _path(uri, t1_20.shards[0].key).unlink()
    restored = _restart_and_restore(store)
    assert restored.manifest.ref == (1, 15)
    assert _save(store, 20).ref == (2, 20)
    lineage.forget(store)
    yield uri, store
    lineage.forget(store)


def _rows(out: str) -> dict[str, str]:
    """Checkpoint lines by their first word, which is the checkpoint's label (tree drawing
    stripped)."""
    rows = {}
    for ln in out.splitlines():
        words = ln.replace("│", " ").split()
        if words and (words[0][:1].isdigit() or words[0][:1] == "t" and ":" in words[0]):
            rows[words[0]] = ln
    return rows


def _indent(line: str) -> int:
    return len(line) - len(line.replace("│", " ").lstrip())


# ------------------------------------------------------------------------------ ls


def test_ls_draws_the_timelines_as_a_tree(forked):
    uri, _ = forked
    r = run_cli("ls", uri)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    rows = _rows(r.out)
    assert list(rows) == ["10", "20", "30", "t1:15", "t1:20", "t2:20"]  # grouped by timeline
    heads = {ln.strip(" │├└─").split(":")[0]: ln for ln in lines if "timeline " in ln}
    assert heads["timeline 0"].startswith("timeline 0")
    assert "└─ timeline 1: rollback from 10, " in heads["timeline 1"]
    assert "└─ timeline 2 (head): fallback from t1:15, " in heads["timeline 2 (head)"]
    # indented under the timeline they branched from
    assert _indent(rows["10"]) < _indent(rows["t1:15"]) < _indent(rows["t2:20"])
    assert _indent(heads["timeline 1"]) < _indent(heads["timeline 2 (head)"])
    order = [ln for ln in lines if ln in rows.values() or ln in heads.values()]
    assert order.index(heads["timeline 1"]) > order.index(rows["30"])  # after its parent's rows
    for name in ("20", "30", "t1:20"):
        assert "(abandoned " in rows[name] and "<- LATEST" not in rows[name]
    for name in ("10", "t1:15", "t2:20"):
        assert "abandoned" not in rows[name]
    assert "base of timeline 1" in rows["10"] and "base of timeline 2" in rows["t1:15"]
    assert rows["t2:20"].rstrip().endswith("<- LATEST")

    d = run_cli("ls", uri, "--json").json()
    assert (d["latest"], d["latest_ref"]) == (20, {"timeline": 2, "step": 20, "label": "t2:20"})
    assert d["head"] == {"timeline": 2, "checkpoint": {"timeline": 2, "step": 20, "label": "t2:20"}}
    assert d["pointer"]["timeline"] == 2 and d["pointer"]["step"] == 20
    flat = {c["label"]: c for c in d["checkpoints"]}
    assert [(c["timeline"], c["step"]) for c in d["checkpoints"]] == [
        (0, 10), (0, 20), (0, 30), (1, 15), (1, 20), (2, 20)
    ]  # fmt: skip
    assert {k for k, c in flat.items() if c["abandoned"]} == {"20", "30", "t1:20"}
    assert all(c["on_line"] != c["abandoned"] for c in flat.values())
    assert flat["t1:20"]["abandoned_by"] == 2 and flat["20"]["abandoned_by"] == 1
    assert flat["t2:20"]["parent"] == 15 and flat["t2:20"]["parent_label"] == "t1:15"
    assert flat["10"]["base_of"] == [1] and flat["t2:20"]["latest"] and flat["t2:20"]["pointer"]
    assert not any(c["quarantined"] or c["damaged"] for c in flat.values())
    tl = {t["timeline"]: t for t in d["timelines"]}
    assert tl[0]["base"] is None and tl[0]["children"] == [1] and not tl[0]["head"]
    assert (tl[1]["base"], tl[1]["reason"]) == ({"timeline": 0, "step": 10, "label": "10"}, "rollback")
    assert (tl[2]["base"]["label"], tl[2]["reason"], tl[2]["head"]) == ("t1:15", "fallback", True)
    assert tl[2]["created_at"] and tl[1]["created_at"] < tl[2]["created_at"]
    assert [c["label"] for c in tl[1]["checkpoints"]] == ["t1:15", "t1:20"]
    assert [c["label"] for c in tl[2]["checkpoints"]] == ["t2:20"]


def test_a_root_with_one_timeline_prints_no_tree(file_root):
    uri, store = file_root
    for s in (1, 2):
        commit_step(store, s, world_size=1, names=("m",), size=10)
    out = run_cli("ls", uri).out
    body = "\n".join(out.splitlines()[1:])  # below the root's URI
    assert "timeline" not in body and "└─" not in body
    assert [ln.split()[0] for ln in out.splitlines()[2:]] == ["1", "2"]


def test_runs_names_the_head_with_its_timeline(forked):
    uri, _ = forked
    parent = uri.rsplit("/", 1)[0]
    d = run_cli("runs", parent, "--json").json()
    (row,) = d["runs"]
    assert (row["head_step"], row["head_timeline"], row["head_label"]) == (20, 2, "t2:20")
    assert "t2:20" in run_cli("runs", parent).out


# ------------------------------------------------------------------------------ @tN:STEP


def test_show_names_a_checkpoint_of_a_timeline(forked):
    uri, _ = forked
    d = run_cli("show", f"{uri}@t1:20", "--json").json()
    assert (d["timeline"], d["step"], d["label"]) == (1, 20, "t1:20")
    assert d["parent"] == {"timeline": 1, "step": 15} and d["parent_label"] == "t1:15"
    assert d["abandoned"] and not d["on_line"] and d["abandoned_by"] == 2
    assert d["timeline_base"] == {"timeline": 0, "step": 10, "label": "10"}
    assert d["timeline_reason"] == "rollback"
    assert d["manifest_key"] == layout.manifest_key(20, 1)
    # @20: the step on the head's line (t2:20), not an abandoned one
    d = run_cli("show", f"{uri}@20", "--json").json()
    assert (d["timeline"], d["on_line"], d["head"]) == (2, True, True)
    # @30: on no line: the newest timeline holding it
    d = run_cli("show", f"{uri}@30", "--json").json()
    assert (d["timeline"], d["abandoned"]) == (0, True)
    assert run_cli("show", f"{uri}@t0:20", "--json").json()["label"] == "20"
    for target in (uri, f"{uri}@latest"):
        assert run_cli("show", target, "--json").json()["label"] == "t2:20"

    r = run_cli("show", f"{uri}@t1:20")
    assert r.rc == 0, r.err
    fields = dict(ln.split(None, 1) for ln in r.out.splitlines() if " " in ln.strip())
    assert fields["step"].strip() == "20" and fields["parent"].strip() == "t1:15"
    assert fields["timeline"].startswith("1 (rollback from 10, ")
    assert fields["state"].startswith("abandoned") and "by timeline 2" in fields["state"]

    r = run_cli("show", f"{uri}@t7:20")
    assert r.rc == 3 and "step 20" in r.err and layout.manifest_key(20, 7) in r.err
    for bad in ("t1:", "t:20", "tx:20", "1:20", "t1:20:3"):
        r = run_cli("show", f"{uri}@{bad}")
        assert r.rc == 2 and "tN:STEP" in r.err, (bad, r.err)


def test_verify_and_cp_take_a_timeline(forked, tmp_path):
    uri, _ = forked
    r = run_cli("verify", f"{uri}@t1:15")
    assert r.rc == 0 and "step t1:15: OK" in r.out, r.err
    r = run_cli("verify", f"{uri}@t1:20")  # the damaged, abandoned one: still verifiable
    assert r.rc == 1 and "step t1:20: FAILED" in r.out
    d = run_cli("verify", uri, "--all", "--json").json()
    assert [s["label"] for s in d["steps"]] == ["10", "20", "30", "t1:15", "t1:20", "t2:20"]
    assert [s["label"] for s in d["steps"] if not s["ok"]] == ["t1:20"]
    assert {s["label"] for s in d["steps"] if s["abandoned"]} == {"20", "30", "t1:20"}

    dst = f"file://{tmp_path}/replica"
    r = run_cli("cp", f"{uri}@t1:15", dst)
    assert r.rc == 0 and "copied step 15" in r.out, r.err
    # replicate() takes a step: a checkpoint that @STEP does not name cannot be copied
    r = run_cli("cp", f"{uri}@t1:20", dst)
    assert r.rc == 2 and "t1:20" in r.err and "@20 names t2:20" in r.err
    r = run_cli("cp", f"{uri}@t0:30", dst)  # abandoned, but the only 30: @30 names it
    assert r.rc == 0 and "copied step 30" in r.out, r.err


def test_split_target_and_split_step():
    assert cli.split_target("s3://b/run@t1:20") == ("s3://b/run", 20, 1)
    assert cli.split_target("s3://b/run@T0:7?region=x") == ("s3://b/run?region=x", 7, 0)
    assert cli.split_target("s3://b/run?region=x@t3:5") == ("s3://b/run?region=x", 5, 3)
    assert cli.split_target("s3://b/run@20") == ("s3://b/run", 20, None)
    assert cli.split_target("s3://b/run@latest") == ("s3://b/run", None, None)
    assert cli.split_target("file:///a@b/run") == ("file:///a@b/run", None, None)
    assert cli.split_step("s3://b/run@20") == ("s3://b/run", 20)
    for bad in ("s3://b/run@t1", "s3://b/run@t-1:2", f"s3://b/run@t{10**10}:1"):
        with pytest.raises(cli.CliError) as e:
            cli.split_target(bad)
        assert e.value.code == cli.EXIT_USAGE
    with pytest.raises(cli.CliError) as e:
        cli.split_step("s3://b/run@t1:20")  # the 2-tuple form never drops a timeline silently
    assert e.value.code == cli.EXIT_USAGE


# ------------------------------------------------------------------------------ rollback


@pytest.fixture
def committed(file_root):
    uri, store = file_root
    return uri, store, {s: commit_step(store, s) for s in (10, 20, 30)}


def test_rollback_makes_the_base_latest_and_the_next_save_continues_from_it(committed):
    uri, store, ms = committed
    r = run_cli("rollback", f"{uri}@20", "--dry-run")
    assert r.rc == 0 and "dry run" in r.out and "abandoned: 30" in r.out, r.err
    assert not list(store.list(layout.TIMELINE_PREFIX))  # nothing written

    r = run_cli("rollback", f"{uri}@20")
    assert r.rc == 0, r.err
    assert "to step 20: timeline 1 continues from it" in r.out and "abandoned: 30" in r.out
    assert run_cli("latest", uri).out.strip() == "20"
    rows = _rows(run_cli("ls", uri).out)
    assert "<- LATEST" in rows["20"] and "(abandoned " in rows["30"]
    assert "timeline 1 (head): rollback from 20" in run_cli("ls", uri).out
    assert Reader(store).load(30).step == 30  # abandoned, not deleted
    assert all(_path(uri, s.key).exists() for s in ms[30].shards)

    again = run_cli("rollback", f"{uri}@20", "--json")  # already the head: no new timeline
    assert again.rc == 0 and again.json()["changed"] is False
    assert [m.key for m in store.list(layout.TIMELINE_PREFIX)] == [layout.timeline_key(1)]

    lineage.forget(store)
    m = _save(store, 25)
    assert (m.timeline, m.parent_ref) == (1, (0, 20))
    assert run_cli("latest", uri, "--json").json()["label"] == "t1:25"

    d = run_cli("rollback", f"{uri}@10", "--json").json()
    assert (
        d["timeline"] == 2 and d["base"]["label"] == "10" and d["base"]["manifest"] == layout.manifest_key(10)
    )
    assert [a["label"] for a in d["abandoned"]] == ["20", "t1:25"]
    assert d["claim"] == layout.timeline_key(2) and d["reason"] == "rollback" and d["created_at"]
    assert run_cli("latest", uri).out.strip() == "10"


def test_rollback_refuses_a_damaged_or_quarantined_base(committed):
    uri, store, ms = committed
    _path(uri, ms[10].shards[0].key).unlink()
    r = run_cli("rollback", f"{uri}@10")
    assert r.rc == 1 and "damaged" in r.err and ms[10].shards[0].key in r.err and uri in r.err
    assert run_cli("quarantine", f"{uri}@20").rc == 0
    r = run_cli("rollback", f"{uri}@20", "--json")
    assert r.rc == 1 and "quarantined" in r.json()["error"]["message"]
    assert not list(store.list(layout.TIMELINE_PREFIX))
    assert run_cli("rollback", f"{uri}@25").rc == 3
    assert run_cli("rollback", uri).rc == 2  # an explicit step is required
    assert run_cli("rollback", f"{uri}@latest").rc == 2


# ------------------------------------------------------------------------------ quarantine


def test_quarantine_is_skipped_by_latest_reported_by_verify_and_undone(committed):
    uri, store, ms = committed
    r = run_cli("quarantine", f"{uri}@30", "--reason", "loss spike")
    assert r.rc == 0, r.err
    assert "quarantined step 30" in r.out and "latest is step 20" in r.out
    assert store.head(layout.quarantine_key(0, 30))  # the marker
    assert all(_path(uri, s.key).exists() for s in ms[30].shards)  # nothing deleted

    r = run_cli("latest", uri)
    assert (r.rc, r.out.strip()) == (0, "20")
    assert "skipped quarantined checkpoint step 30" in r.err and "loss spike" in r.err
    assert r.err.count("quarantined") == 1  # said once, not again by the library's log

    rows = _rows(run_cli("ls", uri).out)
    assert "QUARANTINED: loss spike" in rows["30"] and "<- LATEST" in rows["20"]
    flat = {c["step"]: c for c in run_cli("ls", uri, "--json").json()["checkpoints"]}
    assert flat[30]["quarantined"] and flat[30]["quarantine_reason"] == "loss spike"
    assert flat[30]["damaged"] is None and flat[20]["latest"]

    # verify: a distinct state, never a failure
    r = run_cli("verify", uri)
    assert r.rc == 0, r.out + r.err
    assert "step 30: QUARANTINED: loss spike, skipped" in r.out and "step 20: OK" in r.out
    d = run_cli("verify", uri, "--json").json()
    assert d["ok"] is True and d["quarantined"] == ["30"] and "error" not in d
    by = {s["step"]: s for s in d["steps"]}
    assert by[30]["quarantined"] and not by[30]["verified"] and by[20]["verified"]
    r = run_cli("verify", f"{uri}@30")  # named: its bytes are verified
    assert r.rc == 0 and "step 30: OK" in r.out and "QUARANTINED: loss spike" in r.out
    d = run_cli("verify", uri, "--all", "--json").json()
    assert d["ok"] and d["quarantined"] == ["30"] and all(s["verified"] for s in d["steps"])
    assert run_cli("show", f"{uri}@30", "--json").json()["quarantined"] is True

    r = run_cli("quarantine", f"{uri}@30", "--json")  # idempotent
    assert r.rc == 0 and r.json()["changed"] is False and r.json()["reason"] == "loss spike"
    d = run_cli("quarantine", f"{uri}@30", "--undo", "--json").json()
    assert (d["changed"], d["quarantined"], d["latest"]["label"]) == (True, False, "30")
    assert run_cli("latest", uri).out.strip() == "30"
    assert run_cli("unquarantine", f"{uri}@30").out.startswith("step 30 under")
    assert "nothing to undo" in run_cli("unquarantine", f"{uri}@30").out

    assert run_cli("quarantine", f"{uri}@25").rc == 3
    assert run_cli("quarantine", uri).rc == 2
    assert run_cli("quarantine", f"{uri}@20", "--undo", "--reason", "x").rc == 2


def test_every_checkpoint_quarantined_exits_3_saying_so(file_root):
    uri, store = file_root
    commit_step(store, 1, world_size=1, names=("m",), size=10)
    assert run_cli("quarantine", f"{uri}@1").rc == 0
    r = run_cli("latest", uri)
    assert r.rc == 3 and "step 1: quarantined" in r.err


# ------------------------------------------------------------------------------ latest


def test_latest_never_resumes_an_abandoned_branch(committed):
    uri, store, _ = committed
    rollback(store, 10)
    commit_step(store, 50)  # a stale coordinator's late commit on the old timeline
    r = run_cli("latest", uri)
    assert (r.rc, r.out.strip()) == (0, "10"), r.err
    rows = _rows(run_cli("ls", uri).out)
    assert "(abandoned" in rows["50"] and "<- LATEST" in rows["10"]
    assert run_cli("show", uri, "--json").json()["label"] == "10"
    assert run_cli("show", f"{uri}@50", "--json").json()["abandoned"] is True
    assert "step 10: OK" in run_cli("verify", uri).out


# ------------------------------------------------------------------------------ rm


def test_rm_refuses_a_timeline_base_unless_forced(forked):
    uri, store = forked
    r = run_cli("rm", f"{uri}@10")
    assert r.rc == 1 and "base of timeline 1" in r.err and "--force" in r.err
    r = run_cli("rm", f"{uri}@t1:15", "--json")
    assert r.rc == 1 and "base of timeline 2" in r.json()["error"]["message"]
    r = run_cli("rm", f"{uri}@10", "--force", "--dry-run")
    assert r.rc == 0 and "forced: it is the base of timeline 1" in r.out
    assert set(Reader(store).checkpoints()) == {(0, 10), (0, 20), (0, 30), (1, 15), (1, 20), (2, 20)}

    d = run_cli("rm", f"{uri}@t1:20", "--json")  # abandoned, no base of anything: it may go
    assert d.rc == 0, d.err
    assert d.json()["label"] == "t1:20"
    assert d.json()["result"]["deleted_manifests"] == [layout.manifest_key(20, 1)]
    assert (1, 20) not in Reader(store).checkpoints() and (2, 20) in Reader(store).checkpoints()
    r = run_cli("rm", f"{uri}@t1:20")
    assert r.rc == 3 and "t1:20" in r.err


def test_rm_base_rule_is_one_of_the_rules():
    from objckpt.cli._manage import RmFacts, rm_refusals

    facts = dict(head=(2, 20), pointer_step=(2, 20), newest_valid=(2, 20), retention=None)
    assert rm_refusals(RmFacts(step=15, timeline=1, base_of=(2,), **facts)) == [
        "it is the base of timeline 2, which still holds checkpoints (their line runs through it)"
    ]
    assert rm_refusals(RmFacts(step=20, timeline=1, **facts)) == []  # same step, other timeline
    assert len(rm_refusals(RmFacts(step=20, timeline=2, **facts))) == 3


# ------------------------------------------------------------------------------ gc


def _backdate_claim(store, timeline: int, days: float) -> str:
    """Rewrite timeline ``timeline``'s claim as made ``days`` ago (a valid claim: checksum
    recomputed), i.e. its older branch was abandoned then."""
    key = layout.timeline_key(timeline)
    obj = json.loads(store.get(key))
    when = datetime.now(timezone.utc) - timedelta(days=days)
    obj["created_at"] = when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    obj.pop("checksum")
    obj["checksum"] = sha256_of(obj)
    store.put(key, canonical_json(obj), mode=PutMode.OVERWRITE)
    return obj["created_at"]


def test_gc_keep_abandoned_collects_old_abandoned_checkpoints_only(forked):
    uri, store = forked
    old = _backdate_claim(store, 1, days=10)  # 20 and 30 were abandoned 10 days ago
    assert Reader(store).history.claim(1).created_at == old

    d = run_cli("gc", uri, "--keep-last", "1", "--dry-run", "--json").json()
    assert d["dry_run"] and d["keep_abandoned_seconds"] == 7 * 86400
    plan = d["plan"]
    assert [x["label"] for x in plan["delete"]] == ["20", "30"]
    ab = {a["label"]: a for a in plan["abandoned"]}
    assert set(ab) == {"20", "30", "t1:20"}
    assert (
        ab["20"]["abandoned_at"] == old and ab["20"]["abandoned_by"] == 1 and ab["20"]["action"] == "delete"
    )
    assert ab["20"]["age_seconds"] > 9 * 86400 and ab["20"]["branch"] == "rollback from 10"
    assert ab["t1:20"]["action"] == "keep" and "keep_abandoned" in ab["t1:20"]["why_kept"]
    assert plan["kept"]["10"] == "base of timeline 1" and "t1:15" in plan["kept"]

    r = run_cli("gc", uri, "--keep-last", "1", "--dry-run")
    assert r.rc == 0, r.err
    assert "abandoned checkpoints (off the head's line; kept 7d after they were abandoned):" in r.out
    lines = {ln.strip().split(": abandoned ")[0]: ln for ln in r.out.splitlines() if ": abandoned " in ln}
    assert old in lines["20"] and lines["20"].endswith(": delete") and "by timeline 1" in lines["20"]
    assert lines["t1:20"].endswith(": keep") and "fallback from t1:15" in lines["t1:20"]
    assert set(Reader(store).checkpoints()) == {(0, 10), (0, 20), (0, 30), (1, 15), (1, 20), (2, 20)}

    kept = run_cli("gc", uri, "--keep-last", "1", "--dry-run", "--keep-abandoned", "never", "--json").json()
    assert kept["plan"]["delete"] == [] and kept["keep_abandoned_seconds"] is None
    assert {a["action"] for a in kept["plan"]["abandoned"]} == {"keep"}
    short = run_cli("gc", uri, "--keep-last", "1", "--dry-run", "--keep-abandoned", "0", "--json").json()
    assert [x["label"] for x in short["plan"]["delete"]] == ["20", "30", "t1:20"]
    assert run_cli("gc", uri, "--keep-last", "1", "--keep-abandoned", "soon").rc == 2

    r = run_cli("gc", uri, "--keep-last", "1")
    assert r.rc == 0, r.err
    assert set(Reader(store).checkpoints()) == {(0, 10), (1, 15), (1, 20), (2, 20)}
    assert run_cli("latest", uri, "--json").json()["label"] == "t2:20"


def test_gc_pins_a_checkpoint_of_one_timeline(forked):
    uri, store = forked
    _backdate_claim(store, 1, days=10)
    plan = run_cli("gc", uri, "--keep-last", "1", "--pin", "t0:30", "--dry-run", "--json").json()["plan"]
    assert [x["label"] for x in plan["delete"]] == ["20"] and plan["kept"]["30"] == "pinned"
    assert run_cli("gc", uri, "--keep-last", "1", "--pin", "t0", "--dry-run").rc == 2


def test_gc_never_collects_what_restores_use_when_newer_ones_are_quarantined(committed):
    uri, store, _ = committed
    assert run_cli("quarantine", f"{uri}@30").rc == 0
    plan = run_cli("gc", uri, "--keep-last", "0", "--dry-run", "--json").json()["plan"]
    assert plan["kept"]["20"] == "newest checkpoint that verifies"  # quarantined 30 is skipped
    assert [x["label"] for x in plan["delete"]] == ["10"]
    assert run_cli("gc", uri, "--keep-last", "0").rc == 0
    assert run_cli("latest", uri).out.strip() == "20"
