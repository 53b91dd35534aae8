"""The randomized soak: thousands of episodes, each a random operation under a random fault,
each followed by the invariant checks. Shared by ``scripts/soak.py`` (the full run) and
``tests/reliability/test_soak.py`` (a fixed-seed CI sample).

An **episode** picks (from its own seeded RNG: ``Random(f"{seed}:{episode}")``) a backend --
memory://, file://, S3 on moto, S3 on LocalStack (when installed), GCS on fake-gcs-server -- an
operation and a fault:

* operations: ``save`` (1-3 ranks, small shards, sometimes a multipart one, committed on the
  head's timeline like a restarted job), ``gc`` (keep_last 1-3, sometimes sweeping orphans with
  "now" past the grace period), ``rollback`` (to a random intact checkpoint on the head's line),
  ``cp`` (replicate the head to a second run root) and ``bitflip`` (one byte of a random shard,
  manifest or LATEST flipped: in place on file:// -- bit rot that keeps size, mtime and stored
  CRC --, by overwrite elsewhere);
* faults of the process operations: ``kill`` -- the crash worker (``crash_worker.py``, the one
  the crash matrix uses) dies by SIGKILL as a random primitive call starts, or as a random call
  of a random rank's shard writes starts (memory://: the in-process stand-in, ``SimulatedKill``)
  --, ``net`` -- random 503 SlowDown / 500 / reset / truncated bodies (both before and after the
  server applied the request) through the chaos proxy, at 5-25% of requests --, both, or none.

Process operations run in a forked child (the crash worker, already imported: a fork costs
milliseconds, an interpreter start seconds; ``spawn=True`` uses ``python -m`` instead).

After every episode the checks, against the store directly (no proxy) and an independent model
of what was committed (the soak's own bookkeeping of every commit, claim, deletion and injected
damage; the store's manifests are reconciled with it: a manifest nobody made, or one that
disappeared outside GC, is a violation):

1. ``LATEST`` never names an incomplete or unverifiable checkpoint: the manifest it names exists
   and validates and every shard is there with its size and CRC32C (unless the soak itself
   damaged that checkpoint after its commit);
2. the last complete checkpoint was never deleted: the newest intact checkpoint on the head's
   line before the episode still exists after it, or a newer intact one does (the one exception
   recorded, not counted as a violation: bit rot that no HEAD can see, after which GC rightly
   trusts what it can check);
3. a restore (``RestoreSession``, the one restore path) equals the last committed state bit for
   bit: the model's newest intact checkpoint on the head's line, every shard byte equal to what
   that save wrote; with nothing intact, it raises ``NoCheckpointError`` (or finds nothing).

A run root lives for ``episodes_per_root`` episodes (history, GC and timelines matter), then a
fresh one starts; replaying episode N (``--episode N``) replays its root's episodes up to N.
Everything listens on 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from objckpt import layout
from objckpt.coordination import LocalComm, RestoreSession, lineage
from objckpt.errors import IntegrityError, ManifestError, NoCheckpointError, ObjckptError
from objckpt.manifest import Manifest, Pointer
from objckpt.pointer import TimelineClaim
from objckpt.reader import Reader
from objckpt.store import PutMode, Store, open_store
from objckpt.store.memory import MemoryStore

from . import crash_worker
from .harness import FAST_RETRY, KiB, payloads

log = logging.getLogger("objckpt.tests.soak")

REPO = Path(__file__).resolve().parents[2]

Ref = tuple[int, int]

BACKENDS = ("memory", "file", "s3_moto", "s3_localstack", "gcs")
OPS = {"save": 0.42, "gc": 0.14, "rollback": 0.1, "cp": 0.1, "bitflip": 0.24}
NET_KINDS = ("slowdown", "internal", "reset", "truncate")
SMALL_PART = 64 * KiB


# ------------------------------------------------------------------ the model


@dataclass
class Entry:
    """One committed checkpoint as the soak knows it."""

    ref: Ref
    step: int
    world: int
    big: int
    salt: str
    attempt: str
    damaged: bool = False
    #: the damage can be seen by a HEAD (an overwrite changes the version); bit rot in place cannot
    visible: bool = True

    def payload(self) -> dict[int, dict[str, bytes]]:
        return payloads(
            self.step, self.world, big=self.big, big_ranks=tuple(range(self.world)), salt=self.salt
        )


@dataclass
class Model:
    """What the soak committed on one run root, independent of the code under test."""

    entries: dict[Ref, Entry] = field(default_factory=dict)
    claims: dict[int, Ref] = field(default_factory=dict)  # timeline -> base ref
    gone: set[Ref] = field(default_factory=set)

    def present(self) -> dict[Ref, Entry]:
        return {r: e for r, e in self.entries.items() if r not in self.gone}

    def line(self) -> list[Ref]:
        """The head's line, newest first (present checkpoints only)."""
        present = self.present()
        t: int | None = max([0, *self.claims])
        last: int | None = None
        out: list[Ref] = []
        seen: set[int] = set()
        while t is not None and t not in seen:
            seen.add(t)
            out += sorted((r for r in present if r[0] == t and (last is None or r[1] <= last)), reverse=True)
            if t == 0:
                break
            base = self.claims.get(t)
            if base is None:
                break
            t, last = base
        return out

    def target(self) -> Ref | None:
        """What a restore must give: the newest intact checkpoint on the head's line."""
        return next((r for r in self.line() if not self.entries[r].damaged), None)

    def intact(self) -> list[Ref]:
        return [r for r in self.line() if not self.entries[r].damaged]


