"""A save streams with bounded memory: a state much larger than ``part_size x max_in_flight`` never
costs more than ``part_size x (max_in_flight + 1)`` of extra heap (the bound ``Store.put_stream``
documents), whatever its size.

Measured with tracemalloc, which sees every buffer objckpt allocates (parts assembled from
several source buffers are ``bytearray`` s) but not the source's own memory (allocated before
tracing starts; tensors live outside the Python heap anyway). The source is shaped like a
serialized state, a small header followed by part-sized arrays, so that *every* part straddles
two source buffers and has to be assembled: the worst case for the bound.

* ``file://``: the peak of traced allocations during the whole save (the store writes each part
  to disk and keeps nothing in memory).
* ``memory://``: the store itself keeps every part it receives (that is its storage, not a
  client buffer), so the test's store subclass samples, as each part arrives, the traced heap
  minus what the store already holds; the overall peak is also checked against
  ``2 x size + bound`` (the parts, plus the object they are joined into at completion).

A memory bound, not a timing: it holds on a loaded machine too.
"""

from __future__ import annotations

import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from objckpt import layout
from objckpt.commit import Coordinator
from objckpt.reader import Reader
from objckpt.store.base import PartResult, UploadHandle
from objckpt.store.local import LocalStore
from objckpt.store.memory import MemoryStore
from objckpt.writer import ShardWriter

MiB = 1024 * 1024
PART = 1 * MiB
IN_FLIGHT = 2
STATE = 64 * MiB  # 32x part_size x max_in_flight
#: what put_stream promises: part_size x (max_in_flight + 1)
BOUND = PART * (IN_FLIGHT + 1)
#: small Python objects (futures, receipts, retry state, thread-pool bookkeeping)
SLACK = 512 * 1024


def _state_source(backing: memoryview, header_len: int = 1000) -> Iterator[memoryview]:
    """A header of ``header_len`` bytes, then part-sized arrays: every part spans two buffers."""
    yield backing[:header_len]
    for start in range(header_len, backing.nbytes, PART):
        yield backing[start : start + PART]


def _save(store, backing: memoryview) -> None:
    """One complete save through the protocol core: a rank's shard, then the commit."""
    attempt = layout.new_attempt_id()
    writer = ShardWriter(store, step=1, attempt=attempt, rank=0, part_size=PART, max_in_flight=IN_FLIGHT)
    writer.write("state.bin", _state_source(backing))
    Coordinator(store, world_size=1).commit(1, attempt, {0: writer.receipts})


