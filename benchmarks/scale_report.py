"""Renders ``SCALE.md`` from the scenario results of :mod:`benchmarks.scale` (no simulation here).

Every number in the tables is read from a result; the prose around them names what the
scenario was. Real bytes are shown modelled (``x BYTE_SCALE``)."""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from benchmarks.scale import BYTE_SCALE, MAX_THREADS, REPLICATED_BYTES, RESTORE_BUDGET, SHARD_BYTES
from benchmarks.scale_text import HOOKS, SIMULATOR, model_table
from objckpt.testing.scale import FIXES, SOURCES

GiB = 1024**3
MiB = 1024**2
Result = dict[str, Any]


def _n(x: float | int | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return f"{int(x):,}"


def _bytes(real: int | float | None) -> str:
    if real is None:
        return "-"
    b = real * BYTE_SCALE
    if b >= GiB:
        return f"{b / GiB:,.1f} GiB"
    return f"{b / MiB:,.1f} MiB"


def _s(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x >= 120:
        return f"{x / 60:,.1f} min"
    return f"{x:,.1f} s" if x >= 10 else f"{x:.2f} s"


def _ops(req: dict[str, int]) -> dict[str, int]:
    """Primitive ops as the providers' request kinds."""
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


def _kinds(req: dict[str, int], kinds: tuple[str, ...] = ("PUT", "GET", "HEAD", "LIST", "DELETE")) -> str:
    ops = _ops(req)
    return " / ".join(_n(ops[k]) for k in kinds)


def last_save(r: Result) -> Result | None:
    saves = [s for s in r.get("saves", []) if not s["seeded"]]
    return saves[-1] if saves else None


def the_save(r: Result) -> Result:
    """The last save of ``r`` (``KeyError``, shown as "-", when there is none)."""
    s = last_save(r)
    if s is None:
        raise KeyError("save")
    return s


def seeded(r: Result) -> Result | None:
    saves = [s for s in r.get("saves", []) if s["seeded"]]
    return saves[-1] if saves else None


def _hot(p: Result | None) -> str:
    if not p or not p.get("hottest"):
        return "-"
    h = p["hottest"]
    return f"{_n(h['offered_per_s'])}/s {h['kind']}s vs {_n(h['limit_per_s'])}/s ({h['ratio']:.2f}x)"


def stopped(p: Result | None) -> bool:
    return p is not None and "SimulationBudgetExceeded" in p["outcome"]


def _outcome(p: Result | None) -> str:
    if p is None:
        return "-"
    if p["ok"]:
        return "committed" if p["kind"] == "save" else "restored"
    if stopped(p):
        # the budget of this scenario (larger sizes get a smaller one: benchmarks.scale)
        said = re.search(r"budget of ([\d,]+) requests", p["outcome"])
        budget = int(said.group(1).replace(",", "")) if said else RESTORE_BUDGET
        return f"**stopped** by the simulation's budget of {_n(budget)} requests"
    if p["outcome"].startswith("SlowDown surfaced"):
        return f"**FAILED**: SlowDown surfaced to the user ({_n(p['failed_ranks'])} ranks)"
    return f"**FAILED**: {p['outcome'][:100]}"


def _slow(p: Result | None) -> str:
    if p is None:
        return "-"
    gave = p.get("gave_up_by_phase", {})
    cell = f"{_n(p['slowdowns_injected'])} / {_n(p['slowdowns_absorbed'])} / "
    if not gave:
        return cell + "0"
    return cell + ", ".join(f"{_n(n)} ({ph})" for ph, n in sorted(gave.items()))


def _ratio(r: Result) -> str:
    p = r["restore"]
    return f"{p['planned_read_bytes'] / r['unique_bytes']:,.2f}x"


def _verification(s: Result) -> str:
    coordinator = s["data_lists"].get("commit", 0)
    ranks = s["data_lists"].get("save", 0) + s["data_lists"].get("write", 0)
    return f"{_n(coordinator)} / {_n(ranks)}"


def _restore_progress(p: Result) -> str:
    if p["ok"]:
        return "done"
    done = p["bytes_read"] / max(1, p["planned_read_bytes"])
    bound = p["planned_reads"] / max(1.0, p["hottest"]["limit_per_s"])
    return f"{done:.1%} of the bytes when stopped; its {_n(p['planned_reads'])} GETs need >= {_s(bound)} at the hottest partition's limit"


Row = tuple[str, Callable[[Result], str]]

ROWS: list[Row] = [
    ("**save** (the last one of the run)", lambda r: _outcome(last_save(r))),
    ("shards per save", lambda r: _n(r["options"]["world_size"] * r["options"]["shards_per_rank"])),
    ("key prefixes one save's shards use (`data/<x>/`)", lambda r: _n(r.get("key_prefixes"))),
    (
        "requests per save: PUT / GET / HEAD / LIST / DELETE (tries)",
        lambda r: _kinds(the_save(r)["requests"]),
    ),
    ("of which rank 0 (coordinator)", lambda r: _kinds(the_save(r)["rank0"])),
    ("busiest other rank: requests", lambda r: _n(sum(the_save(r)["other_ranks_max"].values()))),
    (
        "SlowDowns: seen / absorbed by retries / surfaced (requests that gave up)",
        lambda r: _slow(last_save(r)),
    ),
    ("hottest partition, peak offered rate vs its limit", lambda r: _hot(last_save(r))),
    ("verification LISTs of `data/`: coordinator / ranks", lambda r: _verification(the_save(r))),
    (
        "`Coordinator.commit`: requests / CPU (rank 0 thread)",
        lambda r: (
            f"{_n(sum(the_save(r)['requests_by_phase'].get('commit', {}).values()))} / "
            f"{_s(the_save(r)['commit_thread_cpu_s'])}"
        ),
    ),
    (
        "retention after the commit: HEAD / LIST / DELETE, modelled time",
        lambda r: (
            _kinds(the_save(r)["requests_by_phase"].get("retain", {}), ("HEAD", "LIST", "DELETE"))
            + f", {_s(the_save(r)['retention_s'])}"
        ),
    ),
    ("modelled save time (every rank has the outcome)", lambda r: _s(the_save(r)["virtual_s"])),
    ("seeded save (rate limits off), when no save committed", lambda r: _seeded_cell(seeded(r))),
    ("**restore** (every rank restores the latest)", lambda r: _outcome(r["restore"])),
    (
        "requests: GET / HEAD / LIST (tries)",
        lambda r: _kinds(r["restore"]["requests"], ("GET", "HEAD", "LIST")),
    ),
    (
        "resolve: requests on rank 0 / LISTs by other ranks",
        lambda r: (
            f"{_n(sum(r['restore']['requests_by_phase'].get('resolve', {}).values()))} / "
            f"{_n(r['restore']['other_ranks_lists'])}"
        ),
    ),
    ("SlowDowns: seen / absorbed by retries / surfaced", lambda r: _slow(r["restore"])),
    ("hottest partition, peak offered rate vs its limit", lambda r: _hot(r["restore"])),
    ("store bytes each rank reads (modelled)", lambda r: _bytes(r["restore"]["rank_planned_bytes_max"])),
    (
        "store bytes the job reads / unique bytes",
        lambda r: f"{_bytes(r['restore']['planned_read_bytes'])} / {_bytes(r['unique_bytes'])}",
    ),
    ("... ratio (goal <= 1.1x)", _ratio),
    ("bytes received over the process group (job)", lambda r: _bytes(r["restore"].get("shared_bytes", 0))),
    ("progress", lambda r: _restore_progress(r["restore"])),
    ("modelled restore time (to success, failure or stop)", lambda r: _s(r["restore"]["virtual_s"])),
    ("**manifest** bytes (modelled = real)", lambda r: _n(r["manifest_bytes"])),
    (
        "`Manifest.decode` / `encode` (real CPU here)",
        lambda r: f"{_s(r['manifest_decode_s'])} / {_s(r['manifest_encode_s'])}",
    ),
    ("threads (ranks per thread): save; restore", lambda r: _threads(r)),
    ("baton hand-overs / lag violations", lambda r: f"{_n(r['pace_waits'])} / {_n(r['lag_violations'])}"),
    ("**real time of the scenario** (this machine)", lambda r: _s(r.get("process_s", r["wall_s"]))),
]


def _seeded_cell(s: Result | None) -> str:
    if s is None:
        return "not needed"
    return f"{_outcome(s)}: {_kinds(s['requests'])} (PUT/GET/HEAD/LIST/DELETE)"


def _cell(fn: Callable[[Result], str], r: Result | None) -> str:
    if not r:
        return "-"
    if "error" in r:
        text = str(r["error"]).strip()
        if text.startswith("stopped after"):
            return "**not finished**: " + text[:400].replace("|", "/")
        return "error: " + (str(text).splitlines()[-1][:160].replace("|", "/") if text else "?")
    try:
        return str(fn(r))
    except (KeyError, TypeError, ZeroDivisionError, AttributeError, IndexError):
        return "-"


def table(columns: list[tuple[str, Result | None]], rows: list[Row] = ROWS) -> list[str]:
    out = ["| | " + " | ".join(h for h, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for i, (label, fn) in enumerate(rows):
        # a scenario that did not finish says so once, in the first row
        cells = ["-" if i and r and "error" in r else _cell(fn, r) for _, r in columns]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _threads(r: Result) -> str:
    """The save's threads and the restore's (its own count when it needs a thread per rank)."""
    n = r["options"]["world_size"]
    save = r["options"]["threads"]
    restore = (r.get("restore") or {}).get("threads") or save
    return f"{_n(save)} ({n // save}); {_n(restore)} ({n // restore})"


def _size_columns(by_size: dict[int, Result], *, every_fix: bool = False) -> list[tuple[str, Result | None]]:
    """One column per size; with ``every_fix``, a column that ran without some built fix says
    which."""
    built = [f.option for f in FIXES if f.enable is not None]
    columns: list[tuple[str, Result | None]] = []
    for n in sorted(by_size):
        r, label = by_size[n], f"{n:,} ranks"
        missing = [o for o in built if every_fix and "fix_set" in r and o not in r["fix_set"]]
        if missing:
            label += " (without " + ", ".join(f"`{o}`" for o in missing) + ")"
        columns.append((label, r))
    return columns


def goals(before: Result | None, after: Result | None) -> list[str]:
    def pick(r: Result | None, fn: Callable[[Result], str]) -> str:
        return _cell(fn, r)

    def surfaced(r: Result) -> str:
        s, p = last_save(r), r["restore"]
        n = (s["slowdowns_gave_up"] if s else 0) + (p["slowdowns_gave_up"] if p else 0)
        return f"{_n(n)} (save {_outcome(s)}; restore {_outcome(p)})"

    def hottest(r: Result) -> str:
        s, p = last_save(r), r["restore"]
        return f"save {_hot(s)}; restore {_hot(p)}"

    def verify(r: Result) -> str:
        s = the_save(r)
        shards = r["options"]["world_size"] * r["options"]["shards_per_rank"]
        return f"{_verification(s)} (coordinator / ranks) for {_n(shards)} shards"

    def resolve(r: Result) -> str:
        p = r["restore"]
        res = p["requests_by_phase"].get("resolve", {})
        return f"{_n(p['other_ranks_lists'])} LISTs outside rank 0; rank 0: {_n(sum(res.values()))} requests"

    def met_surfaced(r: Result) -> bool:
        s, p = the_save(r), r["restore"]
        return bool(s["ok"] and p["ok"] and s["slowdowns_gave_up"] == 0 and p["slowdowns_gave_up"] == 0)

    def met_hot(r: Result) -> bool:
        return bool(the_save(r)["hottest"]["ratio"] < 1 and r["restore"]["hottest"]["ratio"] < 1)

    def met_resolve(r: Result) -> bool:
        p = r["restore"]
        lists = sum(n for op, n in p["requests_by_phase"].get("resolve", {}).items() if "list" in op)
        return bool(p["other_ranks_lists"] == 0 and lists <= 2)

    def met_verify(r: Result) -> bool:
        s = the_save(r)
        shards = r["options"]["world_size"] * r["options"]["shards_per_rank"]
        coordinator = s["data_lists"].get("commit", 0)
        return bool(coordinator <= math.ceil(shards / 1000) or coordinator == 0)

    rows: list[tuple[str, Callable[[Result], str], Callable[[Result], bool]]] = [
        ("0 SlowDowns surfaced to the user", surfaced, met_surfaced),
        ("hottest partition below its limit", hottest, met_hot),
        (
            "restore reads <= 1.1x unique bytes",
            _ratio,
            lambda r: r["restore"]["planned_read_bytes"] <= 1.1 * r["unique_bytes"],
        ),
        ("resolve: 0 LISTs outside rank 0, O(1) on rank 0", resolve, met_resolve),
        ("commit verification <= 1 LIST per 1,000 shards, or spread over ranks", verify, met_verify),
        (
            "manifest parse < 1 s",
            lambda r: f"{_s(r['manifest_decode_s'])} for {_n(r['manifest_bytes'])} bytes",
            lambda r: r["manifest_decode_s"] < 1.0,
        ),
    ]

    def verdict(r: Result | None, met: Callable[[Result], bool]) -> str:
        text = _cell(lambda x: "met" if met(x) else "**missed**", r)
        return text if text in ("met", "**missed**") else "-"

    out = [
        "| goal (4,096 ranks x 8 shards) | before | after (every built fix) | before / after |",
        "|---|---|---|---|",
    ]
    for label, fn, met in rows:
        out.append(
            f"| {label} | {pick(before, fn)} | {pick(after, fn)} | {verdict(before, met)} / {verdict(after, met)} |"
        )
    out.append(
        "| every count linear in shards, flat in history | see [growth](#growth-with-shards-and-with-history) "
        "| same | see the sweeps |"
    )
    return out


PER_FIX_ROWS: list[Row] = [r for r in ROWS if not r[0].startswith(("threads", "baton", "seeded", "progress"))]


def sweep_tables(shards: list[Result], history: list[Result]) -> list[str]:
    out = [
        "| shards | save: PUT | GET | HEAD | LIST | DELETE | verification LISTs: coordinator / ranks | resolve (rank 0) | restore GETs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in shards:
        ops = _ops(row["save"])
        out.append(
            f"| {_n(row['shards'])} | {_n(ops['PUT'])} | {_n(ops['GET'])} | {_n(ops['HEAD'])} | {_n(ops['LIST'])} "
            f"| {_n(ops['DELETE'])} | {_n(row['commit_lists'])} / {_n(row.get('rank_lists', 0))} "
            f"| {_n(sum(row['resolve'].values()))} | {_n(_ops(row['stage'])['GET'])} |"
        )
    out += [
        "",
        "| save (keep_last=2) | PUT | GET | HEAD | LIST | DELETE | total |",
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


def _fix_lines() -> list[str]:
    out = ["| fix | library switch | in this report | goal |", "|---|---|---|---|"]
    for f in FIXES:
        state = "built; in the *after* columns" if f.enable is not None else f"**not run**: {f.note}"
        out.append(f"| `{f.option}`: {f.title} | `{f.switch}` | {state} | {f.goal} |")
    return out


def _unfinished_note(by_size: dict[int, Result]) -> list[str]:
    """What a scenario that ran out of its time limit tells (measured, not extrapolated beyond
    the rate the cell shows)."""
    out = []
    for n, r in sorted(by_size.items()):
        if "error" in r and str(r["error"]).startswith("stopped after"):
            out += [
                f"**{n:,} ranks did not fit**: the scenario was stopped after {_s(r.get('process_s'))} of this "
                "machine (the cell says what had finished by then, and how many requests the running phase "
                f"had made). Today's restore there needs {_n(n * (7 + n))} GETs ({n:,} x (7 + {n:,})). What "
                f"costs the time: {n:,} simulated ranks, each on its own thread ({MAX_THREADS:,} ThreadWorld "
                "threads and a helper thread per hosted rank), taking turns with the baton, and the library's "
                "own work per request (its retry policy builds a tenacity `Retrying` per request); the "
                "model itself does not change with size.",
                "",
            ]
    return out


def render(
    runs: dict[str, dict[int, Result]], sweeps: dict[str, list[Result]], total_s: float, *, argv: list[str]
) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python -m benchmarks.scale" + (" " + " ".join(argv) if argv else "")
    before, after = runs.get("before", {}), runs.get("after", {})
    lines = [
        "# objckpt at scale (simulated)",
        "",
        f"<!-- generated by `{command}`; edit benchmarks/scale.py / scale_report.py, not this file -->",
        "",
        f"Regenerate with **`PYTHONPATH=. .venv/bin/python -m benchmarks.scale`** (one command; it wrote this "
        f"file on {now} in {total_s / 60:.0f} min on {os.cpu_count()} cores shared with other work, Python "
        f"{platform.python_version()}). Every number comes from objckpt's own save, commit, resolve, "
        "restore and retention code running against a simulated object store on a virtual clock "
        "([the simulator](#the-simulator)). Counts are exact for the run shown; times are *modelled* "
        "(virtual seconds) unless they say real. Sizes: per rank and save 7 shards of 16 MiB and 1/N of a "
        f"16 GiB replicated state (stored as {SHARD_BYTES // 1024} KiB and {REPLICATED_BYTES // MiB} MiB / N "
        f"real bytes, `byte_scale` {BYTE_SCALE:,}). S3: a bucket whose `data/` is partitioned at the 256 "
        "spreading prefixes `data/00/`..`data/ff/` (what S3 learns from spread keys, which are the same "
        "every save; the old layout's keys all fall into one of these ranges), 3,500 writes / 5,500 reads "
        "per second each.",
        "",
        "## Fixes",
        "",
        *_fix_lines(),
        "",
        "*Before* = every switch off (today's design before the fixes). *After* = every built fix on. "
        f"Above {MAX_THREADS:,} ranks, {MAX_THREADS:,} threads host the ranks (several per thread, see "
        "[the simulator](#the-simulator)), each scenario runs under a time limit and its restore under a "
        "smaller request budget (*before*); *after*'s restore there runs on a thread per rank "
        "(`ScaleOptions.restore_max_threads`: `read_shared` is a collective of every rank) under the "
        "full budget. *Each fix alone* runs at 512 ranks.",
        "",
        "## Goals of the issue, at 4,096 ranks x 8 shards",
        "",
        *goals(before.get(4096), after.get(4096)),
        "",
        "## Before: S3, every size",
        "",
        *table(_size_columns(before)),
        "",
        *_unfinished_note(before),
    ]
    if after:
        lines += ["## After: S3, every built fix on", "", *table(_size_columns(after, every_fix=True)), ""]
    for n in sorted({n for f in FIXES for n in runs.get(f.option, {})}):
        cols: list[tuple[str, Result | None]] = [("before", before.get(n))]
        cols += [(f"`{f.option}` alone", runs[f.option].get(n)) for f in FIXES if n in runs.get(f.option, {})]
        cols.append(("every fix", after.get(n)))
        lines += [f"## Each fix alone, S3, {n:,} ranks", "", *table(cols, PER_FIX_ROWS), ""]
    gcs = runs.get("gcs", {})
    if gcs:
        cols = _size_columns(gcs) + [
            (f"{n:,} ranks, every fix", r) for n, r in sorted(runs.get("gcs_after", {}).items())
        ]
        lines += [
            "## GCS (bucket-level ~1,000 writes/s and 5,000 reads/s, doubling per 20 min of load)",
            "",
            *table(cols),
            "",
        ]
    lines += [
        "## Growth with shards and with history",
        "",
        "64 ranks, rate limits off so that every count is exact. Before:",
        "",
        *sweep_tables(sweeps.get("shards", []), sweeps.get("history", [])),
        "",
    ]
    if "shards_after" in sweeps:
        lines += [
            "After (every fix):",
            "",
            *sweep_tables(sweeps["shards_after"], sweeps.get("history_after", [])),
            "",
        ]
    lines += [*findings(runs), "", *SIMULATOR, "", *model_table(), "", *HOOKS, "", "### Sources", ""]
    lines += [f"- **{key}**: {text}" for key, text in SOURCES.items()]
    lines.append("")
    return "\n".join(lines)


def findings(runs: dict[str, dict[int, Result]], n: int = 4096) -> list[str]:
    """What the tables say at ``n`` ranks, with their numbers (rendered from the results)."""
    before, after = runs.get("before", {}).get(n), runs.get("after", {}).get(n)
    if not before or "error" in before or not after or "error" in after:
        return [f"(the {n:,}-rank scenarios did not both run: no reading)"]
    b, a = last_save(before), last_save(after)
    bp, ap = before["restore"], after["restore"]
    if not (b and a and bp and ap):
        return ["(a phase is missing: no reading)"]
    shards = n * before["options"]["shards_per_rank"]
    spread = runs.get("key_spreading", {}).get(n)
    spread_save = last_save(spread) if spread and "error" not in spread else None
    out = [
        f"## What the numbers say ({n:,} ranks x 8 shards)",
        "",
        f"1. **Writes.** Before, every shard key of a save lies under one new prefix `data/<step>-<attempt>/`, "
        f"so the save's {_n(shards)} PUTs land on one key-range partition: {_hot(b)} at the peak, "
        f"{_n(b['slowdowns_injected'])} SlowDowns ({_n(b['slowdowns_gave_up'])} surfaced), the save "
        f"{_outcome(b)} in {_s(b['virtual_s'])} modelled. With key spreading the same save uses "
        f"{_n(after.get('key_prefixes'))} prefixes: {_hot(a)}, {_n(a['slowdowns_injected'])} SlowDowns, "
        f"{_outcome(a)} in {_s(a['virtual_s'])}.",
        f"2. **Restores.** Before, every rank reads every rank's `replicated.bin`: {_n(bp['planned_reads'])} GETs "
        f"and {_ratio(before)} the unique bytes for the job; {_hot(bp)} at the peak; the restore "
        f"{_outcome(bp)} ({_restore_progress(bp)}). With replicated state read once: {_n(ap['planned_reads'])} GETs "
        f"({_n(n)} x 8: each shard once), {_ratio(after)} the unique bytes, {_bytes(ap.get('shared_bytes', 0))} "
        f"over the process group, {_hot(ap)}, {_outcome(ap)} in {_s(ap['virtual_s'])} modelled.",
        f"3. **Retention** after every commit (rank 0, `plan_gc`): the new checkpoint is the newest one that "
        f"verifies without a HEAD of each of its shards (its commit has just checked them against the store: "
        f"`plan_gc(verified=)`; it used to be one HEAD per shard, 32,769 at 4,096 ranks, ~63 s of rank 0 per "
        f"save): {_kinds(b['requests_by_phase'].get('retain', {}), ('HEAD', 'LIST', 'DELETE'))} "
        f"HEAD / LIST / DELETE and {_s(b['retention_s'])} of rank 0's time per save before; "
        f"{_kinds(a['requests_by_phase'].get('retain', {}), ('HEAD', 'LIST', 'DELETE'))} and {_s(a['retention_s'])} after "
        "(with spread keys GC also lists each spreading prefix in use).",
        f"4. **Verification.** Before, the coordinator LISTs the attempt: {_verification(b)} (coordinator / ranks) "
        f"LIST pages for {_n(shards)} shards, commit CPU {_s(b['commit_thread_cpu_s'])}. "
        + (
            f"Key spreading alone makes it LIST every spreading prefix the attempt used ({_verification(spread_save)}). "
            if spread_save
            else ""
        )
        + f'With `verify="ranks"` ranks 0..min(W, 256)-1 each LIST one spread attempt prefix (the whole attempt, strays included) and the coordinator none: {_verification(a)}, '
        f"commit CPU {_s(a['commit_thread_cpu_s'])}.",
        f"5. **Resolution** is O(1) and on rank 0 only before and after: "
        f"{_n(sum(bp['requests_by_phase'].get('resolve', {}).values()))} requests, "
        f"{_n(bp['other_ranks_lists'])} LISTs on other ranks.",
        f"6. **The manifest** holds every receipt: {_n(before['manifest_bytes'])} bytes; `Manifest.decode` takes "
        f"{_s(before['manifest_decode_s'])} here (goal < 1 s), and every rank decodes it.",
    ]
    return out
