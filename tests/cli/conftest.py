"""Helpers for CLI tests: real commits through the protocol core, and the real console script
run in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from objckpt.commit import Coordinator
from objckpt.layout import new_attempt_id
from objckpt.manifest import Manifest
from objckpt.store import Store, open_store
from objckpt.writer import ShardWriter

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "objckpt"


def shard_bytes(step: int, rank: int, name: str, size: int = 3000) -> bytes:
    """Deterministic, distinct content per (step, rank, name)."""
    seed = f"{step}:{rank}:{name}:".encode()
    return (seed * (size // len(seed) + 1))[:size]


def commit_step(
    store: Store,
    step: int,
    *,
    world_size: int = 2,
    names: tuple[str, ...] = ("model.pt", "optim.pt"),
    size: int = 3000,
    timeline: int = 0,
) -> Manifest:
    """A real commit: every rank's ShardWriter, then Coordinator.commit (manifest + pointer), on
    ``timeline`` (claimed beforehand, e.g. by ``objckpt.timelines.rollback``)."""
    attempt = new_attempt_id()
    receipts = {}
    for rank in range(world_size):
        writer = ShardWriter(store, step=step, attempt=attempt, rank=rank)
        for name in names:
            writer.write(name, shard_bytes(step, rank, name, size))
        receipts[rank] = writer.receipts
    return Coordinator(store, world_size=world_size).commit(
        step=step,
        attempt=attempt,
        receipts=receipts,
        progress={"global_step": step, "epoch": step // 100},
        run={"config_hash": "cafef00d"},
        timeline=timeline,
    )


@dataclass
class Result:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Result:
    """Run the installed console script (``python -m objckpt.cli`` if it is missing)."""
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "objckpt.cli"]
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    proc = subprocess.run(
        [*cmd, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def file_root(tmp_path: Path) -> tuple[str, Store]:
    """An empty file:// run root and a store on it."""
    pytest.importorskip("objckpt.store.local", reason="file:// backend not written yet")
    uri = f"file://{tmp_path}/run"
    store = open_store(uri)
    yield uri, store
    store.close()


@pytest.fixture(scope="module")
def moto():
    """A moto S3 server with the bucket ``cli-bucket`` (skips when moto is unavailable)."""
    try:
        from objckpt.testing.s3_servers import MotoServer, create_bucket
    except ImportError as exc:
        pytest.skip(f"MotoServer not available yet: {exc}")
    pytest.importorskip("objckpt.store.s3", reason="s3:// backend not written yet")
    try:
        srv = MotoServer(min_part_size=1024).start()
    except Exception as exc:  # noqa: BLE001 - the reason is what matters for a skip
        pytest.skip(f"moto server did not start: {exc}")
    create_bucket(srv.endpoint_url, "cli-bucket")
    yield srv
    srv.stop()
