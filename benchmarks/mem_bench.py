"""Peak memory of a synchronous save (and, for information, a restore) against the state size.

One fresh subprocess per (store, size). In it: the state is built, a small warm-up save runs
(imports, SDK client, thread pool), memory is handed back to the OS (``malloc_trim``), then the
kernel's peak-RSS counter is reset (``/proc/self/clear_refs`` = 5) and tracemalloc started, and
``CheckpointManager.save`` runs. Reported:

* ``extra RSS``: peak RSS during the save minus RSS just before it (the state itself excluded);
* ``traced peak``: tracemalloc's peak of Python-heap allocations during the save (part buffers
  assembled by ``iter_parts``, SDK copies; tensors live outside the Python heap);

against the bound the store documents: ``part_size x (max_in_flight + 1)``. The goal is extra
memory within that bound and not growing with the shard size. The restore that follows stages
a copy of the state before applying it, so its extra RSS is about 1x the state by design; the
ratio printed is that extra over the state (goal <= 1.1x: shards are read straight into the
staged tensors, ``training._ranged_restore``).

    python -m benchmarks.mem_bench --store file --mib 64 --mib 256

The multi-rank leg (``--ranks 2 --ranks 4``) restores a replicated state (``--rep-mib``) saved
by W gloo ranks from a file:// root with ``replicated_read="once"``: each rank downloads ~1/W of
it and the ranks exchange the rest (``Comm.all_gather_bytes``). Per rank: peak RSS during the
restore over RSS just before it, and tracemalloc's peak; the ratio is the worst rank's extra
over the state (goal <= 1.1x: the staged copy, and not a second copy for the exchange).

    python -m benchmarks.mem_bench --ranks 2 --ranks 4 --rep-mib 256 --runs 3
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from benchmarks.common import BUCKET, REPO, MiB, fingerprint, make_model, write_json


def _status(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    m = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else 0


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass


def child(
    store_uri: str, options: dict[str, str], size: int, n_tensors: int, part_size: int, width: int, out: str
) -> None:
    import torch

    from objckpt.store import open_store
    from objckpt.training.manager import CheckpointManager

    torch.set_num_threads(1)
    opts = {**options, "part_size": str(part_size), "max_in_flight": str(width)}
    warm = make_model(3 * part_size, 3)
    with CheckpointManager(open_store(f"{store_uri}/warm", **opts), keep_last=None) as mgr:
        mgr.save(1, {"model": warm})
    del warm, mgr
    model = make_model(size, n_tensors)
    _trim()
    result: dict[str, Any] = {"state_bytes": size, "part_size": part_size, "max_in_flight": width}
    with CheckpointManager(open_store(f"{store_uri}/main", **opts), keep_last=None) as mgr:
        for op in ("save", "restore"):
            _trim()
            rss_before = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            tracemalloc.start()
            t = time.perf_counter()
            if op == "save":
                mgr.save(1, {"model": model})
            else:
                mgr.restore({"model": model})
            elapsed = time.perf_counter() - t
            _, traced_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            result[op] = {
                "rss_before": rss_before,
                "extra_rss": _status("VmHWM") - rss_before,
                "traced_peak": traced_peak,
                "seconds": elapsed,
            }
    write_json(out, result)


def rank_child(rank: int, world_size: int, rendezvous: str, root: str, size: int, out: str) -> None:
    """One gloo rank of the multi-rank leg: save the replicated state, then measure its
    read-once restore into a fresh module."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from objckpt.store import open_store
    from objckpt.training.manager import CheckpointManager

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=600),
    )
    try:
        model = make_model(size, 16)
        with CheckpointManager(open_store(root), keep_last=None, timeout=600, dedup=False) as mgr:
            mgr.save(1, {"model": model})
        fresh = make_model(size, 16, seed=1)
        with CheckpointManager(
            open_store(root), keep_last=None, timeout=600, replicated_read="once", dedup=False
        ) as mgr:
            dist.barrier()
            _trim()
            rss_before = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")
            tracemalloc.start()
            t = time.perf_counter()
            mgr.restore({"model": fresh})
            elapsed = time.perf_counter() - t
            _, traced_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            extra = _status("VmHWM") - rss_before
        same = fingerprint(model) == fingerprint(fresh)  # bit patterns: random ones hold NaNs
        write_json(
            out,
            {
                "rss_before": rss_before,
                "extra_rss": extra,
                "traced_peak": traced_peak,
                "seconds": elapsed,
                "same": same,
            },
        )
    finally:
        dist.destroy_process_group()


