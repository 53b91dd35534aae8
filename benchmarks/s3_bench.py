"""Save/load of one training state over S3, objckpt vs baselines, on 1 or more ranks.

``run_world(cfg)`` starts ``world_size`` worker processes (a gloo group when > 1) that build the
same state (an ``nn.Module`` of ``n_tensors`` float32 parameters, DDP-style: identical on every
rank) and, interleaved run by run (:func:`run_order`: the cases compared run back to back, in
alternating order), time:

==============  ============================================================================
``objckpt``     ``CheckpointManager.save`` (replicated tensors split across ranks, one
                ``replicated.bin`` + ``rank.bin`` per rank, commit protocol included) and
                ``CheckpointManager.restore`` (resolution through ``Reader``, every rank reads
                every replicated shard, CRC32C-verified, decoded into the live model)
``raw``         bare boto3 (``bench_store.raw_put``/``raw_get``): each rank uploads the bytes of
                the same tensors objckpt gives it as one multipart object, same part size and
                parts in flight; load: every rank fetches every rank's object with parallel
                part-sized ranged GETs (bytes only, no decode)
``dcp_s3fs``    ``torch.distributed.checkpoint`` with ``FsspecWriter``/``FsspecReader`` over s3fs
``s3tc``        ``torch.distributed.checkpoint`` with s3torchconnector's ``S3StorageWriter`` /
                ``S3StorageReader`` (CRT client, ``force_path_style=True``)
``dcp_objckpt`` ``torch.distributed.checkpoint`` with objckpt's ``ObjckptStorageWriter`` /
                ``ObjckptStorageReader`` (``dedup=False``): the same DCP planner as ``dcp_s3fs``
                and ``s3tc``, only the storage layer differs (the head-to-head leg)
==============  ============================================================================

``objckpt_multipart`` (not in :data:`CASES`, for ``--cases``): the manager's save and restore with
ONE multipart upload per rank, the peers' storage pattern, instead of the default single-request
shards; on LocalStack the server then assembles the parts at completion, as for the peers.

Asynchronous saves, 1 rank (``benchmarks.run`` times each pair in a 1-rank world of its own,
see below):

========================  ======================================================================
``objckpt_async``         cold: a NEW ``CheckpointManager`` per run, timed from ``save_async``
                          to the commit (``handle.wait()``): the staging buffer is allocated and
                          first touched (page faults) inside the timed save, the worker thread
                          started. Compared with ``objckpt`` (a new manager per run as well,
                          which never stages). What a job's FIRST ``save_async`` costs.
``objckpt_steady``        steady state, sync: ``CheckpointManager.save`` on ONE manager for the
                          whole world (``keep_last=1``), shared with ``objckpt_async_steady``,
                          its first save an untimed ``save_async`` warm-up; the model's values
                          change before every save (untimed), so every save has a parent to
                          deduplicate against and finds nothing to reuse, as in a training job
``objckpt_async_steady``  the same manager's ``save_async``: the staging buffer was allocated
                          by the warm-up save and is reused; timed from ``save_async`` to the
                          commit. What every later save of a training job costs: a job
                          constructs its manager once and saves with it every ``every``
                          steps (the manager's docstring), so the scoreboard's steady row
                          pairs these two cases; its cold row pairs ``objckpt_async`` with ``objckpt``
========================  ======================================================================

Why each pair has a world of its own (2026-12-06): the S3 server's page-cache writes are cheap
while the free memory the guest never reported to its host lasts (``unreported_free_mib`` in
the counters, :func:`benchmarks.common.unreported_free_mib`) and cost a host fault a page
after it. In one world with the peers, the memory the other cases keep for the world's life
(``raw``'s joined bytes, s3torchconnector's buffers, the steady managers' staging, a model
copy) left 400-1,400 MiB of that pool when a save started, and the async saves, which need
more of it (a cold one stages 512 MiB first), met the slow mode most: run N, cold 1.37x, the
server's system CPU 1.4-6.8 s against 1.3-1.6 s. The cold pair alone, the same day: the pool
1,900-2,300 MiB at every save, the server's system CPU 1.1-1.5 s in all ten. Until then the
steady cases also had a manager each and saved a copy of the model, so the server held two
parents and the client a second 512 MiB.

A time is barrier-to-barrier on rank 0 (so the slowest rank counts). Each load is checked
against the state's fingerprint (raw: byte count). In each run every case saves, loads and has
what it wrote deleted (untimed) before the next case starts, so every case meets the same server.
Until 2026-12-06 the order rotated by one case per run, so two cases compared could run up to
five cases apart (``objckpt`` and ``objckpt_async``), each meeting a server in another state;
now they run back to back, A B then B A (:func:`run_order`). Until 2026-12-02 a run did every case's save, then every
load, then deleted: a save late in a run met a LocalStack holding the run's other saves (~2 GB at
512 MiB and 5 cases), and with fewer runs than cases the rotation did not even out the places
(at 8 cases and 3 runs ``objckpt`` saved 1st, 8th and 7th, ``s3tc`` 4th, 3rd and 2nd). Results
go to a JSON file written by rank 0.

With each timed run rank 0 records :func:`benchmarks.common.os_counters` deltas (``counters`` in
the JSON): steal time, page faults, memory the guest reported to its host, the free memory it
never reported when the run started (``unreported_free_mib``), and the S3 server's user and
system CPU and the bytes it passed to ``write()``/``read()``. They tell a slow run's
cause, and what a case costs the server: on LocalStack a multipart upload's completion copies
its parts into a new file, so a peer's multipart save made the server write 1,024 MiB and read
1,024 MiB per 512 MiB where objckpt's single-request shards made it write 512 MiB and read none
(BENCHMARKS.md, run K's findings). Measured 2026-12-06 on LocalStack, 512 MiB:
the server spools every object over 512 KiB to a temporary file, so it writes each uploaded byte
into page-cache pages (parts, then the assembled object), and on a VM that returns freed memory
to its host (``fresh_memory_probe``), pages freed a few seconds before cost a host fault to touch
again: writing 512 MiB to a file took 0.17 s right after a delete, 2.3-2.6 s after 3 s, 5.7 s
after 8 s (in 16 MiB writes; see :func:`benchmarks.common.unreported_free_mib` for why
LocalStack's 64 KiB writes pay it only once the never-reported free memory runs out). The server's system CPU for a 512 MiB save was 1.2-1.4 s in most runs and 3-8 s in
the slow ones, whose extra wall time it matches; the client's CPU did not change. A cold
``save_async`` first-touches 512 MiB of staging on the client, taking the recently freed pages
the server would otherwise get, so on this machine (not against a remote S3) it meets the slow
mode more often than the sync save beside it. An untimed settling save before every case, tried
the same day, made it more frequent (cold async 1.34x against 1.05x without), and was not kept.

    python -m benchmarks.s3_bench --endpoint http://127.0.0.1:4566 --world-size 2 --mib 64
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BUCKET,
    REPO,
    MiB,
    counter_delta,
    delete_prefix,
    fingerprint,
    make_model,
    os_counters,
    server_pids,
    state_bytes,
    write_json,
    zero,
)

CASES = ("objckpt", "raw", "dcp_s3fs", "s3tc", "dcp_objckpt")
REGION = "us-east-1"
#: the order cases run in: every two that the scoreboard compares run back to back (DCP load
#: against raw GETs, DCP against s3torchconnector, the manager's save against s3torchconnector
#: and against its save_async, the two steady saves); cases not named here run last
PAIRED_ORDER = (
    "raw",
    "dcp_objckpt",
    "s3tc",
    "objckpt",
    "objckpt_async",
    "dcp_s3fs",
    "objckpt_steady",
    "objckpt_async_steady",
)


def run_order(cases: list[str], run: int) -> list[str]:
    """The cases of ``run`` in :data:`PAIRED_ORDER`, reversed every other run (A B, then B A):
    a ratio compares two cases timed next to each other, each of them first in half the runs,
    and every case's average place in a run is the same."""
    order = [c for c in PAIRED_ORDER if c in cases] + [c for c in cases if c not in PAIRED_ORDER]
    return order if run % 2 == 0 else order[::-1]


