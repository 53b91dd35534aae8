"""Scale fixes in real processes (issue 13; invariants 10 and 16): 4 ranks on gloo, an S3 run
root on moto. Counts and bytes, never times. Slow (process start-up, a moto server)."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from objckpt import layout
from tests.backends import Backend

from . import scale_workers
from .mp import run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

WORLD = 4


#: each mode's world runs once per session (a world of processes costs seconds)
_results: dict[str, list[dict]] = {}


def _run(backend: Backend, tmp_path: Path, mode: str) -> list[dict]:
    if mode in _results:
        return _results[mode]
    assert backend.uri_for is not None
    root = backend.uri_for(f"scale-{mode}-{tmp_path.name}")
    out = tmp_path / mode
    out.mkdir()
    codes = run_world(scale_workers.save_then_restore, WORLD, root, str(out), mode, timeout=400)
    assert codes == [0] * WORLD, codes
    _results[mode] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return _results[mode]


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


def test_read_once_adds_one_agreement_and_one_broadcast_per_reading_rank_to_a_restore(
    backend_s3_moto: Backend, tmp_path: Path
) -> None:
    """The collectives of a whole restore over gloo: read-once adds the agreement on the reads
    (a gather: its length all-reduce and the gather; a broadcast: length and payload) and, at 4
    ranks (up to ``EXCHANGE_BROADCAST_MAX_WORLD``), one broadcast per rank that read shards,
    straight into its exact buffer on the others (issue 14: it was one all-gather into a padded
    buffer; before that a length and a payload broadcast per replicated shard)."""
    once, every = _run(backend_s3_moto, tmp_path, "once"), _run(backend_s3_moto, tmp_path, "every")
    assert all(r["restored"] == 1 and r["same"] for r in once + every)
    added = [
        collections.Counter(o["collectives"]) - collections.Counter(e["collectives"])
        for o, e in zip(once, every, strict=True)
    ]
    assert not [n for name, n in once[0]["collectives"].items() if name.startswith("all_gather")]
    assert all(a == {"all_reduce": 1, "gather": 1, "broadcast": 2 + WORLD} for a in added), added


@pytest.mark.parametrize(("budget", "rounds"), [(1 << 20, 1), (16, 13)])
def test_gloo_all_gather_bytes_takes_rounds_of_the_budget_and_no_length_collective(
    tmp_path: Path, budget: int, rounds: int
) -> None:
    """Above ``broadcast_max_world`` (forced here): 4 ranks contributing 0, 50, 7 and 1 bytes:
    one all-gather under a large budget; under 16 bytes (4 bytes per rank and round) ceil(50 / 4)
    = 13 rounds; never a broadcast or a length all-reduce (every rank knows the sizes); and no
    copy of what was received."""
    codes = run_world(scale_workers.all_gather_bytes, WORLD, str(tmp_path), budget, 0, timeout=200)
    assert codes == [0] * WORLD, codes
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = [bytes((r * 31 + i) % 256 for i in range((0, 50, 7, 1)[r])).hex() for r in range(WORLD)]
    assert all(r["got"] == expected and r["own_is_mine"] for r in ranks)
    for r in ranks:
        assert sum(r["counts"].values()) == rounds, r["counts"]
        assert set(r["counts"]) <= {"all_gather_single", "all_gather_into_tensor"}, r["counts"]
    # no copy per rank: other ranks' entries are views into the one receive buffer of the single
    # round, or (several rounds) into one buffer per rank, allocated once and filled in place
    for rank, r in enumerate(ranks):
        others = [o for o in r["owners"] if o is not None]
        assert all(kind == "memoryview" for kind, _, _ in others), r["owners"]
        buffers = {ident: size for _, ident, size in others}
        if rounds == 1:
            assert list(buffers.values()) == [WORLD * 50], r["owners"]
        else:
            assert sorted(buffers.values()) == sorted(
                n for q, n in enumerate((0, 50, 7, 1)) if n and q != rank
            )


@pytest.mark.parametrize(("budget", "pieces"), [(1 << 20, (0, 1, 1, 1)), (16, (0, 4, 1, 1))])
def test_gloo_all_gather_bytes_broadcasts_each_source_into_an_exact_writable_buffer(
    tmp_path: Path, budget: int, pieces: tuple[int, ...]
) -> None:
    """Up to ``broadcast_max_world`` ranks (4 here): one broadcast per contributing rank and
    piece of at most the budget (ceil(50 / 16) = 4 for the 50 bytes of rank 1), none for the
    empty rank 0, no all-gather, no length collective; each other rank's bytes arrive in a
    buffer of exactly its size (no padding: it was one buffer of 4 x 50 bytes), writable (the
    decoder builds tensors as views into it), one per source (issue 14)."""
    codes = run_world(scale_workers.all_gather_bytes, WORLD, str(tmp_path), budget, 8, timeout=200)
    assert codes == [0] * WORLD, codes
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = [bytes((r * 31 + i) % 256 for i in range((0, 50, 7, 1)[r])).hex() for r in range(WORLD)]
    assert all(r["got"] == expected and r["own_is_mine"] for r in ranks)
    for rank, r in enumerate(ranks):
        assert r["counts"] == {"broadcast": sum(pieces)}, r["counts"]
        others = [o for o in r["owners"] if o is not None]
        assert all(kind == "memoryview" for kind, _, _ in others), r["owners"]
        assert sorted(size for _, _, size in others) == sorted(
            n for q, n in enumerate((0, 50, 7, 1)) if n and q != rank
        ), r["owners"]
        assert len({ident for _, ident, _ in others}) == len(others)
        assert r["writable"] == [q != rank and n > 0 for q, n in enumerate((0, 50, 7, 1))], r


def test_replicated_read_every_is_the_old_behaviour(backend_s3_moto: Backend, tmp_path: Path) -> None:
    ranks = _run(backend_s3_moto, tmp_path, "every")
    assert all(r["restored"] == 1 and r["same"] for r in ranks)
    replicated = {s["key"]: s["size"] for s in ranks[0]["shards"] if s["name"] == "replicated.bin"}
    unique = sum(replicated.values())
    read = [sum(n for k, n in r["read_bytes"].items() if k in replicated) for r in ranks]
    assert read == [unique] * WORLD  # every rank downloads the whole replicated state
