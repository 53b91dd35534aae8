"""Resolve-latest cost against the number of committed checkpoints.

For each N, a fresh run root gets N committed checkpoints, written directly through the core
(``Manifest.create`` + a create-if-absent PUT of ``manifests/<step>.json`` per step, each naming
its parent, then ``LATEST``), in parallel: the resolution path only reads manifests, so no shard
bytes are needed. Then ``Reader(CountingStore(store)).latest()`` (what ``CheckpointManager``'s
``latest_step``/``restore`` use) is timed and its requests counted:

* ``pointer``: ``LATEST`` names the newest manifest (the normal case);
* ``no pointer``: ``LATEST`` deleted (lost or never written): ``manifests/`` is listed whole.

Goal: a constant number of requests whatever N (with a pointer).

    python -m benchmarks.resolve_bench --server localstack
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.common import BUCKET, Series


def build(store: Any, n: int) -> None:
    from objckpt import layout
    from objckpt._crc import crc32c_b64
    from objckpt.manifest import Manifest, Pointer, ShardReceipt
    from objckpt.store.base import PutMode

    def one(step: int) -> Manifest:
        attempt = layout.new_attempt_id()
        receipt = ShardReceipt(
            key=layout.shard_key(step, attempt, 0, "rank.bin"),
            size=1,
            version='"v"',
            crc32c=crc32c_b64(b"x"),
            rank=0,
            name="rank.bin",
        )
        m = Manifest.create(
            step=step,
            attempt=attempt,
            world_size=1,
            shards=[receipt],
            progress={"global_step": step},
            parent=step - 1 if step > 1 else None,
        )
        store.put(m.key, m.encode(), mode=PutMode.CREATE)
        return m

    with ThreadPoolExecutor(16) as pool:
        manifests = list(pool.map(one, range(1, n + 1)))
    store.put(layout.POINTER_KEY, Pointer.for_manifest(manifests[-1]).encode(), mode=PutMode.OVERWRITE)


def measure(open_store_fn: Any, counts: list[int], runs: int = 5) -> list[dict[str, Any]]:
    """``open_store_fn(prefix)`` opens a fresh store; returns one row per (N, case)."""
    from objckpt import layout
    from objckpt.reader import Reader
    from objckpt.store.wrappers import CountingStore

    rows = []
    for n in counts:
        store = open_store_fn(f"resolve/{n}-{time.time_ns()}")
        t = time.perf_counter()
        build(store, n)
        build_s = time.perf_counter() - t
        counting = CountingStore(store, close_inner=False)
        reader = Reader(counting)
        for case in ("pointer", "no pointer"):
            if case == "no pointer":
                store.delete([layout.POINTER_KEY])
            times = Series()
            counts_seen: dict[str, int] = {}
            for _ in range(runs):
                counting.reset()
                t = time.perf_counter()
                m = reader.latest()
                times.values.append(time.perf_counter() - t)
                assert m is not None and m.step == n, (m, n)
                counts_seen = dict(counting.counts)
            rows.append(
                {
                    "n": n,
                    "case": case,
                    "requests": sum(counts_seen.values()),
                    "by_op": counts_seen,
                    "seconds": times.values,
                    "build_s": build_s,
                }
            )
        store.delete(meta.key for meta in store.list(""))
        store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=["localstack", "moto"], default="localstack")
    ap.add_argument("--endpoint")
    ap.add_argument("-n", type=int, action="append")
    args = ap.parse_args(argv)
    from benchmarks.common import start_server
    from objckpt.store import open_store

    with start_server(args.server, args.endpoint) as srv:
        rows = measure(
            lambda p: open_store(f"s3://{BUCKET}/{p}", **srv.store_options), args.n or [10, 100, 1000]
        )
    for r in rows:
        print(
            f"N={r['n']:>5} {r['case']:<10} requests {r['requests']} {r['by_op']} "
            f"time {Series(r['seconds']).fmt(4, 's')} (built in {r['build_s']:.1f}s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