# ------------------------------------------------------------------------------ launcher


def run_world(cfg: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Run the workers; return rank 0's results (``{"error": ...}`` if the world failed)."""
    from objckpt.testing.s3_servers import child_env, free_port

    out = Path(cfg["out"])
    out.unlink(missing_ok=True)
    cfg = {**cfg, "port": free_port()}
    cfg_path = out.with_suffix(".cfg.json")
    cfg_path.write_text(json.dumps(cfg))
    env = child_env(
        {
            "AWS_ENDPOINT_URL": cfg["endpoint"],
            # the repo first, then whatever the caller had (e.g. where the `bench` peers live)
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "PYTHONWARNINGS": "ignore",
        }
    )
    logs = [out.with_suffix(f".rank{r}.log") for r in range(cfg["world_size"])]
    procs = []
    for r in range(cfg["world_size"]):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.s3_bench", "--worker", str(cfg_path), "--rank", str(r)],
                cwd=REPO,
                env=env,
                stdout=open(logs[r], "wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:  # bounded: nothing outlives the call
        if p.poll() is None:
            p.kill()
            p.wait(30)
    if out.exists():
        result = json.loads(out.read_text())
    else:
        result = {}
    if any(c != 0 for c in codes):
        tails = "\n".join(f"--- rank {r} (exit {c}):\n" + _tail(logs[r]) for r, c in enumerate(codes))
        result.setdefault("error", f"workers exited {codes} (None: killed after {timeout:.0f}s)\n{tails}")
    return result


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ------------------------------------------------------------------------------ worker


class World:
    def __init__(self, rank: int, world_size: int, port: int) -> None:
        self.rank, self.world_size = rank, world_size
        if world_size > 1:
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=900),
            )

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def timed(self, fn: Any) -> tuple[float, float]:
        self.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        self.barrier()
        return time.perf_counter() - wall, time.process_time() - cpu

    def close(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


class Bench:
    """One world's cases, over one model."""

    def __init__(self, cfg: dict[str, Any], world: World, tag: str, total: int, n_tensors: int) -> None:
        import torch

        from benchmarks.common import boto_client

        self.cfg, self.world, self.tag = cfg, world, tag
        self.rank, self.ws = world.rank, world.world_size
        self.part, self.width = cfg["part_size"], cfg["width"]
        self.model = make_model(total, n_tensors)
        self.fp = fingerprint(self.model)
        self.client = boto_client(cfg["endpoint"], pool=max(self.width, 10))
        self.errors: dict[str, str] = {}
        #: per case and op, one :func:`os_counters` delta a timed run (steal time, page faults,
        #: memory reported to the host, the server's CPU): what a slow run met
        self.counters: dict[str, dict[str, list[dict[str, float]]]] = {}
        port = cfg["endpoint"].rsplit(":", 1)[1].strip("/")
        self.server_pids = server_pids(int(port)) if self.rank == 0 and port.isdigit() else []
        #: seconds until save_async returned (the part a training loop waits for)
        self.async_blocking: list[float] = []
        self.async_steady_blocking: list[float] = []
        #: the steady cases' one manager (for the world's life), the step it saved last and the
        #: model it saves (see _steady)
        self.steady: Any = None
        self.steady_step = 0
        self.steady_model: Any = None
        #: a check a case wants run after its timed part (set by the case, run by ``one``)
        self.untimed_check: Callable[[], None] | None = None
        # the tensors objckpt's manager gives this rank (equal sizes: round robin), as one blob
        params = list(self.model.parameters())
        mine = [p for i, p in enumerate(params) if i % self.ws == self.rank]
        self.raw_sizes = [
            sum(p.numel() * 4 for i, p in enumerate(params) if i % self.ws == r) for r in range(self.ws)
        ]
        self.raw_data = (
            b"".join(memoryview(p.data.view(torch.uint8).numpy()) for p in mine)
            if "raw" in cfg["cases"]
            else b""
        )

    # -- per-case prefixes (everything a run writes lies under prefix(run))
    def prefix(self, case: str, run: int | str) -> str:
        return f"{self.tag}/w{self.ws}/{case}/run{run}"

    # -- objckpt
    def _store(self, run: int | str, case: str = "objckpt") -> Any:
        from objckpt.store import open_store

        return open_store(
            f"s3://{BUCKET}/{self.prefix(case, run)}",
            **self.cfg["store_options"],
            part_size=str(self.part),
            max_in_flight=str(self.width),
        )

    def _manager_save(self, run: int, case: str, *, multipart: bool = False) -> Any:
        from objckpt.training.manager import CheckpointManager

        store = self._store(run, case)
        if multipart:
            store.cheap_multipart = True  # one multipart upload per rank (writer.spread_for)
        mgr = CheckpointManager(store, keep_last=None)
        return mgr, (lambda: mgr.save(run + 1, {"model": self.model}))

    def _manager_load(self, run: int, case: str) -> Any:
        from objckpt.training.manager import CheckpointManager

        mgr = CheckpointManager(self._store(run, case), keep_last=None)

        def go() -> None:
            step = mgr.restore({"model": self.model})
            assert step == run + 1, step

        return mgr, go

    def objckpt_save(self, run: int) -> Any:
        return self._manager_save(run, "objckpt")

    def objckpt_load(self, run: int) -> Any:
        return self._manager_load(run, "objckpt")

    def objckpt_multipart_save(self, run: int) -> Any:
        """The manager's save with the peers' storage pattern: ONE multipart upload per rank
        (``cheap_multipart`` forced on, as file:// has it), so LocalStack assembles the parts at
        completion as it does for the peers, instead of the default single-request shards
        (``writer.spread_for``). Not in :data:`CASES`: a check of the save ratios' caveat."""
        return self._manager_save(run, "objckpt_multipart", multipart=True)

    def objckpt_multipart_load(self, run: int) -> Any:
        return self._manager_load(run, "objckpt_multipart")

    # -- raw boto3
    def raw_save(self, run: int) -> Any:
        from benchmarks.bench_store import raw_put

        key = f"{self.prefix('raw', run)}/{self.rank}"
        return None, (lambda: raw_put(self.client, BUCKET, key, self.raw_data, self.part, self.width))

    def raw_load(self, run: int) -> Any:
        from benchmarks.bench_store import raw_get

        def go() -> None:
            for r, size in enumerate(self.raw_sizes):
                got = raw_get(
                    self.client, BUCKET, f"{self.prefix('raw', run)}/{r}", size, self.part, self.width
                )
                assert got == size, (got, size)

        return None, go

    # -- DCP + s3fs
    def _fsspec_kwargs(self) -> dict[str, Any]:
        from objckpt.testing.s3_servers import DUMMY_CREDENTIALS

        return {
            "key": DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.cfg["endpoint"], "region_name": REGION},
        }

    def dcp_s3fs_save(self, run: int) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        path = f"s3://{BUCKET}/{self.prefix('dcp_s3fs', run)}"
        writer = FsspecWriter(path, thread_count=self.cfg["dcp_threads"], **self._fsspec_kwargs())
        return None, (lambda: dcp.save(self.model.state_dict(), storage_writer=writer))

    def dcp_s3fs_load(self, run: int) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        path = f"s3://{BUCKET}/{self.prefix('dcp_s3fs', run)}"
        reader = FsspecReader(path, **self._fsspec_kwargs())
        return None, (lambda: dcp.load(self.model.state_dict(), storage_reader=reader))

    # -- DCP + s3torchconnector
    def s3tc_save(self, run: int) -> Any:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter

        path = f"s3://{BUCKET}/{self.prefix('s3tc', run)}"
        writer = S3StorageWriter(
            REGION,
            path,
            s3client_config=S3ClientConfig(force_path_style=True),
            thread_count=self.cfg["dcp_threads"],
        )
        return None, (lambda: dcp.save(self.model.state_dict(), storage_writer=writer))

    def s3tc_load(self, run: int) -> Any:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader

        path = f"s3://{BUCKET}/{self.prefix('s3tc', run)}"
        reader = S3StorageReader(REGION, path, s3client_config=S3ClientConfig(force_path_style=True))
        return None, (lambda: dcp.load(self.model.state_dict(), storage_reader=reader))

    # -- DCP + objckpt (same planner as the DCP peers: storage only differs)
    def dcp_objckpt_save(self, run: int) -> Any:
        import torch.distributed.checkpoint as dcp

        from objckpt.training.dcp import ObjckptStorageWriter

        writer = ObjckptStorageWriter(self._store(run, "dcp_objckpt"), step=run + 1, dedup=False)
        return writer, (lambda: dcp.save(self.model.state_dict(), storage_writer=writer))

    def dcp_objckpt_load(self, run: int) -> Any:
        import torch.distributed.checkpoint as dcp

        from objckpt.training.dcp import ObjckptStorageReader

        reader = ObjckptStorageReader(self._store(run, "dcp_objckpt"))
        return reader, (lambda: dcp.load(self.model.state_dict(), storage_reader=reader))

    # -- objckpt async save (CheckpointManager.save_async, when it exists)
    def objckpt_async_save(self, run: int) -> Any:
        from objckpt.training.manager import CheckpointManager

        if not hasattr(CheckpointManager, "save_async"):
            raise NotImplementedError("CheckpointManager.save_async does not exist yet")
        mgr = CheckpointManager(self._store(run, "objckpt_async"), keep_last=None)

        def go() -> None:
            t = time.perf_counter()
            handle = mgr.save_async(run + 1, {"model": self.model})
            self.async_blocking.append(time.perf_counter() - t)
            _await(handle, mgr)

        def committed() -> None:
            assert mgr.latest_step() == run + 1

        # checked after the timing, as the sync case it is paired with is not checked inside it
        # (a resolve is ~5 requests; until 2026-12-06 it was timed on the async side only)
        self.untimed_check = committed
        return mgr, go

    # -- steady state: one manager for the world, as a training job keeps (see the docstring)
    def _steady(self, case: str) -> Any:
        """``case``'s (a steady case) save on the steady cases' manager (created, with an
        untimed warm-up ``save_async``, on first use); the saved model's values change first
        (untimed). That model is the benchmark's own in a world of steady cases only (as
        ``benchmarks.run`` has it), else a copy, so the other cases' loads still find what
        they saved."""
        import torch

        from objckpt.training.manager import CheckpointManager

        if not hasattr(CheckpointManager, "save_async"):
            raise NotImplementedError("CheckpointManager.save_async does not exist yet")
        if self.steady_model is None:
            alone = set(self.cfg["cases"]) <= {"objckpt_steady", "objckpt_async_steady"}
            self.steady_model = self.model if alone else copy.deepcopy(self.model)
        if self.steady is None:
            self.steady = CheckpointManager(self._store("steady", "steady"), keep_last=1)
            self._steady_save("objckpt_async_steady")  # warm-up: staging buffer, worker thread, connections
        with torch.no_grad():  # new values: the parent holds nothing this save can reuse
            for p in self.steady_model.parameters():
                p.add_(1)
        return None, (lambda: self._steady_save(case))

    def _steady_save(self, case: str) -> None:
        self.steady_step += 1
        step, state = self.steady_step, {"model": self.steady_model}
        if case == "objckpt_async_steady":
            t = time.perf_counter()
            handle = self.steady.save_async(step, state)
            blocked = time.perf_counter() - t
            _await(handle, self.steady)
            if step > 1:
                self.async_steady_blocking.append(blocked)
        else:
            self.steady.save(step, state)
        assert self.steady.latest_step() == step

    def objckpt_steady_save(self, run: int) -> Any:
        return self._steady("objckpt_steady")

    def objckpt_async_steady_save(self, run: int) -> Any:
        return self._steady("objckpt_async_steady")

    def close(self) -> None:
        """Close the steady manager and delete what it wrote (untimed)."""
        if self.steady is not None:
            self.steady.close()
            if self.rank == 0:
                delete_prefix(self.client, BUCKET, self.prefix("steady", "steady") + "/")
        self.steady = None

    # -- driver
    def one(self, case: str, op: str, run: int) -> tuple[float, float] | None:
        """Time one case/op (None if the case already failed; its error is kept)."""
        from torch.distributed.checkpoint.api import CheckpointException

        if case in self.errors or not hasattr(self, f"{case}_{op}"):
            return None
        res: Any = None
        try:
            if op == "load" and case != "raw":  # raw loads bytes only: the model stays as is
                zero(self.model)
            self.untimed_check = None
            res, fn = getattr(self, f"{case}_{op}")(run)
            before = os_counters(self.server_pids)
            t = self.world.timed(fn)
            self.counters.setdefault(case, {}).setdefault(op, []).append(
                counter_delta(before, os_counters(self.server_pids))
            )
            if self.untimed_check is not None:
                self.untimed_check()
            if op == "load" and case != "raw":
                got = fingerprint(self.model)
                if got != self.fp:
                    raise AssertionError(f"{case} load returned different content")
            return t
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - recorded, the case is skipped from then on
            # (DCP's CheckpointException is a BaseException: a failing DCP peer must not kill the world)
            self.errors[case] = f"{op}: {type(exc).__name__}: {exc}".strip()[:2000]
            traceback.print_exc()
            return None
        finally:
            if res is not None:
                res.close()

    def cleanup(self, run: int, cases: list[str] | None = None) -> None:
        """Delete what ``cases`` (default: every case) wrote in ``run``; a collective."""
        prefixes = [self.prefix(c, run) + "/" for c in (self.cfg["cases"] if cases is None else cases)]
        self.world.barrier()
        if self.rank == 0:
            for prefix in prefixes:
                delete_prefix(self.client, BUCKET, prefix)
        self.world.barrier()


