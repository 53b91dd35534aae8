"""Deduplication on 2 gloo ranks (file://): each rank reuses its own share of the frozen base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import dedup_workers
from .mp import run_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_each_rank_reuses_its_share_and_every_rank_restores_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    codes = run_world(dedup_workers.two_saves_then_restore, 2, f"file://{tmp_path}/root", str(out))
    assert codes == [0, 0]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rep in reports:
        assert rep["restored"] == 2 and rep["same"]
        assert rep["second"] <= rep["first"] // 50  # the adapter, its moments and two rank.bin
        # the base is split across the ranks: both ranks' replicated shards are referenced
        assert rep["references"] == [[0, "replicated.bin"], [1, "replicated.bin"]]
