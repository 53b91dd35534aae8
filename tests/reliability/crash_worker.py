"""A save (or a GC run) that SIGKILLs its own process at one protocol point.

Run by ``test_crash_matrix.py`` and ``scripts/reliability.py`` as a real subprocess, so the crash
is a real one: no ``finally`` blocks, no ``atexit``, no abort of the pending multipart upload,
open sockets and half-written staging files left as they are -- exactly what a preempted node
leaves behind. The crash point is named by ``$OBJCKPT_CRASH_AT``; the hook lives in a
``CountingStore`` subclass wrapped around the real store, so product code carries no crash hooks.

Usage (from the repository root)::

    OBJCKPT_CRASH_AT=after_manifest python -m tests.reliability.crash_worker save URI STEP WORLD BIG REPORT
    OBJCKPT_CRASH_AT=gc_between_deletes python -m tests.reliability.crash_worker gc URI KEEP_LAST REPORT

``REPORT`` is a JSON file the worker writes *before* it starts (the attempt id, so the test knows
which attempt the crash abandoned) and updates as it goes. Exit status: -9 (SIGKILL) when the
crash point was reached, 0 when the operation completed without reaching it (the test fails),
1 on any error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

from objckpt.commit import Coordinator
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.layout import MANIFEST_PREFIX, new_attempt_id
from objckpt.store import Store, open_store
from objckpt.store.wrappers import CountingStore
from tests.reliability.harness import FAST_RETRY, GRACE, payloads, write_rank

#: crash point -> what has happened when the process dies
CRASH_POINTS = {
    "mid_part_upload": "a multipart shard has started; the process dies as part 2 goes out",
    "before_complete": "every part of a multipart shard is uploaded; dies before completing it",
    "after_complete": "every shard of every rank is complete; dies before receipts are gathered",
    "before_manifest": "receipts gathered and checked against the store; dies before the manifest",
    "after_manifest": "the manifest is written (committed); dies before LATEST moves",
    "gc_between_deletes": "GC deleted the old manifests; dies before deleting their shards",
}


def die(point: str, report: dict[str, Any], path: str) -> None:
    report["crashed_at"] = point
    _write(path, report)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _write(path: str, report: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CrashingStore(CountingStore):
    """Counts primitive calls like ``CountingStore`` and kills the process at ``point``."""

    def __init__(self, inner: Store, point: str, report: dict[str, Any], path: str) -> None:
        super().__init__(inner)
        self.point = point
        self.report = report
        self.path = path
        self.completes = 0
        self.deletes = 0
        self.expected_completes = 0
        self._lock2 = threading.Lock()

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Any, *args: Any) -> Any:
        p = self.point
        if p == "mid_part_upload" and op == "upload_part" and args[1] == 2:
            die(p, self.report, self.path)
        if p == "before_complete" and op == "complete_upload":
            die(p, self.report, self.path)
        if p == "before_manifest" and op == "put" and key.startswith(MANIFEST_PREFIX):
            die(p, self.report, self.path)
        if p == "gc_between_deletes" and op == "delete_batch":
            with self._lock2:
                self.deletes += 1
                # The first batch is the manifests; the second would be their shards.
                if self.deletes == 2:
                    die(p, self.report, self.path)
                self.report["deleted_first"] = list(keys or [])
                _write(self.path, self.report)
        result = super()._invoke(op, key, keys, fn, *args)
        if p == "after_complete" and op == "complete_upload":
            with self._lock2:
                self.completes += 1
                if self.completes == self.expected_completes:
                    die(p, self.report, self.path)
        if p == "after_manifest" and op == "put" and key.startswith(MANIFEST_PREFIX):
            die(p, self.report, self.path)
        return result


def main(argv: list[str]) -> int:
    point = os.environ.get("OBJCKPT_CRASH_AT", "")
    if point and point not in CRASH_POINTS:
        print(f"unknown crash point {point!r}; known: {sorted(CRASH_POINTS)}", file=sys.stderr)
        return 2
    op = argv[0]
    report: dict[str, Any] = {"op": op, "point": point, "pid": os.getpid()}
    if op == "save":
        uri, step, world, big, path = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
        attempt = new_attempt_id()
        report.update(step=step, attempt=attempt)
        _write(path, report)
        store = CrashingStore(open_store(uri, retry=FAST_RETRY), point, report, path)
        p = payloads(step, world, big=big, big_ranks=tuple(range(world)))
        store.expected_completes = sum(1 for r in p.values() if "big.bin" in r)
        # Ranks one after another, so 'the last complete' and 'part 2 of the first multipart
        # shard' are well defined; concurrency is covered by the chaos tests.
        reports = {r: write_rank(store, step, attempt, r, p[r]) for r in sorted(p)}
        report["receipts"] = sum(len(v) for v in reports.values())
        _write(path, report)
        m = Coordinator(store, world_size=world).commit(step, attempt, reports)
        report["committed"] = m.step
    elif op == "gc":
        uri, keep_last, path = argv[1], int(argv[2]), argv[3]
        _write(path, report)
        store = CrashingStore(open_store(uri, retry=FAST_RETRY), point, report, path)
        plan = plan_gc(store, RetentionPolicy(keep_last=keep_last), grace_period=GRACE)
        report["planned"] = [d.step for d in plan.manifests]
        _write(path, report)
        run_gc(store, plan)
    else:
        print(f"unknown op {op!r}", file=sys.stderr)
        return 2
    report["finished"] = True
    _write(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
