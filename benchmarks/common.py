"""Shared helpers for the benchmarks: statistics, machine facts, servers, the workload state.

Every reported figure is a ratio against a baseline timed in the same run (interleaved), so
drift on a shared machine hits both sides alike; medians of >= 3 runs with min-max.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # ``python benchmarks/run.py`` as well as ``-m benchmarks.run``
    sys.path.insert(0, str(REPO))

MiB = 1024 * 1024
BUCKET = "objckpt-bench"


# ------------------------------------------------------------------------------ statistics


@dataclass
class Series:
    """Values of one metric over runs."""

    values: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def lo(self) -> float:
        return min(self.values) if self.values else float("nan")

    @property
    def hi(self) -> float:
        return max(self.values) if self.values else float("nan")

    def fmt(self, digits: int = 2, unit: str = "", *, count: bool = True) -> str:
        """``median [min-max] n=N`` (without `` n=N`` when not ``count``), or "n/a"."""
        if not self.values:
            return "n/a"
        text = f"{self.median:.{digits}f}{unit} [{self.lo:.{digits}f}-{self.hi:.{digits}f}]"
        return f"{text} n={len(self.values)}" if count else text


def paired_ratios(base: list[float], ours: list[float]) -> Series:
    """Speed ratios per run, ``base_time / our_time`` (> 1: objckpt faster)."""
    return Series([b / o for b, o in zip(base, ours, strict=True) if o > 0])


# ------------------------------------------------------------------------------ machine


def machine_info() -> dict[str, str]:
    mem = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return {
        "nproc": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
        "memory": mem,
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "boto3": _version("boto3"),
        "botocore": _version("botocore"),
        "s3fs": _version("s3fs"),
        "s3torchconnector": _version("s3torchconnector"),
        **host_state("start"),
        "free page reporting": _page_reporting(),
    }


def host_state(when: str) -> dict[str, str]:
    """The load average, a :func:`fresh_memory_probe` and a :func:`page_cache_probe` at ``when``
    ("start", "end")."""
    load = "?"
    with contextlib.suppress(OSError):
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return {
        f"load average at {when}": load,
        f"fresh memory probe at {when}": fresh_memory_probe(),
        f"page-cache probe at {when}": page_cache_probe(),
        f"free memory never reported to the host at {when}": _mib(unreported_free_mib()),
    }


def _mib(value: float | None) -> str:
    return "? (no page reporting here)" if value is None else f"{value:.0f} MiB"


_PAGE_CACHE_PROBE = """
import os, tempfile, time
chunk = b"\\1" * (16 << 20)
fd, path = tempfile.mkstemp()
try:
    t = time.perf_counter()
    for _ in range({mib} // 16):
        os.write(fd, chunk)
    print(time.perf_counter() - t)
finally:
    os.close(fd)
    os.unlink(path)
"""


def page_cache_probe(mib: int = 512) -> str:
    """Seconds to write ``mib`` MiB to a new temporary file (the page cache, not the disk), in a
    child process, after a 5 s pause.

    Why: the S3 server of these benchmarks runs on this machine and writes every object into
    page-cache pages (LocalStack spools objects to temporary files), so on a VM that returns
    freed memory to its host, its cost follows how much of it the host took back
    (``s3_bench`` docstring). Measured 2026-12-06: 0.17 s per 512 MiB right after a delete,
    2.3-2.6 s after 3 s, 5.7 s after 8 s.

    What it measures exactly: it writes 16 MiB at a time, which on kernel 6.18's ext4 gets
    2 MiB page-cache folios, and those always come from blocks the host has taken back once
    they were freed more than a few seconds before: it is the price of such pages. LocalStack
    writes 64 KiB at a time, whose pages come first from the free memory never reported
    (:func:`unreported_free_mib`, the machine table's next row), so the server pays that price
    only once that pool runs out."""
    time.sleep(5)  # what a run's first case meets: nothing freed in the last seconds
    return _probe(_PAGE_CACHE_PROBE, mib, timeout=300)


def _probe(script: str, mib: int, *, timeout: float) -> str:
    """Run a probe ``script`` (formatted with ``mib``; it prints seconds) in a child process:
    "<seconds> s per <mib> MiB", or "? (<error>)" when it failed."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", script.format(mib=mib)], capture_output=True, text=True, timeout=timeout
        )
        return f"{float(out.stdout.strip()):.2f} s per {mib} MiB"
    except (subprocess.SubprocessError, ValueError, OSError) as exc:
        return f"? ({type(exc).__name__})"


#: what :func:`fresh_memory_probe` touches
PROBE_MIB = 1024
_PROBE = """
import ctypes, mmap, time
n = {mib} << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
address = ctypes.addressof(ctypes.c_char.from_buffer(m))
t = time.perf_counter()
ctypes.memset(address, 1, n)
print(time.perf_counter() - t)
"""


