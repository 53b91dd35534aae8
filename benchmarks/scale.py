"""The scale report: objckpt's real save / commit / resolve / restore / retention at 8 to 16,384
ranks against a simulated S3 (and GCS), on a virtual clock. Writes ``SCALE.md``.

    .venv/bin/python -m benchmarks.scale                  # every size, writes SCALE.md (~30 min here)
    .venv/bin/python -m benchmarks.scale --sizes 8,64     # a quick look (not written unless --out)
    .venv/bin/python -m benchmarks.scale --one 512 --json /tmp/r.json   # one scenario

Each scenario runs in its own process (``--one``) so that thousands of threads, their memory and
a possible runaway stay contained; the parent collects the JSON and renders the tables. For each
size the scenario runs "before" (every fix option off, today's design) and, for every fix that is
built (:mod:`objckpt.testing.scale.fixes`), "after" (those fixes on). Raw results go to
``build/scale/results.json``.

The simulator and its model are documented in ``objckpt/testing/scale`` and in the generated
``SCALE.md``; this module only chooses the scenarios and renders them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python benchmarks/scale.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from objckpt.testing.scale import FIXES, SOURCES, NetworkModel, ScaleOptions, StoreProfile  # noqa: E402
from objckpt.testing.scale import fixes as fixes_mod  # noqa: E402
from objckpt.testing.scale.fixes import spread_boundaries  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIZES = (8, 64, 512, 4096, 16384)
GCS_SIZES = (64, 512, 4096)
#: each stored byte stands for this many (see NetworkModel.byte_scale): 4 KiB shards are 16 MiB
BYTE_SCALE = 4096
SHARD_BYTES = 4096
REPLICATED_BYTES = 4 * 1024 * 1024
GiB = 1024**3
MiB = 1024**2
TIMEOUT_S = 3600
#: requests a restore may make before the simulation stops it (today's restore at 4,096 ranks
#: needs 16.8 M GETs; ~100 us of this machine per simulated request)
RESTORE_BUDGET = 1_500_000
#: ranks beyond this share threads (objckpt.testing.scale.world); read-once cannot run there
MAX_THREADS = 4096


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ scenarios


def options_for(size: int, *, profile: str = "s3", after: bool = False) -> ScaleOptions:
    """The scenario of one size: 8 shards per rank (7 x 16 MiB + 1/N of a 16 GiB replicated
    state, modelled), two saves (one from 4,096 ranks on: each save costs minutes here), then a
    restore. S3: a bucket whose ``data/`` is partitioned at the 256 spreading prefixes in both
    columns (the old layout's keys all fall into one of them). ``after``: every built fix on,
    except read-once where ranks share threads (16,384: see ``AFTER_WITHOUT_READ_ONCE``)."""
    fix_options = {f.option: True for f in fixes_mod.built()} if after else {}
    if after and size > MAX_THREADS:
        fix_options.pop("replicated_read_once", None)
    return ScaleOptions(
        world_size=size,
        shards_per_rank=8,
        shard_bytes=SHARD_BYTES,
        replicated_bytes=REPLICATED_BYTES,
        profile=StoreProfile.s3(initial_boundaries=spread_boundaries())
        if profile == "s3"
        else StoreProfile.gcs(),
        network=NetworkModel(byte_scale=BYTE_SCALE),
        saves=2 if size < 4096 else 1,
        max_threads=MAX_THREADS,
        max_restore_requests=RESTORE_BUDGET,
        **fix_options,
    )


def run_one(size: int, profile: str, after: bool, out: Path) -> None:
    from objckpt.testing.scale import run_scenario

    options = options_for(size, profile=profile, after=after)
    log(f"{profile} {size} ranks ({'after' if after else 'before'}), {options.threads} threads")
    result = run_scenario(options, log=lambda m: log(m))
    out.write_text(json.dumps(result.to_dict(), default=str))
    log(f"{profile} {size} ranks done in {result.wall_s:.0f}s")


def spawn(size: int, profile: str, after: bool, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{profile}-{size}-{'after' if after else 'before'}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.scale", "--one", str(size), "--profile", profile]
    if after:
        cmd.append("--after")
    cmd += ["--json", str(out)]
    started = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=TIMEOUT_S, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {TIMEOUT_S}s", "process_s": time.monotonic() - started}
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stdout + proc.stderr)[-2000:], "process_s": time.monotonic() - started}
    result: dict[str, Any] = json.loads(out.read_text())
    result["process_s"] = time.monotonic() - started
    return result


def sweep(kind: str) -> list[dict[str, Any]]:
    """Small in-process sweeps at 64 ranks, rate limits off (counts only): shards per rank, and
    saves in a run root's history."""
    from objckpt.testing.scale import run_scenario

    rows = []
    base = replace(options_for(64), profile=StoreProfile.unlimited(), saves=1)
    if kind == "shards":
        for shards in (2, 4, 8, 16):
            r = run_scenario(replace(base, shards_per_rank=shards, saves=2))
            save, restore = r.saves[-1], r.restore
            rows.append(
                {
                    "shards": 64 * shards,
                    "save": save.requests,
                    "commit_lists": save.data_lists.get("commit", 0),
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


# ------------------------------------------------------------------------------------ rendering


def _n(x: float | int | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{int(x):,}"


def _bytes(real: int | None) -> str:
    if real is None:
        return "-"
    b = real * BYTE_SCALE
    if b >= GiB:
        return f"{b / GiB:,.1f} GiB"
    return f"{b / MiB:,.1f} MiB"


def _s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.1f} s" if x >= 10 else f"{x:.2f} s"


def _ops(req: dict[str, int]) -> dict[str, int]:
    """Primitive ops as the request kinds of the providers."""
    out = {"PUT": 0, "GET": 0, "HEAD": 0, "LIST": 0, "DELETE": 0, "other": 0}
    for op, n in req.items():
        if op == "put" or op in ("create_upload", "upload_part", "complete_upload"):
            out["PUT"] += n
        elif op in ("get", "open"):
            out["GET"] += n
        elif op == "head":
            out["HEAD"] += n
        elif "list" in op:
            out["LIST"] += n
        elif "delete" in op:
            out["DELETE"] += n
        else:
            out["other"] += n
    return out


def _last_save(r: dict[str, Any]) -> dict[str, Any] | None:
    saves = [s for s in r.get("saves", []) if not s["seeded"]]
    return saves[-1] if saves else None


def _seeded(r: dict[str, Any]) -> dict[str, Any] | None:
    saves = [s for s in r.get("saves", []) if s["seeded"]]
    return saves[-1] if saves else None


def _hot(p: dict[str, Any] | None) -> str:
    if not p or not p.get("hottest"):
        return "-"
    h = p["hottest"]
    return f"{_n(h['offered_per_s'])}/s {h['kind']}s vs {_n(h['limit_per_s'])}/s ({h['ratio']:.2f}x)"


def _outcome(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    if p["ok"]:
        return "**committed**" if p["kind"] == "save" else "**restored**"
    if p["outcome"].startswith("SlowDown surfaced"):
        return f"**FAILED**: SlowDown surfaced ({_n(p['failed_ranks'])} ranks)"
    return f"**FAILED**: {p['outcome'][:80]}"


def _slow(p: dict[str, Any] | None) -> str:
    if p is None:
        return "-"
    gave = p.get("gave_up_by_phase", {})
    parts = [f"{_n(p['slowdowns_injected'])} / {_n(p['slowdowns_absorbed'])}"]
    if gave:
        parts.append(" / gave up: " + ", ".join(f"{_n(n)} ({ph})" for ph, n in sorted(gave.items())))
    else:
        parts.append(" / 0")
    return "".join(parts)


def main_table(results: dict[int, dict[str, Any]], sizes: list[int]) -> list[str]:
    cols = [results.get(n, {}) for n in sizes]
    head = "| | " + " | ".join(f"{n:,} ranks" for n in sizes) + " |"
    sep = "|---|" + "---|" * len(sizes)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, fn: Any) -> None:
        cells = []
        for r in cols:
            try:
                cells.append(fn(r) if r and "error" not in r else ("error" if r else "-"))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("-")
        rows.append((label, cells))

    def save_ops(r: dict[str, Any], kind: str) -> str:
        s = _last_save(r)
        return _n(_ops(s["requests"])[kind]) if s else "-"

    row("**save** (last save of the run, rate limits on)", lambda r: _outcome(_last_save(r)))
    row("shards per save", lambda r: _n(r["options"]["world_size"] * r["options"]["shards_per_rank"]))
    for kind in ("PUT", "GET", "HEAD", "LIST", "DELETE"):
        row(f"requests per save: {kind} (tries)", lambda r, k=kind: save_ops(r, k))
    row("requests by the busiest other rank", lambda r: _n(sum(_last_save(r)["other_ranks_max"].values())))
    row("requests by rank 0 (coordinator)", lambda r: _n(sum(_last_save(r)["rank0"].values())))
    row("SlowDowns: injected / absorbed / gave up", lambda r: _slow(_last_save(r)))
    row("hottest partition, peak offered rate vs limit", lambda r: _hot(_last_save(r)))
    row("partitions (S3 ranges) at the end", lambda r: _n(_last_save(r)["partitions"]))
    row(
        "commit verification: LIST pages of the attempt",
        lambda r: (
            f"{_n(_last_save(r)['data_lists'].get('commit', 0))} "
            f"(shards/1,000 = {_n(r['options']['world_size'] * r['options']['shards_per_rank'] / 1000)})"
        ),
    )
    row(
        "commit: requests by rank 0 in `Coordinator.commit`",
        lambda r: _n(sum(_last_save(r)["requests_by_phase"].get("commit", {}).values())),
    )
    row(
        "commit CPU, rank 0 thread (`thread_time`, store excluded)",
        lambda r: _s(_last_save(r)["commit_thread_cpu_s"]),
    )
    row("commit CPU, whole process (`process_time`)", lambda r: _s(_last_save(r)["commit_process_cpu_s"]))
    row(
        "retention after the commit: requests (HEADs)",
        lambda r: (
            f"{_n(sum(_last_save(r)['requests_by_phase'].get('retain', {}).values()))} "
            f"({_n(_last_save(r)['requests_by_phase'].get('retain', {}).get('head', 0))})"
        ),
    )
    row("retention, modelled time on rank 0", lambda r: _s(_last_save(r)["retention_s"]))
    row("modelled save time (every rank has the outcome)", lambda r: _s(_last_save(r)["virtual_s"]))
    row("seeded save (rate limits off), when no save committed", lambda r: _seeded_cell(_seeded(r)))
    row("**restore** (rate limits on)", lambda r: _outcome(r.get("restore")))
    row("GETs the restore needs (today's rule)", lambda r: _n(r["restore"]["planned_reads"]))
    row("requests made: GET / LIST", lambda r: _restore_ops(r["restore"]))
    row(
        "resolve: requests by rank 0 / LISTs by other ranks",
        lambda r: (
            f"{_n(sum(r['restore']['requests_by_phase'].get('resolve', {}).values()))} / "
            f"{_n(r['restore']['other_ranks_lists'])}"
        ),
    )
    row("SlowDowns: injected / absorbed / gave up", lambda r: _slow(r["restore"]))
    row("hottest partition, peak offered rate vs limit", lambda r: _hot(r["restore"]))
    row("bytes each rank needs (modelled)", lambda r: _bytes(r["restore"]["rank_planned_bytes_max"]))
    row("bytes the job needs / unique bytes", lambda r: _ratio_cell(r))
    row("bytes read before the end (job, modelled)", lambda r: _bytes(r["restore"]["bytes_read"]))
    row("modelled restore time (to success or failure)", lambda r: _s(r["restore"]["virtual_s"]))
    row(
        "lower bound: needed GETs / partition read limit",
        lambda r: _s(r["restore"]["planned_reads"] / r["restore"]["hottest"]["limit_per_s"]),
    )
    row("**manifest** bytes", lambda r: _n(r["manifest_bytes"]))
    row(
        "`Manifest.decode` / `encode` (real CPU)",
        lambda r: f"{_s(r['manifest_decode_s'])} / {_s(r['manifest_encode_s'])}",
    )
    row(
        "threads (ranks per thread)",
        lambda r: f"{_n(r['options']['threads'])} ({r['options']['world_size'] // r['options']['threads']})",
    )
    row(
        "scheduler hand-overs / lag violations",
        lambda r: f"{_n(r['pace_waits'])} / {_n(r['lag_violations'])}",
    )
    row("**real time of the scenario** (this machine)", lambda r: _s(r.get("process_s", r["wall_s"])))
    out = [head, sep]
    for label, cells in rows:
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _seeded_cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "not needed"
    ops = _ops(s["requests"])
    return (
        f"{_outcome(s)}: {_n(ops['PUT'])} PUT, {_n(ops['HEAD'])} HEAD, {_n(ops['LIST'])} LIST, "
        f"commit CPU {_s(s['commit_thread_cpu_s'])}, retention {_s(s['retention_s'])}"
    )


def _restore_ops(p: dict[str, Any]) -> str:
    ops = _ops(p["requests"])
    return f"{_n(ops['GET'])} / {_n(ops['LIST'])}"


def _ratio_cell(r: dict[str, Any]) -> str:
    p = r["restore"]
    return f"{_bytes(p['planned_read_bytes'])} / {_bytes(r['unique_bytes'])} = {p['planned_read_bytes'] / r['unique_bytes']:,.1f}x"


def goals(results: dict[int, dict[str, Any]]) -> list[str]:
    r = results.get(4096)
    if not r or "error" in r:
        return ["(the 4,096-rank scenario did not run)"]
    save, restore = _last_save(r), r.get("restore")
    assert save is not None
    shards = r["options"]["world_size"] * r["options"]["shards_per_rank"]
    gave_save = save["slowdowns_gave_up"]
    gave_restore = restore["slowdowns_gave_up"] if restore else 0
    surfaced = (not save["ok"] and save["outcome"].startswith("SlowDown")) or (
        restore is not None and not restore["ok"] and restore["outcome"].startswith("SlowDown")
    )
    hot = max(save["hottest"]["ratio"], restore["hottest"]["ratio"] if restore else 0)
    ratio = restore["planned_read_bytes"] / r["unique_bytes"] if restore else math.nan
    resolve = restore["requests_by_phase"].get("resolve", {}) if restore else {}
    lists_rank0 = sum(n for op, n in resolve.items() if "list" in op)
    pages = save["data_lists"].get("commit", 0) or (_seeded(r) or {}).get("data_lists", {}).get("commit", 0)
    decode = r["manifest_decode_s"]
    after = "not built yet" if not fixes_mod.built() else "see the after table"

    def verdict(ok: bool) -> str:
        return "met" if ok else "**MISSED**"

    lines = [
        "| goal (4,096 ranks x 8 shards) | today (before) | after | verdict today |",
        "|---|---|---|---|",
        f"| 0 SlowDowns surfaced to the user | save: {_outcome(save)}, {_n(gave_save)} requests gave up; "
        f"restore: {_outcome(restore)}, {_n(gave_restore)} gave up | {after} | {verdict(not surfaced)} |",
        f"| hottest partition below its limit | {hot:.1f}x its limit (save {_hot(save)}; restore {_hot(restore)}) "
        f"| {after} | {verdict(hot < 1.0)} |",
        f"| restore reads <= 1.1x unique bytes | {ratio:,.0f}x ({_bytes(restore['planned_read_bytes'] if restore else None)} "
        f"for {_bytes(r['unique_bytes'])}) | {after} | {verdict(ratio <= 1.1)} |",
        f"| resolve: 0 LISTs outside rank 0, O(1) on rank 0 | {_n(restore['other_ranks_lists'] if restore else None)} "
        f"LISTs outside rank 0; rank 0: {_n(sum(resolve.values()))} requests ({_n(lists_rank0)} LIST) at every size "
        f"| (built: rank 0 resolves and broadcasts) | {verdict(bool(restore) and restore['other_ranks_lists'] == 0 and lists_rank0 <= 1)} |",
        f"| commit verification <= 1 LIST per 1,000 shards | {_n(pages)} LIST pages for {_n(shards)} shards "
        f"(one page per 1,000 keys); but retention then HEADs all {_n(shards)} shards from rank 0 on every save "
        f"| {after} | {verdict(pages <= math.ceil(shards / 1000))} (verification); retention is not |",
        f"| manifest parse < 1 s | `Manifest.decode` {_s(decode)} for {_n(r['manifest_bytes'])} bytes "
        f"(16,384 ranks: {_s(results.get(16384, {}).get('manifest_decode_s'))}) | {after} | {verdict(decode < 1.0)} |",
        "| every count linear in shards, flat in history | see the sweeps below | - | met (counts) |",
    ]
    return lines


def sweep_tables(shards: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[str]:
    out = [
        "Shards per save (64 ranks, rate limits off so that every count is exact):",
        "",
        "| shards | save: PUT | GET | HEAD | LIST | DELETE | commit LIST pages | resolve (rank 0) | restore GETs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in shards:
        ops = _ops(row["save"])
        out.append(
            f"| {_n(row['shards'])} | {_n(ops['PUT'])} | {_n(ops['GET'])} | {_n(ops['HEAD'])} | {_n(ops['LIST'])} "
            f"| {_n(ops['DELETE'])} | {_n(row['commit_lists'])} | {_n(sum(row['resolve'].values()))} "
            f"| {_n(_ops(row['stage'])['GET'])} |"
        )
    out += [
        "",
        "History (64 ranks x 8 shards, `keep_last=2`, six saves into one run root):",
        "",
        "| save | PUT | GET | HEAD | LIST | DELETE | total |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in history:
        if "step" not in row:
            continue
        ops = _ops(row["save"])
        out.append(
            f"| step {row['step']} | {_n(ops['PUT'])} | {_n(ops['GET'])} | {_n(ops['HEAD'])} | {_n(ops['LIST'])} "
            f"| {_n(ops['DELETE'])} | {_n(sum(row['save'].values()))} |"
        )
    return out


def render(
    s3: dict[int, dict[str, Any]],
    gcs: dict[int, dict[str, Any]],
    after: dict[int, dict[str, Any]],
    shards: list[dict[str, Any]],
    history: list[dict[str, Any]],
    total_s: float,
) -> str:
    sizes = sorted(s3)
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    built, missing = fixes_mod.built(), fixes_mod.not_built()
    lines = [
        "# objckpt at scale (simulated)",
        "",
        "<!-- generated by `python -m benchmarks.scale`; edit benchmarks/scale.py, not this file -->",
        "",
        f"Generated {now} by `python -m benchmarks.scale` in {total_s / 60:.0f} min on this machine "
        f"({os.cpu_count()} cores shared with other engineers, Python {platform.python_version()}). "
        "Every number below comes from objckpt's own save, commit, resolve, restore and retention code "
        "running against a simulated object store on a virtual clock; what is real and what is "
        "simulated is listed under [the simulator](#the-simulator). Counts are exact for the run "
        "shown; times are *modelled* (virtual seconds) unless they say real.",
        "",
        "## Fixes",
        "",
    ]
    for f in FIXES:
        state = "built, in the *after* table" if f.enable is not None else "**not built yet**"
        lines.append(f"- `{f.option}` ({state}): {f.title}. Goal: {f.goal}.")
    lines += [
        "",
        "Only the *before* column exists today: every table is today's design."
        if not built
        else "The *after* table runs every built fix together.",
        "",
        "## Goals of the issue, at 4,096 ranks x 8 shards",
        "",
        *goals(s3),
        "",
        "## Before: S3, every size",
        "",
        "Per rank and save: 7 shards of 16 MiB and 1/N of a 16 GiB replicated state (modelled; "
        f"stored as {SHARD_BYTES // 1024} KiB and {REPLICATED_BYTES // MiB} MiB / N real bytes, "
        f"`byte_scale` {BYTE_SCALE:,}). Sizes below 4,096 save twice (the second, reported, has a "
        "parent and retention deletes the first); from 4,096 once. When no save committed, one more "
        "save runs with the rate limits off (the *seeded* row) so that the restore can be measured. "
        "The restore is every rank restoring the latest checkpoint.",
        "",
        *main_table(s3, sizes),
        "",
    ]
    if after:
        lines += ["## After: S3, every built fix on", "", *main_table(after, sorted(after)), ""]
    if gcs:
        lines += [
            "## Before: GCS (bucket-level ~1,000 writes/s and 5,000 reads/s, doubling per 20 min of load)",
            "",
            *main_table(gcs, sorted(gcs)),
            "",
        ]
    lines += [
        "## Growth with shards and with history",
        "",
        *sweep_tables(shards, history),
        "",
        *STATIC_SECTIONS,
        "",
        "### Sources",
        "",
    ]
    for key, text in SOURCES.items():
        lines.append(f"- **{key}**: {text}")
    lines += ["", f"Unbuilt fixes at generation time: {', '.join(f.option for f in missing) or 'none'}.", ""]
    return "\n".join(lines)


STATIC_SECTIONS = [
    "## What today's numbers say",
    "",
    "See the report of the session that built the simulator for the full reading; in short:",
    "",
    "1. **Writes**: every shard key of a save lies under one new prefix `data/<step>-<attempt>/`, "
    "so a save's PUTs land on one key-range partition. Up to 3,500 PUT/s that is fine (512 ranks x 8 "
    "shards: absorbed by retries); at 4,096 x 8 = 32,768 PUTs the partition needs >= 9.4 s and the "
    "retry budget (10 tries, 0.1-5 s jittered backoff) runs out for some ranks: the save fails with "
    "`CommitError` naming them. A partition only splits after sustained load (30-60 min), and a split "
    "learnt on one attempt's prefix does not help the next, whose keys sort after it.",
    "2. **Restores**: every rank reads every rank's `replicated.bin` (`shards.stage`), so a restore "
    "needs N x (7 + N) GETs and N x the replicated bytes: 16.8 M GETs at 4,096 ranks, at least "
    "~51 min at one partition's 5,500 GET/s even if nothing failed; in the simulation it fails on "
    "SlowDowns within seconds.",
    "3. **Retention** (`retain` after every commit, rank 0): `plan_gc` HEADs every shard of the new "
    "checkpoint (`Reader.check` with 16 workers) before anything can be deleted: 32,768 HEADs and "
    "about a minute of rank 0's time per save at 4,096 ranks, on the same partition as the next "
    "save's writes; and one `DeleteObjects` of 1,000 keys costs 1,000 writes of the partition.",
    "4. **Resolution** is already O(1) and on rank 0 only (pointer GET, one LIST of `manifests/`, "
    "manifest GET; the others receive the bytes).",
    "5. **Coordinator verification** is one LIST page per 1,000 shards of the attempt (33 at "
    "4,096 x 8), but its CPU (`Coordinator.commit` validating every receipt, `Manifest.create` "
    "validating them again) grows to seconds, and the manifest (every receipt, ~170 bytes each) to "
    "megabytes: decoding it misses the 1 s goal at 4,096 ranks on this machine.",
    "",
    "## The simulator",
    "",
    "Code: `objckpt/testing/scale/` (library), `benchmarks/scale.py` (this report), "
    "`tests/scale/` (CI: counts at 8 and 64 ranks, and the simulator's own validation).",
    "",
    "**Real** (objckpt's code, unmodified, called as a job calls it): `SaveSession` (handshake, "
    "receipts gather, `Coordinator.commit` with its LIST verification, manifest create-if-absent, "
    "pointer compare-and-swap, retention/GC), `RestoreSession` (rank 0 resolves, broadcasts the "
    "manifest, every rank validates it, the agreement rounds), `ShardWriter`, `Reader.read_shard` "
    "(CRC32C-verified streams), the store's public methods with its retry policy (tenacity, jitter, "
    "deadline) and `get_stream`'s resume loop, the `_Wrapper` store hook, `MemoryStore` holding "
    "every byte, the library's `ThreadWorld` carrying every collective as JSON between threads.",
    "",
    "**Simulated**: the store's performance model (rate limits and 503 SlowDown, latency, bandwidth) "
    "and time itself (per-rank virtual clocks); collective costs; the content a rank writes and reads "
    "(a torch-free mirror of `CheckpointManager`'s layout: `shard-NN.bin` x 7 + `replicated.bin`, "
    "restore reading its own shards and every `replicated.bin`, 8 reads in flight); sizes "
    "(`byte_scale`). Beyond 4,096 ranks, 4 ranks per `ThreadWorld` thread: the sessions still see "
    "N ranks and the coordinator verifies N ranks' receipts, every rank's I/O still runs on its own "
    "thread and timeline, but ranks other than a thread's first contribute that rank's values to "
    "the handshake and staging verdicts (their own receipts to the commit). With `memoize_manifest_decode` "
    "one real `Manifest.decode` per distinct manifest body serves every rank (each rank's clock is "
    "still charged its measured CPU).",
    "",
    "**Virtual clock**: a request costs its latency plus its bytes at the connection's and the "
    "host NIC's bandwidth; a 503 costs 10 ms and the retry policy's own backoff sleep, which the "
    "simulation turns into virtual time by replacing the `time` module seen by `tenacity`, "
    "`tenacity.nap`, `objckpt.store.base` and the sessions (and patching `ThreadPoolExecutor` so "
    "pool threads inherit their submitter's clock); no simulated thread ever sleeps for real "
    "(tested). Simulated threads run one at a time, earliest virtual time first (a baton handed "
    "over within a 0.25 s lag), so requests reach the rate limiter in time order. Charged CPU: the "
    "coordinator's `commit` (thread CPU minus the in-memory store's) and every `Manifest.decode`.",
    "",
    "**Model parameters** (`objckpt/testing/scale/model.py`):",
    "",
    "| parameter | S3 profile | GCS profile | source |",
    "|---|---|---|---|",
    "| writes per second (PUT, POST, DELETE) | 3,500 per key-range partition | ~1,000 per bucket | s3_rates, gcs_rates |",
    "| reads per second (GET, HEAD, LIST) | 5,500 per partition (LIST assumed a read) | ~5,000 per bucket (listing is a read) | s3_rates, gcs_rates |",
    "| counting | fixed 1 s windows; a refused request uses no capacity | same | assumed |",
    "| adaptation | a partition throttling for 30 min splits at the median of its recent keys | the bucket limit doubles per 20 min above half its limit | s3_split_time, gcs_rates |",
    "| initial partitions | one (a fresh prefix) | one bucket | s3_503 |",
    "| DeleteObjects | 1 request, 1 write unit per key | same | assumed |",
    "| request latency | 30 ms (small requests: tens of ms) | same | s3_503 |",
    "| LIST page latency / 503 latency | 100 ms / 10 ms | same | assumed |",
    "| bandwidth | 100 MB/s per connection, 12.5 GB/s (100 Gb/s) per host and direction, 8 ranks per host | same | assumed |",
    "| collectives | 50 us per tree level + 1 GB/s | same | assumed |",
    "| retry policy | the library's default: 10 tries, 0.1 s doubling to 5 s full jitter, 120 s deadline | same | `objckpt/_retry.py` |",
    "",
    "## Hooks the library lacks (worked around here)",
    "",
    "- **An injectable clock/sleep** (`RetryPolicy(sleep=..., monotonic=...)`, and for "
    "`Store.get_stream`'s resume loop and the sessions' timestamps): the simulator replaces the "
    "`time` module inside tenacity, `objckpt.store.base` and the sessions instead.",
    "- **A byte path on `Comm`** exists (`broadcast_bytes`); a *gather of receipts without JSON* "
    "would cut rank 0's CPU at 16,384 ranks.",
    "- **Timing hooks** on `SaveSession` (commit and retention durations, and their request counts): "
    "the simulator subclasses `SaveSession` to time `commit` and `retain`.",
    "- **A cheaper manifest decode path** (or a shared decoded manifest) for ranks that received "
    "the bytes from rank 0: the simulator memoizes `Manifest.decode`.",
]


# ------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--gcs-sizes", default=",".join(map(str, GCS_SIZES)), help="'' to skip GCS")
    ap.add_argument("--out", default=None, help="markdown to write (default SCALE.md for the full run)")
    ap.add_argument("--one", type=int, help="run one scenario of this many ranks (internal)")
    ap.add_argument("--profile", choices=["s3", "gcs"], default="s3")
    ap.add_argument("--after", action="store_true", help="with --one: every built fix on")
    ap.add_argument("--json", help="with --one: where to write the result")
    args = ap.parse_args(argv)
    if args.one:
        run_one(args.one, args.profile, args.after, Path(args.json))
        return 0

    started = time.monotonic()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    gcs_sizes = [int(x) for x in args.gcs_sizes.split(",") if x]
    full = tuple(sizes) == SIZES
    out = Path(args.out) if args.out else (REPO / "SCALE.md" if full else None)
    tmp = REPO / "build" / "scale"
    tmp.mkdir(parents=True, exist_ok=True)
    s3 = {n: spawn(n, "s3", False, tmp) for n in sizes}
    after = {n: spawn(n, "s3", True, tmp) for n in sizes} if fixes_mod.built() else {}
    gcs = {n: spawn(n, "gcs", False, tmp) for n in gcs_sizes}
    log("sweeps (64 ranks): shards per save, history")
    shards, history = sweep("shards"), sweep("history")
    total = time.monotonic() - started
    (tmp / "results.json").write_text(
        json.dumps({"s3": s3, "after": after, "gcs": gcs, "shards": shards, "history": history}, default=str)
    )
    for n, r in {**s3}.items():
        log(
            f"s3 {n:>6} ranks: {r.get('process_s', 0):.0f}s real"
            + (f" ERROR {r['error'][:200]}" if "error" in r else "")
        )
    text = render(s3, gcs, after, shards, history, total)
    if out is not None:
        out.write_text(text)
        log(f"wrote {out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