@dataclass
class Root:
    """A run root of one backend (and the root its ``cp`` episodes copy to)."""

    backend: str
    worker_uri: str  # what the worker opens (through the chaos proxy, if any)
    check_uri: str  # what the checks open (directly)
    cp_worker_uri: str
    cp_check_uri: str
    model: Model = field(default_factory=Model)
    cp_model: Model = field(default_factory=Model)
    next_step: int = 10
    episodes: int = 0


@dataclass
class Outcome:
    episode: int
    backend: str
    op: str
    fault: str
    detail: str = ""
    killed: str | None = None  # the phase the worker died in
    faults: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Stats:
    episodes: int = 0
    by_backend: Counter[str] = field(default_factory=Counter)
    by_op: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, out: Outcome) -> None:
        self.episodes += 1
        self.by_backend[out.backend] += 1
        self.by_op[out.op] += 1
        self.faults.update(out.faults)
        for n in out.notes:
            self.notes[n] += 1
        for v in out.violations:
            self.violations.append(
                {
                    "episode": out.episode,
                    "backend": out.backend,
                    "op": out.op,
                    "fault": out.fault,
                    "violation": v,
                }
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "by_backend": dict(self.by_backend),
            "by_op": dict(self.by_op),
            "faults": dict(sorted(self.faults.items())),
            "checks": dict(self.checks),
            "notes": dict(self.notes),
            "violations": self.violations,
            "seconds": round(self.seconds, 1),
        }


# ------------------------------------------------------------------ backends


class _Backend:
    def __init__(self, name: str) -> None:
        self.name = name
        self.proxy: Any = None
        self.server: Any = None
        self.bucket = f"soak-{uuid.uuid4().hex[:8]}"
        self.part = SMALL_PART

    def uris(self, prefix: str) -> tuple[str, str]:
        raise NotImplementedError

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.stop()


class _Memory(_Backend):
    def __init__(self) -> None:
        super().__init__("memory")
        self.stores: dict[str, MemoryStore] = {}

    def uris(self, prefix: str) -> tuple[str, str]:
        uri = f"memory://{prefix}"
        self.stores[uri] = MemoryStore(prefix, retry=FAST_RETRY, part_size=self.part)
        return uri, uri

    def open(self, uri: str) -> Store:
        return self.stores[uri]


class _File(_Backend):
    def __init__(self, tmp: str) -> None:
        super().__init__("file")
        self.tmp = tmp

    def uris(self, prefix: str) -> tuple[str, str]:
        uri = f"file://{self.tmp}/{prefix}?part_size={self.part}"
        return uri, uri


