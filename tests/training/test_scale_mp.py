"""Scale fixes in real processes (issue 13; invariants 10 and 16): 4 ranks on gloo, an S3 run
root on moto. Counts and bytes, never times. Slow (process start-up, a moto server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from objckpt import layout
from tests.backends import Backend

from . import scale_workers
from .mp import run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

WORLD = 4


def _run(backend: Backend, tmp_path: Path, mode: str) -> list[dict]:
    assert backend.uri_for is not None
    root = backend.uri_for(f"scale-{mode}-{tmp_path.name}")
    out = tmp_path / mode
    out.mkdir()
    codes = run_world(scale_workers.save_then_restore, WORLD, root, str(out), mode, timeout=400)
    assert codes == [0] * WORLD, codes
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_replicated_state_is_read_once_per_job_and_only_rank_0_resolves(
    backend_s3_moto: Backend, tmp_path: Path
) -> None:
    ranks = _run(backend_s3_moto, tmp_path, "once")
    assert all(r["restored"] == 1 and r["same"] for r in ranks)
    shards = ranks[0]["shards"]
    replicated = {s["key"]: s["size"] for s in shards if s["name"] == "replicated.bin"}
    unique = sum(replicated.values())
    assert len(replicated) == WORLD and unique > 1_000_000
    read = [sum(n for k, n in r["read_bytes"].items() if k in replicated) for r in ranks]
    # each rank downloads ~1/W of the replicated state; the job reads each unique byte once
    assert sum(read) == unique
    assert all(n <= unique / WORLD + max(replicated.values()) for n in read), (read, unique)
    # resolution on rank 0 only: no LIST, no manifest or pointer request from the others
    for r in ranks[1:]:
        assert r["counts"].get("list_page", 0) == 0 and r["counts"].get("list_prefixes", 0) == 0, r["counts"]
        assert r["outside_data"] == [], r["outside_data"]
    assert ranks[0]["counts"].get("list_page", 0) >= 1
    # one save's shard keys fall on more than one spreading prefix
    spreads = {s["key"].split("/")[1] for s in shards}
    assert len(spreads) > 1 and all(layout.parse_shard_key(s["key"]) for s in shards)


def test_replicated_read_every_is_the_old_behaviour(backend_s3_moto: Backend, tmp_path: Path) -> None:
    ranks = _run(backend_s3_moto, tmp_path, "every")
    assert all(r["restored"] == 1 and r["same"] for r in ranks)
    replicated = {s["key"]: s["size"] for s in ranks[0]["shards"] if s["name"] == "replicated.bin"}
    unique = sum(replicated.values())
    read = [sum(n for k, n in r["read_bytes"].items() if k in replicated) for r in ranks]
    assert read == [unique] * WORLD  # every rank downloads the whole replicated state
