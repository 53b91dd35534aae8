"""Output format: one JSON object on stdout for every error with --json; no padding or wrapping
off a terminal; one (binary) unit family for sizes, progress bars included."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from objckpt.layout import manifest_key

from .conftest import commit_step, run_cli


@pytest.fixture
def committed(file_root):
    uri, store = file_root
    ms = {s: commit_step(store, s) for s in (10, 20, 30)}
    return uri, store, ms


def _one_json_error(r, code: int, kind: str | None = None) -> dict:
    assert r.rc == code, (r.rc, r.out, r.err)
    doc = json.loads(r.out)  # the whole of stdout is one JSON document
    assert isinstance(doc, dict) and set(doc["error"]) >= {"type", "message", "exit_code"}
    assert doc["error"]["exit_code"] == code
    if kind is not None:
        assert doc["error"]["type"] == kind
    assert "objckpt: error:" in r.err or "error:" in r.err  # the text line stays on stderr
    return doc["error"]


def test_json_errors_for_every_kind_of_failure(committed, tmp_path):
    uri, _, _ = committed
    e = _one_json_error(run_cli("ls", "not-a-uri", "--json"), 2, "ConfigError")
    assert "not a run-root URI" in e["message"] and e["command"] == "ls"
    e = _one_json_error(run_cli("show", f"{uri}@25", "--json"), 3, "NoCheckpointError")
    assert "step 25" in e["message"] and uri in e["message"]  # on no timeline: no one key to name
    e = _one_json_error(run_cli("show", f"{uri}@t0:25", "--json"), 3, "NoCheckpointError")
    assert manifest_key(25) in e["message"]
    _one_json_error(run_cli("latest", f"file://{tmp_path}/empty", "--json"), 3)
    _one_json_error(run_cli("plan", "--json"), 2, "UsageError")
    _one_json_error(run_cli("plan", "--save", "1h", "--mtbf", "1h", "--json"), 2, "UsageError")
    _one_json_error(run_cli("rm", f"{uri}@30", "--json"), 1, "Refused")
    _one_json_error(run_cli("show", f"{uri}@abc", "--json"), 2, "UsageError")
    e = _one_json_error(
        run_cli("cp", uri, f"file://{tmp_path}/d", "-o", "endpoint_url=http://x", "--json"), 2
    )
    assert "--src-option" in e["message"]


def test_json_error_for_argparse_usage_errors():
    e = _one_json_error(run_cli("ls", "--json"), 2, "UsageError")
    assert "required" in e["message"] and e["command"] == "ls"
    e = _one_json_error(run_cli("gc", "file:///tmp/x", "--keep-last", "many", "--json"), 2, "UsageError")
    assert "invalid int value" in e["message"]


def test_json_error_never_shows_secrets():
    r = run_cli("ls", "s3://BAD_Bucket/run?secret_access_key=SUPERSECRET123", "--json")
    e = _one_json_error(r, 2)
    assert "SUPERSECRET123" not in r.out + r.err and "invalid bucket name" in e["message"]


def test_verify_failure_json_carries_the_error(committed):
    uri, _, ms = committed
    Path(uri.removeprefix("file://"), ms[30].shards[0].key).unlink()
    r = run_cli("verify", f"{uri}@30", "--json")
    assert r.rc == 1
    doc = json.loads(r.out)
    assert doc["ok"] is False and doc["error"]["exit_code"] == 1
    assert "verification failed" in doc["error"]["message"]


def test_no_trailing_spaces_and_no_wrapping_off_a_terminal(committed):
    uri, _, ms = committed
    for args in (("ls", uri), ("show", f"{uri}@20", "--shards"), ("plan", "--save", "12s"), ("verify", uri)):
        # a narrow COLUMNS must neither wrap nor crop piped output
        r = run_cli(*args, env={"COLUMNS": "40"})
        assert r.rc == 0, r.err
        lines = r.out.splitlines()
        assert lines and all(ln == ln.rstrip() for ln in lines), [ln for ln in lines if ln != ln.rstrip()]
        assert "…" not in r.out
    ls = run_cli("ls", uri, env={"COLUMNS": "40"}).out
    row = next(ln for ln in ls.splitlines() if ln.strip().startswith("30"))
    assert ms[30].attempt in row and row.endswith("<- LATEST")
    shards = run_cli("show", f"{uri}@20", "--shards", env={"COLUMNS": "40"}).out
    for s in ms[20].shards:
        assert any(ln.endswith(s.key) for ln in shards.splitlines())


def test_progress_bar_uses_binary_units(committed):
    uri, _, _ = committed
    r = run_cli("verify", uri, "--progress")
    assert r.rc == 0, r.err
    assert "verify step 30" in r.err and "KiB" in r.err
    assert not re.search(r"\d\s?(kB|MB|GB|TB)\b", r.err + r.out), r.err
