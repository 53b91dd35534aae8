"""A small sample of the benchmarks in CI: ``python -m benchmarks.run`` on a 4 MiB state, on moto,
every leg (LocalStack's left to the full runs). It asserts that every leg ran to the end and
measured every case and every row of the issue-14 table, and that the report replaced only its
own section; never how fast anything was (a 4 MiB state on a shared 2-core machine times
overheads, not storage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("boto3")
pytest.importorskip("moto")

# the sample takes ~1.5 min on 2 idle cores; the limit leaves room for a loaded CI machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
RUNS = 3
#: whether this kernel reports free pages to a host (then the counters have the unreported pool)
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters/page_reporting_order").exists()


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench")
    report = out / "BENCHMARKS.md"
    # a hand-written text and a stale generated section: the run must keep the one, replace the other
    report.write_text(
        "# hand-written\n\nkept text\n\n<!-- BEGIN quick results (benchmarks/run.py) -->\n"
        "stale numbers\n<!-- END quick results -->\n\ntrailing text\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--quick",
        "--mib",
        "4",
        "--runs",
        str(RUNS),
        "--skip",
        "localstack",
        "--out",
        str(report),
        "--results-dir",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results-quick.json").read_text()), report.read_text()


def test_every_s3_case_ran_every_run_without_error(sample):
    results, _ = sample
    (s3,) = results["s3"]
    assert s3["server"] == "moto" and "error" not in s3
    assert set(s3["worlds"]) == {"1", "2"}
    for ws, world in s3["worlds"].items():
        assert world.get("errors") == {}, (ws, world.get("errors"))
        for case in ("objckpt", "raw", "dcp_s3fs", "s3tc", "dcp_objckpt"):
            for op in ("save", "load"):
                assert len(world["times"][case][op]) == RUNS, (ws, case, op)
    # each async pair in a 1-rank world of its own (s3_bench docstring), none in the peers' worlds
    pairs = {"1-cold": ("objckpt", "objckpt_async"), "1-steady": ("objckpt_steady", "objckpt_async_steady")}
    assert set(s3["async_worlds"]) == set(pairs)
    for name, cases in pairs.items():
        world = s3["async_worlds"][name]
        assert world.get("errors") == {} and world["config"]["world_size"] == 1, (name, world.get("errors"))
        assert set(world["times"]) == set(cases), name
        for case in cases:
            assert len(world["times"][case]["save"]) == RUNS, (name, case)
    assert not {"objckpt_async", "objckpt_steady", "objckpt_async_steady"} & set(s3["worlds"]["1"]["times"])


def test_every_timed_s3_run_records_what_the_machine_and_the_server_did(sample):
    """The counters that tell a slow run's cause (steal time, page faults, the server's CPU):
    one set per timed run, the server's included (the sample's moto runs on this machine)."""
    results, _ = sample
    (s3,) = results["s3"]
    for ws, world in [*s3["worlds"].items(), *s3["async_worlds"].items()]:
        for case, ops in world["times"].items():
            for op, runs in ops.items():
                counters = world["counters"].get(case, {}).get(op, [])
                assert len(counters) == len(runs), (ws, case, op)
                for one in counters:
                    assert one["self_minflt"] >= 0 and one["server_sys_s"] >= 0, (ws, case, op, one)
                    assert one["server_write_mib"] >= 0 and one["server_read_mib"] >= 0, one
                    if sys.platform == "linux":
                        assert "steal_s" in one and "pgfault" in one, one
                    if PAGE_REPORTING:  # a level: the value at the run's start
                        assert one["unreported_free_mib"] > 0, one


def test_the_other_legs_measured_and_the_gpu_leg_says_why_it_skipped(sample):
    results, report = sample
    for leg in ("file", "async", "resolve"):
        assert "error" not in results[leg], (leg, results[leg])
    assert all("error" not in row for row in results["memory"] + results["memory_ranks"])
    for case, runs in results["file"]["times"].items():
        assert all(len(runs[op]) == RUNS for op in ("save", "load")), case
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - importorskip above
        cuda = False
    if not cuda:
        assert results["gpu"]["skipped"].startswith("no CUDA device here")
        assert "GPU leg skipped: no CUDA device here" in report


def test_every_row_of_the_issue_table_is_measured(sample):
    _, report = sample
    table = report.split("### 8. Issue 14 table", 1)[1].split("<!-- END", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| path")]
    assert len(rows) >= 14
    for row in rows:
        assert "n/a" not in row and "not measured" not in row, row


def test_the_report_replaces_only_its_own_section_and_records_the_host(sample):
    _, report = sample
    assert report.startswith("# hand-written\n\nkept text\n")
    assert report.rstrip().endswith("trailing text")
    assert "stale numbers" not in report
    assert report.count("<!-- BEGIN quick results") == 1
    for row in ("load average at start", "load average at end"):
        assert f"| {row} |" in report
    for row in ("fresh memory probe at start", "fresh memory probe at end"):
        line = next(line for line in report.splitlines() if line.startswith(f"| {row} |"))
        assert line.endswith("s per 1024 MiB |"), line
    for row in ("page-cache probe at start", "page-cache probe at end"):
        line = next(line for line in report.splitlines() if line.startswith(f"| {row} |"))
        assert line.endswith("s per 512 MiB |"), line
    for when in ("start", "end"):
        row = f"free memory never reported to the host at {when}"
        line = next(line for line in report.splitlines() if line.startswith(f"| {row} |"))
        assert line.endswith(" MiB |" if PAGE_REPORTING else "(no page reporting here) |"), line


def test_steady_cases_beside_other_cases_leave_the_model_their_loads_check(tmp_path):
    """``s3_bench --cases`` may put the steady cases in one world with cases that load and check
    the model: the steady saves change a model of their own there, never the shared one."""
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, "-m", "benchmarks.s3_bench", "--server", "moto", "--mib", "4", "--runs", "1"]
    cmd += ["--cases", "objckpt,objckpt_steady", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["errors"] == {}, result["errors"]
    assert (
        len(result["times"]["objckpt"]["load"]) == 1 and len(result["times"]["objckpt_steady"]["save"]) == 1
    )
