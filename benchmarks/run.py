"""Run every objckpt benchmark, print the table, write it into ``BENCHMARKS.md``.

    .venv/bin/python -m benchmarks.run            # full: 512 MiB state (the report says how long it took)
    .venv/bin/python -m benchmarks.run --quick    # smoke: 64 MiB state
    pip install -e '.[bench]'                     # the peers (s3fs, s3torchconnector), pinned
    python benchmarks/run.py --quick --skip moto  # also works as a script

Legs (see each module's docstring for exactly what is timed):

1. ``s3_bench``: save/load of one state through ``CheckpointManager`` vs bare boto3 multipart
   upload / parallel ranged GET of the same bytes (goal >= 0.9), on 1 and 2 ranks;
2. the same runs: vs DCP + ``FsspecWriter``/``FsspecReader`` over s3fs (goal >= 1.5) and vs DCP +
   s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (goal >= 1.0);
3. ``file_bench``: ``file://`` vs DCP ``FileSystemWriter``/``FileSystemReader`` (goal >= 1.0);
4. async save (``CheckpointManager.save_async``) and ``async_bench``: training-step slowdown of a
   toy CPU loop while a save is in flight, thread uploader vs DCP's checkpoint process;
5. ``mem_bench``: peak extra memory of a save against the state size, and of a read-once
   restore on 2 and 4 gloo ranks against the replicated state (goal <= 1.1x);
6. ``resolve_bench``: requests and time of resolve-latest vs number of checkpoints;
7. ``gpu_bench``: CUDA staging and ``save_async`` blocking (skipped, with the reason, without CUDA);
8. the issue-14 table (``scoreboard``): every path against its peer, DCP-vs-DCP rows included
   (case ``dcp_objckpt``: the same DCP planner, only the storage layer differs).

The S3 legs run on LocalStack (when ``scripts/localstack.sh`` has installed it) and on moto.
Every ratio is a speed ratio, baseline time / objckpt time, computed per run from interleaved
runs in the same process world, then summarised as median [min-max]. ``BENCHMARKS.md`` keeps one
section per mode (full, quick) between markers; a run replaces only its own section, so the
hand-written analysis around them stays.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python benchmarks/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    MiB,
    Series,
    host_state,
    localstack_available,
    machine_info,
    paired_ratios,
    start_server,
)
from benchmarks.scoreboard import ASYNC_WORLDS, async_world  # noqa: E402

GOALS = {"raw": 0.9, "dcp_s3fs": 1.5, "s3tc": 1.0, "dcp_fs": 1.0}
BASELINE_NAMES = {
    "raw": "bare boto3 (multipart put / parallel ranged GET)",
    "dcp_s3fs": "DCP + FsspecWriter/Reader (s3fs)",
    "s3tc": "DCP + s3torchconnector S3StorageWriter/Reader",
    "dcp_fs": "DCP FileSystemWriter/Reader",
}
MODES = {
    "quick": {
        "mib": 64,
        "tensors": 16,
        "runs": 3,
        "worlds": [1, 2],
        "mem_mib": [64, 256],
        "mem_ranks": [2],
        "mem_rep_mib": 64,
        "resolve": [10, 100, 1000],
        "file_mib": 64,
    },
    "full": {
        "mib": 512,
        "tensors": 16,
        "runs": 3,
        "worlds": [1, 2],
        "mem_mib": [64, 256, 512],
        "mem_ranks": [2, 4],
        "mem_rep_mib": 256,
        "resolve": [10, 100, 1000],
        "file_mib": 512,
    },
}


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------ legs


def s3_legs(kind: str, mode: dict[str, Any], out_dir: Path, endpoint: str | None) -> dict[str, Any]:
    from benchmarks.s3_bench import CASES, default_cfg, run_world

    res: dict[str, Any] = {"server": kind, "worlds": {}, "async_worlds": {}}
    with start_server(kind, endpoint) as srv:
        res["server_label"] = srv.label
        res["startup_s"] = srv.startup_s
        res["store_options"] = {
            k: v
            for k, v in srv.store_options.items()
            if k not in ("access_key_id", "secret_access_key", "endpoint_url")
        }
        # (name, ranks, cases): the peers' world of each size, and after the 1-rank one each
        # async pair in a 1-rank world of its own (s3_bench docstring)
        worlds: list[tuple[int | str, int, list[str]]] = []
        for ws in mode["worlds"]:
            worlds.append((ws, ws, list(CASES)))
            if ws == 1:
                worlds.append((ASYNC_WORLDS[0], 1, ["objckpt", "objckpt_async"]))
                worlds.append((ASYNC_WORLDS[1], 1, ["objckpt_steady", "objckpt_async_steady"]))
        for name, ws, cases in worlds:
            cfg = default_cfg(
                srv,
                ws,
                mode["mib"] * MiB,
                mode["tensors"],
                mode["runs"],
                cases,
                str(out_dir / f"s3-{kind}-w{name}.json"),
            )
            log(
                f"S3 legs on {srv.label}, {ws} rank(s), {', '.join(cases)}, {mode['mib']} MiB, {mode['runs']} runs"
            )
            t = time.monotonic()
            world = run_world(cfg, timeout=mode.get("s3_timeout", 3000))
            world["config"] = {k: v for k, v in cfg.items() if k not in ("store_options", "endpoint", "out")}
            res["async_worlds" if isinstance(name, str) else "worlds"][name] = world
            log(
                f"  done in {time.monotonic() - t:.0f}s; errors: "
                f"{world.get('errors') or world.get('error', '')[:300] or 'none'}"
            )
    return res


def file_leg(mode: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    import subprocess

    out = out_dir / "file.json"
    out.unlink(missing_ok=True)
    log(f"file:// leg, {mode['file_mib']} MiB, {mode['runs']} runs")
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "benchmarks.file_bench",
            "--mib",
            str(mode["file_mib"]),
            "--tensors",
            str(mode["tensors"]),
            "--runs",
            str(mode["runs"]),
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(out.read_text())


def async_leg(mode: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    import subprocess

    out = out_dir / "async.json"
    out.unlink(missing_ok=True)
    log(f"async leg (toy training loop), {mode['file_mib']} MiB, {mode['runs']} runs")
    cmd = [sys.executable, "-W", "ignore", "-m", "benchmarks.async_bench", "--mib", str(mode["file_mib"])]
    cmd += ["--runs", str(mode["runs"]), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3000)
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(out.read_text())


def mem_leg(mode: dict[str, Any], s3_kind: str | None, endpoint: str | None) -> list[dict[str, Any]]:
    from benchmarks.mem_bench import measure

    log(f"memory leg, file:// {mode['mem_mib']} MiB")
    rows = measure("file", mode["mem_mib"])
    if s3_kind:
        with start_server(s3_kind, endpoint) as srv:
            log(f"memory leg, S3 on {srv.label}, {mode['mem_mib']} MiB")
            for r in measure("s3", mode["mem_mib"], server=srv):
                r["server"] = srv.label
                rows.append(r)
    return rows


def mem_ranks_leg(mode: dict[str, Any]) -> list[dict[str, Any]]:
    """The multi-rank read-once restore's peak memory (``mem_bench --ranks``), file://."""
    from benchmarks.mem_bench import measure_ranks

    log(f"memory leg, read-once restore on {mode['mem_ranks']} gloo ranks, {mode['mem_rep_mib']} MiB")
    return measure_ranks(mode["mem_ranks"], mode["mem_rep_mib"], max(3, mode["runs"]))


