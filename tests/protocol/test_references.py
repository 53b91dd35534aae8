"""References (invariants 5, 7, 15 of revision 2): a checkpoint may reuse objects an ancestor
committed instead of writing them again; the coordinator accepts only what an ancestor really
committed, and garbage collection keeps an object while any retained manifest needs it.

These drive the protocol through the save session with references reported by hand; the
writers that find unchanged bytes on their own are tested with them.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from objckpt import layout
from objckpt.coordination import LocalComm, RestoreSession, SaveSession, lineage
from objckpt.errors import CommitError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.manifest import Reference
from objckpt.reader import Reader
from objckpt.store.base import PutMode
from objckpt.store.wrappers import CountingStore

from .helpers import forge_manifest, memory_store

BASE = b"frozen base weights " * 4096  # 80 KiB that never change
ADAPTER = "adapter step {} ".format


def save(store: Any, step: int, *, reuse: Any = None, retention: RetentionPolicy | None = None) -> Any:
    """Rank 0 writes the adapter; the base is written (step 1) or referenced from ``reuse``."""
    session = SaveSession(store, LocalComm(), retention=retention)

    def write(ticket: Any) -> None:
        ticket.writer.write("adapter.bin", ADAPTER(step).encode() * 16)
        if reuse is None:
            ticket.writer.write("base.bin", BASE)
        else:
            ticket.references.append(reuse)

    return session.save(step, write)


def base_ref(manifest: Any) -> Reference:
    """The reference to the base: ``manifest``'s own base shard, or the one it references."""
    for s in manifest.shards:
        if s.name == "base.bin":
            return Reference.to(s, manifest)
    return manifest.references[0]


def restore_base(store: Any) -> bytes:
    reader = Reader(store)

    def stage(m: Any) -> bytes:
        ref = next((r for r in m.references if r.name == "base.bin"), None)
        return reader.read_shard(ref if ref is not None else m.shard(0, "base.bin"))

    restored = RestoreSession(store, LocalComm()).restore(stage)
    assert restored is not None
    return restored.value


@pytest.fixture
def store() -> Any:
    s = memory_store()
    yield s
    lineage.forget(s)


def test_a_reference_reuses_an_ancestors_object_without_writing_it(store: Any) -> None:
    first = save(store, 10)
    counted = CountingStore(store, close_inner=False)
    second = save(counted, 20, reuse=base_ref(first))
    written = [k for op, k in counted.calls if op == "put" and k.startswith("data/")]
    assert written == [second.shard(0, "adapter.bin").key]  # the base is not written again
    assert [r.key for r in second.references] == [first.shard(0, "base.bin").key]
    assert second.total_size < first.total_size and second.referenced_size == len(BASE)
    third = save(store, 30, reuse=base_ref(second))  # a reference of a reference: same origin
    assert third.references == second.references
    assert restore_base(store) == BASE


def test_a_forged_reference_is_rejected_at_commit(store: Any) -> None:
    first = save(store, 10)
    good = base_ref(first)
    # an object no manifest committed, at a shard-shaped key of step 10
    stray_key = layout.shard_key(10, "f" * 16, 0, "base.bin")
    meta = store.put(stray_key, BASE, mode=PutMode.CREATE)
    forged = [
        (
            Reference(stray_key, meta.size, meta.version, good.crc32c, 0, 10, 0, "base.bin"),
            "did not commit it",
        ),
        (Reference(good.key, good.size, good.version, "AAAAAA==", 0, 10, 0, "base.bin"), "CRC32C"),
        (Reference(good.key, good.size, good.version, good.crc32c, 0, 5, 0, "base.bin"), "is not shard"),
    ]
    for ref, why in forged:
        with pytest.raises(CommitError, match="not committed") as info:
            save(store, 20, reuse=ref)
        assert why in str(info.value) and 0 in info.value.failures
    assert Reader(store).steps() == [10]


