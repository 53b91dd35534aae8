"""Shard writing (invariants 1-4)."""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from dataclasses import replace

import pytest

from objckpt import layout
from objckpt._crc import crc32c_b64
from objckpt.errors import AlreadyExistsError, NotFoundError, NotSupportedError, PermissionDeniedError
from objckpt.store.base import Capabilities, PutMode
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from objckpt.writer import ShardWriter

from .helpers import FAST_RETRY, memory_store

STEP = 7
ATTEMPT = "00112233aabbccdd"


# -- invariant 1: own prefix, create-if-absent


def test_shard_is_written_under_its_own_rank_prefix_of_its_attempt():
    store = memory_store()
    r = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=3).write("opt/state.pt", b"abc")
    spread = layout.spread_of(3)
    assert r.key == f"data/{spread}/{STEP:020d}-{ATTEMPT}/00003/opt/state.pt"
    assert r.key.startswith(layout.rank_prefix(STEP, ATTEMPT, 3, spread=True))
    assert layout.parse_shard_key(r.key) == (STEP, ATTEMPT, 3, "opt/state.pt")
    assert store.get(r.key) == b"abc"


def test_key_spreading_off_writes_the_old_layout():
    store = memory_store()
    w = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=3, key_spreading=False)
    r = w.write("opt/state.pt", b"abc")
    assert r.key == f"data/{STEP:020d}-{ATTEMPT}/00003/opt/state.pt"
    assert layout.parse_shard_key(r.key) == (STEP, ATTEMPT, 3, "opt/state.pt")


def test_a_spread_key_with_the_wrong_spreading_digits_is_not_a_shard_key():
    good = layout.shard_key(STEP, ATTEMPT, 3, "x", spread=True)
    digits = good.split("/")[1]
    wrong = "00" if digits != "00" else "01"
    assert layout.parse_shard_key(good.replace(f"/{digits}/", f"/{wrong}/", 1)) is None
    assert layout.attempt_prefix_of(good) == layout.attempt_prefix(STEP, ATTEMPT, digits)


def test_one_save_spreads_over_many_prefixes_and_each_rank_stays_in_one():
    attempt = layout.new_attempt_id()
    per_prefix = Counter(layout.rank_prefix(STEP, attempt, r, spread=True).split("/")[1] for r in range(4096))
    assert len(per_prefix) == 256 and set(per_prefix.values()) == {16}  # all 256, evenly
    assert len({layout.spread_of(r) for r in range(100)}) == 100  # fewer ranks: one prefix each
    # consecutive ranks far apart in key order: no hot key range
    assert all(abs(int(layout.spread_of(r), 16) - int(layout.spread_of(r + 1), 16)) > 16 for r in range(255))
    for r in range(8):
        keys = {layout.shard_key(STEP, attempt, r, f"s{i}", spread=True).split("/")[1] for i in range(8)}
        assert keys == {layout.spread_of(r)}


@pytest.mark.parametrize("part_size", [None, 4], ids=["single-put", "multipart"])
def test_writer_never_overwrites_an_existing_shard(part_size):
    store = memory_store()
    w = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=0, part_size=part_size)
    key = w.key_for("model.pt")
    store.put(key, b"original", mode=PutMode.CREATE)  # e.g. a zombie's or an earlier write
    with pytest.raises(AlreadyExistsError):
        w.write("model.pt", b"replacement bytes")
    assert store.get(key) == b"original"
    assert w.receipts == []
    assert store.list_uploads() == []  # the refused multipart upload was aborted


def test_writer_refuses_store_without_create_if_absent():
    store = MemoryStore("x", capabilities=replace(Capabilities.ALL, create_if_absent=False))
    with pytest.raises(NotSupportedError, match="create-if-absent"):
        ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=0)


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/./b", "sp ace", ""])
def test_writer_rejects_names_that_escape_the_prefix(name):
    w = ShardWriter(memory_store(), step=STEP, attempt=ATTEMPT, rank=0)
    with pytest.raises(ValueError):
        w.write(name, b"x")


# -- invariant 2: bounded streaming, per-part checksums


class _PartTrackingStore(MemoryStore):
    """Checks every part's CRC32C and tracks concurrency and bytes uploaded."""

    def __init__(self, **kw):
        super().__init__("track", **kw)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight_seen = 0
        self.uploaded = 0
        self.part_crcs_ok: list[bool] = []

    def _upload_part(self, handle, part_number, offset, data, crc32c):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight_seen = max(self.max_in_flight_seen, self.in_flight)
            self.part_crcs_ok.append(crc32c == crc32c_b64(data))
        try:
            return super()._upload_part(handle, part_number, offset, data, crc32c)
        finally:
            with self.lock:
                self.in_flight -= 1
                self.uploaded += data.nbytes


