"""The scale report: objckpt's real save / commit / resolve / restore / retention at 8 to 16,384
ranks against a simulated S3 (and GCS), on a virtual clock. Writes ``SCALE.md``.

    .venv/bin/python -m benchmarks.scale                  # everything, writes SCALE.md
    .venv/bin/python -m benchmarks.scale --sizes 8,64 --fix-sizes '' --gcs-sizes ''   # a quick look
    .venv/bin/python -m benchmarks.scale --one 512 --fixes all --json /tmp/r.json      # one scenario

Each scenario runs in its own process (``--one``) so that thousands of threads, their memory and
a possible runaway stay contained; the parent collects the JSON and renders the tables
(:mod:`benchmarks.scale_report`). Scenarios: S3 at every size *before* (every fix off: today's
design before the scale fixes) and *after* (every built fix on); at ``--fix-sizes`` each built fix
alone; GCS before (and after at its largest size). Raw results go to ``build/scale/results.json``.

The simulator and its model are documented in ``objckpt/testing/scale`` and in the generated
``SCALE.md``; this module only chooses the scenarios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python benchmarks/scale.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from objckpt.testing.scale import NetworkModel, ScaleOptions, StoreProfile  # noqa: E402
from objckpt.testing.scale import fixes as fixes_mod  # noqa: E402
from objckpt.testing.scale.fixes import spread_boundaries  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = (8, 64, 512, 4096, 16384)
FIX_SIZES = (512,)
GCS_SIZES = (64, 512, 4096)
#: each stored byte stands for this many (see NetworkModel.byte_scale): 4 KiB shards are 16 MiB
BYTE_SCALE = 4096
SHARD_BYTES = 4096
REPLICATED_BYTES = 4 * 1024 * 1024
#: real seconds one scenario may take before it is stopped (and reported as such); beyond
#: MAX_THREADS ranks without read-once BIG_TIMEOUT_S (16,384 ranks, before: 7.6 min here, its
#: save 4.8 min for 557,379 requests on 16,384 threads, its restore 2.4 min to a 100,000-request
#: budget); with read-once there TIMEOUT_S (2026-12-02: 3.9 min, its restore 137 s real)
TIMEOUT_S = 1200
BIG_TIMEOUT_S = 600
#: requests a restore may make before the simulation stops it (today's restore at 4,096 ranks
#: needs 16.8 M GETs; ~100 us of this machine per simulated request); beyond MAX_THREADS ranks
#: without read-once BIG_RESTORE_BUDGET (today's restore there needs 268 M GETs: the budget only
#: shows the rate); read-once there needs 131,077
RESTORE_BUDGET = 1_500_000
BIG_RESTORE_BUDGET = 50_000
#: ranks beyond this share threads in a save (objckpt.testing.scale.world). A read-once restore
#: needs a thread per rank (``ScaleOptions.restore_max_threads``: ``read_shared`` is a collective
#: of every rank): 16,384 threads run here since the simulator memoizes ``read_shared``'s plan and
#: check (``plan_shared``/``check_received``, computed once for every rank; before, each rank's
#: O(W) Python planning made that restore stall for minutes before its first shard read)
MAX_THREADS = 4096


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def fix_set(spec: str, size: int) -> list[str]:
    """``""``: none (before); ``"all"``: every built fix; else a comma list of fix options."""
    return [f.option for f in fixes_mod.built()] if spec == "all" else [x for x in spec.split(",") if x]


def _read_once_big(fixes: list[str], size: int) -> bool:
    """A read-once restore beyond MAX_THREADS ranks: a thread per rank in the restore."""
    return size > MAX_THREADS and "replicated_read_once" in fixes


def options_for(size: int, *, profile: str = "s3", fixes: str = "") -> ScaleOptions:
    """The scenario of one size: 8 shards per rank (7 x 16 MiB + 1/N of a 16 GiB replicated
    state, modelled), two saves below 4,096 ranks (the second, reported, has a parent and
    retention deletes the first), one from 4,096 on (each save costs minutes here), then a
    restore. S3: a bucket whose ``data/`` is partitioned at the 256 spreading prefixes, in both
    columns (the old layout's keys all fall into one of those ranges)."""
    chosen = fix_set(fixes, size)
    fix_flags: dict[str, Any] = dict.fromkeys(chosen, True)
    big = size > MAX_THREADS and not _read_once_big(chosen, size)
    return ScaleOptions(
        world_size=size,
        shards_per_rank=8,
        shard_bytes=SHARD_BYTES,
        replicated_bytes=REPLICATED_BYTES,
        profile=(
            StoreProfile.s3(initial_boundaries=spread_boundaries()) if profile == "s3" else StoreProfile.gcs()
        ),
        network=NetworkModel(byte_scale=BYTE_SCALE),
        saves=2 if size < 4096 else 1,
        max_threads=MAX_THREADS,
        restore_max_threads=size if _read_once_big(chosen, size) else None,
        max_restore_requests=BIG_RESTORE_BUDGET if big else RESTORE_BUDGET,
        **fix_flags,
    )


def run_one(size: int, profile: str, fixes: str, out: Path) -> None:
    from objckpt.testing.scale import run_scenario

    options = options_for(size, profile=profile, fixes=fixes)
    threads = f"{options.threads} threads"
    if options.restore_threads != options.threads:
        threads += f" ({options.restore_threads} in the restore)"
    log(f"{profile} {size} ranks, fixes: {', '.join(options.fixes) or 'none'}; {threads}")
    result = run_scenario(options, log=lambda m: log(m), progress_s=120.0)
    out.write_text(json.dumps(result.to_dict(), default=str))
    log(f"{profile} {size} ranks done in {result.wall_s:.0f}s")


def spawn(size: int, profile: str, fixes: str, tmp: Path, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Run one scenario in a child process; its result, or ``{"error": ...}``."""
    out = tmp / f"{profile}-{size}-{fixes.replace(',', '+') or 'before'}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.scale", "--one", str(size), "--profile", profile]
    cmd += ["--fixes", fixes, "--json", str(out)]
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired as exc:
        progress = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        sys.stdout.write(progress)
        lines = [line.split("] ", 1)[-1].strip() for line in progress.splitlines() if "] " in line][1:]
        # the phases that finished, and the running one's last count
        done = [x for x in lines if not x.startswith("...")] + [x for x in lines if x.startswith("...")][-1:]
        return {
            "error": f"stopped after {timeout_s / 60:.0f} min of this machine; done by then: "
            + ("; ".join(done) or "nothing"),
            "process_s": time.monotonic() - started,
        }
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stdout + proc.stderr)[-2000:], "process_s": time.monotonic() - started}
    result: dict[str, Any] = json.loads(out.read_text())
    result["process_s"] = time.monotonic() - started
    result["fix_set"] = fix_set(fixes, size)
    return result


def sweep(kind: str, fixes: str = "") -> list[dict[str, Any]]:
    """Small in-process sweeps at 64 ranks, rate limits off (counts only): shards per rank, and
    saves in a run root's history."""
    from objckpt.testing.scale import run_scenario

    rows = []
    base = replace(options_for(64, fixes=fixes), profile=StoreProfile.unlimited(), saves=1)
    if kind == "shards":
        for shards in (2, 4, 8, 16):
            r = run_scenario(replace(base, shards_per_rank=shards, saves=2))
            save, restore = r.saves[-1], r.restore
            rows.append(
                {
                    "shards": 64 * shards,
                    "save": save.requests,
                    "commit_lists": save.data_lists.get("commit", 0),
                    "rank_lists": save.data_lists.get("save", 0) + save.data_lists.get("write", 0),
                    "resolve": restore.requests_by_phase.get("resolve", {}) if restore else {},
                    "stage": restore.requests_by_phase.get("stage", {}) if restore else {},
                }
            )
    else:
        r = run_scenario(replace(base, saves=6, keep_last=2))
        for s in r.saves:
            rows.append({"step": s.step, "save": s.requests, "by_phase": s.requests_by_phase})
        rows.append({"restore": r.restore.requests if r.restore else {}})
    return rows


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--fix-sizes", default=",".join(map(str, FIX_SIZES)), help="each fix alone ('' to skip)")
    ap.add_argument("--gcs-sizes", default=",".join(map(str, GCS_SIZES)), help="'' to skip GCS")
    ap.add_argument("--out", default=None, help="markdown to write (default SCALE.md for the full run)")
    ap.add_argument("--one", type=int, help="run one scenario of this many ranks (internal)")
    ap.add_argument("--profile", choices=["s3", "gcs"], default="s3")
    ap.add_argument("--fixes", default="", help="with --one: '' (before), 'all', or a comma list")
    ap.add_argument("--json", help="with --one: where to write the result")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite SCALE.md from build/scale/results.json (no simulation)",
    )
    args = ap.parse_args(argv)
    if args.one:
        run_one(args.one, args.profile, args.fixes, Path(args.json))
        return 0

    from benchmarks.scale_report import render

    if args.render_only:
        saved = json.loads((REPO / "build" / "scale" / "results.json").read_text())
        loaded = {kind: {int(n): r for n, r in rows.items()} for kind, rows in saved["runs"].items()}
        target = Path(args.out) if args.out else REPO / "SCALE.md"
        target.write_text(render(loaded, saved["sweeps"], saved.get("total_s", 0.0), argv=[]))
        log(f"wrote {target} from the saved results")
        return 0

    started = time.monotonic()
    sizes, fix_sizes, gcs_sizes = _sizes(args.sizes), _sizes(args.fix_sizes), _sizes(args.gcs_sizes)
    full = tuple(sizes) == SIZES
    out = Path(args.out) if args.out else (REPO / "SCALE.md" if full else None)
    tmp = REPO / "build" / "scale"
    tmp.mkdir(parents=True, exist_ok=True)
    built = [f.option for f in fixes_mod.built()]
    runs: dict[str, dict[int, dict[str, Any]]] = {"before": {}, "after": {}, "gcs": {}, "gcs_after": {}}
    runs.update({option: {} for option in built})
    # (table, size, profile, fixes, time limit): the biggest size last, so that a run stopped
    # by hand still leaves every smaller table written (SCALE.md is rewritten after each one)
    jobs: list[tuple[str, int, str, str, float]] = []
    small = [n for n in sizes if n <= MAX_THREADS]
    for n in small:
        jobs.append(("before", n, "s3", "", TIMEOUT_S))
        if built:
            jobs.append(("after", n, "s3", "all", TIMEOUT_S))
    jobs += [(option, n, "s3", option, TIMEOUT_S) for option in built for n in fix_sizes]
    jobs += [("gcs", n, "gcs", "", TIMEOUT_S) for n in gcs_sizes]
    if gcs_sizes and built:
        # read-once at 4,096 ranks costs ~4 min here (its restore 183 s real): the middle size
        n = sorted(gcs_sizes)[len(gcs_sizes) // 2]
        jobs.append(("gcs_after", n, "gcs", "all", TIMEOUT_S))
    for n in sizes:
        if n > MAX_THREADS:  # ranks share threads: before, a time limit and a smaller restore budget
            jobs.append(("before", n, "s3", "", BIG_TIMEOUT_S))
            if built:  # with read-once: a thread per rank in the restore (options_for)
                jobs.append(("after", n, "s3", "all", TIMEOUT_S))
    log("sweeps (64 ranks): shards per save, history")
    sweeps = {"shards": sweep("shards"), "history": sweep("history")}
    if built:
        sweeps["shards_after"] = sweep("shards", "all")
        sweeps["history_after"] = sweep("history", "all")

    def write() -> str:
        total_s = time.monotonic() - started
        (tmp / "results.json").write_text(
            json.dumps({"runs": runs, "sweeps": sweeps, "total_s": total_s}, default=str)
        )
        text = render(runs, sweeps, total_s, argv=sys.argv[1:] if argv is None else argv)
        if out is not None:
            out.write_text(text)
        return text

    for table, n, profile, fixes, limit in jobs:
        runs[table][n] = spawn(n, profile, fixes, tmp, limit)
        write()
    for kind, results in runs.items():
        for size, result in results.items():
            failed = " ERROR" if "error" in result else ""
            log(f"{kind} {size:>6} ranks: {result.get('process_s', 0):.0f}s real{failed}")
    text = write()
    if out is not None:
        log(f"wrote {out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