def fresh_memory_probe(mib: int = PROBE_MIB) -> str:
    """Seconds to write ``mib`` MiB of memory a fresh process never touched (in a child process,
    so the benchmark's own heap is not changed).

    Why: on a VM whose guest returns free memory to the host (virtio-balloon free page
    reporting, as on the Firecracker VMs these benchmarks ran on), the first touch of a page the
    host has taken back costs a host fault: measured 2026-12-06, 0.14 s per 256 MiB for pages
    the host still backs, 3.3-3.9 s per 256 MiB (55 us a page) beyond them. A case that
    allocates fresh memory (a receive buffer, a staging buffer, a joined ``bytes``) pays that
    or not depending on which pages the kernel hands out, so a run whose probe is slow says
    its times are not comparable with a quiet run's."""
    return _probe(_PROBE, mib, timeout=120)


def os_counters(pids: Sequence[int] = ()) -> dict[str, float]:
    """Counters read around a timed case (see :func:`counter_delta`), to tell a slow run's cause:
    the VM's steal time (the host ran something else on our CPUs), the memory the guest reported
    back to the host (``page_reporting``'s ``reported_kib``: pages the next first touch pays a
    host fault for, see :func:`fresh_memory_probe`), the free memory it never reported (a level:
    :func:`unreported_free_mib`), system-wide page faults, and the page faults
    and CPU seconds and the bytes written and read of ``pids`` (the S3 server's processes), and
    this process's page faults.
    Linux only; missing ones are left out."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    out: dict[str, float] = {"self_minflt": usage.ru_minflt, "self_sys_s": usage.ru_stime}
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    with contextlib.suppress(OSError, ValueError, IndexError):
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        out["steal_s"] = int(cpu[8]) / hz
        out["iowait_s"] = int(cpu[5]) / hz
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            name, value = line.split()
            if name in ("pgfault", "pgmajfault", "nr_dirty", "pgpgout"):
                out[name] = int(value)
    with contextlib.suppress(OSError, ValueError):
        reported = Path("/sys/module/page_reporting/parameters/reported_kib").read_text()
        out["reported_mib"] = int(reported) / 1024
    unreported = unreported_free_mib()
    if unreported is not None:
        out["unreported_free_mib"] = unreported
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            # fields after the ")" that ends the command name: minflt is the 10th field of the
            # line, utime and stime the 14th and 15th
            rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out["server_minflt"] = out.get("server_minflt", 0) + int(rest[7])
            out["server_user_s"] = out.get("server_user_s", 0) + int(rest[11]) / hz
            out["server_sys_s"] = out.get("server_sys_s", 0) + int(rest[12]) / hz
        with contextlib.suppress(OSError, ValueError):
            # bytes the server passed to write() and read() (files and sockets alike)
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            out["server_write_mib"] = out.get("server_write_mib", 0) + int(io["wchar"]) / MiB
            out["server_read_mib"] = out.get("server_read_mib", 0) + int(io["rchar"]) / MiB
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` for the counters both have (rounded for the JSON); for the
    :data:`LEVEL_COUNTERS`, their value ``before`` (what the timed case started with)."""
    return {
        k: round(before[k] if k in LEVEL_COUNTERS else after[k] - before[k], 3) for k in before if k in after
    }


