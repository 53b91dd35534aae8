"""Resolution, validation, verified reads and fallback (invariants 10, 11, 12, 13)."""

from __future__ import annotations

import logging
import pickle

import pytest

from objckpt import layout
from objckpt.errors import (
    ChecksumMismatchError,
    DistributedError,
    ManifestError,
    NoCheckpointError,
    PermissionDeniedError,
)
from objckpt.manifest import Manifest
from objckpt.reader import Reader, agree_on_step
from objckpt.store.base import PutMode
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore

from .helpers import forge_manifest, memory_store, put_checkpoint_directly, save, set_pointer


def build_history(n_checkpoints: int, shards_per_rank: int, world_size: int = 4):
    store = memory_store()
    parent = None
    for i in range(n_checkpoints):
        m = put_checkpoint_directly(
            store, (i + 1) * 10, shards_per_rank=shards_per_rank, world_size=world_size, parent=parent
        )
        parent = m.step
    set_pointer(store, m)
    return store, m


# -- invariant 10: constant-cost resolution that never scans shard prefixes

RESOLVE_COST = {"open": 2, "list_page": 2, "head": 1}


def resolve_counting(store):
    counting = CountingStore(store)
    m = Reader(counting).latest()
    return m, dict(counting.counts), counting.calls


def test_resolving_latest_costs_the_same_requests_with_1000_checkpoints_as_with_2():
    small, small_newest = build_history(2, 16)  # 2 checkpoints x 64 shards
    # 1,024 checkpoints x 64 shards: more manifests than one LIST page holds, so a reader that
    # listed all of manifests/ would pay an extra request
    big, big_newest = build_history(1024, 16)
    assert len(big._objects) == 1024 * 65 + 1  # shards + manifests + pointer
    m_small, counts_small, calls_small = resolve_counting(small)
    m_big, counts_big, calls_big = resolve_counting(big)
    assert (m_small, m_big) == (small_newest, big_newest)
    # pointer + head manifest; manifests/ and timelines/ after the pointer; the head's quarantine
    # marker (absent)
    assert counts_small == counts_big == RESOLVE_COST
    assert not any(k.startswith("data/") for _, k in calls_big)


def test_resolution_without_a_pointer_lists_only_manifests():
    store, newest = build_history(3, 4)
    store.delete([layout.POINTER_KEY])
    m, counts, calls = resolve_counting(store)
    assert m == newest
    assert [k for op, k in calls if op == "list_page"] == ["manifests/", "timelines/"]
    assert not any(k.startswith("data/") for _, k in calls)


def test_corrupt_pointer_falls_back_to_listing_manifests(caplog):
    store, newest = build_history(3, 4)
    store.put(layout.POINTER_KEY, b'{"format":"objckpt.pointer","step":')
    with caplog.at_level(logging.WARNING, logger="objckpt.reader"):
        m, counts, calls = resolve_counting(store)
    assert m == newest and "corrupt pointer" in caplog.text
    assert not any(k.startswith("data/") for _, k in calls)


def test_reader_rolls_forward_over_a_lost_pointer_update():
    inner = memory_store()
    save(inner, 10)
    lossy = FaultInjectingStore(
        inner, [Fault(op="put", key=layout.POINTER_KEY, error=PermissionDeniedError, times=None)]
    )
    save(inner, 20, coordinator_store=lossy)
    save(inner, 30, coordinator_store=lossy)
    assert lossy.injected and Reader(inner).pointer().step == 10
    m, counts, calls = resolve_counting(inner)
    assert m.step == 30
    assert counts == RESOLVE_COST
    assert ("list_page", "manifests/") in calls and not any(k.startswith("data/") for _, k in calls)


def test_empty_run_root_has_no_checkpoint():
    reader = Reader(memory_store())
    assert reader.latest() is None and reader.latest_valid() is None
    assert list(reader.candidates()) == [] and reader.steps() == []
    with pytest.raises(NoCheckpointError):
        reader.load(5)
    with pytest.raises(NoCheckpointError):
        reader.restore(lambda m: None)


# -- invariant 11: validated before use; mismatch -> reject whole, fall back loudly


def test_corrupted_shard_fails_its_read_and_falls_back_to_the_parent(caplog):
    store = memory_store()
    parent = save(store, 10)
    newest = save(store, 20)
    bad = newest.shards[1]
    data = bytearray(store.get(bad.key))
    data[3] ^= 0x01
    store.corrupt(bad.key, bytes(data))  # bit rot: metadata still looks right
    reader = Reader(store)
    with pytest.raises(ChecksumMismatchError):
        reader.read_shard(bad)
    problems = reader.verify(newest)
    assert [p.key for p in problems] == [bad.key] and "CRC32C" in problems[0].reason
    with caplog.at_level(logging.WARNING, logger="objckpt.reader"):
        assert reader.latest_valid(full=True) == parent
    assert "step 20" in caplog.text and bad.key in caplog.text and "CRC32C" in caplog.text


