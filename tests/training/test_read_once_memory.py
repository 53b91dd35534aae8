"""A read-once restore's memory (issue 14): each replicated shard is held once on every rank.

The manager runs on a ThreadWorld of 2 ranks. What is counted: where the staged tensors' bytes
live. Module tensors must be views into the buffers the exchange handed out (this rank's own
download, the other rank's contribution), not copies of them; an optimizer's state (which the
optimizer keeps as given) must be on storages of its own, not pinning a shard buffer. Addresses
and counts, never timings.
"""

from __future__ import annotations

import copy
import mmap
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

import objckpt.training.manager as manager_module
from objckpt._crc import Buffer
from objckpt.coordination import ThreadWorld
from objckpt.coordination.comm import ThreadComm
from objckpt.store.memory import MemoryStore
from objckpt.training import shards
from objckpt.training._borrowed_decode import decode_borrowed
from objckpt.training.manager import CheckpointManager
from objckpt.training.serialization import decode, encode

WORLD = 2


class RecordingComm(ThreadComm):
    """A ThreadComm that keeps every buffer its byte exchange returned."""

    def __init__(self, world: ThreadWorld, rank: int, seen: list[Buffer]) -> None:
        super().__init__(world, rank)
        self.seen = seen

    def all_gather_bytes(self, data: Buffer | None, sizes: Sequence[int], what: str) -> Sequence[Buffer]:
        got = super().all_gather_bytes(data, sizes, what)
        self.seen.extend(b for b in got if len(b))
        return got


def _span(buf: Buffer) -> tuple[int, int]:
    arr = np.frombuffer(buf, dtype=np.uint8)
    return arr.ctypes.data, arr.ctypes.data + arr.nbytes


def _inside(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return any(lo <= start and end <= hi for lo, hi in spans)


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 64)).sum().backward()
    opt.step()
    return {"model": model, "optimizer": opt}


@pytest.mark.parametrize("dedup", [False, True])
def test_staged_module_tensors_are_views_into_the_exchanged_buffers(
    monkeypatch: pytest.MonkeyPatch, dedup: bool
) -> None:
    local = threading.local()
    real = manager_module.make_comm
    monkeypatch.setattr(manager_module, "make_comm", lambda **kw: getattr(local, "comm", None) or real(**kw))
    staged_by_rank: dict[int, Any] = {}
    real_apply = shards.apply

    def keep(state: Any, staged: shards.Staged, *, rank: int) -> Any:
        staged_by_rank[rank] = staged
        return real_apply(state, staged, rank=rank)

    monkeypatch.setattr(shards, "apply", keep)
    store = MemoryStore()
    seen: dict[int, list[Buffer]] = {r: [] for r in range(WORLD)}
    # built here, copied per rank: ranks are threads sharing the global torch RNG
    templates = _state(0), _state(1)
    lock = threading.Lock()

    def body(comm: Any) -> Any:
        local.comm = RecordingComm(comm.world, comm.rank, seen[comm.rank])
        with lock:
            saved, fresh = copy.deepcopy(templates[0]), copy.deepcopy(templates[1])
        with CheckpointManager(store, keep_last=None, dedup=dedup) as mgr:
            mgr.save(1, saved)
        with CheckpointManager(store, keep_last=None, dedup=dedup, replicated_read="once") as mgr:
            assert mgr.restore(fresh) == 1
        same_model = all(
            torch.equal(a, b)
            for a, b in zip(
                saved["model"].state_dict().values(), fresh["model"].state_dict().values(), strict=True
            )
        )
        a, b = saved["optimizer"].state_dict()["state"], fresh["optimizer"].state_dict()["state"]
        same_opt = all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k])
        return same_model and same_opt, fresh

    results = ThreadWorld(WORLD, timeout=60).run(body)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    assert all(ok for ok, _ in results)  # type: ignore[misc]
    for rank in range(WORLD):
        spans = [_span(b) for b in seen[rank]]
        # the exchange handed out one buffer per rank, each the contribution itself
        assert len(spans) == WORLD
        staged = staged_by_rank[rank].items
        module = list(staged["model"].values())
        assert len(module) == 8 and all(_inside(t, spans) for t in module), "module state was copied"
        # every tensor on a storage of its own: no two share one (the next save lays them out apart)
        assert len({t.untyped_storage().data_ptr() for t in module}) == len(module)
        opt = [
            v
            for s in staged["optimizer"]["state"].values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        assert opt and not any(_inside(t, spans) for t in opt), "optimizer state pins a shard buffer"
        live = [v for s in results[rank][1]["optimizer"].state.values() for v in s.values()]  # type: ignore[index]
        assert live and not any(_inside(t, spans) for t in live)


def test_decode_borrowed_views_a_writable_buffer_and_copies_a_read_only_one() -> None:
    tree = {"w": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5, dtype=torch.bfloat16)}
    tree["v"] = tree["w"][10:20]  # laid out as an array of its own by encode()
    tree["a"] = np.arange(7, dtype=np.int16)
    raw = b"".join(bytes(b) for b in encode(tree).buffers())
    buf = mmap.mmap(-1, len(raw))
    buf[:] = raw
    borrowed: set[int] = set()
    out = decode_borrowed(memoryview(buf), borrowed=borrowed)
    ref = decode(raw)
    assert (
        torch.equal(out["w"], ref["w"])
        and torch.equal(out["b"], ref["b"])
        and torch.equal(out["v"], ref["v"])
    )
    assert np.array_equal(out["a"], ref["a"])
    spans = [_span(buf)]
    assert _inside(out["w"], spans) and _inside(out["b"], spans) and _inside(out["v"], spans)
    # each array on a storage of its own, every one of them recorded as borrowed
    assert {out[k].untyped_storage().data_ptr() for k in ("w", "b", "v")} == borrowed
    copied = decode_borrowed(raw, borrowed=borrowed)  # bytes: read-only, so decoded by copying
    assert not _inside(copied["w"], [_span(raw)]) and torch.equal(copied["w"], ref["w"])


def test_decode_borrowed_checks_sizes_before_building_anything() -> None:
    from objckpt.errors import SerializationError

    raw = b"".join(bytes(b) for b in encode({"w": torch.zeros(64)}).buffers())
    for bad in (raw[:-1], raw + bytes(64)):
        buf = bytearray(bad)
        with pytest.raises(SerializationError):
            decode_borrowed(buf)
