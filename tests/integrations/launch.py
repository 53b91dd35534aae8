"""Run a worker module as a small torchrun-style world: one subprocess per rank, env-launched.

Each rank gets ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (what
torchrun sets, which Lightning, Hugging Face Accelerate and DeepSpeed all read), one CPU thread,
and its own log file. Processes still running after ``timeout`` are killed and the test fails
with every rank's log tail.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_ranks(
    module: str,
    args: list[str],
    *,
    log_dir: Path,
    world_size: int = 2,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
) -> list[int]:
    """Run ``python -m module *args`` once per rank; return the exit codes (rank order).

    Raises AssertionError with the log tails when a rank is still running after ``timeout``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
            **(env or {}),
        }
        log = log_dir / f"{module.rsplit('.', 1)[-1]}-rank{rank}.log"
        logs.append(log)
        with open(log, "wb") as fh:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=REPO_ROOT,
                    env=rank_env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
    deadline = time.monotonic() + timeout
    hung: list[int] = []
    for rank, p in enumerate(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
    for rank in hung:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(procs[rank].pid, signal.SIGKILL)
        procs[rank].wait(10)
    if hung:
        detail = "\n".join(f"--- rank {r} ---\n{_tail(logs[r])}" for r in range(world_size))
        raise AssertionError(f"{module}: ranks {hung} still running after {timeout}s, killed\n{detail}")
    return [p.returncode for p in procs]


def logs_of(module: str, log_dir: Path, world_size: int = 2) -> str:
    """Every rank's log tail (for assertion messages)."""
    name = module.rsplit(".", 1)[-1]
    return "\n".join(f"--- rank {r} ---\n{_tail(log_dir / f'{name}-rank{r}.log')}" for r in range(world_size))