def _await(handle: Any, mgr: Any) -> None:
    """Wait for an async save, whatever shape its handle has."""
    for name in ("result", "wait", "join"):
        fn = getattr(handle, name, None)
        if callable(fn):
            fn()
            return
    for name in ("wait", "wait_for_pending", "finalize", "flush"):
        fn = getattr(mgr, name, None)
        if callable(fn):
            fn()
            return
    raise NotImplementedError(f"do not know how to wait for {type(handle).__name__}")


def worker(cfg_path: str, rank: int) -> None:
    import torch

    cfg = json.loads(Path(cfg_path).read_text())
    ws = cfg["world_size"]
    torch.set_num_threads(1 if ws > 1 else 2)
    world = World(rank, ws, cfg["port"])
    cases = list(cfg["cases"])
    # Warm-up (untimed): connection pools, lazy imports, server code paths, multipart included.
    warm = Bench(cfg, world, "warm", min(cfg["total_bytes"], 64 * MiB), 4)
    for op in ("save", "load"):
        for case in cases:
            warm.one(case, op, 0)
    warm.cleanup(0)
    warm.close()
    warm_errors = dict(warm.errors)
    del warm

    bench = Bench(cfg, world, "main", cfg["total_bytes"], cfg["n_tensors"])
    bench.errors.update(warm_errors)  # a case that cannot run at all is not retried
    times: dict[str, dict[str, list[list[float]]]] = {c: {"save": [], "load": []} for c in cases}
    for run in range(cfg["runs"]):
        for case in run_order(cases, run):
            # each case saves, loads and is deleted before the next starts, so every save meets
            # the same server (see the module docstring)
            for op in ("save", "load"):
                t = bench.one(case, op, run)
                if t is not None:
                    times[case][op].append(list(t))
            bench.cleanup(run, [case])
    bench.close()
    if rank == 0:
        write_json(
            cfg["out"],
            {
                "world_size": ws,
                "state_bytes": state_bytes(bench.model),
                "n_tensors": cfg["n_tensors"],
                "times": times,
                "async_blocking": bench.async_blocking,
                "async_steady_blocking": bench.async_steady_blocking,
                "counters": bench.counters,
                "errors": bench.errors,
            },
        )
    world.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help="a running S3-compatible server (else start --server)")
    ap.add_argument("--server", choices=["localstack", "moto"], default="localstack")
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--mib", type=int, default=64, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default="build/benchmarks/s3_bench.json", help="the raw results (JSON)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rank)
        return 0
    from benchmarks.common import Series, paired_ratios, start_server

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    with start_server(args.server, args.endpoint) as srv:
        cfg = default_cfg(
            srv,
            args.world_size,
            args.mib * MiB,
            args.tensors,
            args.runs,
            args.cases.split(","),
            str(Path(args.out).resolve()),
        )
        res = run_world(cfg, timeout=3600)
    print(json.dumps(res.get("errors", {}), indent=1), res.get("error", ""))
    times = res.get("times", {})
    for op in ("save", "load"):
        for case, t in times.items():
            walls = [w for w, _ in t[op]]
            if not walls:  # a case without this op (the async ones have no load)
                continue
            line = f"{op} {case:<9} {Series(walls).fmt(2, 's')}"
            if case != "objckpt" and len(times.get("objckpt", {}).get(op, [])) == len(walls):
                ours = [w for w, _ in times["objckpt"][op]]
                line += f"  objckpt speed ratio {paired_ratios(walls, ours).fmt(2, 'x')}"
            print(line)
    return 0


def default_cfg(
    srv: Any, world_size: int, total: int, n_tensors: int, runs: int, cases: list[str], out: str
) -> dict[str, Any]:
    return {
        "endpoint": srv.endpoint,
        "store_options": srv.store_options,
        "world_size": world_size,
        "total_bytes": total,
        "n_tensors": n_tensors,
        "runs": runs,
        "cases": cases,
        "part_size": 16 * MiB,  # objckpt's default; the raw baseline uses the same
        "width": 8,  # objckpt's default parts in flight; the raw baseline uses the same
        "dcp_threads": 8,
        "out": out,
    }


if __name__ == "__main__":
    raise SystemExit(main())
