"""``show`` and ``ls`` of a deduplicated run root: what each step wrote and what it reuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_cli

torch = pytest.importorskip("torch")

MiB = 1024 * 1024


def test_show_and_ls_report_written_and_reused_bytes(tmp_path: Path) -> None:
    from objckpt import CheckpointManager

    uri = f"file://{tmp_path}/run"
    torch.manual_seed(0)
    frozen = torch.randn(2 * MiB)  # 8 MiB: two 4 MiB chunks the second save reuses
    with CheckpointManager(uri, replicated=()) as ckpt:
        first = ckpt.save(1, {"model": {"frozen": frozen, "head": torch.randn(64)}})
        second = ckpt.save(2, {"model": {"frozen": frozen, "head": torch.randn(64)}})
    assert second.references and not first.references

    shown = run_cli("show", f"{uri}@2", "--json")
    assert shown.rc == 0, shown.err
    usage = shown.json()["usage"]
    assert usage["written_bytes"] == second.total_size < MiB
    assert usage["exact"] and usage["referenced_objects"] == 1
    assert usage["referenced_bytes"] == 8 * MiB  # the ranges it names, not the parent's whole object
    assert usage["logical_bytes"] == usage["written_bytes"] + usage["referenced_bytes"]
    first_usage = run_cli("show", f"{uri}@1", "--json").json()["usage"]
    assert first_usage["referenced_objects"] == 0 and first_usage["logical_bytes"] == first.total_size

    human = run_cli("show", f"{uri}@2")
    assert human.rc == 0 and "written" in human.out and "reused from 1 object" in human.out

    rows = {r["step"]: r for r in run_cli("ls", uri, "--json").json()["checkpoints"]}
    assert rows[1]["reused_bytes"] == 0 and rows[1]["bytes"] == first.total_size
    assert rows[2]["bytes"] == second.total_size
    assert rows[2]["reused_bytes"] == second.referenced_size >= 8 * MiB
    listing = run_cli("ls", uri)
    assert listing.rc == 0 and "reused)" in listing.out