def test_a_reference_to_an_abandoned_branch_is_rejected(store: Any) -> None:
    save(store, 10)
    m20 = save(store, 20)
    RestoreSession(store, LocalComm()).restore(lambda m: None, step=10)  # roll back to 10
    with pytest.raises(CommitError, match="not an ancestor"):
        save(store, 20, reuse=Reference.to(m20.shard(0, "adapter.bin"), m20))


def test_a_damaged_referenced_object_rejects_the_checkpoint_at_load(store: Any) -> None:
    first = save(store, 10)
    second = save(store, 20, reuse=base_ref(first))
    third = save(store, 30, reuse=base_ref(second))
    store.corrupt(first.shard(0, "base.bin").key, b"X" * len(BASE))  # same size: CRC32C sees it
    with pytest.raises(Exception, match="none is usable"):
        restore_base(store)  # 30, 20 and 10 all need the damaged base: none is usable
    assert [p.key for p in Reader(store).verify(third)] == [first.shard(0, "base.bin").key]


def test_a_manifest_whose_reference_lies_is_refused_when_read(store: Any) -> None:
    first = save(store, 10)
    second = save(store, 20, reuse=base_ref(first))
    lie = dict(second.references[0].to_dict(), key=layout.shard_key(20, second.attempt, 0, "base.bin"))
    raw = forge_manifest(second, references=[lie])
    with pytest.raises(Exception, match="is not shard|own attempt"):
        type(second).decode(raw, key=second.key)


def test_retention_keeps_an_object_while_a_retained_manifest_references_it(store: Any) -> None:
    keep1 = RetentionPolicy(keep_last=1)
    first = save(store, 10, retention=keep1)
    previous = first
    for step in (20, 30, 40):
        previous = save(store, step, reuse=base_ref(previous), retention=keep1)
    assert Reader(store).steps() == [40]
    base_key = first.shard(0, "base.bin").key
    assert store.get(base_key) == BASE  # its manifest is gone, the object lives on
    assert restore_base(store) == BASE
    plan = plan_gc(store, RetentionPolicy(keep_last=0))
    assert plan.manifests == [] and (0, 40) in plan.kept  # the head is never collected


def test_gc_dry_run_shows_shared_bytes(store: Any) -> None:
    first = save(store, 10)
    save(store, 20, reuse=base_ref(first))
    plan = plan_gc(store, RetentionPolicy(keep_last=1))
    (deletion,) = plan.manifests
    assert deletion.shared_keys == (first.shard(0, "base.bin").key,) and deletion.shared_size == len(BASE)
    assert any("shared object(s)" in line for line in plan.describe())


def test_gc_racing_a_save_that_references_an_old_object_keeps_it(backend: Any) -> None:
    if backend.name not in ("file", "s3_localstack"):
        pytest.skip("the race runs on file:// and LocalStack, whose conditional writes are atomic")
    store = backend.new_store()
    try:
        first = save(store, 10)
        second = save(store, 20, reuse=base_ref(first))
        entered, release = threading.Event(), threading.Event()

        class Holding(CountingStore):
            def _invoke(self, op: str, key: str, keys: Any, fn: Any, *args: Any) -> Any:
                if op == "put" and key.startswith("manifests/") and "30" in key:
                    entered.set()
                    release.wait(60)  # the commit of 30 is checked, its manifest not yet written
                return super()._invoke(op, key, keys, fn, *args)

        holding = Holding(store, close_inner=False)
        outcome: dict[str, Any] = {}
        saver = threading.Thread(target=lambda: outcome.update(m=save(holding, 30, reuse=base_ref(second))))
        saver.start()
        assert entered.wait(60)
        run_gc(store, plan_gc(store, RetentionPolicy(keep_last=1)))  # collects 10 while 30 commits
        release.set()
        saver.join(60)
        assert outcome["m"].step == 30
        run_gc(store, plan_gc(store, RetentionPolicy(keep_last=1)))  # now 20 goes too
        assert Reader(store).steps() == [30]
        assert store.get(first.shard(0, "base.bin").key) == BASE
        lineage.forget(store)
        assert restore_base(store) == BASE
    finally:
        lineage.forget(store)
        store.close()
