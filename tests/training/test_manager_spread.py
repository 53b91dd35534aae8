"""How CheckpointManager spreads a rank's replicated share over shards: counted, never timed.

The share follows the DCP writer's rule (``objckpt.writer.spread_for``): up to two parts, one
``replicated.bin``; up to ``max_in_flight`` requests of ``part_size x max_in_flight`` bytes,
``replicated.bin``, ``replicated.1.bin``, ... written at once, ONE request each; beyond,
``max_in_flight`` multipart pieces of at least four parts. Layout ``objckpt.training/1``
checkpoints (one ``replicated.bin`` per rank) still restore and export. Counted on memory:// (an
object store's rules); file://, where a multipart upload is as cheap as one request
(``Store.cheap_multipart``), keeps one ``replicated.bin``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from objckpt.errors import CommitError, PermissionDeniedError, TrainingStateError  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore  # noqa: E402
from objckpt.training import _state_write, shards  # noqa: E402
from objckpt.training.export import export_safetensors  # noqa: E402
from objckpt.training.manager import CheckpointManager  # noqa: E402
from objckpt.writer import SPREAD_PARTS, Spread  # noqa: E402

PART = 4096
WRITES = ("put", "create_upload", "upload_part", "complete_upload")


def _model(n: int = 8, floats: int = PART) -> torch.nn.Module:
    """``n`` parameters of ``floats`` float32 each (4 parts at the default), distinct values."""
    model = torch.nn.Module()
    for i in range(n):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.arange(floats, dtype=torch.float32) + i))
    return model


def _save(
    tmp_path: Path, model: torch.nn.Module, max_in_flight: int, scheme: str = "memory", **options: Any
) -> tuple[CountingStore, Any]:
    root = f"file://{tmp_path}/run" if scheme == "file" else f"memory://{tmp_path.name}/run"
    store = open_store(root, part_size=str(PART), max_in_flight=str(max_in_flight))
    counting = CountingStore(store)
    with CheckpointManager(counting, dedup=False, **options) as mgr:
        manifest = mgr.save(1, {"model": model})
    return counting, manifest


def _restored(counting: CountingStore, model: torch.nn.Module) -> None:
    target = _model(len(list(model.parameters())), next(model.parameters()).numel())
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    with CheckpointManager(counting) as mgr:
        assert mgr.restore({"model": target}) == 1
    got, want = target.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _writes(counting: CountingStore, name: str) -> dict[str, int]:
    ops: dict[str, int] = {}
    for op, key in counting.calls:
        if op in WRITES and key.startswith("data/") and key.rsplit("/", 1)[-1] == name:
            ops[op] = ops.get(op, 0) + 1
    return ops


def test_a_share_of_up_to_max_in_flight_requests_is_spread_over_single_request_shards(tmp_path: Path) -> None:
    # 128 KiB with 8 in flight: one request may carry 8 parts (32 KiB), 8 of them 256 KiB, so the
    # share is 8 pieces of 16 KiB, one PUT each, where one multipart upload made 1 + 32 + 1 requests
    model = _model()
    counting, manifest = _save(tmp_path, model, max_in_flight=8)
    pieces = shards.replicated_receipts(manifest)
    assert [s.name for s in pieces] == ["replicated.bin", *(f"replicated.{k}.bin" for k in range(1, 8))]
    assert all(s.parts == 1 for s in pieces)
    for piece in pieces:
        assert _writes(counting, piece.name) == {"put": 1}
    assert manifest.topology["layout"] == shards.STATE_LAYOUT == "objckpt.training/2"
    _restored(counting, model)


def test_a_share_beyond_max_in_flight_requests_is_spread_over_multipart_shards(tmp_path: Path) -> None:
    # 2 in flight: one request may carry 2 parts (8 KiB), 2 of them 16 KiB; 128 KiB is beyond
    # that, so 2 multipart pieces (memory stays bounded), each of at least SPREAD_PARTS parts
    model = _model()
    counting, manifest = _save(tmp_path, model, max_in_flight=2)
    pieces = shards.replicated_receipts(manifest)
    assert [s.name for s in pieces] == ["replicated.bin", "replicated.1.bin"]
    assert all(s.parts >= SPREAD_PARTS for s in pieces)
    for piece in pieces:
        ops = _writes(counting, piece.name)
        assert ops["create_upload"] == ops["complete_upload"] == 1 and "put" not in ops
    _restored(counting, model)


def test_a_share_under_two_parts_stays_one_shard(tmp_path: Path) -> None:
    model = _model(n=3, floats=PART // 8)  # 6 KiB: one part and a half
    counting, manifest = _save(tmp_path, model, max_in_flight=8)
    assert [s.name for s in shards.replicated_receipts(manifest)] == ["replicated.bin"]
    _restored(counting, model)


def test_on_file_a_share_stays_one_multipart_shard(tmp_path: Path) -> None:
    # the 128 KiB that spreads over 8 objects above is one replicated.bin of 33 parts on file://
    model = _model()
    counting, manifest = _save(tmp_path, model, 8, "file")
    assert [s.name for s in shards.replicated_receipts(manifest)] == ["replicated.bin"]
    ops = _writes(counting, "replicated.bin")
    assert ops["create_upload"] == ops["complete_upload"] == 1 and ops["upload_part"] >= 32
    _restored(counting, model)


def test_a_compressed_share_stays_one_shard(tmp_path: Path) -> None:
    # a compressed piece's bytes are fresh buffers, not views: one request per piece would hold
    # a whole piece in memory, so compression keeps the bounded multipart upload
    model = _model()
    counting, manifest = _save(tmp_path, model, max_in_flight=8, compression="zstd")
    assert [s.name for s in shards.replicated_receipts(manifest)] == ["replicated.bin"]
    _restored(counting, model)


def test_pieces_are_read_by_restore_export_and_verify_at_any_world_size(tmp_path: Path) -> None:
    model = _model()
    counting, manifest = _save(tmp_path, model, max_in_flight=8)
    assert len(shards.replicated_receipts(manifest)) == 8
    out = tmp_path / "model.safetensors"
    export_safetensors(counting, out)
    exported = safetensors_torch.load_file(str(out))
    assert exported.keys() == model.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())
    assert Reader(counting).verify(manifest) == []  # every piece read and its CRC32C checked


def test_a_layout_1_checkpoint_still_restores_and_exports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what earlier versions wrote: one replicated.bin per rank, layout objckpt.training/1
    monkeypatch.setattr(_state_write, "spread_for", lambda total, **_: Spread(1, None))
    monkeypatch.setattr(shards, "STATE_LAYOUT", "objckpt.training/1")
    model = _model()
    counting, manifest = _save(tmp_path, model, max_in_flight=8)
    monkeypatch.undo()
    assert manifest.topology["layout"] == "objckpt.training/1"
    assert sorted(s.name for s in manifest.shards) == ["rank.bin", "replicated.bin"]
    _restored(counting, model)
    export_safetensors(counting, tmp_path / "old.safetensors")
    exported = safetensors_torch.load_file(str(tmp_path / "old.safetensors"))
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


def test_a_failed_piece_fails_the_save_and_commits_nothing(tmp_path: Path) -> None:
    store = open_store(f"memory://{tmp_path.name}/run", part_size=str(PART), max_in_flight="8")
    faulty = FaultInjectingStore(
        store, [Fault(op="put", key="data/*/replicated.3.bin", error=PermissionDeniedError, times=1)]
    )
    model = _model()
    with CheckpointManager(faulty, dedup=False) as mgr:
        with pytest.raises(CommitError, match=r"PermissionDeniedError.*replicated\.3\.bin"):
            mgr.save(1, {"model": model})
        assert mgr.latest_step() is None
        assert faulty.injected == [("put", faulty.injected[0][1])]
        mgr.save(2, {"model": model})  # the next save is whole
        assert mgr.latest_step() == 2


def test_a_checkpoint_of_a_newer_layout_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a layout this version does not know is fatal (TrainingStateError), never "damage" to
    # fall back from: the bytes are fine, the reader is too old
    monkeypatch.setattr(shards, "STATE_LAYOUT", "objckpt.training/99")
    model = _model()
    counting, _ = _save(tmp_path, model, max_in_flight=8)
    monkeypatch.undo()
    with CheckpointManager(counting) as mgr:
        with pytest.raises(TrainingStateError, match=r"objckpt.training/99.*newer objckpt"):
            mgr.restore({"model": _model()})