def test_large_shard_streams_with_bounded_memory_and_checksummed_parts():
    part, in_flight, chunk, n_chunks = 1024, 3, 256, 256  # 64 parts
    store = _PartTrackingStore(retry=FAST_RETRY)
    taken = [0]
    worst = [0]

    def source():
        for i in range(n_chunks):
            with store.lock:
                worst[0] = max(worst[0], taken[0] - store.uploaded)
            taken[0] += chunk
            yield bytes([i % 251]) * chunk

    w = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=0, part_size=part, max_in_flight=in_flight)
    r = w.write("big.bin", source())
    total = chunk * n_chunks
    assert r.size == total and r.parts == total // part
    assert len(store.part_crcs_ok) == total // part and all(store.part_crcs_ok)
    assert store.max_in_flight_seen <= in_flight
    # bytes taken from the source but not yet uploaded never exceed parts in flight + one
    assert worst[0] <= part * (in_flight + 1) + chunk
    assert store.get(r.key) == b"".join(bytes([i % 251]) * chunk for i in range(n_chunks))


# -- invariant 3: abort on failure, retry transient, fail fast on permanent


def test_failed_upload_is_aborted_and_leaves_nothing_visible():
    inner = memory_store()
    store = CountingStore(FaultInjectingStore(inner, [Fault(op="upload_part", error=PermissionDeniedError)]))
    w = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=0, part_size=4, max_in_flight=1)
    with pytest.raises(PermissionDeniedError):
        w.write("model.pt", b"0123456789abcdef")
    assert store.counts["upload_part"] == 1  # permanent: not retried
    assert store.counts["abort_upload"] == 1
    assert inner.list_uploads() == []
    with pytest.raises(NotFoundError):
        inner.head(w.key_for("model.pt"))
    assert w.receipts == []


def test_transient_errors_are_retried_and_the_shard_completes():
    inner = memory_store()
    faults = [
        Fault(op="upload_part", times=2),
        Fault(op="complete_upload", times=1),
        Fault(op="put", times=1),
    ]
    store = FaultInjectingStore(inner, faults)
    w = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=0, part_size=4)
    big = w.write("big.bin", b"0123456789abcdef")
    small = w.write("small.bin", b"xy")
    assert len(store.injected) == 4
    assert inner.get(big.key) == b"0123456789abcdef" and inner.get(small.key) == b"xy"


# -- invariant 4: receipts


def test_receipt_matches_what_the_store_holds():
    store = memory_store()
    data = b"some tensor bytes" * 100
    w = ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=1, part_size=256, sha256=True)
    r = w.write("model.pt", iter([data[:1000], data[1000:]]))
    head = store.head(r.key)
    assert (r.size, r.version, r.crc32c) == (head.size, head.version, crc32c_b64(data))
    assert (r.rank, r.name, r.parts) == (1, "model.pt", -(-len(data) // 256))
    assert r.sha256 == hashlib.sha256(data).hexdigest()
    assert w.receipts == [r]
    assert ShardWriter(store, step=STEP, attempt=ATTEMPT, rank=2).write("m", b"").sha256 is None


@pytest.mark.parametrize(
    "world,spread", [(1, True), (8, True), (300, True), (1, False), (64, False), (150, False)]
)
def test_verification_slices_hold_every_key_of_the_attempt_exactly_once(world: int, spread: bool):
    """The ranks' verification LISTs (invariant 5, ``verify="ranks"``) cover every key of the
    attempt's prefixes -- rank shards, a marker object equal to a rank prefix, strays sorting
    before and after every rank prefix -- each in exactly one slice."""
    attempt = layout.new_attempt_id()
    slices = layout.verification_slices(3, attempt, world, spread=spread)
    assert [s.lister for s in slices] == list(range(len(slices)))
    keys = [layout.shard_key(3, attempt, r, "shard.bin", spread=spread) for r in range(world)]
    keys += [layout.rank_prefix(3, attempt, r, spread=spread) for r in range(world)]  # markers
    for prefix in {s.prefix for s in slices}:
        keys += [prefix + "!early", prefix + "00000", prefix + "zzz/late"]
    for key in keys:
        assert sum(s.holds(key) for s in slices) == 1, key
    other = layout.new_attempt_id()
    assert not any(s.holds(layout.shard_key(3, other, 0, "x", spread=spread)) for s in slices)
    if spread:
        assert len(slices) == min(world, 256)
    else:
        assert len(slices) == -(-world // layout.RANKS_PER_SLICE)


def test_verification_slices_refuse_a_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        layout.verification_slices(3, layout.new_attempt_id(), 0, spread=True)


@pytest.mark.parametrize("world,spread", [(8, True), (300, True), (150, False)])
def test_a_ranks_own_verification_slice_is_its_entry_of_the_plan(world: int, spread: bool):
    attempt = layout.new_attempt_id()
    plan = layout.verification_slices(3, attempt, world, spread=spread)
    own = [layout.verification_slice(3, attempt, world, r, spread=spread) for r in range(world)]
    assert own == plan + [None] * (world - len(plan))
