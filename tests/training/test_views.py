"""Views in the shard format: round trip, versioning, hostile view nodes, older shards."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.reader import Reader
from objckpt.store.memory import MemoryStore
from objckpt.training import serialization as ser
from objckpt.training.manager import CheckpointManager
from objckpt.training.replicated import resolve, split_tensors
from objckpt.training.serialization import SerializationError, TensorRef, ViewRef, decode, dumps, make_view
from objckpt.training.state import capture_global_rng
from objckpt.writer import ShardWriter


def _version(blob: bytes) -> int:
    (n,) = struct.unpack("<Q", blob[8:16])
    return json.loads(blob[16 : 16 + n])["version"]


def test_split_and_resolve_round_trip_through_a_shard() -> None:
    base = torch.arange(10, dtype=torch.float64)
    tree = {"a": base, "b": base[3:], "c": [base[::2]], "d": torch.zeros(2)}
    table: list[torch.Tensor] = []
    skeleton = split_tensors(tree, table)
    assert isinstance(skeleton["a"], TensorRef) and isinstance(skeleton["b"], ViewRef)
    blob = dumps({"s": skeleton, "t": table})
    assert _version(blob) == 2
    back = decode(blob)
    out = resolve(back["s"], back["t"])
    assert out["b"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    assert out["c"][0].stride() == (2,) and out["c"][0].tolist() == base[::2].tolist()
    assert _version(dumps({"plain": torch.ones(2), "ref": TensorRef(0)})) == 1  # unchanged format


@pytest.mark.parametrize(
    "ref, match",
    [
        (ViewRef(0, torch.float32, (5,), (1,), 4), "reaches byte 24, past its 16"),
        (ViewRef(0, torch.float32, (2, 2), (1, 3), 0), "past its 16"),
        (ViewRef(0, torch.float32, (1,), (1,), 2), "not a multiple of 4"),
        (ViewRef(0, torch.float64, (3,), (1,), 0), "past its 16"),
    ],
)
def test_a_view_outside_its_tensor_is_refused(ref: ViewRef, match: str) -> None:
    with pytest.raises(SerializationError, match=match):
        make_view(torch.zeros(4), ref)
    assert make_view(torch.zeros(4), ViewRef(0, torch.float32, (0, 7), (9, 9), 16)).shape == (0, 7)


def _forge(tree: object, version: int) -> bytes:
    header = json.dumps(
        {"format": "objckpt-state", "version": version, "tree": tree, "arrays": [], "data_size": 0}
    )
    raw = header.encode()
    prefix = struct.pack("<8sQ", ser.MAGIC, len(raw)) + raw
    return prefix + bytes(-len(prefix) % ser.ALIGN)


@pytest.mark.parametrize(
    "node, version, match",
    [
        ({"w": [0, "float32", [1], [1], 0]}, 1, "unknown node tag"),  # views need version 2
        ({"w": [0, "os.system", [1], [1], 0]}, 2, "not allowed"),
        ({"w": [0, "float32", [1, 2], [1], 0]}, 2, "shape/stride"),
        ({"w": [0, "float32", [1], [-1], 0]}, 2, "shape/stride"),
        ({"w": [-1, "float32", [1], [1], 0]}, 2, "bad view node"),
        ({"w": [0, "float32"]}, 2, "bad view node"),
    ],
)
def test_hostile_view_nodes_are_refused(node: object, version: int, match: str) -> None:
    with pytest.raises(SerializationError, match=match):
        decode(_forge(node, version))
    with pytest.raises(SerializationError, match="unsupported format version 4"):
        decode(_forge(1, 4))
    with pytest.raises(SerializationError, match="trailer"):  # version 3 keeps its header at the end
        decode(_forge(1, 3))


def _commit(store: MemoryStore, step: int, rank_tree: object) -> None:
    attempt = layout.new_attempt_id()
    writer = ShardWriter(store, step=step, attempt=attempt, rank=0)
    writer.write("rank.bin", dumps(rank_tree))
    topology = {"layout": "objckpt.training/1", "replicated": [], "per_rank": ["buffers"]}
    Coordinator(store, world_size=1).commit(step, attempt, {0: writer.receipts}, topology=topology)


def test_a_per_rank_shard_written_before_the_tensor_table_still_restores() -> None:
    store = MemoryStore()
    _commit(store, 3, {"items": {"buffers": {"w": torch.arange(4.0)}}, "rng": capture_global_rng()})
    restored: dict = {}
    with CheckpointManager(store, replicated=()) as mgr:
        assert mgr.restore({"buffers": restored}) == 3
    assert restored["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_view_reaching_outside_its_tensor_is_damage_and_falls_back() -> None:
    store = MemoryStore()
    with CheckpointManager(store, replicated=()) as mgr:
        mgr.save(1, {"buffers": {"w": torch.ones(2)}})
    hostile = {
        "items": {"buffers": {"w": ViewRef(0, torch.float32, (1000,), (1,), 0)}},
        "tensors": [torch.zeros(2)],
        "rng": capture_global_rng(),
    }
    _commit(store, 2, hostile)  # committed with valid receipts: only decoding can tell
    restored: dict = {}
    with CheckpointManager(store, replicated=()) as mgr:
        assert mgr.restore({"buffers": restored}) == 1
        assert [s for s, _ in mgr.fallbacks] == [2] and "past its 8" in mgr.fallbacks[0][1]
    assert restored["w"].tolist() == [1.0, 1.0]
    assert Reader(store).steps() == [1, 2]
