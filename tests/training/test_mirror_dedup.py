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


def test_latest_policy_never_drops_a_step_the_next_one_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from objckpt.coordination import mirror as mirror_module

    root = f"file://{tmp_path}/primary"
    torch.manual_seed(7)
    changed = torch.randn(2 * MiB)
    with CheckpointManager(root, replicated=()) as ckpt:
        ckpt.save(1, state(1))
        # new bytes at 2; written once more at 3 (a chunk is reused once its parent holds its
        # full hash, benchmarks/DEDUP.md); reused from 3 at 4
        m2, m3, m4 = (
            ckpt.save(s, {"model": {"frozen": changed, "head": torch.randn(256)}}) for s in (2, 3, 4)
        )
    assert any(r.origin == m3.ref for r in m4.references)

    gate = threading.Event()
    real_copy = mirror_module.copy_checkpoint

    def slow_copy(*args, **kwargs):  # type: ignore[no-untyped-def]
        gate.wait(60)  # the mirror is busy with step 1 while steps 2 and 3 arrive
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(mirror_module, "copy_checkpoint", slow_copy)
    primary, copy = open_store(root), open_store(f"file://{tmp_path}/mirror")
    mirror = mirror_module.Mirror(primary, copy, policy="latest")
    mirror.submit(m2)  # in flight (held at the gate)
    for _ in range(600):  # until the worker has taken it
        if mirror._busy:
            break
        threading.Event().wait(0.05)
    assert mirror._busy
    mirror.submit(m3)  # waiting
    fourth = threading.Thread(target=mirror.submit, args=(m4,))
    fourth.start()  # reuses step 3's objects: must not replace it
    fourth.join(0.5)
    assert mirror.counts["skipped"] == 0
    gate.set()
    fourth.join(60)
    assert mirror.wait(60)
    mirror.close()
    assert mirror.counts == {"mirrored": 3, "already": 0, "skipped": 0, "failed": 0}
    assert Reader(copy).steps() == [2, 3, 4]