def server_pids(port: int) -> list[int]:
    """The process listening on ``port`` on this machine and its children (the S3 server's), or
    [] when it cannot be found (another machine's endpoint, no permission)."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                proc = psutil.Process(conn.pid)
                return [proc.pid, *(c.pid for c in proc.children(recursive=True))]
    except Exception:  # noqa: BLE001 - a diagnostic only: without it the counters omit the server
        return []
    return []


def unreported_free_mib() -> float | None:
    """Free memory the guest kernel has never reported to its host: the buddy allocator's free
    blocks below ``page_reporting_order`` (``/proc/buddyinfo``), which page reporting skips.
    None without page reporting or off Linux.

    Why (measured 2026-12-06 on kernel 6.18, ``page_reporting_order=9``): the allocator serves
    a small allocation (a 4 KiB page, LocalStack's 64 KiB page-cache writes) from the smallest
    free block, so such allocations stay cheap while this pool lasts; once it is used up, they
    split blocks the host has taken back and pay a host fault a page. A 2 MiB allocation (a
    transparent huge page, a file write of >= 2 MiB, which gets 2 MiB page-cache folios) always
    takes such a block: writing 512 MiB to a file in 2-16 MiB writes took 5.3-8.1 s after a 5 s
    pause, in 64 KiB-1 MiB writes 0.14-0.32 s (:func:`page_cache_probe` writes 16 MiB at a
    time). Freed memory coalesces into large blocks and is reported within seconds, so a run
    that allocates and frees a lot shrinks this pool; only fragmentation refills it."""
    try:
        order = int(Path("/sys/module/page_reporting/parameters/page_reporting_order").read_text())
        pages = 0
        for line in Path("/proc/buddyinfo").read_text().splitlines():
            counts = [int(n) for n in line.split()[4:]]  # "Node 0, zone Normal c0 c1 ..."
            pages += sum(n << o for o, n in enumerate(counts[:order]))
    except (OSError, ValueError):
        return None
    return pages * mmap.PAGESIZE / MiB


#: counters that are a level, not a running total: :func:`counter_delta` keeps their value
#: before the timed case
LEVEL_COUNTERS = ("unreported_free_mib",)


def _page_reporting() -> str:
    """Whether the guest kernel reports free pages to a hypervisor (see fresh_memory_probe)."""
    order = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    balloon = Path("/sys/bus/virtio/drivers/virtio_balloon")
    if not balloon.exists():
        return "no virtio-balloon driver"
    try:
        return f"virtio-balloon, page_reporting_order={order.read_text().strip()}"
    except OSError:
        return "virtio-balloon (page reporting not visible)"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------ servers


@dataclass
class Server:
    kind: str  # "localstack" | "moto"
    endpoint: str
    version: str
    startup_s: float
    #: ``open_store`` options for this server, as its launcher class defines them
    store_options: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.version}"


def _server_object(kind: str) -> Any:
    from objckpt.testing.s3_servers import LocalStackServer, MotoServer

    return LocalStackServer() if kind == "localstack" else MotoServer()


def localstack_version() -> str:
    from objckpt.testing.s3_servers import DEFAULT_LOCALSTACK_VENV

    py = Path(os.environ.get("OBJCKPT_LOCALSTACK_VENV") or DEFAULT_LOCALSTACK_VENV) / "bin" / "python"
    out = subprocess.run(
        [str(py), "-c", "import importlib.metadata as m; print(m.version('localstack-core'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or "?"


@contextlib.contextmanager
def start_server(kind: str, endpoint: str | None = None) -> Iterator[Server]:
    """Start a local S3 server (or use ``endpoint``) with the benchmark bucket created."""
    from objckpt.testing.s3_servers import create_bucket

    version = localstack_version() if kind == "localstack" else _version("moto")
    if endpoint:  # a server someone else runs: same options as if we had started it
        srv = _server_object(kind)
        srv.port = int(endpoint.rsplit(":", 1)[1].strip("/"))
        create_bucket(endpoint, BUCKET)
        yield Server(kind, endpoint, version, 0.0, dict(srv.store_options))
        return
    with _server_object(kind) as srv:
        create_bucket(srv.endpoint_url, BUCKET)
        yield Server(kind, srv.endpoint_url, version, srv.startup_seconds or 0.0, dict(srv.store_options))


def localstack_available() -> bool:
    from objckpt.testing.s3_servers import LocalStackServer

    return LocalStackServer.available()


def boto_client(endpoint: str, pool: int = 16) -> Any:
    """A plain boto3 client (the baseline's; see ``bench_store.raw_client``)."""
    from benchmarks.bench_store import raw_client

    return raw_client(endpoint, pool)


def delete_prefix(client: Any, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix`` (and abort its multipart uploads); bounded."""
    n = 0
    for _ in range(10_000):
        resp = client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1000)
        keys = [{"Key": o["Key"]} for o in resp.get("Contents", []) or []]
        if not keys:
            break
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        n += len(keys)
    with contextlib.suppress(Exception):
        ups = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) or []
        for u in ups:
            client.abort_multipart_upload(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"])
    return n


# ------------------------------------------------------------------------------ workload


def make_model(total_bytes: int, n_tensors: int, seed: int = 0) -> Any:
    """An ``nn.Module`` holding ``n_tensors`` float32 parameters of equal size (``total_bytes``
    in all), random content (incompressible, like trained weights)."""
    import torch

    numel = max(1, total_bytes // n_tensors // 4)
    gen = torch.Generator().manual_seed(seed)

    class Blob(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(n_tensors):
                p = torch.nn.Parameter(torch.empty(numel), requires_grad=False)
                # uniform random 32-bit patterns are as incompressible as trained weights and
                # much cheaper to make than randn
                p.data.view(torch.int32).random_(generator=gen)
                self.register_parameter(f"w{i:02d}", p)

    return Blob()


def fingerprint(model: Any) -> list[int]:
    """A cheap content check: per tensor, the int64 sum of its 32-bit patterns."""
    import torch

    return [int(p.data.view(torch.int32).sum(dtype=torch.int64)) for p in model.parameters()]


def zero(model: Any) -> None:
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.data.zero_()


def state_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def timed(fn: Any) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def write_json(path: str | Path, obj: Any) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)
