"""A save (or a GC run) that SIGKILLs its own process at one protocol point.

Run by ``test_crash_matrix.py`` and ``scripts/reliability.py`` as a real subprocess, so the crash
is a real one: no ``finally`` blocks, no ``atexit``, no abort of the pending multipart upload,
open sockets and half-written staging files left as they are -- exactly what a preempted node
leaves behind. The crash point is named by ``$OBJCKPT_CRASH_AT``; the hook lives in a
``CountingStore`` subclass wrapped around the real store, so product code carries no crash hooks.

Usage (from the repository root)::

    OBJCKPT_CRASH_AT=after_manifest python -m tests.reliability.crash_worker save URI STEP WORLD BIG [SALT] REPORT
    OBJCKPT_CRASH_AT=gc_between_deletes python -m tests.reliability.crash_worker gc URI KEEP_LAST [sweep] REPORT
    OBJCKPT_CRASH_AT=call:7 python -m tests.reliability.crash_worker rollback URI STEP REPORT
    OBJCKPT_CRASH_AT=rank:1:3 python -m tests.reliability.crash_worker cp SRC_URI DST_URI REPORT

Besides the named points, generic ones pick a random point for the soak (scripts/soak.py):
``call:N`` dies as the N-th primitive call starts (any op; ``call:N:OP``: the N-th call of that op),
``rank:R:N`` as the N-th call on rank R's shards starts. A save commits on the head's timeline
after the head (as a restarted job does), with payloads salted by SALT; ``gc ... sweep`` collects
with "now" past the grace period (orphans and pending uploads swept). The report says which call
the process died at (``killed_at``: op and key). ``run`` is the same worker in-process (the soak's
memory:// runs), where dying raises :class:`SimulatedKill` instead.

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
from collections.abc import Callable
from typing import Any

from objckpt.commit import Coordinator
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.layout import MANIFEST_PREFIX, new_attempt_id, parse_shard_key
from objckpt.reader import Reader
from objckpt.store import Store, open_store
from objckpt.store.wrappers import CountingStore
from tests.reliability.harness import FAST_RETRY, GRACE, after_grace, payloads, write_rank

#: crash point -> what has happened when the process dies
CRASH_POINTS = {
    "mid_part_upload": "a multipart shard has started; the process dies as part 2 goes out",
    "before_complete": "every part of a multipart shard is uploaded; dies before completing it",
    "after_complete": "every shard of every rank is complete; dies before receipts are gathered",
    "before_manifest": "receipts gathered and checked against the store; dies before the manifest",
    "after_manifest": "the manifest is written (committed); dies before LATEST moves",
    "gc_between_deletes": "GC deleted the old manifests; dies before deleting their shards",
}


class SimulatedKill(BaseException):
    """The in-process stand-in for SIGKILL (memory:// runs of the soak): a BaseException, so no
    ``except Exception`` of the code under test catches it."""


#: how the worker dies: SIGKILL of its own process, or (in-process) raising SimulatedKill -- on
#: whichever thread reaches the point (upload threads too), so process-wide, not per thread
_IN_PROCESS = {"active": False}


def die(point: str, report: dict[str, Any], path: str | None) -> None:
    report["crashed_at"] = point
    if path is not None:
        _write(path, report)
    if _IN_PROCESS["active"]:
        raise SimulatedKill(point)
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _write(path: str | None, report: dict[str, Any]) -> None:
    if path is None:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Counter:
    """Calls counted across every store of one worker (a cp has two)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.total = 0
        self.by_op: dict[str, int] = {}
        self.by_rank: dict[int, int] = {}


def _generic(point: str) -> tuple[str, int, str | None] | None:
    """``call:N[:OP]`` -> ("call", N, OP); ``rank:R:N`` -> ("rank", N, R); else None."""
    parts = point.split(":")
    if parts[0] == "call" and len(parts) in (2, 3) and parts[1].isdigit():
        return "call", int(parts[1]), parts[2] if len(parts) == 3 else None
    if parts[0] == "rank" and len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return "rank", int(parts[2]), parts[1]
    return None


class CrashingStore(CountingStore):
    """Counts primitive calls like ``CountingStore`` and kills the process at ``point``."""

    def __init__(
        self,
        inner: Store,
        point: str,
        report: dict[str, Any],
        path: str | None,
        counter: _Counter | None = None,
    ) -> None:
        super().__init__(inner)
        self.point = point
        self.report = report
        self.path = path
        self.completes = 0
        self.deletes = 0
        self.expected_completes = 0
        self._lock2 = threading.Lock()
        self.counter = counter or _Counter()
        self.generic = _generic(point)

    def _generic_hit(self, op: str, key: str) -> bool:
        kind, n, arg = self.generic  # type: ignore[misc]
        c = self.counter
        with c.lock:
            if kind == "call":
                if arg is not None and op != arg:
                    return False
                c.total += 1
                return c.total == n
            parsed = parse_shard_key(key) if key.startswith("data/") else None
            if parsed is None or parsed[2] != int(arg):  # type: ignore[arg-type]
                return False
            c.by_rank[parsed[2]] = c.by_rank.get(parsed[2], 0) + 1
            return c.by_rank[parsed[2]] == n

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Any, *args: Any) -> Any:
        p = self.point
        if self.generic is not None:
            if self._generic_hit(op, key):
                self.report["killed_at"] = {"op": op, "key": key, "location": self.location}
                die(p, self.report, self.path)
            return super()._invoke(op, key, keys, fn, *args)
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


