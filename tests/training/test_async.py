"""Asynchronous saves: CheckpointManager.save_async, the staging buffer, SaveHandle.

Single-process tests use a memory:// store wrapped so the test decides, by events, when the
background upload may go on. No assertion depends on timing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from objckpt import layout
from objckpt.errors import CommitError, PermissionDeniedError
from objckpt.gc import RetentionPolicy, plan_gc, run_gc
from objckpt.reader import Reader
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore
from objckpt.training.manager import CheckpointManager
from objckpt.training.staging import SaveAbandonedError, StagingArea, StagingBudgetError

from .test_manager import _same, _state, _step

#: write primitives of a save (manifest and pointer included)
WRITES = ("put", "create_upload", "upload_part", "complete_upload")


class GatedStore(CountingStore):
    """Holds every write of a shard (``data/...``) until :attr:`gate` is set (or ``release_if()``
    says so); :attr:`entered` is set when the first one arrives. Records the step of every write
    (shards and manifests) in call order, to check that saves never interleave."""

    def __init__(self, inner: Any, *, closed: bool = False, delay: float = 0.0) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        if not closed:
            self.gate.set()
        self.entered = threading.Event()
        self.release_if: Any = None
        self.delay = delay  # widens the window an overlap would need; asserts nothing about time
        self.write_steps: list[int] = []
        self._log_lock = threading.Lock()

    def _invoke(self, op: str, key: str, keys: Any, fn: Any, *args: Any) -> Any:
        step = _step_of(key) if op in WRITES else None
        if step is not None:
            with self._log_lock:
                self.write_steps.append(step)
        if op in WRITES and key.startswith("data/"):
            self.entered.set()
            while not self.gate.wait(0.005):
                if self.release_if is not None and self.release_if():
                    break
            if self.delay:
                threading.Event().wait(self.delay)
        return super()._invoke(op, key, keys, fn, *args)


def _step_of(key: str) -> int | None:
    if key.startswith("data/"):
        parsed = layout.parse_shard_key(key)  # either layout (spread or not)
        return parsed[0] if parsed is not None else None
    if key.startswith("manifests/"):
        return int(key.split("/")[1].split(".")[0])
    return None


def _gated(**kw: Any) -> GatedStore:
    # 256-byte parts: every replicated shard is a multipart upload, so a gate on create_upload
    # holds the save after only its first two parts (the header) were read
    return GatedStore(MemoryStore(part_size=256), **kw)


def _pair(seed: int = 0, steps: int = 3, width: int = 32) -> tuple[dict, dict]:
    """Two identical trained states: one to save (and then change), one to compare with."""
    out = []
    for _ in range(2):
        s = _state(seed, width=width)
        torch.manual_seed(100)
        _step(s, steps)
        s["progress"].global_step = steps
        out.append(s)
    return out[0], out[1]


def _scramble(s: dict) -> None:
    """What a training loop does right after save_async returns, and then some: every
    parameter, optimizer moment, counter and dict changes in place."""
    torch.manual_seed(7)
    _step(s, 2)
    with torch.no_grad():
        for p in s["model"].parameters():
            p.mul_(-3.0).add_(1000.0)
    for st in s["optimizer"].state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v.fill_(12345.0)
    s["extra"]["best"] = -1.0
    s["sampler"].set_epoch(9)


# ---------------------------------------------------------------------------------- save_async


def test_save_async_returns_while_the_upload_is_held_and_training_goes_on() -> None:
    store = _gated(closed=True)
    mgr = CheckpointManager(store, keep_last=None)
    s, ref = _pair()
    handle = mgr.save_async(3, s)
    # save_async returned; the background thread is inside an upload that cannot finish yet
    assert store.entered.wait(30)
    assert not handle.done() and handle.attempt is not None
    assert Reader(store).steps() == []
    torch.manual_seed(1)
    _step(s, 2)  # the training thread makes progress meanwhile
    assert s["progress"].global_step == 5 and not handle.done()
    store.gate.set()
    manifest = handle.wait(timeout=60)
    assert manifest is not None and manifest.step == 3 and manifest.attempt == handle.attempt
    assert handle.committed and Reader(store).steps() == [3]
    assert handle.staged_bytes > 0 and mgr.staging_bytes >= handle.staged_bytes
    fresh = _state(5, width=32)
    assert CheckpointManager(store).restore(fresh) == 3
    _same(ref, fresh)
    mgr.close()


def test_changing_everything_right_after_save_async_returns_does_not_reach_the_checkpoint() -> None:
    """The point of staging: the checkpoint holds the state as it was at the call, although the
    upload had read nothing but the header when the tensors were changed in place."""
    store = _gated(closed=True)
    mgr = CheckpointManager(store, keep_last=None)
    s, ref = _pair()
    handle = mgr.save_async(3, s)
    assert store.entered.wait(30)
    _scramble(s)
    store.gate.set()
    handle.wait(timeout=60)
    fresh = _state(5, width=32)
    assert CheckpointManager(store).restore(fresh) == 3
    _same(ref, fresh)  # parameters, optimizer moments, scheduler, progress, dicts, RNG
    mgr.close()


def test_background_failure_is_raised_at_wait_and_no_manifest_is_written() -> None:
    store = FaultInjectingStore(
        MemoryStore(), [Fault(op="put", key="data/*/rank.bin", error=PermissionDeniedError, times=1)]
    )
    mgr = CheckpointManager(store)
    handle = mgr.save_async(1, _state())
    with pytest.raises(CommitError, match=r"failing ranks \[0\].*PermissionDenied") as info:
        handle.wait(timeout=60)
    assert set(info.value.failures) == {0}
    with pytest.raises(CommitError):  # again: the outcome stays
        handle.result()
    assert not handle.committed and Reader(store).steps() == []
    # seen at wait(): not raised again by the next save, which works
    assert mgr.save_async(2, _state()).wait(timeout=60).step == 2
    assert Reader(store).steps() == [2]
    mgr.close()


@pytest.mark.parametrize("next_call", ["save_async", "save", "close"])
def test_a_failure_nobody_waited_for_is_raised_by_the_next_call(next_call: str) -> None:
    store = FaultInjectingStore(
        MemoryStore(), [Fault(op="put", key="data/*/rank.bin", error=PermissionDeniedError, times=1)]
    )
    mgr = CheckpointManager(store)
    failed = mgr.save_async(1, _state())
    # nobody looks at `failed`; the next call waits for it and raises its error instead of saving
    with pytest.raises(CommitError, match=r"step 1 .*PermissionDenied"):
        if next_call == "save_async":
            mgr.save_async(2, _state())
        elif next_call == "save":
            mgr.save(2, _state())
        else:
            mgr.close()
    assert failed.done() and Reader(store).steps() == []
    if next_call == "close":
        mgr.close()  # closed: idempotent, raises nothing more
        with pytest.raises(ValueError, match="closed"):
            mgr.save_async(2, _state())
        return
    # raised once: the call after it saves normally
    assert mgr.save_async(3, _state()).wait(timeout=60).step == 3
    assert Reader(store).steps() == [3]
    mgr.close()


def test_saves_never_run_concurrently() -> None:
    """Rapid save_async calls (and a save() among them) wait for the one in flight: every
    write of one save happens before any write of the next."""
    store = GatedStore(MemoryStore(part_size=256), delay=0.002)
    mgr = CheckpointManager(store, keep_last=None)
    s = _state(width=32)
    handles = []
    for step in (1, 2, 3):
        handles.append(mgr.save_async(step, s))
        _step(s)
    assert mgr.save(4, s).step == 4  # a synchronous save waits for the one in flight
    handles.append(mgr.save_async(5, s))
    mgr.close()
    assert [h.wait().step for h in handles] == [1, 2, 3, 5]
    assert Reader(store).steps() == [1, 2, 3, 4, 5]
    seen = store.write_steps
    assert set(seen) == {1, 2, 3, 4, 5}
    assert seen == sorted(seen), f"writes of two saves interleaved: {seen}"


def test_a_state_over_the_staging_budget_is_refused_before_anything_is_staged() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, max_staging_bytes=1024)
    s = _state(width=64)
    with pytest.raises(
        StagingBudgetError, match=r"needs [\d,]+ bytes of host staging memory.*max_staging_bytes=1,024"
    ):
        mgr.save_async(1, s)
    assert mgr.staging_bytes == 0 and list(store.list("")) == []
    # save() streams without staging: the budget does not apply
    assert mgr.save(1, s).step == 1
    mgr.close()

    roomy = CheckpointManager(store, max_staging_bytes=1 << 20, keep_last=None)
    h = roomy.save_async(2, s)
    h.wait(timeout=60)
    held = roomy.staging_bytes
    assert h.staged_bytes <= held <= 1 << 20
    ptr = roomy._staging._buffer.data_ptr()
    roomy.save_async(3, s).wait(timeout=60)
    assert roomy.staging_bytes == held and roomy._staging._buffer.data_ptr() == ptr  # reused
    roomy.close()
    assert roomy.staging_bytes == 0


def test_skip_policy_skips_while_a_save_is_in_flight(caplog: pytest.LogCaptureFixture) -> None:
    store = _gated(closed=True)
    mgr = CheckpointManager(store, keep_last=None, every=2)
    s = _state()
    first = mgr.save_async(2, s)
    assert store.entered.wait(30)
    with caplog.at_level(logging.WARNING, logger="objckpt.training"):
        second = mgr.save_async(4, s, policy="skip")
    assert second.skipped and second.done() and second.wait() is None
    assert "in flight" in (second.reason or "") and "skipped" in caplog.text
    assert not first.done()
    not_due = mgr.save_async(5, s)  # every=2: not due, skipped without a warning
    assert not_due.skipped and "not due" in (not_due.reason or "")
    store.gate.set()
    assert first.wait(timeout=60).step == 2
    assert Reader(store).steps() == [2]
    with pytest.raises(ValueError, match="policy"):
        mgr.save_async(6, s, policy="later")
    mgr.close()


def test_close_abandon_commits_nothing_and_aborts_the_uploads() -> None:
    store = _gated(closed=True)
    mgr = CheckpointManager(store)
    handle = mgr.save_async(1, _state(width=32))
    # the held upload lets go once the abandon request is made (and not before)
    store.release_if = lambda: handle.abandon_requested
    assert store.entered.wait(30)
    mgr.close(abandon=True)  # returns once the background thread is done; raises nothing
    assert handle.done() and not handle.committed
    with pytest.raises(SaveAbandonedError, match="abandoned") as info:
        handle.wait()
    assert isinstance(info.value, CommitError) and set(info.value.failures) == {0}
    assert Reader(store).steps() == [] and list(store.list("manifests/")) == []
    assert store.list_uploads("") == []  # the multipart upload was aborted
    # leftovers (if any) are an unreferenced attempt: GC sweeps them after the grace period
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    run_gc(store, plan_gc(store, RetentionPolicy(keep_last=1), grace_period=timedelta(hours=1), now=later))
    assert list(store.list("data/")) == []


def test_abandoning_a_save_by_its_handle_lets_the_next_one_run() -> None:
    store = _gated(closed=True)
    mgr = CheckpointManager(store)
    s = _state()
    first = mgr.save_async(1, s)
    store.release_if = lambda: first.abandon_requested
    assert store.entered.wait(30)
    first.abandon()
    second = mgr.save_async(2, s)  # waits for the abandoned save; asked for here: not raised
    with pytest.raises(SaveAbandonedError):
        first.wait()
    assert second.wait(timeout=60).step == 2 and Reader(store).steps() == [2]
    mgr.close()


def test_context_manager_exit_waits_for_the_save_in_flight() -> None:
    store = _gated(closed=True)
    with CheckpointManager(store) as mgr:
        handle = mgr.save_async(1, _state())
        assert store.entered.wait(30) and not handle.done()
        store.gate.set()
    assert handle.committed and Reader(store).steps() == [1]


def test_restore_waits_for_the_save_in_flight() -> None:
    store = _gated(closed=True)
    mgr = CheckpointManager(store)
    s, ref = _pair()
    handle = mgr.save_async(3, s)
    assert store.entered.wait(30)
    store.release_if = lambda: True  # let go; restore must still see step 3 committed
    fresh = _state(5, width=32)
    assert mgr.restore(fresh) == 3 and handle.done()
    _same(ref, fresh)
    mgr.close()


# ---------------------------------------------------------------------------------- staging


def test_staged_copies_are_bitwise_and_alias_nothing() -> None:
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001], dtype=torch.int32).view(torch.float32)
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    tied = torch.randn(5)
    meta_dict: OrderedDict = OrderedDict(w=torch.ones(2))
    meta_dict._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    tree = {
        "nan": nan_payload,
        "bf16": torch.randn(7).to(torch.bfloat16),
        "strided": base.t(),  # not contiguous
        "conj": torch.randn(3, dtype=torch.complex64).conj(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "bool": torch.tensor([True, False, True]),
        "np": np.arange(6, dtype=">i4").reshape(2, 3),
        "np_scalar": np.float64(2.5),
        "tied": [tied, tied],
        "module": meta_dict,
        "nested": {"lst": [1, 2.0, "x", None, (3, torch.zeros(2))], "b": bytearray(b"ab")},
    }
    expect = {
        "nan": nan_payload.clone(),
        "strided": base.t().contiguous(),
        "conj": tree["conj"].resolve_conj(),
    }
    area = StagingArea()
    plan = area.plan([tree])
    (staged,) = area.stage(plan)
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    assert torch.equal(as_bytes(staged["nan"]), as_bytes(expect["nan"]))  # NaN payloads kept
    assert torch.equal(staged["bf16"], tree["bf16"]) and staged["bf16"].dtype == torch.bfloat16
    assert torch.equal(staged["strided"], expect["strided"])
    assert torch.equal(staged["conj"], expect["conj"]) and not staged["conj"].is_conj()
    assert staged["scalar"].shape == () and staged["scalar"].item() == 3.5
    assert staged["empty"].shape == (0, 3) and torch.equal(staged["bool"], tree["bool"])
    assert staged["np"].dtype == np.dtype(">i4") and (staged["np"] == tree["np"]).all()
    assert staged["tied"][0] is staged["tied"][1]  # one object, staged once
    assert staged["module"]._metadata == {"": {"version": 1}} and isinstance(staged["module"], OrderedDict)
    assert staged["nested"]["lst"][4][0] == 3 and staged["nested"]["b"] == b"ab"
    # nothing aliases the live objects: change them all, the staged copy stays
    for t in (nan_payload, base, tied, meta_dict["w"], tree["bool"]):
        t.zero_()
    tree["np"][:] = 0
    tree["nested"]["lst"].append("more")
    assert torch.equal(staged["strided"], expect["strided"]) and staged["tied"][0].abs().sum() > 0
    assert (staged["np"] != 0).any() and staged["module"]["w"].sum() == 2
    assert len(staged["nested"]["lst"]) == 5
    # all of it lives in the one buffer, which the next staging reuses
    assert plan.nbytes <= area.capacity
    ptr = area._buffer.data_ptr()
    area.stage(area.plan([tree]))
    assert area._buffer.data_ptr() == ptr
    with pytest.raises(StagingBudgetError):
        StagingArea(max_bytes=16).plan([tree])


def test_one_staging_buffer_for_every_save_and_each_tensor_copied_once() -> None:
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=2)
    s, _ = _pair()
    model_bytes = sum(p.numel() * p.element_size() for p in s["model"].parameters())
    copied, handles = [], []
    for step in range(3, 8):
        _scramble(s)  # new values, same shapes: the buffer is big enough already
        handles.append(mgr.save_async(step, s))
        handles[-1].wait(timeout=60)
        copied.append(mgr._staging.copied_bytes)
    assert mgr._staging.allocations == 1  # allocated by the first save, reused by the other four
    assert len(set(copied)) == 1 and model_bytes < copied[0] <= handles[0].staged_bytes
    mgr.close()


def test_staging_copies_each_distinct_tensor_once_and_grows_only_when_needed() -> None:
    a = torch.randn(1000)
    tree = {"a": a, "tied": [a, a], "np": np.arange(10, dtype=np.int64), "t": torch.randn(6, 4).t()}
    area = StagingArea()
    for _ in range(4):
        area.stage(area.plan([tree]))
        assert area.copied_bytes == 4000 + 80 + 96  # the tied tensor once
    assert area.allocations == 1
    area.stage(area.plan([{"big": torch.zeros(1 << 19)}]))  # 2 MiB: more than the buffer holds
    assert area.allocations == 2 and area.copied_bytes == 1 << 21
    area.stage(area.plan([tree]))  # smaller again: the larger buffer is kept
    assert area.allocations == 2


def test_staged_copies_are_bit_exact_and_alias_nothing_at_one_and_two_threads() -> None:
    nan = torch.tensor([0x7FC00123, 0x7F800001, 0xFFC0BEEF], dtype=torch.int64).to(torch.uint32)
    nan = nan.view(torch.float32)
    tree = {
        "f": torch.randn(300),
        "nan_payloads": nan,  # a byte copy keeps them; an arithmetic one may not
        "bf16": torch.randn(7).to(torch.bfloat16),
        "offset": torch.arange(20, dtype=torch.int64)[5:],  # contiguous, not at its storage's start
        "strided": torch.randn(3, 4).t(),  # not contiguous: materialised in C order
    }
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            area = StagingArea()
            (staged,) = area.stage(area.plan([tree]))
            assert area.copied_bytes == 1200 + 12 + 14 + 120 + 48
            for k, t in tree.items():
                got = staged[k]
                assert got.dtype == t.dtype and got.shape == t.shape and got.data_ptr() != t.data_ptr()
                assert torch.equal(got.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8))
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- 2 ranks


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_async_save_and_restore_round_trip_is_bitwise(tmp_path: Path) -> None:
    from objckpt.store import open_store
    from objckpt.training.serialization import loads

    from . import workers
    from .mp import run_world
    from .test_multiprocess import _assert_same

    out = tmp_path / "out"
    out.mkdir()
    root, failing, abandoned = (f"file://{tmp_path}/{n}" for n in ("run", "failing", "abandoned"))
    assert run_world(workers.async_round_trip, 2, root, failing, abandoned, str(out)) == [0, 0]
    results = [loads((out / f"rank{r}.bin").read_bytes()) for r in range(2)]
    for r, res in enumerate(results):
        # the state restored from each async checkpoint is, bit for bit, the state at the call,
        # although training changed it (in place and by DDP steps) while the upload ran
        _assert_same(res["at_save"], res["restored_save"], f"rank {r} step 5")
        _assert_same(res["at_final"], res["restored_final"], f"rank {r} step 8")
        assert res["restored_steps"] == [5, 8]
    # every rank's handle got the same outcome
    assert results[0]["attempts"] == results[1]["attempts"]
    for key in ("failure", "abandon"):
        assert results[0][key] == results[1][key], key
    assert results[0]["failure"].startswith("CommitError") and "rank 1" in results[0]["failure"]
    assert results[0]["abandon"].startswith("SaveAbandonedError") and "[0]" in results[0]["abandon"]
    assert Reader(open_store(root)).steps() == [5, 8]
    assert Reader(open_store(failing)).steps() == []
    aband = open_store(abandoned)
    assert Reader(aband).steps() == [] and aband.list_uploads("") == []


# ------------------------------------------------------------------------- the worker thread


def _record_save_threads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[threading.Thread], list[str]]:
    """The thread each save's upload ran on, and the names of the threads started meanwhile."""
    from objckpt.training import shards

    ran_on: list[threading.Thread] = []
    started: list[str] = []
    real_write, real_start = shards.write, threading.Thread.start

    def write(*args: Any, **kwargs: Any) -> Any:
        ran_on.append(threading.current_thread())
        return real_write(*args, **kwargs)

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(shards, "write", write)
    monkeypatch.setattr(threading.Thread, "start", start)
    return ran_on, started