def resolve_leg(mode: dict[str, Any], kind: str, endpoint: str | None) -> dict[str, Any]:
    from benchmarks.common import BUCKET
    from benchmarks.resolve_bench import measure
    from objckpt.store import open_store

    with start_server(kind, endpoint) as srv:
        log(f"resolve leg on {srv.label}, N = {mode['resolve']}")
        rows = measure(lambda p: open_store(f"s3://{BUCKET}/{p}", **srv.store_options), mode["resolve"])
        return {"server": srv.label, "rows": rows}


# ------------------------------------------------------------------------------ report


def _walls(t: dict[str, Any], case: str, op: str) -> list[float]:
    return [w for w, _ in t.get(case, {}).get(op, [])]


def _cpus(t: dict[str, Any], case: str, op: str) -> list[float]:
    return [c for _, c in t.get(case, {}).get(op, [])]


def _counter(w: dict[str, Any], case: str, key: str = "server_sys_s", digits: int = 2) -> str:
    """A counter ``s3_bench`` records with every timed run of ``case``'s save (default: the S3
    server's system CPU seconds), median [min-max], or "n/a" where it was not recorded (the
    server's process not found, no page reporting)."""
    runs = (w.get("counters") or {}).get(case, {}).get("save", [])
    return Series([r[key] for r in runs if key in r]).fmt(digits, count=False)