def run(
    argv: list[str],
    point: str,
    *,
    report_path: str | None = None,
    opener: Callable[[str], Store] | None = None,
    in_process: bool = False,
    report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One worker operation (``argv`` without the report path) dying at ``point``; returns its
    report. ``opener`` opens a URI (default: ``open_store`` with fast retries). With
    ``in_process`` the death is :class:`SimulatedKill` raised on this thread."""
    if point and point not in CRASH_POINTS and _generic(point) is None:
        raise ValueError(
            f"unknown crash point {point!r}; known: {sorted(CRASH_POINTS)}, call:N[:OP], rank:R:N"
        )
    opener = opener or (lambda uri: open_store(uri, retry=FAST_RETRY))
    op = argv[0]
    report = {} if report is None else report  # filled in place: readable after a SimulatedKill
    report.update(op=op, point=point, pid=os.getpid())
    counter = _Counter()
    _IN_PROCESS["active"] = in_process
    try:
        return _run(op, argv, point, report, report_path, opener, counter)
    finally:
        _IN_PROCESS["active"] = False


def _run(
    op: str,
    argv: list[str],
    point: str,
    report: dict[str, Any],
    path: str | None,
    opener: Callable[[str], Store],
    counter: _Counter,
) -> dict[str, Any]:
    def crashing(uri: str) -> CrashingStore:
        return CrashingStore(opener(uri), point, report, path, counter)

    if op == "save":
        uri, step, world, big = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        salt = argv[5] if len(argv) > 5 else ""
        attempt = new_attempt_id()
        report.update(step=step, attempt=attempt, salt=salt)
        _write(path, report)
        store = crashing(uri)
        p = payloads(step, world, big=big, big_ranks=tuple(range(world)), salt=salt)
        store.expected_completes = sum(1 for r in p.values() if "big.bin" in r)
        if salt:
            # a restarted job: continue on the head's timeline, after the head
            head = Reader(store).head()
            timeline, after = head.timeline, head.ref
        else:
            timeline, after = 0, None
        report["timeline"] = timeline
        # Ranks one after another, so 'the last complete' and 'part 2 of the first multipart
        # shard' are well defined; concurrency is covered by the chaos tests.
        reports = {r: write_rank(store, step, attempt, r, p[r]) for r in sorted(p)}
        report["receipts"] = sum(len(v) for v in reports.values())
        _write(path, report)
        m = Coordinator(store, world_size=world).commit(
            step, attempt, reports, timeline=timeline, after=after
        )
        report["committed"] = m.step
        report["committed_timeline"] = m.timeline
    elif op == "gc":
        uri, keep_last = argv[1], int(argv[2])
        sweep = len(argv) > 3 and argv[3] == "sweep"
        _write(path, report)
        store = crashing(uri)
        plan = plan_gc(
            store,
            RetentionPolicy(keep_last=keep_last),
            grace_period=GRACE,
            now=after_grace() if sweep else None,
        )
        report["planned"] = [d.step for d in plan.manifests]
        _write(path, report)
        run_gc(store, plan)
    elif op == "rollback":
        from objckpt.timelines import rollback

        uri, step = argv[1], int(argv[2])
        timeline = int(argv[3]) if len(argv) > 3 else None
        _write(path, report)
        claim = rollback(crashing(uri), step, timeline=timeline)
        report["claimed"] = claim.timeline
    elif op == "cp":
        from objckpt.replicate import replicate

        src, dst = crashing(argv[1]), crashing(argv[2])
        _write(path, report)
        m = replicate(src, dst)
        report["committed"] = m.step
        report["source_attempt"] = m.metadata.get("replicated_from", {}).get("attempt")
    else:
        raise ValueError(f"unknown op {op!r}")
    report["finished"] = True
    _write(path, report)
    return report


def main(argv: list[str]) -> int:
    point = os.environ.get("OBJCKPT_CRASH_AT", "")
    if point and point not in CRASH_POINTS and _generic(point) is None:
        print(f"unknown crash point {point!r}; known: {sorted(CRASH_POINTS)}", file=sys.stderr)
        return 2
    if not argv or argv[0] not in ("save", "gc", "rollback", "cp"):
        print(f"unknown op {argv[:1]!r}", file=sys.stderr)
        return 2
    run(argv[:-1], point, report_path=argv[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