def test_saves_run_on_one_worker_thread_that_close_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    # save_async hands the save to a thread already running instead of starting one per save
    # (Thread.start waits for the new thread to run, inside the time training is blocked)
    ran_on, started = _record_save_threads(monkeypatch)
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    s = _state()
    for step in (1, 2, 3):
        assert mgr.save_async(step, s).wait(timeout=60).step == step
    assert len(ran_on) == 3 and len({t.ident for t in ran_on}) == 1
    assert started.count("objckpt-save") == 1
    mgr.close()
    assert not ran_on[0].is_alive()
    assert Reader(store).steps() == [1, 2, 3]


def test_an_idle_worker_exits_and_the_next_save_starts_another(monkeypatch: pytest.MonkeyPatch) -> None:
    from objckpt.training import background

    monkeypatch.setattr(background, "_IDLE_EXIT_S", 0.01)  # a manager never closed keeps no thread
    ran_on, started = _record_save_threads(monkeypatch)
    store = MemoryStore()
    mgr = CheckpointManager(store, keep_last=None)
    s = _state()
    assert mgr.save_async(1, s).wait(timeout=60).step == 1
    ran_on[0].join(timeout=30)
    assert not ran_on[0].is_alive()
    assert mgr.save_async(2, s).wait(timeout=60).step == 2
    assert started.count("objckpt-save") == 2 and ran_on[1] is not ran_on[0]
    mgr.close()
    assert Reader(store).steps() == [1, 2]