def _pair(w: dict[str, Any], sync_case: str, async_case: str) -> str:
    """The async table's counter columns for one sync / async pair."""
    return " | ".join(
        f"{_counter(w, sync_case, key, digits)} / {_counter(w, async_case, key, digits)}"
        for key, digits in (("server_sys_s", 2), ("unreported_free_mib", 0))
    )


def _met(ratio: Series, goal: float) -> str:
    if not ratio.values:
        return "n/a"
    if ratio.median >= goal:
        return "**met**" if ratio.lo >= goal else "met (median; min below)"
    return "**NOT met**"


def render(results: dict[str, Any]) -> str:
    mode = results["mode"]
    cfg = results.get("params") or MODES[mode]  # what this run used (--mib/--runs override)
    lines: list[str] = []
    add = lines.append
    add(f"Run {results['started']} UTC, `{results['command']}`, {results['elapsed_s'] / 60:.1f} min.")
    add("")
    add("| machine | |")
    add("|---|---|")
    for k, v in results["machine"].items():
        add(f"| {k} | {v} |")
    add("")
    add(
        f"State: {cfg['mib']} MiB in {cfg['tensors']} float32 tensors (an `nn.Module`, identical on "
        "every rank as under DDP). objckpt: part 16 MiB x 8 in flight (store defaults); raw "
        "boto3: same part size and width; DCP writers: `thread_count=8`. Speed ratio = baseline "
        "time / objckpt time per interleaved run, median [min-max] of "
        f"{cfg['runs']} runs; > 1 means objckpt is faster."
    )
    add("")

    # -- 1, 2: S3
    add("### 1-2. Save / load over S3 (objckpt `CheckpointManager` vs baselines)")
    add("")
    add(
        "| server | ranks | op | baseline | objckpt s | baseline s | speed ratio | goal | met | client CPU s objckpt / baseline (rank 0) |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|")
    notes: list[str] = []
    for s3 in results.get("s3", []):
        if "error" in s3:
            add(f"| {s3['server']} | | | | | | | | error: {s3['error'][:200]} | |")
            continue
        for ws, w in sorted(s3["worlds"].items(), key=lambda kv: int(kv[0])):
            if "times" not in w:
                add(f"| {s3['server_label']} | {ws} | | | | | | | error (see below) | |")
                notes.append(f"{s3['server_label']}, {ws} rank(s): {w.get('error', '')[:1500]}")
                continue
            t = w["times"]
            for case, err in (w.get("errors") or {}).items():
                notes.append(f"{s3['server_label']}, {ws} rank(s), `{case}`: {err[:600]}")
            for op in ("save", "load"):
                ours = _walls(t, "objckpt", op)
                for base in ("raw", "dcp_s3fs", "s3tc"):
                    theirs = _walls(t, base, op)
                    goal = GOALS[base]
                    if not theirs or not ours:
                        why = (
                            (w.get("errors") or {}).get(base)
                            or (w.get("errors") or {}).get("objckpt")
                            or "not run"
                        )
                        add(
                            f"| {s3['server_label']} | {ws} | {op} | {BASELINE_NAMES[base]} | "
                            f"{Series(ours).fmt(2)} | n/a | n/a | >= {goal} | not measured: {why[:160]} | |"
                        )
                        continue
                    ratio = paired_ratios(theirs, ours)
                    add(
                        f"| {s3['server_label']} | {ws} | {op} | {BASELINE_NAMES[base]} | "
                        f"{Series(ours).fmt(2)} | {Series(theirs).fmt(2)} | {ratio.fmt(2, 'x')} | "
                        f">= {goal} | {_met(ratio, goal)} | "
                        f"{Series(_cpus(t, 'objckpt', op)).median:.2f} / {Series(_cpus(t, base, op)).median:.2f} |"
                    )
    add("")
    if notes:
        add("Errors recorded by the runs:")
        add("")
        for n in notes:
            add(f"* {n}".replace("\n", " "))
        add("")

    # -- 3: file
    add("### 3. Local disk: objckpt `file://` vs DCP `FileSystemWriter`/`FileSystemReader`")
    add("")
    f = results.get("file", {})
    if "times" in f:
        add(
            f"Same disk ({f['dir']}), {f['state_bytes'] / MiB:.0f} MiB, DCP `thread_count="
            f"{f['dcp_threads']}`, `sync_files=True`; loads come from the page cache for both."
        )
        add("")
        add("| op | objckpt s | DCP s | speed ratio | goal | met |")
        add("|---|---|---|---|---|---|")
        for op in ("save", "load"):
            ours, theirs = _walls(f["times"], "objckpt", op), _walls(f["times"], "dcp_fs", op)
            ratio = paired_ratios(theirs, ours)
            add(
                f"| {op} | {Series(ours).fmt(2)} | {Series(theirs).fmt(2)} | {ratio.fmt(2, 'x')} | "
                f">= 1.0 | {_met(ratio, 1.0)} |"
            )
    else:
        add(f"error: {f.get('error', 'not run')[:1500]}")
    add("")

    # -- 4: async
    add("### 4. Async save")
    add("")
    asy = async_world(results, ASYNC_WORLDS[0])
    steady = async_world(results, ASYNC_WORLDS[1])
    if asy and _walls(asy[1]["times"], "objckpt_async", "save"):
        label, w = asy
        sync = _walls(w["times"], "objckpt", "save")
        total = _walls(w["times"], "objckpt_async", "save")
        block = w.get("async_blocking", [])
        add(
            "| server | managers | sync save s | save_async blocking s | save_async total s | "
            "total / sync | blocking / sync | server system CPU s, sync / async | "
            "free MiB never reported at the start, sync / async |"
        )
        add("|---|---|---|---|---|---|---|---|---|")
        add(
            f"| {label} | a new one per save (cold) | {Series(sync).fmt(2)} | {Series(block).fmt(3)} | "
            f"{Series(total).fmt(2)} | {paired_ratios(total, sync).fmt(2, 'x')} | {paired_ratios(block, sync).fmt(3)} | "
            f"{_pair(w, 'objckpt', 'objckpt_async')} |"
        )
        sw = steady[1] if steady else {"times": {}}
        s_sync = _walls(sw["times"], "objckpt_steady", "save")
        s_total = _walls(sw["times"], "objckpt_async_steady", "save")
        s_block = sw.get("async_steady_blocking", [])
        if s_sync and s_total:
            add(
                f"| {label} | one for the run (steady) | {Series(s_sync).fmt(2)} | {Series(s_block).fmt(3)} | "
                f"{Series(s_total).fmt(2)} | {paired_ratios(s_total, s_sync).fmt(2, 'x')} | "
                f"{paired_ratios(s_block, s_sync).fmt(3)} | "
                f"{_pair(sw, 'objckpt_steady', 'objckpt_async_steady')} |"
            )
        add("")
        add(
            "Cold: the first `save_async` of a manager allocates and first-touches its staging buffer "
            "inside the timed save; steady: one manager for the run, its staging reused, the first "
            "save an untimed warm-up; each pair timed in a 1-rank world of its own (`s3_bench` docstring). Server system CPU: the S3 server's "
            "kernel time during each timed save (it runs on this machine and writes every object into "
            "page-cache pages; `s3_bench` docstring). It is ~1.3 s for a 512 MiB save when the pages it "
            "gets are backed by the host; a run where it is several seconds more is that much slower, "
            "whichever case it was. Free MiB never reported: the free memory the host still backs "
            "when the save starts (`common.unreported_free_mib`); the server's page-cache writes "
            "take it first, and pay a host fault a page once it runs out."
        )
    else:
        why = ""
        if asy:
            why = (asy[1].get("errors") or {}).get("objckpt_async", "")
        add(f"S3 `save_async` not measured in this run: {why or 'the S3 leg did not run'}.")
    add("")
    add("Training-step slowdown while a save is in flight (file://, toy CPU MLP loop, one torch thread):")
    add("")
    a = results.get("async", {})
    if "cases" in a:
        add(
            f"{a['mib']} MiB state; memcpy floor {Series(a['memcpy_floor_s']).fmt(3, ' s')}, sync save {Series(a['sync_save_s']).fmt(2, ' s')}."
        )
        add("")
        add("| uploader | step time during save / without | blocking s | start to commit s |")
        add("|---|---|---|---|")
        for case, rows in a["cases"].items():
            add(
                f"| {case} | {Series([r['slowdown'] for r in rows]).fmt(2, 'x')} | "
                f"{Series([r['blocked_s'] for r in rows]).fmt(3)} | {Series([r['total_s'] for r in rows]).fmt(2)} |"
            )
    else:
        add(f"not measured: {a.get('error', 'leg skipped')[:600]}")
    add("")

    # -- 5: memory
    add("### 5. Peak memory of a sync save (subprocess per size)")
    add("")
    add(
        "Extra = peak RSS during `CheckpointManager.save` minus RSS just before it (the state "
        "itself is excluded); traced = tracemalloc peak (Python-heap buffers). Bound: "
        "part_size x (max_in_flight + 1) = 16 MiB x 9 = 144 MiB. Restore (for information) "
        "stages the decoded state before applying it, so it needs about 1x state by design."
    )
    add("")
    add(
        "| store | state MiB | save extra RSS MiB | save traced peak MiB | bound MiB | within bound | restore extra RSS MiB |"
    )
    add("|---|---|---|---|---|---|---|")
    mem = results.get("memory", [])
    by_store: dict[str, list[float]] = {}
    for r in mem:
        label = r.get("server", r["store"]) if r["store"] == "s3" else "file://"
        if "error" in r:
            add(f"| {label} | {r['mib']} | error: {r['error'][-300:]} | | | | |".replace("\n", " "))
            continue
        bound = r["part_size"] * (r["max_in_flight"] + 1)
        extra = r["save"]["extra_rss"]
        by_store.setdefault(label, []).append(extra)
        add(
            f"| {label} | {r['mib']} | {extra / MiB:.1f} | {r['save']['traced_peak'] / MiB:.1f} | "
            f"{bound / MiB:.0f} | {'yes' if extra <= bound else '**NO**'} | "
            f"{r['restore']['extra_rss'] / MiB:.1f} |"
        )
    add("")
    for label, extras in by_store.items():
        if len(extras) > 1:
            grow = (extras[-1] - extras[0]) / MiB
            add(
                f"* {label}: extra memory from the smallest to the largest state changes by "
                f"{grow:+.1f} MiB (goal: not growing with shard size once the state exceeds "
                "the bound)."
            )
    add("")
    ranks_rows = results.get("memory_ranks", [])
    if ranks_rows:
        from benchmarks.mem_bench import _ranks_report

        add(
            "Read-once restore at several gloo ranks (`mem_bench --ranks`, file://): per rank, peak RSS "
            "during `CheckpointManager.restore` over RSS just before it; goal: the worst rank's extra "
            "<= 1.1x the replicated state (the staged copy only, not a second one for the exchange)."
        )
        add("")
        for row in ranks_rows:
            add(f"* {_ranks_report(row)}")
        add("")

    # -- 6: resolve
    add("### 6. Resolve latest (`Reader.latest()`) vs number of committed checkpoints")
    add("")
    rs = results.get("resolve", {})
    if "rows" in rs:
        add(f"Server: {rs['server']}. Requests counted with `CountingStore`; time median [min-max] of 5.")
        add("")
        add("| checkpoints | LATEST pointer | requests | by op | time s | goal | met |")
        add("|---|---|---|---|---|---|---|")
        # invariant 10: the request count does not grow with the number of old checkpoints
        # (a listing page holds 1,000 keys, so without a pointer one more page per 1,000)
        first = {}
        for r in rs["rows"]:
            first.setdefault(r["case"], r)
        for r in rs["rows"]:
            base = first[r["case"]]
            if r["case"] == "pointer":
                ok, goal = r["requests"] == base["requests"], "constant in N"
            else:
                pages = -(-r["n"] // 1000) - -(-base["n"] // 1000)
                ok, goal = r["requests"] <= base["requests"] + pages, "+1 per 1,000 checkpoints at most"
            add(
                f"| {r['n']} | {'present' if r['case'] == 'pointer' else 'missing'} | {r['requests']} | "
                f"{json.dumps(r['by_op'], sort_keys=True)} | {Series(r['seconds']).fmt(4)} | {goal} | "
                f"{'**met**' if ok else '**NOT met**'} |"
            )
    else:
        add(f"error: {rs.get('error', 'not run')[:1500]}")
    add("")
    # -- 7: GPU
    add("### 7. GPU: pinned staging and `save_async` blocking on CUDA tensors")
    add("")
    from benchmarks.gpu_bench import summary as gpu_summary

    g = results.get("gpu") or {"skipped": "leg not run"}
    add("; ".join(gpu_summary(g)) + ".")
    add("")

    # -- 8: the table
    from benchmarks.scoreboard import render as scoreboard

    add("### 8. Issue 14 table: every path against its peer, this run")
    add("")
    lines.extend(scoreboard(results))
    add("")
    return "\n".join(lines)


def write_report(body: str, mode: str, path: Path) -> None:
    begin, end = f"<!-- BEGIN {mode} results (benchmarks/run.py) -->", f"<!-- END {mode} results -->"
    block = f"{begin}\n{body}\n{end}"
    if path.exists():
        text = path.read_text()
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            path.write_text(head + block + tail)
            return
        path.write_text(text.rstrip() + f"\n\n## {mode.capitalize()} run\n\n{block}\n")
        return
    path.write_text(
        "# objckpt benchmarks\n\n"
        "Regenerate with `.venv/bin/python -m benchmarks.run` (full) or `--quick` (smoke); each "
        "run replaces only its own section below.\n\n"
        f"## {mode.capitalize()} run\n\n{block}\n"
    )


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke version (64 MiB state)")
    ap.add_argument("--runs", type=int, help="runs per measurement (>= 3; default 3)")
    ap.add_argument("--mib", type=int, help="state size in MiB for the S3 and file legs")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["localstack", "moto", "file", "memory", "resolve", "async", "gpu"],
        help="leave a leg out (repeatable)",
    )
    ap.add_argument("--localstack-endpoint", help="use a running LocalStack")
    ap.add_argument("--moto-endpoint", help="use a running moto server")
    ap.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    ap.add_argument(
        "--results-dir",
        default=str(REPO / "build" / "benchmarks"),
        help="where the raw results (JSON) and the legs' files go",
    )
    args = ap.parse_args(argv)

    mode_name = "quick" if args.quick else "full"
    mode = dict(MODES[mode_name])
    if args.runs:
        mode["runs"] = max(3, args.runs)
    if args.mib:
        mode["mib"] = mode["file_mib"] = args.mib
    out_dir = Path(args.results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "mode": mode_name,
        "started": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "params": mode,
        "s3": [],
    }
    endpoints = {"localstack": args.localstack_endpoint, "moto": args.moto_endpoint}
    servers = []
    if "localstack" not in args.skip:
        if localstack_available() or args.localstack_endpoint:
            servers.append("localstack")
        else:
            results["s3"].append(
                {"server": "localstack", "error": "LocalStack is not installed (bash scripts/localstack.sh)"}
            )
    if "moto" not in args.skip:
        servers.append("moto")
    for kind in servers:
        try:
            results["s3"].append(s3_legs(kind, mode, out_dir, endpoints[kind]))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            results["s3"].append({"server": kind, "error": f"{type(exc).__name__}: {exc}"})
    if "file" not in args.skip:
        results["file"] = file_leg(mode, out_dir)
    if "async" not in args.skip:
        results["async"] = async_leg(mode, out_dir)
    if "gpu" not in args.skip:
        from benchmarks.gpu_bench import bench as gpu_bench

        try:
            results["gpu"] = gpu_bench(mode["file_mib"], max(3, mode["runs"]))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            results["gpu"] = {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    first = servers[0] if servers else None
    if "memory" not in args.skip:
        try:
            results["memory"] = mem_leg(mode, first, endpoints.get(first or ""))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results["memory"] = [{"store": "?", "mib": 0, "error": f"{type(exc).__name__}: {exc}"}]
        try:
            results["memory_ranks"] = mem_ranks_leg(mode)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results["memory_ranks"] = [
                {"ranks": 0, "state_bytes": 0, "error": f"{type(exc).__name__}: {exc}"}
            ]
    if "resolve" not in args.skip and first:
        try:
            results["resolve"] = resolve_leg(mode, first, endpoints.get(first))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            results["resolve"] = {"error": f"{type(exc).__name__}: {exc}"}
    results["machine"].update(host_state("end"))
    results["elapsed_s"] = time.monotonic() - started
    (out_dir / f"results-{mode_name}.json").write_text(json.dumps(results, indent=1, default=str))
    body = render(results)
    print("\n" + body)
    write_report(body, mode_name, Path(args.out))
    log(f"wrote {args.out} ({mode_name} section) and {out_dir / f'results-{mode_name}.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