def measure_ranks(
    worlds: list[int], rep_mib: int, runs: int, *, timeout: float = 900
) -> list[dict[str, Any]]:
    """``runs`` read-once restores per world size, each in ``W`` fresh processes; one row per
    world size with every run's per-rank results."""
    from objckpt.testing.s3_servers import child_env

    rows = []
    for w in worlds:
        row: dict[str, Any] = {"ranks": w, "state_bytes": rep_mib * MiB, "runs": []}
        for _ in range(runs):
            with tempfile.TemporaryDirectory(prefix="objckpt-mem-ranks-") as tmp:
                env = child_env({"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"})
                procs = []
                for r in range(w):
                    args = json.dumps(
                        [r, w, f"{tmp}/rdv", f"file://{tmp}/root", rep_mib * MiB, f"{tmp}/r{r}.json"]
                    )
                    cmd = [sys.executable, "-m", "benchmarks.mem_bench", "--rank-child", args]
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            cwd=REPO,
                            env=env,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            text=True,
                        )
                    )
                outs = []
                for p in procs:
                    try:
                        outs.append(p.communicate(timeout=timeout)[0])
                    except subprocess.TimeoutExpired:
                        for q in procs:
                            q.kill()
                        outs.append("timed out")
                files = [Path(tmp) / f"r{r}.json" for r in range(w)]
                if any(p.returncode != 0 for p in procs) or not all(f.exists() for f in files):
                    row["error"] = "\n".join(o[-1500:] for o in outs)
                    break
                row["runs"].append([json.loads(f.read_text()) for f in files])
        rows.append(row)
    return rows


def _ranks_report(row: dict[str, Any]) -> str:
    import statistics

    w, state = row["ranks"], row["state_bytes"]
    if "error" in row:
        return f"read-once restore, {w} ranks: ERROR {row['error']}"
    worst = [max(r["extra_rss"] for r in run) for run in row["runs"]]
    traced = [max(r["traced_peak"] for r in run) for run in row["runs"]]
    per_rank = [[r["extra_rss"] for r in run] for run in row["runs"]]
    same = all(r["same"] for run in row["runs"] for r in run)

    def fmt(xs: list[int]) -> str:
        return f"{statistics.median(xs) / MiB:.0f} MiB ({min(xs) / MiB:.0f}-{max(xs) / MiB:.0f})"

    ratios = [x / state for x in worst]
    return (
        f"read-once restore, {w} ranks, {state // MiB} MiB replicated, {len(worst)} runs: worst-rank "
        f"extra RSS {fmt(worst)} = {statistics.median(ratios):.2f}x the state ({min(ratios):.2f}-"
        f"{max(ratios):.2f}); traced peak {fmt(traced)}; per rank, run by run (MiB): "
        f"{[[round(x / MiB) for x in run] for run in per_rank]}; restored equal: {same}"
    )


def measure(
    store: str,
    sizes_mib: list[int],
    *,
    n_tensors: int = 16,
    part_size: int = 16 * MiB,
    width: int = 8,
    server: Any = None,
    timeout: float = 900,
) -> list[dict[str, Any]]:
    """One subprocess per size; ``store`` is ``file`` or ``s3`` (then ``server`` is a
    :class:`benchmarks.common.Server`)."""
    from objckpt.testing.s3_servers import child_env

    rows = []
    for mib in sizes_mib:
        with tempfile.TemporaryDirectory(prefix="objckpt-mem-bench-") as tmp:
            if store == "file":
                uri, options = f"file://{tmp}/root", {}
            else:
                uri, options = f"s3://{BUCKET}/mem/{mib}-{time.time_ns()}", server.store_options
            out = Path(tmp) / "out.json"
            args = json.dumps([uri, options, mib * MiB, n_tensors, part_size, width, str(out)])
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.mem_bench", "--child", args],
                cwd=REPO,
                env=child_env({"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if proc.returncode != 0 or not out.exists():
                rows.append({"store": store, "mib": mib, "error": (proc.stdout + proc.stderr)[-2000:]})
                continue
            row = json.loads(out.read_text())
            row.update(store=store, mib=mib)
            rows.append(row)
        if store == "s3":
            from benchmarks.common import boto_client, delete_prefix

            client = boto_client(server.endpoint)
            delete_prefix(client, BUCKET, "mem/")
            client.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--store", choices=["file", "s3"], default="file")
    ap.add_argument("--server", choices=["localstack", "moto"], default="localstack")
    ap.add_argument("--endpoint")
    ap.add_argument("--mib", type=int, action="append")
    ap.add_argument("--rank-child", help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, action="append", help="the multi-rank read-once leg at W ranks")
    ap.add_argument("--rep-mib", type=int, default=256, help="replicated state of that leg (MiB)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    if args.child:
        child(*json.loads(args.child))
        return 0
    if args.rank_child:
        rank_child(*json.loads(args.rank_child))
        return 0
    if args.ranks:
        for row in measure_ranks(args.ranks, args.rep_mib, args.runs):
            print(_ranks_report(row))
        return 0
    sizes = args.mib or [64, 256]
    if args.store == "s3":
        from benchmarks.common import start_server

        with start_server(args.server, args.endpoint) as srv:
            rows = measure("s3", sizes, server=srv)
    else:
        rows = measure("file", sizes)
    for r in rows:
        if "error" in r:
            print(r["store"], r["mib"], "ERROR", r["error"])
            continue
        print(
            f"{r['store']} {r['mib']} MiB: save extra RSS {r['save']['extra_rss'] / MiB:.1f} MiB, "
            f"traced peak {r['save']['traced_peak'] / MiB:.1f} MiB; restore extra RSS "
            f"{r['restore']['extra_rss'] / MiB:.1f} MiB ({r['restore']['extra_rss'] / r['state_bytes']:.2f}x "
            f"the state), traced peak {r['restore']['traced_peak'] / MiB:.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