def test_restore_uses_a_checkpoint_whole_or_not_at_all(caplog):
    store = memory_store()
    parent = save(store, 10)
    newest = save(store, 20)
    store.corrupt(newest.shards[-1].key, b"truncated")
    reader = Reader(store)
    with caplog.at_level(logging.WARNING, logger="objckpt.reader"):
        m, state = reader.restore(lambda m: {r.key: reader.read_shard(r) for r in m.shards})
    assert m == parent
    assert set(state) == {r.key for r in parent.shards}  # nothing of step 20 mixed in
    assert all(state[r.key] == store.get(r.key) for r in parent.shards)
    assert "rejecting checkpoint step 20" in caplog.text and newest.shards[-1].key in caplog.text
    assert "size mismatch" in caplog.text


def test_deleted_shard_is_rejected_by_the_head_check(caplog):
    store = memory_store()
    parent = save(store, 10)
    newest = save(store, 20)
    store.delete([newest.shards[0].key])
    reader = Reader(store)
    assert [p.reason for p in reader.check(newest)] == ["shard is missing"]
    with caplog.at_level(logging.WARNING, logger="objckpt.reader"):
        assert list(reader.candidates()) == [parent]
    assert "step 20" in caplog.text and newest.shards[0].key in caplog.text and "missing" in caplog.text


_ran: list[str] = []


def _record(what: str) -> None:  # pickled by reference, so unpickling really calls it
    _ran.append(what)


class _Payload:
    def __reduce__(self):
        return (_record, ("executed",))


def _malicious_variants(m: Manifest) -> dict[str, bytes]:
    shards = [s.to_dict() for s in m.shards]

    def with_key(k: str) -> bytes:
        return forge_manifest(m, shards=[{**shards[0], "key": k}, *shards[1:]])

    other_attempt = "f" * 16 if m.attempt != "f" * 16 else "e" * 16
    return {
        "dotdot": with_key(f"{m.attempt_prefix}00000/../../../secrets"),
        "absolute": with_key("/etc/passwd"),
        "other-scheme": with_key("s3://other-bucket/x"),
        "outside-own-attempt": with_key(layout.shard_key(m.step, other_attempt, 0, "model.pt")),
        "unknown-version": forge_manifest(m, format_version=99),
        "bad-checksum": m.encode().replace(b'"global_step":', b'"global_step":1'),
        "not-json": b"\x80\x04 definitely not json",
        "pickle": pickle.dumps(_Payload()),
    }


@pytest.mark.parametrize(
    "variant",
    [
        "dotdot",
        "absolute",
        "other-scheme",
        "outside-own-attempt",
        "unknown-version",
        "bad-checksum",
        "not-json",
        "pickle",
    ],
)
def test_malicious_newest_manifest_is_rejected_and_the_parent_used(variant, caplog):
    store = memory_store()
    parent = save(store, 10)
    newest = save(store, 20)
    store.delete([newest.key])
    store.put(newest.key, _malicious_variants(newest)[variant], mode=PutMode.CREATE)
    reader = Reader(store)
    with pytest.raises(ManifestError) as ei:
        reader.load(20)
    assert newest.key in str(ei.value)
    with caplog.at_level(logging.WARNING, logger="objckpt.reader"):
        assert reader.latest() == parent
        assert reader.latest_valid() == parent
    assert "step 20" in caplog.text and newest.key in caplog.text
    assert _ran == []  # invariant 12: nothing from the store was executed


def test_a_malicious_manifest_never_causes_a_read_outside_the_run_root():
    store = memory_store()
    save(store, 10)
    newest = save(store, 20)
    store.delete([newest.key])
    store.put(newest.key, _malicious_variants(newest)["dotdot"], mode=PutMode.CREATE)
    counting = CountingStore(store)
    list(Reader(counting).candidates())
    touched = [k for op, k in counting.calls if op in ("get", "head", "open")]
    assert all(".." not in k for k in touched)


def test_open_shard_verifies_while_streaming():
    store = memory_store()
    m = save(store, 1)
    r = m.shards[0]
    reader = Reader(store)
    assert b"".join(reader.open_shard(r)) == store.get(r.key)
    store.corrupt(r.key, store.get(r.key) + b"!")
    with pytest.raises(ChecksumMismatchError):
        for _ in reader.open_shard(r):
            pass


def test_verify_reports_progress_and_passes_a_good_checkpoint():
    store = memory_store()
    m = save(store, 1)
    seen = []
    assert Reader(store).verify(m, progress=seen.append) == []
    assert sum(seen) == m.total_size


def test_steps_and_load():
    store = memory_store()
    for s in (3, 1, 2):
        save(store, s)
    reader = Reader(store)
    assert reader.steps() == [1, 2, 3]
    assert reader.load(2).step == 2 and reader.latest().step == 3


# -- invariant 13: every rank restored the same step


def test_ranks_that_restored_different_steps_refuse_to_resume():
    store = memory_store()
    save(store, 10)
    rank0 = Reader(store).latest().step
    save(store, 20)  # lands between two ranks' resolutions
    rank1 = Reader(store).latest().step
    with pytest.raises(DistributedError, match="rank 0: 10, rank 1: 20"):
        agree_on_step({0: rank0, 1: rank1})
    assert agree_on_step({0: 20, 1: 20, 2: 20}) == 20
    assert agree_on_step({0: None, 1: None}) is None