class _S3(_Backend):
    def __init__(self, name: str, server: Any, part: int) -> None:
        from objckpt.testing.chaos_proxy import ChaosProxy
        from objckpt.testing.s3_servers import create_bucket

        super().__init__(name)
        self.server = server
        self.part = part
        create_bucket(server.endpoint_url, self.bucket)
        self.proxy = ChaosProxy(server.endpoint_url, fault_rate=0.0, flavor="s3", latency=(0.0, 0.05)).start()

    def _uri(self, endpoint: str, prefix: str) -> str:
        opts = {**self.server.store_options, "endpoint_url": endpoint, "part_size": self.part}
        opts["min_part_size"] = min(self.part, int(opts.get("min_part_size", 5 * 1024 * 1024)))
        return f"s3://{self.bucket}/{prefix}?{urlencode(opts)}"

    def uris(self, prefix: str) -> tuple[str, str]:
        return self._uri(self.proxy.endpoint_url, prefix), self._uri(self.server.endpoint_url, prefix)


class _GCS(_Backend):
    def __init__(self, server: Any) -> None:
        from objckpt.testing.chaos_proxy import ChaosProxy

        super().__init__("gcs")
        self.server = server
        server.create_bucket(self.bucket)
        self.proxy = ChaosProxy(
            server.endpoint_url, fault_rate=0.0, flavor="gcs", latency=(0.0, 0.05)
        ).start()

    def uris(self, prefix: str) -> tuple[str, str]:
        def uri(endpoint: str) -> str:
            return (
                f"gs://{self.bucket}/{prefix}?{urlencode({'endpoint_url': endpoint, 'part_size': self.part})}"
            )

        return uri(self.proxy.endpoint_url), uri(self.server.endpoint_url)


# ------------------------------------------------------------------ the soak


