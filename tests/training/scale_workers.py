"""Rank functions of ``test_scale_mp.py`` (imported by the spawned ranks: keep it light).

Each rank wraps its store in a :class:`ByteCountingStore` and writes what it did as JSON:
requests by kind, bytes downloaded per key, the keys it touched outside ``data/``.
"""

from __future__ import annotations

import collections
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
        "read_bytes": dict(store.read_bytes),
        "outside_data": sorted({k for _, k in store.calls if not k.startswith("data/")}),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))