def _backing() -> memoryview:
    data = bytearray(STATE)
    for i in range(0, STATE, 4096):  # not all zeros; cheap
        data[i] = (i // 4096) & 0xFF
    return memoryview(data)


class _SamplingMemoryStore(MemoryStore):
    """memory:// that records, as each part arrives, the traced heap minus what it retains."""

    def __init__(self, location: str) -> None:
        super().__init__(location, part_size=PART, max_in_flight=IN_FLIGHT)
        self.retained = 0
        self.samples: list[int] = []
        self._sample_lock = threading.Lock()

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        with self._sample_lock:
            self.samples.append(tracemalloc.get_traced_memory()[0] - self.retained)
        result = super()._upload_part(handle, part_number, offset, data, crc32c)
        with self._sample_lock:
            self.retained += data.nbytes
        return result


def _traced_peak(run: Callable[[], object]) -> int:
    """Peak heap (tracemalloc) allocated above the starting level while ``run()`` executes."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_file_store_save_peak_heap_is_bounded(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "root"), part_size=PART, max_in_flight=IN_FLIGHT)
    backing = _backing()
    peak = _traced_peak(lambda: _save(store, backing))
    manifest = Reader(store).latest()
    assert manifest is not None and manifest.total_size == STATE
    assert manifest.shards[0].parts == STATE // PART
    assert peak < BOUND + SLACK, (
        f"saving {STATE // MiB} MiB with {PART // MiB} MiB parts x {IN_FLIGHT} in flight peaked at "
        f"{peak / MiB:.2f} MiB of extra heap; the bound is {BOUND / MiB:.0f} MiB"
    )
    store.close()


def test_memory_store_save_client_heap_is_bounded() -> None:
    store = _SamplingMemoryStore("mem-bound")
    backing = _backing()
    # samples are absolute traced sizes, so this test keeps its own base
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        _save(store, backing)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert Reader(store).latest() is not None
    assert len(store.samples) == STATE // PART
    client = max(store.samples) - base
    assert client < BOUND + SLACK, (
        f"client-side buffers reached {client / MiB:.2f} MiB while saving {STATE // MiB} MiB; "
        f"the bound is {BOUND / MiB:.0f} MiB"
    )
    # the store's own copy (parts, then the joined object) is all the rest
    assert peak < 2 * STATE + BOUND + SLACK, f"peak {peak / MiB:.1f} MiB"


@pytest.mark.parametrize("size", [STATE, IN_FLIGHT * PART], ids=["multipart", "one-request"])
def test_reading_ahead_for_one_request_stays_within_the_bound(tmp_path: Path, size: int) -> None:
    """``single_request_max`` reads parts ahead before it knows whether the source fits one
    request: capped at ``part_size x max_in_flight``, so assembled parts held never exceed the
    bound, whether the source then goes as a multipart upload (64 MiB) or as one request."""
    store = LocalStore(str(tmp_path / "root"), part_size=PART, max_in_flight=IN_FLIGHT)
    backing = _backing()[:size]
    writer = ShardWriter(store, step=1, attempt=layout.new_attempt_id(), rank=0, part_size=PART)
    peak = _traced_peak(lambda: writer.write("state.bin", _state_source(backing), single_request_max=STATE))
    (receipt,) = writer.receipts
    assert receipt.size == size and receipt.parts == (size // PART if size > IN_FLIGHT * PART else 1)
    assert peak < BOUND + SLACK, (
        f"writing {size // MiB} MiB with one-request read-ahead peaked at {peak / MiB:.2f} MiB of "
        f"extra heap; the bound is {BOUND / MiB:.0f} MiB"
    )
    store.close()


def test_checkpoint_manager_save_peak_heap_is_bounded(tmp_path: Path) -> None:
    """The training layer streams tensors the same way: 16 tensors of 4 MiB, 1 MiB parts."""
    torch = pytest.importorskip("torch")
    from objckpt.store import open_store
    from objckpt.training.manager import CheckpointManager

    params = [torch.full((MiB,), float(i)) for i in range(16)]  # 16 x 4 MiB, outside the heap
    model = torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=False) for p in params])
    store = open_store(f"file://{tmp_path / 'run'}", part_size=str(PART), max_in_flight=str(IN_FLIGHT))
    with CheckpointManager(store, keep_last=None) as mgr:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            mgr.save(1, {"model": model})
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert mgr.latest_step() == 1
    store.close()
    assert peak < BOUND + SLACK, (
        f"CheckpointManager.save of 64 MiB peaked at {peak / MiB:.2f} MiB of extra heap; "
        f"the bound is {BOUND / MiB:.0f} MiB"
    )


#: a restore's reads: 5 MiB parts (S3's smallest), 4 ranged reads at a time
RESTORE_PART = 5 * MiB
RESTORE_WINDOW = 4


def _restore_peak(store: Any) -> int:
    """Save 40 MiB of parameters through ``store``, zero them, restore them; the restore's peak
    of extra Python heap (tracemalloc). Closes ``store``."""
    import torch

    from objckpt.training.manager import CheckpointManager

    params = [torch.full((MiB,), float(i)) for i in range(10)]  # 10 x 4 MiB
    model = torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=False) for p in params])
    with CheckpointManager(store, keep_last=None) as mgr:
        mgr.save(1, {"model": model})
        with torch.no_grad():
            for p in model:
                p.zero_()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            assert mgr.restore({"model": model}) == 1
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    store.close()
    assert all(torch.equal(p, torch.full((MiB,), float(i))) for i, p in enumerate(model))
    return int(peak)


def test_checkpoint_manager_restore_reads_into_the_staged_tensors(tmp_path: Path) -> None:
    """A restore stages a copy of the state (torch memory, outside the Python heap) and reads
    every shard larger than one part straight into it (``training._ranged_restore``; file://
    receives into the buffers with ``preadv``): its extra heap is the probe and tail reads plus,
    per ranged read in flight, at most one ``SLICE_BYTES`` buffer (what an S3 client allocates
    per ``readinto``, copied up to three times on the way), whatever the state's size."""
    pytest.importorskip("torch")
    from objckpt.store import open_store
    from objckpt.training._chunked import TAIL_READ
    from objckpt.training._ranged_restore import PROBE_BYTES, SLICE_BYTES

    store = open_store(
        f"file://{tmp_path / 'run'}", part_size=str(RESTORE_PART), max_in_flight=str(RESTORE_WINDOW)
    )
    peak = _restore_peak(store)
    bound = PROBE_BYTES + TAIL_READ + RESTORE_WINDOW * 3 * SLICE_BYTES + SLACK
    assert peak < bound, (
        f"CheckpointManager.restore of 40 MiB peaked at {peak / MiB:.2f} MiB of extra heap; "
        f"the bound is {bound / MiB:.2f} MiB"
    )


def test_checkpoint_manager_restore_on_s3_reads_into_the_staged_tensors(
    backend_s3_localstack: Any, tmp_path: Path
) -> None:
    """The same restore on an s3:// run root with a prefix (a ``PrefixStore`` over ``S3Store``,
    which forwards ``_read_into``) on LocalStack: each ranged GET is received slice by slice
    into the staged tensors (measured 4.4 MiB of extra heap). Through a wrapper that fell back
    to ``_open`` every GET in flight held its whole part as ``bytes`` (measured 20.3 MiB), as
    streaming the parts did (``read_concurrency + 1`` of them)."""
    pytest.importorskip("torch")
    from objckpt.store import open_store
    from objckpt.store.wrappers import PrefixStore
    from objckpt.training._chunked import TAIL_READ
    from objckpt.training._ranged_restore import PROBE_BYTES, SLICE_BYTES

    opts = f"part_size={RESTORE_PART}&max_in_flight={RESTORE_WINDOW}&read_concurrency={RESTORE_WINDOW}"
    store = open_store(backend_s3_localstack.uri_for(f"restore-bound-{tmp_path.name}") + "&" + opts)
    assert isinstance(store, PrefixStore)
    peak = _restore_peak(store)
    bound = PROBE_BYTES + TAIL_READ + RESTORE_WINDOW * 3 * SLICE_BYTES + SLACK
    assert bound < RESTORE_WINDOW * RESTORE_PART  # below what whole parts in flight would hold
    assert peak < bound, (
        f"CheckpointManager.restore of 40 MiB on S3 peaked at {peak / MiB:.2f} MiB of extra heap; "
        f"the bound is {bound / MiB:.2f} MiB"
    )