class Soak:
    """Runs episodes; ``with Soak(...) as soak: soak.run(range(n))``."""

    def __init__(
        self,
        seed: int,
        *,
        backends: tuple[str, ...] = BACKENDS,
        episodes_per_root: int = 12,
        spawn: bool = False,
        worker_timeout: float = 120.0,
    ) -> None:
        self.seed = seed
        self.wanted = backends
        self.episodes_per_root = episodes_per_root
        self.spawn = spawn
        self.worker_timeout = worker_timeout
        self.backends: dict[str, _Backend] = {}
        self.roots: dict[tuple[str, int], Root] = {}
        self.stats = Stats()
        self.skipped: dict[str, str] = {}
        self._stack = contextlib.ExitStack()
        self._tmp = ""

    # -- lifecycle

    def __enter__(self) -> Soak:
        self._tmp = self._stack.enter_context(tempfile.TemporaryDirectory(prefix="objckpt-soak-"))
        for name in self.wanted:
            try:
                self.backends[name] = self._start(name)
            except Exception as exc:  # noqa: BLE001 - reported: the soak runs on the others
                self.skipped[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        if not self.backends:
            raise RuntimeError(f"no backend could start: {self.skipped}")
        return self

    def __exit__(self, *exc: object) -> None:
        for b in self.backends.values():
            with contextlib.suppress(Exception):
                b.close()
        self._stack.close()

    def _start(self, name: str) -> _Backend:
        if name == "memory":
            return _Memory()
        if name == "file":
            return _File(self._tmp)
        if name == "s3_moto":
            from objckpt.testing.s3_servers import MotoServer

            return _S3(name, MotoServer(min_part_size=SMALL_PART).start(), SMALL_PART)
        if name == "s3_localstack":
            from objckpt.testing.s3_servers import LocalStackServer

            from .harness import localstack_unavailable

            why = localstack_unavailable()
            if why:
                raise RuntimeError(why)
            return _S3(name, LocalStackServer().start(), 5 * 1024 * 1024)
        if name == "gcs":
            from objckpt.testing.gcs_server import FakeGcsServer

            return _GCS(FakeGcsServer().start())
        raise ValueError(name)

    # -- choices

    def _rng(self, episode: int) -> random.Random:
        return random.Random(f"{self.seed}:{episode}")

    def _backend_of(self, episode: int) -> str:
        """The backend of the root ``episode`` belongs to (fixed for the whole root)."""
        first = episode - episode % self.episodes_per_root
        names = sorted(self.backends)
        weights = {"memory": 4, "file": 3, "s3_moto": 2, "gcs": 2, "s3_localstack": 1}
        return random.Random(f"{self.seed}:root:{first}").choices(names, [weights.get(n, 1) for n in names])[
            0
        ]

    def _root(self, episode: int) -> Root:
        first = episode - episode % self.episodes_per_root
        backend = self._backend_of(episode)
        key = (backend, first)
        root = self.roots.get(key)
        if root is None:
            b = self.backends[backend]
            prefix = f"soak-{self.seed}-{first}-{uuid.uuid4().hex[:6]}"
            w, c = b.uris(prefix)
            cw, cc = b.uris(prefix + "-cp")
            root = self.roots[key] = Root(backend, w, c, cw, cc)
            # roots of finished runs are dropped (their stores with them)
            for k in [k for k in self.roots if k[1] < first]:
                del self.roots[k]
        return root

    # -- running

    def run(self, episodes: Any, *, on_episode: Any = None, deadline: float | None = None) -> Stats:
        started = time.monotonic()
        for i in episodes:
            if deadline is not None and time.monotonic() > deadline:
                break
            out = self.episode(i)
            self.stats.add(out)
            if on_episode is not None:
                on_episode(out, self.stats)
        self.stats.seconds += time.monotonic() - started
        return self.stats

    def replay(self, episode: int) -> list[Outcome]:
        """Episode ``episode`` with its root's earlier episodes replayed first."""
        first = episode - episode % self.episodes_per_root
        return [self.episode(i) for i in range(first, episode + 1)]

    def episode(self, i: int) -> Outcome:
        rng = self._rng(i)
        root = self._root(i)
        op = rng.choices(list(OPS), list(OPS.values()))[0]
        if not root.model.present() and op in ("gc", "rollback", "bitflip", "cp"):
            op = "save"  # nothing to act on yet
        if op == "cp" and root.backend == "memory":
            op = "save" if rng.random() < 0.5 else "bitflip" if root.model.present() else "save"
        net_ok = self.backends[root.backend].proxy is not None
        if op == "bitflip":
            fault = "bitflip"
        else:
            kinds = ["none", "kill", "kill"] + (["net", "kill+net"] if net_ok else [])
            fault = rng.choice(kinds)
        out = Outcome(i, root.backend, op, fault)
        started = time.monotonic()
        before = root.model.target()
        before_intact = root.model.intact()
        try:
            if op == "bitflip":
                self._bitflip(root, rng, out)
            else:
                self._process_op(root, op, fault, rng, out)
            self._check(root, out, before, before_intact)
        except Exception as exc:  # noqa: BLE001 - a harness failure is reported as a violation
            out.violations.append(
                f"harness error: {type(exc).__name__}: {exc} ({traceback.format_exc(limit=3)})"
            )
        out.seconds = time.monotonic() - started
        root.episodes += 1
        return out

    # -- operations

    def _process_op(self, root: Root, op: str, fault: str, rng: random.Random, out: Outcome) -> None:
        backend = self.backends[root.backend]
        point = ""
        world = rng.choice([1, 1, 2, 2, 3])
        if "kill" in fault:
            if op == "save" and world > 1 and rng.random() < 0.5:
                point = f"rank:{rng.randrange(world)}:{rng.randint(1, 6)}"
            else:
                point = f"call:{rng.randint(1, 30)}"
        if op == "save":
            step = root.next_step
            root.next_step += 10
            big_every = 12 if root.backend == "s3_localstack" else 4
            big = int(backend.part * 2.5) + rng.randrange(1000) if rng.randrange(big_every) == 0 else 0
            salt = f"e{out.episode}"
            argv = ["save", root.worker_uri, str(step), str(world), str(big), salt]
            out.detail = f"step {step}, {world} rank(s)" + (f", multipart {big} B" if big else "")
        elif op == "gc":
            keep = rng.choice([1, 2, 3])
            sweep = rng.random() < 0.5
            argv = ["gc", root.worker_uri, str(keep)] + (["sweep"] if sweep else [])
            out.detail = f"keep_last={keep}" + (", sweeping orphans" if sweep else "")
        elif op == "rollback":
            choices = [r for r in root.model.intact() if root.model.entries[r].visible]
            if not choices:
                out.op, out.detail = "rollback", "nothing intact to roll back to"
                return
            ref = rng.choice(choices)
            argv = ["rollback", root.worker_uri, str(ref[1]), str(ref[0])]
            out.detail = f"to step {ref[1]} of timeline {ref[0]}"
        elif op == "cp":
            argv = ["cp", root.worker_uri, root.cp_worker_uri]
            out.detail = "head to the cp root"
        else:
            raise ValueError(op)
        rates = None
        if "net" in fault:
            rate = rng.uniform(0.05, 0.25)
            rates = {k: rate / len(NET_KINDS) for k in NET_KINDS}
        report = self._work(root, argv, point, rates, rng, out)
        killed = report.get("crashed_at")
        if killed:
            out.killed = self._phase(op, report)
            out.faults[f"kill:{out.killed}"] = out.faults.get(f"kill:{out.killed}", 0) + 1
        elif point:
            out.faults["kill:not_reached"] = out.faults.get("kill:not_reached", 0) + 1
        if op == "save":
            self._reconcile(root, root.model, out, save=report)
        elif op == "gc":
            self._reconcile(root, root.model, out, gc=True)
        elif op == "rollback":
            self._reconcile(root, root.model, out, rollback=True)
        elif op == "cp":
            self._reconcile(root, root.model, out)
            self._reconcile_cp(root, out)

    @staticmethod
    def _phase(op: str, report: dict[str, Any]) -> str:
        if op in ("gc", "rollback", "cp"):
            return op
        key = str((report.get("killed_at") or {}).get("key", ""))
        if key.startswith("data/"):
            return "save"
        if key.startswith(layout.POINTER_KEY):
            return "pointer"
        if report.get("point") in ("after_manifest",):
            return "pointer"
        return "commit"

    def _work(
        self,
        root: Root,
        argv: list[str],
        point: str,
        rates: dict[str, float] | None,
        rng: random.Random,
        out: Outcome,
    ) -> dict[str, Any]:
        backend = self.backends[root.backend]
        proxy = backend.proxy
        before = dict(proxy.stats) if proxy is not None else {}
        if proxy is not None:
            proxy.seed = rng.randrange(2**31)
            proxy.set_fault_rate(rates or 0.0, kinds=NET_KINDS)
        try:
            if isinstance(backend, _Memory):
                report: dict[str, Any] = {}
                try:
                    crash_worker.run(argv, point, opener=backend.open, in_process=True, report=report)
                except crash_worker.SimulatedKill:
                    report["crashed_at"] = point
                except (ObjckptError, ValueError) as exc:
                    out.notes.append(f"{argv[0]} failed: {type(exc).__name__}")
                    out.detail += f" [failed: {type(exc).__name__}: {str(exc)[:160]}]"
                return report
            return self._fork(argv, point, out)
        finally:
            if proxy is not None:
                proxy.set_fault_rate(0.0, kinds=NET_KINDS)
                after = proxy.stats
                for kind in (*NET_KINDS, "latency"):
                    n = after.get(kind, 0) - before.get(kind, 0)
                    if n:
                        out.faults[f"net:{kind}"] = out.faults.get(f"net:{kind}", 0) + n

    def _fork(self, argv: list[str], point: str, out: Outcome) -> dict[str, Any]:
        fd, path = tempfile.mkstemp(prefix="soak-report-", suffix=".json", dir=self._tmp)
        os.close(fd)
        os.unlink(path)
        try:
            if self.spawn:
                env = {**os.environ, "OBJCKPT_CRASH_AT": point, "PYTHONPATH": str(REPO)}
                proc = subprocess.run(
                    [sys.executable, "-m", "tests.reliability.crash_worker", *argv, path],
                    cwd=REPO,
                    env=env,
                    timeout=self.worker_timeout,
                    capture_output=True,
                    text=True,
                )
                rc = proc.returncode
            else:
                rc = _forked(argv, point, path, self.worker_timeout)
            report: dict[str, Any] = {}
            if os.path.exists(path):
                with open(path) as f:
                    report = json.load(f)
            if rc == -signal.SIGKILL and not report.get("crashed_at"):
                out.notes.append("worker hung past its timeout and was killed")
                report["crashed_at"] = "timeout"
            elif rc not in (0, -signal.SIGKILL):
                error = str(report.get("error", f"exit {rc}"))
                out.notes.append(f"{argv[0]} failed: {error.split(':', 1)[0]}")
                out.detail += f" [failed: {error[:160]}]"
            return report
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _bitflip(self, root: Root, rng: random.Random, out: Outcome) -> None:
        store = self._open(root.check_uri, root)
        try:
            present = sorted(root.model.present())
            ref = rng.choice(present)
            entry = root.model.entries[ref]
            what = rng.choice(["shard", "shard", "manifest", "pointer"])
            in_place = root.backend == "file" and rng.random() < 0.5
            if what == "pointer":
                key = layout.POINTER_KEY
            elif what == "manifest":
                key = layout.manifest_key(ref[1], ref[0])
            else:
                mkey = layout.manifest_key(ref[1], ref[0])
                try:
                    m = Manifest.decode(store.get(mkey), key=mkey)
                except ObjckptError:
                    out.detail = f"step {ref[1]}: its manifest is already damaged; nothing flipped"
                    return
                key = rng.choice(list(m.shards)).key
            try:
                data = bytearray(store.get(key))
            except ObjckptError:
                out.detail = f"{what} {key}: unreadable, nothing flipped"
                return
            if not data:
                return
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
            if in_place:
                path = os.path.join(root.check_uri.split("://", 1)[1].split("?", 1)[0], *key.split("/"))
                st = os.stat(path)
                with open(path, "r+b") as f:
                    f.seek(pos)
                    f.write(bytes(data[pos : pos + 1]))
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                store.put(key, bytes(data), mode=PutMode.OVERWRITE)
            out.detail = (
                f"{what} of step {ref[1]} (timeline {ref[0]}) {'in place' if in_place else 'by overwrite'}"
            )
            out.faults[f"bitflip:{what}"] = out.faults.get(f"bitflip:{what}", 0) + 1
            if what == "pointer":
                return
            if what == "manifest":
                try:
                    if Manifest.decode(bytes(data), key=key).checksum:
                        out.notes.append("manifest flip left it valid")
                        return  # the flip kept the same JSON meaning (e.g. 1e5 -> 1E5): no damage
                except ManifestError:
                    pass
            # damage a HEAD can see (an overwrite changes the version) vs bit rot in place
            entry.visible = (entry.visible or not in_place) if entry.damaged else not in_place
            entry.damaged = True
        finally:
            self._close(store, root)

    # -- reconciliation of the model with the store

    def _open(self, uri: str, root: Root) -> Store:
        b = self.backends[root.backend]
        if isinstance(b, _Memory):
            return b.open(uri)
        return open_store(uri, retry=FAST_RETRY)

    def _close(self, store: Store, root: Root) -> None:
        if not isinstance(self.backends[root.backend], _Memory):
            store.close()

    def _manifest_refs(self, store: Store) -> dict[Ref, str]:
        found = {}
        for meta in store.list(layout.MANIFEST_PREFIX):
            ref = layout.parse_manifest_key(meta.key)
            if ref is not None:
                found[ref] = meta.key
        return found

    def _reconcile(
        self,
        root: Root,
        model: Model,
        out: Outcome,
        *,
        save: dict[str, Any] | None = None,
        gc: bool = False,
        rollback: bool = False,
    ) -> None:
        store = self._open(root.check_uri, root)
        try:
            listed = self._manifest_refs(store)
            known = set(model.entries) - model.gone
            for ref in sorted(set(listed) - known):
                if ref in model.gone:
                    out.violations.append(f"manifest {ref} came back after it was deleted")
                    continue
                ok = False
                if save is not None and save.get("attempt") and ref[1] == int(save.get("step", -1)):
                    try:
                        m = Manifest.decode(store.get(listed[ref]), key=listed[ref])
                    except ObjckptError as exc:
                        out.violations.append(f"the save's manifest {ref} does not validate: {exc}")
                        continue
                    if m.attempt == save["attempt"]:
                        salt = str(save.get("salt", ""))
                        model.entries[ref] = Entry(ref, ref[1], m.world_size, _big_of(m), salt, m.attempt)
                        ok = True
                if not ok:
                    out.violations.append(f"a manifest nobody committed appeared: {ref}")
            for ref in sorted(known - set(listed)):
                if gc:
                    model.gone.add(ref)
                else:
                    out.violations.append(f"committed checkpoint {ref} disappeared outside GC")
                    model.gone.add(ref)
            # claims: only a rollback makes one
            for meta in store.list(layout.TIMELINE_PREFIX):
                t = layout.parse_timeline_key(meta.key)
                if t is None or t in model.claims:
                    continue
                if not rollback:
                    out.violations.append(f"a timeline claim nobody made appeared: {meta.key}")
                try:
                    claim = TimelineClaim.decode(store.get(meta.key), key=meta.key)
                except ObjckptError as exc:
                    out.violations.append(f"timeline claim {meta.key} does not validate: {exc}")
                    continue
                model.claims[t] = claim.base_ref
        finally:
            self._close(store, root)

    def _reconcile_cp(self, root: Root, out: Outcome) -> None:
        store = self._open(root.cp_check_uri, root)
        try:
            listed = self._manifest_refs(store)
            model = root.cp_model
            for ref in sorted(set(listed) - set(model.entries)):
                m = Manifest.decode(store.get(listed[ref]), key=listed[ref])
                origin = m.metadata.get("replicated_from", {})
                source = next(
                    (
                        e
                        for e in root.model.entries.values()
                        if e.attempt == origin.get("attempt") and e.step == m.step
                    ),
                    None,
                )
                if source is None:
                    out.violations.append(
                        f"cp root: manifest {ref} copies nothing the soak committed ({origin})"
                    )
                    continue
                model.entries[ref] = Entry(ref, m.step, source.world, source.big, source.salt, m.attempt)
            for ref in sorted(set(model.entries) - set(listed)):
                out.violations.append(f"cp root: checkpoint {ref} disappeared")
                model.gone.add(ref)
        finally:
            self._close(store, root)

    # -- the checks

    def _check(self, root: Root, out: Outcome, before: Ref | None, before_intact: list[Ref]) -> None:
        self.stats.checks["episodes checked"] += 1
        self._check_root(root, root.model, root.check_uri, out, before, before_intact, "")
        if root.cp_model.entries:
            self._check_root(root, root.cp_model, root.cp_check_uri, out, None, [], "cp root: ")

    def _check_root(
        self,
        root: Root,
        model: Model,
        uri: str,
        out: Outcome,
        before: Ref | None,
        before_intact: list[Ref],
        label: str,
    ) -> None:
        store = self._open(uri, root)
        try:
            # 1. LATEST names a complete, verifiable checkpoint (or is absent, or was flipped)
            try:
                raw = store.get(layout.POINTER_KEY)
            except ObjckptError:
                raw = None
            if raw is not None:
                try:
                    pointer: Pointer | None = Pointer.decode(raw)
                except ManifestError:
                    pointer = None  # corrupt (a bit flip): readers ignore it
                if pointer is not None:
                    self.stats.checks["LATEST checked"] += 1
                    parsed = layout.parse_manifest_key(pointer.manifest_key)
                    entry = model.entries.get(parsed) if parsed is not None else None
                    if entry is None or parsed in model.gone:
                        out.violations.append(
                            f"{label}LATEST names {pointer.manifest_key}, which is not committed"
                        )
                    elif not entry.damaged:
                        problem = _verify(store, pointer.manifest_key)
                        if problem:
                            out.violations.append(
                                f"{label}LATEST names an unverifiable checkpoint: {problem}"
                            )
            # 2. the last complete checkpoint was never deleted (before a newer complete one exists)
            if before is not None:
                self.stats.checks["last complete kept"] += 1
                now = model.target()
                if before in model.gone and (now is None or now in before_intact):
                    # excusable only when GC trusted a newer checkpoint whose damage no HEAD can see
                    rot = [
                        r
                        for r in model.line()
                        if r[1] > before[1] and model.entries[r].damaged and not model.entries[r].visible
                    ]
                    if rot:
                        out.notes.append("GC trusted bit rot no HEAD can see")
                    else:
                        out.violations.append(
                            f"{label}the last complete checkpoint {before} was deleted (now: {now})"
                        )
            # 3. a restore equals the last committed state, bit for bit
            self.stats.checks["restores compared"] += 1
            expected = model.target()
            session = RestoreSession(store, LocalComm(), label="soak restore")

            def stage(m: Manifest) -> dict[int, dict[str, bytes]]:
                got: dict[int, dict[str, bytes]] = {}
                for s in m.shards:
                    got.setdefault(s.rank, {})[s.name] = session.reader.read_shard(s)
                return got

            try:
                restored = session.restore(stage)
            except NoCheckpointError as exc:
                if expected is not None:
                    out.violations.append(f"{label}restore found nothing usable, expected {expected}: {exc}")
                return
            finally:
                lineage.forget(store)
            if restored is None:
                if expected is not None:
                    out.violations.append(f"{label}restore found nothing, expected {expected}")
                return
            ref = restored.manifest.ref
            if expected is None:
                out.violations.append(f"{label}restore gave {ref}, but nothing intact is committed")
                return
            if ref != expected:
                out.violations.append(
                    f"{label}restore gave {ref}, expected {expected} (line {model.line()[:6]})"
                )
                return
            if restored.value != model.entries[ref].payload():
                out.violations.append(f"{label}restore of {ref} is not bit for bit what was saved")
        finally:
            self._close(store, root)


# ------------------------------------------------------------------ helpers


def _big_of(m: Manifest) -> int:
    for s in m.shards:
        if s.name == "big.bin":
            return s.size
    return 0


def _verify(store: Store, key: str) -> str | None:
    """Why the checkpoint at ``key`` is not complete and verifiable, or None."""
    try:
        m = Manifest.decode(store.get(key), key=key)
        reader = Reader(store)
        for s in m.shards:
            reader.read_shard(s)
    except (IntegrityError, ObjckptError) as exc:
        return f"{key}: {exc}"
    return None


def _forked(argv: list[str], point: str, path: str, timeout: float) -> int:
    """Run the crash worker in a forked child; its exit status (``-9`` when SIGKILLed)."""
    pid = os.fork()
    if pid == 0:  # the child: the worker, then _exit (never back into the parent's code)
        code = 1
        try:
            os.environ["OBJCKPT_CRASH_AT"] = point
            logging.disable(logging.CRITICAL)
            crash_worker.run(argv, point, report_path=path)
            code = 0
        except BaseException as exc:  # noqa: BLE001 - an error of the operation: exit 1
            code = 1
            with contextlib.suppress(Exception):
                report = json.load(open(path)) if os.path.exists(path) else {}  # noqa: SIM115
                report["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                with open(path, "w") as f:
                    json.dump(report, f)
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Fallback warnings and worker errors are the soak's daily bread: keep them off the console."""
    logger = logging.getLogger("objckpt")
    old = logger.propagate, logger.level
    handler = logging.NullHandler()
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate, _ = old
