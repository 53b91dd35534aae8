"""A deduplicated run mirrored by CheckpointManager(mirror=): the mirror copies only what each
step wrote, keeps the sharing (references to its own copies of the ancestors' objects), and a
restore from the mirror is bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from objckpt import CheckpointManager  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402

MiB = 1024 * 1024


def state(step: int) -> dict:
    torch.manual_seed(0)
    frozen = torch.randn(2 * MiB)  # 8 MiB, the same every step
    torch.manual_seed(step)
    return {"model": {"frozen": frozen, "head": torch.randn(256)}}


def test_a_deduplicated_run_is_mirrored_with_its_sharing(tmp_path: Path) -> None:
    primary, mirror = f"file://{tmp_path}/primary", f"file://{tmp_path}/mirror"
    with CheckpointManager(primary, mirror=mirror, mirror_policy="wait", replicated=()) as ckpt:
        saved = [ckpt.save(step, state(step)) for step in (1, 2, 3)]
    assert not saved[0].references and saved[1].references and saved[2].references

    copies = Reader(open_store(mirror))
    assert copies.steps() == [1, 2, 3]
    first = copies.load(1)
    for step, original in zip((2, 3), saved[1:], strict=True):
        copy = copies.load(step)
        assert copy.total_size == original.total_size < MiB  # only what the step wrote
        # its references name the mirror's own copy of step 1's object
        assert [r.key for r in copy.references] == [first.shard(0, "rank.bin").key]
        assert copies.check(copy) == []

    # the primary is gone: the mirror's copy restores bit for bit
    (tmp_path / "primary").rename(tmp_path / "gone")
    with CheckpointManager(mirror, replicated=()) as again:
        target = state(0)
        restored = again.restore(target)
    assert restored == 3
    want = state(3)["model"]
    assert torch.equal(target["model"]["frozen"], want["frozen"])
    assert torch.equal(target["model"]["head"], want["head"])
