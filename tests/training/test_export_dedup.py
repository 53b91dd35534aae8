"""Export of deduplicated and compressed checkpoints (shard format 3).

A save that reuses its parent's chunks writes references instead of bytes; the export must
assemble every tensor from this shard's own chunks and the referenced ranges of the ancestors'
objects, read only those ranges, check each referenced chunk against its CRC32C, decode
compressed chunks, and keep views and shared storage as the non-deduplicated export does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from objckpt import CheckpointManager, open_store  # noqa: E402
from objckpt.errors import ChecksumMismatchError  # noqa: E402
from objckpt.training import serialization  # noqa: E402
from objckpt.training.export import export_safetensors, plan_export  # noqa: E402

MiB = 1024 * 1024


def frozen_state(seed: int) -> dict:
    """A 12 MiB frozen base (three 4 MiB chunks), views into it, and a small trained part."""
    torch.manual_seed(0)
    base = torch.randn(1536, 2048)  # 12 MiB of float32
    torch.manual_seed(seed)
    return {
        "weights": {
            "frozen": base,
            "rows": base[100:900],  # a contiguous view crossing a chunk boundary
            "cols": base[:, 7],  # strided: gathered from the whole base
            "head": torch.randn(64, 64),  # changes every save
            "note": "not a tensor",
        }
    }


def expected_tensors(state: dict) -> dict:
    return {k: v.contiguous() for k, v in state["weights"].items() if isinstance(v, torch.Tensor)}


def assert_same(loaded: dict, reference: dict) -> None:
    assert sorted(loaded) == sorted(reference)
    for k, v in reference.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert torch.equal(loaded[k], v), k


def test_reused_chunks_are_read_from_the_parent_by_ranges(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root, replicated=()) as ckpt:
        first = ckpt.save(1, frozen_state(1))
        second_state = frozen_state(2)
        second = ckpt.save(2, second_state)
    assert first.references == () and second.references, "the second save reuses the frozen base"
    assert second.total_size < 2 * MiB  # only the changed head and the header were written

    out = tmp_path / "w.safetensors"
    result = export_safetensors(root, out, step=2, entry="weights")
    assert_same(safetensors_torch.load_file(out), expected_tensors(second_state))
    assert result.skipped == ["note"]

    plan = plan_export(open_store(root), 2, entry="weights")
    ranged = [s for s in plan.sources if not s.whole]
    assert [s.receipt.key for s in ranged] == [r.key for r in second.references]
    # the referenced object is read by ranges: the frozen base's 12 MiB, not the parent's
    # whole object (which also holds the parent's head and header)
    parent = first.shard(0, "rank.bin")
    assert 12 * MiB <= plan.read_bytes - second.total_size < parent.size


def test_a_damaged_referenced_chunk_fails_the_export_and_leaves_no_file(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root, replicated=()) as ckpt:
        first = ckpt.save(1, frozen_state(1))
        ckpt.save(2, frozen_state(2))
    parent = tmp_path / "run" / first.shard(0, "rank.bin").key
    with open(parent, "r+b") as f:  # one byte of the frozen base, inside a reused chunk
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    out = tmp_path / "w.safetensors"
    with pytest.raises(ChecksumMismatchError, match="CRC32C"):
        export_safetensors(root, out, step=2, entry="weights")
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".objckpt-" in p.name]


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_compressed_checkpoint_exports_bit_exact(tmp_path: Path, dtype: str | None) -> None:
    pytest.importorskip("zstandard")
    root = f"file://{tmp_path}/run"
    state = frozen_state(1)
    state["weights"]["frozen"][:512] = 0.0  # compressible planes, so chunks are stored compressed
    with CheckpointManager(root, replicated=(), compression="zstd") as ckpt:
        first = ckpt.save(1, state)
        second = frozen_state(3)
        second["weights"]["frozen"][:512] = 0.0
        ckpt.save(2, second)
    receipt = first.shard(0, "rank.bin")
    store = open_store(root)
    header, _ = serialization.read_header(
        lambda a, b: store.get(receipt.key, byte_range=(a, b)), receipt.size
    )
    assert any(c.get("z") for a in header["arrays"] for c in a["chunks"]), "some chunks are stored compressed"
    for step, st in ((1, state), (2, second)):
        out = tmp_path / f"w{step}.safetensors"
        export_safetensors(root, out, step=step, entry="weights", dtype=dtype)
        want = expected_tensors(st)
        if dtype is not None:
            want = {k: v.to(torch.bfloat16) for k, v in want.items()}
        assert_same(safetensors_torch.load_file(out), want)


def test_dedup_false_checkpoints_still_export(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    state = frozen_state(1)
    with CheckpointManager(root, replicated=(), dedup=False) as ckpt:
        ckpt.save(1, state)
    shard = next((tmp_path / "run").rglob("rank.bin"))
    with open(shard, "rb") as f:
        assert b'"version":3' not in f.read(256)
    out = tmp_path / "w.safetensors"
    export_safetensors(root, out, entry="weights")
    assert_same(safetensors_torch.load_file(out), expected_tensors(state))
    assert os.path.getsize(out) > 12 * MiB
