"""objckpt.replicate: copy a committed checkpoint between stores by the commit protocol."""

from __future__ import annotations

import threading

import pytest

from objckpt import layout
from objckpt._retry import RetryPolicy
from objckpt.commit import Coordinator
from objckpt.errors import ChecksumMismatchError, CommitConflict, NoCheckpointError
from objckpt.layout import new_attempt_id
from objckpt.reader import Reader
from objckpt.replicate import replicate, replicate_all, same_checkpoint
from objckpt.store import PutMode
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from objckpt.writer import ShardWriter

FAST_RETRY = RetryPolicy(initial_backoff=0.0, max_backoff=0.0, max_attempts=5)


def content(step: int, rank: int, name: str, size: int) -> bytes:
    seed = f"{step}/{rank}/{name}|".encode()
    return (seed * (size // len(seed) + 1))[:size]


def commit(store, step, *, world_size=2, names=("model", "optim"), size=5000):
    attempt = new_attempt_id()
    receipts = {}
    for rank in range(world_size):
        w = ShardWriter(store, step=step, attempt=attempt, rank=rank)
        for name in names:
            w.write(name, content(step, rank, name, size))
        receipts[rank] = w.receipts
    return Coordinator(store, world_size=world_size).commit(
        step=step,
        attempt=attempt,
        receipts=receipts,
        progress={"global_step": step},
        run={"config_hash": "abc"},
        topology={"dp": world_size},
        metadata={"note": "x"},
    )


@pytest.fixture
def src():
    return MemoryStore("src", retry=FAST_RETRY)


@pytest.fixture
def dst():
    return MemoryStore("dst", retry=FAST_RETRY)


def test_replicate_latest_is_a_real_commit_with_identical_bytes(src, dst):
    commit(src, 10)
    source = commit(src, 20)
    m = replicate(src, dst)
    assert m.step == 20 and m.attempt != source.attempt
    assert same_checkpoint(m, source)
    assert (m.progress, m.topology, m.world_size) == (source.progress, source.topology, 2)
    assert m.run["config_hash"] == "abc" and m.metadata["note"] == "x"
    assert m.metadata["replicated_from"] == {
        "location": "memory://src",
        "step": 20,
        "attempt": source.attempt,
        "checksum": source.checksum,
    }
    reader = Reader(dst)
    assert reader.latest() == m and reader.pointer().step == 20
    assert reader.verify(m) == []
    for s in m.shards:
        assert layout.parse_shard_key(s.key)[:2] == (m.step, m.attempt)  # the copy's own attempt
        assert reader.read_shard(s) == content(20, s.rank, s.name, 5000)


def test_specific_step_and_progress_callback(src, dst):
    source = commit(src, 10)
    commit(src, 20)
    seen = []
    m = replicate(src, dst, 10, seen.append)
    assert m.step == 10
    assert sum(seen) == source.total_size


def test_idempotent_when_destination_has_same_checkpoint(src, dst):
    commit(src, 5)
    first = replicate(src, dst)
    counting = CountingStore(dst)
    existed = []
    again = replicate(src, counting, on_exists=existed.append)
    assert again == first and existed == [first]
    writes = {"put", "create_upload", "upload_part", "complete_upload", "delete_batch"}
    assert not writes & set(counting.counts)


def test_conflict_when_destination_has_other_content(src, dst):
    commit(src, 5)
    commit(dst, 5, world_size=1, names=("other",))
    with pytest.raises(CommitConflict, match="different checkpoint at step 5"):
        replicate(src, dst)
    assert Reader(dst).load(5).shards[0].name == "other"


def test_corrupt_source_commits_nothing_and_leaves_no_shards(src, dst):
    m = commit(src, 5)
    victim = m.shards[-1]
    src.put(victim.key, b"\0" * victim.size, mode=PutMode.OVERWRITE)
    with pytest.raises(ChecksumMismatchError):
        replicate(src, dst)
    assert Reader(dst).steps() == []
    assert list(dst.list("")) == []


def test_no_checkpoint(src, dst):
    with pytest.raises(NoCheckpointError):
        replicate(src, dst)
    commit(src, 1)
    with pytest.raises(NoCheckpointError):
        replicate(src, dst, 2)


def test_transient_errors_on_both_sides_are_retried(src, dst):
    commit(src, 3, size=200_000)
    flaky_src = FaultInjectingStore(src, [Fault(op="open", after_bytes=70_000, times=2)])
    flaky_dst = FaultInjectingStore(dst, [Fault(op="put", times=2), Fault(op="list_page", times=1)])
    m = replicate(flaky_src, flaky_dst)
    assert flaky_src.injected and flaky_dst.injected
    assert Reader(dst).verify(m) == []


def test_pointer_never_moves_backwards(src, dst):
    commit(src, 10)
    commit(src, 20)
    replicate(src, dst, 20)
    replicate(src, dst, 10)
    assert Reader(dst).pointer().step == 20
    assert Reader(dst).steps() == [10, 20]


def test_replicate_all_in_order_and_skips_existing(src, dst):
    for s in (1, 2, 3):
        commit(src, s)
    replicate(src, dst, 2)
    results = replicate_all(src, dst)
    assert [(r.step, r.copied) for r in results] == [(1, True), (2, False), (3, True)]
    assert Reader(dst).pointer().step == 3


class _SlicedSource(MemoryStore):
    """Serves downloads in 64 KiB chunks and records how far reading runs ahead of uploading."""

    CHUNK = 64 * 1024

    def __init__(self, dst: _TrackingDest) -> None:
        super().__init__("sliced", retry=FAST_RETRY)
        self.dst = dst
        self.read = 0
        self.max_ahead = 0

    def _open(self, key, start, end):
        for chunk in super()._open(key, start, end):
            for i in range(0, len(chunk), self.CHUNK):
                piece = chunk[i : i + self.CHUNK]
                self.read += len(piece)
                self.max_ahead = max(self.max_ahead, self.read - self.dst.settled)
                yield piece


class _TrackingDest(MemoryStore):
    def __init__(self, **kw) -> None:
        super().__init__("tracking", **kw)
        self.settled = 0  # bytes of parts uploaded (or of whole single-request puts)
        self._count_lock = threading.Lock()

    def _upload_part(self, handle, part_number, offset, data, crc32c):
        result = super()._upload_part(handle, part_number, offset, data, crc32c)
        with self._count_lock:
            self.settled += data.nbytes
        return result

    def _put(self, key, data, mode, crc32c):
        meta = super()._put(key, data, mode, crc32c)
        with self._count_lock:
            self.settled += data.nbytes
        return meta


def test_memory_is_bounded_by_parts_in_flight_not_shard_size():
    part, in_flight, size = 128 * 1024, 2, 4 * 1024 * 1024
    dst = _TrackingDest(part_size=part, max_in_flight=in_flight, retry=FAST_RETRY)
    src = _SlicedSource(dst)
    commit(src, 1, world_size=1, names=("big",), size=size)
    src.read = 0
    m = replicate(src, dst)
    assert m.total_size == size
    # Unsettled bytes = parts buffered/in flight + the part being assembled + one read chunk.
    # (Manifest/pointer reads also count as "read", hence the small slack.)
    bound = part * (in_flight + 1) + _SlicedSource.CHUNK
    assert src.max_ahead <= bound + 64 * 1024, (src.max_ahead, bound)
    assert src.max_ahead < size / 4
