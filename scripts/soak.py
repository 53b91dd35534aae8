#!/usr/bin/env python
"""The randomized soak (see tests/reliability/soak.py for what an episode is and what is checked).

    .venv/bin/python scripts/soak.py --episodes 10000            # the full run; writes RELIABILITY.md
    .venv/bin/python scripts/soak.py --episodes 300 --no-report  # a quick one
    .venv/bin/python scripts/soak.py --seed 7 --episode 1234     # replay one episode (and its root's earlier ones)
    .venv/bin/python scripts/soak.py --budget 3600               # as many episodes as fit in an hour

Servers (moto, fake-gcs-server, LocalStack when installed) run on 127.0.0.1 for the run and are
stopped at the end (and on Ctrl-C). Exit status 0 when no invariant was violated, 1 otherwise; a
violation prints the seed and episode that replay it.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.reliability import harness  # noqa: E402
from tests.reliability.soak import BACKENDS, Soak, quiet  # noqa: E402


def _table(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "none"


def render(stats: dict, args: argparse.Namespace, skipped: dict[str, str], requested: int) -> str:
    faults = stats["faults"]
    kills = {
        k.split(":", 1)[1]: v for k, v in faults.items() if k.startswith("kill:") and k != "kill:not_reached"
    }
    net = {k.split(":", 1)[1]: v for k, v in faults.items() if k.startswith("net:")}
    flips = {k.split(":", 1)[1]: v for k, v in faults.items() if k.startswith("bitflip:")}
    done = stats["episodes"]
    honest = "" if done >= requested else f" (of {requested:,} requested: the time budget ran out)"
    if stats.get("runs"):
        honest += f" in two runs of seed {args.seed} ({' + '.join(f'{n:,}' for n in stats['runs'])} episodes)"
    lines = [
        "## Randomized soak",
        "",
        "```",
        f".venv/bin/python scripts/soak.py --episodes {requested} --seed {args.seed}"
        + (f" --budget {args.budget:g}" if args.budget else ""),
        "```",
        "",
        f"* date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}; wall time {stats['seconds']:,.0f} s",
        f"* **episodes: {done:,}**{honest}; by backend: {_table(stats['by_backend'])}; by operation: "
        f"{_table(stats['by_op'])}",
        f"* SIGKILLs that hit (by phase): {_table(kills)}; kill points past the end of the operation: "
        f"{faults.get('kill:not_reached', 0):,} (memory:// runs die in-process: SimulatedKill)",
        f"* network faults injected through the chaos proxy (by kind): {_table(net)}",
        f"* bit flips (by object): {_table(flips)}",
        f"* checks: {_table(stats['checks'])}",
        f"* **violations: {len(stats['violations'])}**",
    ]
    if stats["notes"]:
        lines.append(f"* expected failures and notes (not violations): {_table(stats['notes'])}")
    if skipped:
        lines.append("* backends not run: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    for v in stats["violations"][:20]:
        lines.append(
            f"  * episode {v['episode']} ({v['backend']}, {v['op']}, {v['fault']}): {v['violation']} -- replay: "
            f"`scripts/soak.py --seed {args.seed} --episode {v['episode']}`"
        )
    lines += [
        "",
        "Each episode: a random backend, operation (save of 1-3 ranks, GC, rollback, cp, bit flip) and "
        "fault (SIGKILL of the crash worker at a random call or a random rank's call, 503/500/reset/"
        "truncation through the chaos proxy, both, none), then the checks: LATEST names only complete, "
        "verifiable checkpoints; the last complete checkpoint is never deleted; a restore equals the last "
        "committed state bit for bit. CI runs a fixed-seed sample (tests/reliability/test_soak.py).",
    ]
    return "\n".join(lines)


def _merged(first: dict, second: dict) -> dict:
    """The counts of two runs of one seed (episodes [0, n) and [n, m)) as one."""
    out: dict = {"episodes": first["episodes"] + second["episodes"]}
    for key in ("by_backend", "by_op", "faults", "checks", "notes"):
        merged = dict(first.get(key, {}))
        for k, v in second.get(key, {}).items():
            merged[k] = merged.get(k, 0) + v
        out[key] = merged
    out["violations"] = list(first.get("violations", [])) + list(second.get("violations", []))
    out["seconds"] = first.get("seconds", 0) + second.get("seconds", 0)
    out["requested"] = out["episodes"]
    out["runs"] = [first.get("episodes"), second.get("episodes")]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--episode", type=int, default=None, help="replay this episode (and its root's earlier ones)"
    )
    ap.add_argument("--start", type=int, default=0, help="first episode number (default 0)")
    ap.add_argument(
        "--backends", default=",".join(BACKENDS), help=f"comma-separated, of {', '.join(BACKENDS)}"
    )
    ap.add_argument(
        "--budget", type=float, default=0.0, help="seconds after which no new episode starts (0: none)"
    )
    ap.add_argument("--spawn", action="store_true", help="run workers with python -m instead of fork")
    ap.add_argument("--out", default=str(REPO / "RELIABILITY.md"))
    ap.add_argument("--json", default=None, help="write the counts here too")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--progress", type=int, default=200, help="print a line every N episodes")
    ap.add_argument(
        "--continue-from",
        default=None,
        help="the --json of an earlier run of the same seed that ended (budget) before --start: the report "
        "counts both runs together",
    )
    args = ap.parse_args(argv)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with quiet(), Soak(args.seed, backends=backends, spawn=args.spawn) as soak:
        if soak.skipped:
            print(f"not running on: {soak.skipped}", flush=True)
        if args.episode is not None:
            outs = soak.replay(args.episode)
            for out in outs:
                print(
                    f"episode {out.episode}: {out.backend} {out.op} ({out.fault}) {out.detail} -> "
                    f"{'VIOLATION ' + '; '.join(out.violations) if out.violations else 'ok'} {out.faults}",
                    flush=True,
                )
            return 1 if outs[-1].violations else 0
        t0 = time.monotonic()

        def on_episode(out, stats) -> None:  # type: ignore[no-untyped-def]
            if out.violations:
                print(
                    f"VIOLATION at episode {out.episode} ({out.backend} {out.op} {out.fault}): {out.violations}",
                    flush=True,
                )
            if stats.episodes % args.progress == 0:
                print(
                    f"{stats.episodes:,} episodes, {len(stats.violations)} violations, "
                    f"{time.monotonic() - t0:,.0f} s",
                    flush=True,
                )
            if args.json and stats.episodes % args.progress == 0:
                Path(args.json).write_text(json.dumps(stats.to_dict(), indent=1))

        deadline = time.monotonic() + args.budget if args.budget else None
        stats = soak.run(
            range(args.start, args.start + args.episodes), on_episode=on_episode, deadline=deadline
        )
        result = stats.to_dict()
        skipped = dict(soak.skipped)
    if args.continue_from:
        result = _merged(json.loads(Path(args.continue_from).read_text()), result)
    print(json.dumps({k: v for k, v in result.items() if k != "violations"}, indent=1), flush=True)
    print(f"violations: {len(result['violations'])}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.no_report:
        requested = result.get("requested", args.episodes)
        harness.write_report_section(
            args.out, "soak", "scripts/soak.py", render(result, args, skipped, requested)
        )
        print(f"updated {args.out}", flush=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
