"""Rank functions of ``test_scale_mp.py`` (imported by the spawned ranks: keep it light).

Each rank wraps its store in a :class:`ByteCountingStore` and writes what it did as JSON:
requests by kind, bytes downloaded per key, the keys it touched outside ``data/``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from objckpt.store import open_store
from objckpt.store.base import Store
from objckpt.store.wrappers import CountingStore
from objckpt.training.manager import CheckpointManager


class ByteCountingStore(CountingStore):
    """A CountingStore that also sums the bytes every download delivered, per key."""

    def __init__(self, inner: Store, **options: Any) -> None:
        super().__init__(inner, **options)
        self.read_bytes: collections.Counter[str] = collections.Counter()
        self._bytes_lock = threading.Lock()

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        stream = super()._open(key, start, end)

        def counted() -> Iterator[bytes]:
            for chunk in stream:
                with self._bytes_lock:
                    self.read_bytes[key] += len(chunk)
                yield chunk

        return counted()


#: the torch.distributed collectives DistComm issues (a name missing from this torch is skipped)
COLLECTIVES = ("broadcast", "all_reduce", "gather", "all_gather_single", "all_gather_into_tensor")


@contextlib.contextmanager
def counting_collectives() -> Iterator[collections.Counter[str]]:
    """Count the calls of each ``torch.distributed`` collective made inside the block (DistComm
    looks them up on the module at each call)."""
    dist = torch.distributed
    counts: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _owner(b: Any) -> Any:
    return b.obj if isinstance(b, memoryview) else b


def all_gather_bytes(rank: int, world_size: int, out: str, budget: int, broadcast_max_world: int) -> None:
    """DistComm.all_gather_bytes of uneven sizes (one rank empty) under ``budget``: every rank's
    bytes and the collectives it took."""
    from objckpt.training.dist import DistComm

    sizes = [(0, 50, 7, 1)[r % 4] for r in range(world_size)]
    comm = DistComm(
        timeout=60, handshake_timeout=60, exchange_budget=budget, broadcast_max_world=broadcast_max_world
    )
    mine = bytes((rank * 31 + i) % 256 for i in range(sizes[rank]))
    with counting_collectives() as counts:
        got = comm.all_gather_bytes(mine, sizes, "test")
    comm.close()
    # where each other rank's entry lives: the buffer object behind it (a copy is its own object)
    owners = [
        None if r == rank or not sizes[r] else [type(b).__name__, id(_owner(b)), len(_owner(b))]
        for r, b in enumerate(got)
    ]
    outcome = {
        "got": [b.hex() for b in got],
        "counts": dict(counts),
        "own_is_mine": got[rank] is mine,
        "owners": owners,
        "writable": [r != rank and isinstance(b, memoryview) and not b.readonly for r, b in enumerate(got)],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))


def _state() -> dict[str, Any]:
    torch.manual_seed(0)  # the same replicated model on every rank
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    return {"model": model, "progress": {"global_step": 0}}


def save_then_restore(rank: int, world_size: int, root: str, out: str, replicated_read: str) -> None:
    """Save step 1, then restore it on fresh managers; record the restore's requests and bytes."""
    store = ByteCountingStore(open_store(root))
    state = _state()
    mgr = CheckpointManager(
        store, timeout=60, handshake_timeout=60, replicated_read=replicated_read, dedup=False
    )
    manifest = mgr.save(1, state)
    mgr.close()
    store.reset()
    store.read_bytes.clear()
    fresh = _state()
    with torch.no_grad():
        for p in fresh["model"].parameters():
            p.zero_()
    mgr = CheckpointManager(
        store, timeout=60, handshake_timeout=60, replicated_read=replicated_read, dedup=False, check=False
    )
    with counting_collectives() as collectives:
        restored = mgr.restore(fresh)
    mgr.close()
    same = all(
        torch.equal(a, b)
        for a, b in zip(
            state["model"].state_dict().values(), fresh["model"].state_dict().values(), strict=True
        )
    )
    outcome = {
        "restored": restored,
        "same": same,
        "shards": [{"key": s.key, "size": s.size, "name": s.name, "rank": s.rank} for s in manifest.shards],
        "counts": dict(store.counts),
        "collectives": dict(collectives),
        "read_bytes": dict(store.read_bytes),
        "outside_data": sorted({k for _, k in store.calls if not k.startswith("data/")}),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))
