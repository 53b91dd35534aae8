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

from benchmarks.common import BUCKET, REPO, MiB, make_model, write_json


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
    args = ap.parse_args(argv)
    if args.child:
        child(*json.loads(args.child))
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
