"""Shared helpers for the protocol tests: quick saves and directly-built store states."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from objckpt import layout
from objckpt._crc import crc32c_b64
from objckpt._retry import RetryPolicy
from objckpt.commit import Coordinator
from objckpt.errors import CommitError
from objckpt.manifest import Manifest, Pointer, ShardReceipt
from objckpt.store.base import PutMode, Store
from objckpt.store.memory import MemoryStore
from objckpt.writer import ShardWriter

#: retries without real waiting, so fault-injection tests stay fast
FAST_RETRY = RetryPolicy(deadline=30.0, max_attempts=4, initial_backoff=0.0001, max_backoff=0.001)


def memory_store(**options: object) -> MemoryStore:
    options.setdefault("retry", FAST_RETRY)
    return MemoryStore("test", **options)  # type: ignore[arg-type]


def shard_bytes(step: int, rank: int, name: str = "model.pt") -> bytes:
    return f"step={step} rank={rank} name={name} ".encode() * 3


def write_rank(
    store: Store,
    step: int,
    attempt: str,
    rank: int,
    names: Iterable[str] = ("model.pt",),
    *,
    key_spreading: bool = True,
) -> list[ShardReceipt]:
    w = ShardWriter(store, step=step, attempt=attempt, rank=rank, key_spreading=key_spreading)
    for name in names:
        w.write(name, shard_bytes(step, rank, name))
    return w.receipts


def save(
    store: Store,
    step: int,
    *,
    world_size: int = 2,
    attempt: str | None = None,
    coordinator_store: Store | None = None,
    **commit_kwargs: object,
) -> Manifest:
    """Every rank writes one shard, then the coordinator commits (sequentially, one process)."""
    attempt = attempt or layout.new_attempt_id()
    receipts = {r: write_rank(store, step, attempt, r) for r in range(world_size)}
    coord = Coordinator(coordinator_store or store, world_size=world_size)
    return coord.commit(step, attempt, receipts, progress={"global_step": step}, **commit_kwargs)


def put_checkpoint_directly(
    store: Store,
    step: int,
    *,
    shards_per_rank: int,
    world_size: int,
    parent: int | None,
    payload: bytes = b"x",
) -> Manifest:
    """Build a committed checkpoint without the writer/coordinator (fast bulk state)."""
    attempt = layout.new_attempt_id()
    receipts = []
    crc = crc32c_b64(payload)
    view = memoryview(payload)
    for rank in range(world_size):
        for i in range(shards_per_rank):
            name = f"shard-{i}.bin"
            key = layout.shard_key(step, attempt, rank, name)
            # the backend primitive directly: no retry machinery, so 64,000 shards take seconds
            meta = store._put(key, view, PutMode.CREATE, crc)
            receipts.append(
                ShardReceipt(
                    key=key, size=len(payload), version=meta.version, crc32c=crc, rank=rank, name=name
                )
            )
    m = Manifest.create(step=step, attempt=attempt, world_size=world_size, shards=receipts, parent=parent)
    store.put(m.key, m.encode(), mode=PutMode.CREATE)
    return m


def set_pointer(store: Store, m: Manifest) -> None:
    store.put(layout.POINTER_KEY, Pointer.for_manifest(m).encode(), mode=PutMode.OVERWRITE)


def forge_manifest(m: Manifest, **changes: object) -> bytes:
    """``m``'s JSON with fields changed and the self-checksum recomputed (a well-formed lie)."""
    import hashlib

    from objckpt.manifest import canonical_json

    body = {**m.body(), **changes}
    return canonical_json({**body, "checksum": hashlib.sha256(canonical_json(body)).hexdigest()})


def race_two_attempts(store: Store, step: int) -> list[object]:
    """Two coordinators commit two fully written attempts of ``step`` at the same moment;
    returns each one's outcome (a Manifest or the CommitError it raised)."""
    attempts = [layout.new_attempt_id() for _ in range(2)]
    receipts = [{r: write_rank(store, step, a, r) for r in range(2)} for a in attempts]
    barrier = threading.Barrier(2)
    outcomes: list[object] = [None, None]

    def run(i: int) -> None:
        coord = Coordinator(store, world_size=2)
        barrier.wait()
        try:
            outcomes[i] = coord.commit(step, attempts[i], receipts[i])
        except CommitError as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def keys_of_attempt(store: Store, step: int, attempt: str) -> list[str]:
    """Every key under ``data/`` that belongs to ``attempt`` of ``step``, in either layout."""
    return sorted(
        m.key
        for m in store.list(layout.DATA_PREFIX)
        if (layout.parse_shard_key(m.key) or ())[:2] == (step, attempt)
    )


def attempts_in_data(store: Store) -> set[tuple[int, str]]:
    """``(step, attempt)`` of every shard key under ``data/`` (either layout)."""
    return {p[:2] for m in store.list(layout.DATA_PREFIX) if (p := layout.parse_shard_key(m.key)) is not None}
