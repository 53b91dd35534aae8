"""DCP StorageWriter/StorageReader on objckpt (objckpt/training/dcp.py).

Fast single-process tests run DCP with no process group (DCP's own no-dist path, which still goes
through plan -> write -> finish). The slow test runs FSDP2 on a CPU gloo mesh in subprocesses:
save at world size 4, load at 2, save, load at 4, comparing full state dicts bit for bit.
"""

from __future__ import annotations

import io
import pickle
import socket
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType  # noqa: E402

from objckpt import layout  # noqa: E402
from objckpt._retry import RetryPolicy  # noqa: E402
from objckpt.commit import Coordinator  # noqa: E402
from objckpt.errors import (  # noqa: E402
    CommitConflict,
    CommitError,
    DistributedError,
    LoadRefusedError,
    NoCheckpointError,
    PermissionDeniedError,
)
from objckpt.reader import Reader  # noqa: E402
from objckpt.store.memory import MemoryStore  # noqa: E402
from objckpt.store.wrappers import CountingStore, Fault, FaultInjectingStore  # noqa: E402
from objckpt.training.dcp import (  # noqa: E402
    METADATA_SHARD,
    ObjckptStorageReader,
    ObjckptStorageWriter,
    _ResolvedCheckpoint,
    async_save_sharded,
    load_sharded,
    save_sharded,
)
from objckpt.writer import ShardWriter  # noqa: E402

FAST_RETRY = RetryPolicy(deadline=10.0, max_attempts=3, initial_backoff=0.0001, max_backoff=0.001)


def fail_data_upload() -> Fault:
    """A permanent error on every upload of a rank's data shard, whatever the attempt id."""
    return Fault(op="put", key="data/*/dcp-00000.bin", error=PermissionDeniedError, times=None)


pytestmark = pytest.mark.usefixtures("quiet_dcp")


def mem() -> MemoryStore:
    return MemoryStore("dcp", retry=FAST_RETRY)


def sample_state(seed: int = 0) -> dict[str, Any]:
    """Tensors of several dtypes and layouts, nested dicts, and non-tensor (bytes) items."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(6, 5, generator=g),
            "b": torch.arange(7, dtype=torch.int64) + seed,
            "half": torch.randn(4, generator=g).bfloat16(),
            "mask": torch.rand(3, 3, generator=g) > 0.5,
            "transposed": torch.randn(3, 4, generator=g).t(),  # not contiguous
            "empty": torch.empty(0, 3),
            "scalar_tensor": torch.tensor(seed + 0.5),
        },
        "extra": {"epoch": 3 + seed, "names": ["a", "b"], "lr": 0.1 * (seed + 1)},
    }


def zeros_like_state(sd: Any) -> Any:
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd.contiguous())
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    return None


def assert_state_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} vs {sorted(b)}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def snapshot(store: MemoryStore) -> dict[str, bytes]:
    return {m.key: store.get(m.key) for m in store.list("")}


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_round_trip(kind: str, tmp_path: Path) -> None:
    store_or_uri: Any = mem() if kind == "memory" else f"file://{tmp_path}/run"
    sd = sample_state(0)
    dcp.save(sd, storage_writer=ObjckptStorageWriter(store_or_uri, step=7))
    out = zeros_like_state(sd)
    reader = ObjckptStorageReader(store_or_uri)
    dcp.load(out, storage_reader=reader)
    assert reader.step == 7
    assert_state_equal(sd, out)

    # The convenience functions, and the pointer moving forward to the newer step.
    sd2 = sample_state(1)
    assert save_sharded(sd2, store_or_uri, 8) == 8
    out2 = zeros_like_state(sd2)
    assert load_sharded(out2, store_or_uri) == 8
    assert_state_equal(sd2, out2)
    out1 = zeros_like_state(sd)
    assert load_sharded(out1, store_or_uri, step=7) == 7
    assert_state_equal(sd, out1)


def test_layout_manifest_and_metadata_are_json() -> None:
    store = mem()
    save_sharded(sample_state(), store, 3, progress={"global_step": 3}, run={"config_hash": "abc"})
    m = Reader(store).latest()
    assert m is not None and m.step == 3 and m.progress == {"global_step": 3}
    assert m.metadata["dcp"]["metadata_shard"] == {"rank": 0, "name": METADATA_SHARD}
    # Every shard lies under this attempt's prefix; the metadata is plain JSON, never a pickle.
    assert {s.name for s in m.shards} == {"dcp-00000.bin", METADATA_SHARD}
    assert all(layout.parse_shard_key(s.key)[:2] == (m.step, m.attempt) for s in m.shards)
    raw = Reader(store).read_shard(m.shard(0, METADATA_SHARD))
    assert raw.startswith(b"{")


def test_load_resolution_never_lists_data_prefix() -> None:
    inner = mem()
    for step in (1, 2, 3):
        save_sharded(sample_state(step), inner, step)
    counting = CountingStore(inner, close_inner=False)
    out = zeros_like_state(sample_state())
    assert load_sharded(out, counting) == 3
    listed = [key for op, key in counting.calls if op in ("list_page", "list_prefixes")]
    assert listed and all(p.startswith(("manifests/", "timelines/")) for p in listed), listed
    assert_state_equal(sample_state(3), out)


# ------------------------------------------------------------------------- failure & atomicity


def test_failed_save_raises_commit_error_and_keeps_previous_checkpoint() -> None:
    inner = mem()
    good = sample_state(0)
    save_sharded(good, inner, 10)
    before = snapshot(inner)

    # A permanent error on this attempt's shard upload (any attempt prefix: the id is random).
    faulty = FaultInjectingStore(inner, [fail_data_upload()], close_inner=False)
    for step in (10, 20):  # the same step as the committed one, and a new one
        with pytest.raises(CommitError) as info:
            save_sharded(sample_state(1), faulty, step)
        assert isinstance(info.value, Exception)  # never DCP's BaseException
        assert not isinstance(info.value, CommitConflict)
        assert 0 in info.value.failures and "PermissionDeniedError" in info.value.failures[0]
        assert isinstance(info.value.__cause__, CheckpointException)
    assert faulty.injected, "the fault never fired"

    # No manifest was written and every object of the committed checkpoint is byte-identical.
    after = snapshot(inner)
    assert {k for k in after if k.startswith("manifests/") or k == "LATEST"} == {
        "manifests/00000000000000000010.json",
        "LATEST",
    }
    assert {k: v for k, v in after.items() if k in before} == before
    out = zeros_like_state(good)
    assert load_sharded(out, inner) == 10
    assert_state_equal(good, out)


def test_second_commit_of_a_step_is_a_conflict() -> None:
    store = mem()
    good = sample_state(0)
    save_sharded(good, store, 5)
    before = snapshot(store)
    with pytest.raises(CommitConflict):
        save_sharded(sample_state(1), store, 5)
    after = snapshot(store)
    assert {k: v for k, v in after.items() if k in before} == before
    out = zeros_like_state(good)
    assert load_sharded(out, store, step=5) == 5
    assert_state_equal(good, out)


def test_plain_dcp_save_reports_checkpoint_exception_without_committing() -> None:
    # Documented behaviour of dcp.save itself (save_sharded converts it): no manifest either way.
    inner = mem()
    faulty = FaultInjectingStore(inner, [fail_data_upload()])
    with pytest.raises(CheckpointException):
        dcp.save(sample_state(), storage_writer=ObjckptStorageWriter(faulty, step=1))
    assert not list(inner.list("manifests/"))


def test_corrupt_data_falls_back_to_parent_loudly() -> None:
    store = mem()
    old, new = sample_state(0), sample_state(1)
    save_sharded(old, store, 1)
    save_sharded(new, store, 2)
    m2 = Reader(store).latest()
    shard = m2.shard(0, "dcp-00000.bin")
    raw = bytearray(store.get(shard.key))
    raw[-1] ^= 0xFF  # same size, so the HEAD check passes; the item CRC32C must catch it
    store.corrupt(shard.key, bytes(raw))

    out = zeros_like_state(old)
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert load_sharded(out, store) == 1
    assert_state_equal(old, out)
    # An explicit step never falls back: it is refused, naming the damage (the one restore
    # protocol raises NoCheckpointError for a damaged explicit step on every path).
    with pytest.raises(NoCheckpointError, match="step 2 is damaged.*CRC32C"):
        load_sharded(zeros_like_state(old), store, step=2)


def test_missing_step_and_empty_root() -> None:
    store = mem()
    with pytest.raises(NoCheckpointError):
        load_sharded(zeros_like_state(sample_state()), store)
    save_sharded(sample_state(), store, 1)
    with pytest.raises(NoCheckpointError):
        load_sharded(zeros_like_state(sample_state()), store, step=99)


# ------------------------------------------------------------------------------ no pickle


_EXECUTED: list[str] = []


def _pwned(tag: str) -> str:  # what a hostile pickle would run
    _EXECUTED.append(tag)
    return tag


class _Evil:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __reduce__(self) -> tuple[Any, ...]:
        return (_pwned, (self.tag,))


def _commit_hostile_metadata(store: MemoryStore, step: int) -> None:
    """Commit, through the real protocol (valid receipts and CRCs), a DCP checkpoint whose
    metadata shard is a pickle that runs code when unpickled."""
    attempt = layout.new_attempt_id()
    w = ShardWriter(store, step=step, attempt=attempt, rank=0)
    w.write("dcp-00000.bin", b"")
    w.write(METADATA_SHARD, pickle.dumps(_Evil("metadata")))
    Coordinator(store, world_size=1).commit(
        step,
        attempt,
        {0: w.receipts},
        metadata={"dcp": {"format_version": 1, "metadata_shard": {"rank": 0, "name": METADATA_SHARD}}},
    )


def test_pickled_metadata_is_never_executed() -> None:
    _EXECUTED.clear()
    store = mem()
    good = sample_state(0)
    save_sharded(good, store, 1)
    _commit_hostile_metadata(store, 2)

    with pytest.raises(NoCheckpointError, match="not JSON"):
        load_sharded(zeros_like_state(good), store, step=2)
    out = zeros_like_state(good)
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert load_sharded(out, store) == 1  # latest is hostile: fall back to its parent
    assert_state_equal(good, out)
    assert _EXECUTED == []


class _HostilePlanner(DefaultSavePlanner):
    """Writes a code-running pickle in place of one bytes item (the writer checksums it)."""

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO and write_item.index.fqn == "extra.epoch":
            payload = io.BytesIO()
            torch.save(_Evil("bytes-item"), payload)  # what DCP's planner itself would produce
            payload.seek(0)
            return payload
        return super().resolve_data(write_item)


def test_a_bytes_item_the_load_policy_refuses_is_refused_at_save_time() -> None:
    _EXECUTED.clear()
    store = mem()
    save_sharded(sample_state(0), store, 1)
    with pytest.raises(CommitError, match="LoadRefusedError.*extra.epoch.*add_safe_globals"):
        save_sharded(sample_state(1), store, 2, planner=_HostilePlanner())
    assert [m.step for m in Reader(store).candidates()] == [1]  # nothing committed
    assert _EXECUTED == []


def test_train_state_holding_a_bytesio_is_refused_before_commit() -> None:
    # PyTorch's own DCP end-to-end pattern: a train state with an io.BytesIO, which DCP pickles
    # into a bytes item that weights_only loading can never rebuild.
    store = mem()
    state = sample_state(0)
    state["extra"]["buffer"] = io.BytesIO(b"not a tensor")
    with pytest.raises(CommitError, match="extra.buffer.*add_safe_globals"):
        save_sharded(state, store, 1)
    assert Reader(store).latest() is None


def test_a_committed_bytes_item_the_policy_refuses_is_an_error_not_damage(monkeypatch) -> None:
    """Invariant 11b: a policy refusal at load never falls back to an older checkpoint."""
    import objckpt.training.dcp._shard_stream as dcp_shard_stream

    _EXECUTED.clear()
    store = mem()
    good = sample_state(0)
    save_sharded(good, store, 1)
    # Commit the hostile pickle anyway (an older objckpt, or another writer, could have).
    monkeypatch.setattr(dcp_shard_stream, "_check_loadable", lambda view, fqn: None)
    save_sharded(sample_state(1), store, 2, planner=_HostilePlanner())
    monkeypatch.undo()

    with pytest.raises(LoadRefusedError, match="weights_only.*add_safe_globals"):
        load_sharded(zeros_like_state(good), store, step=2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(LoadRefusedError):
            load_sharded(zeros_like_state(good), store)
    assert not [w for w in seen if "fell back" in str(w.message)]  # no fallback to step 1
    assert _EXECUTED == []


# ------------------------------------------------------------------------------ async & misc


def test_dcp_async_save_commits() -> None:
    store = mem()
    sd = sample_state(0)
    fut = dcp.async_save(sd, storage_writer=ObjckptStorageWriter(store, step=4))
    fut = getattr(fut, "upload_completion", fut)
    fut.result(timeout=120)
    assert Reader(store).latest().step == 4
    out = zeros_like_state(sd)
    assert load_sharded(out, store) == 4
    assert_state_equal(sd, out)

    sd2 = sample_state(1)
    assert async_save_sharded(sd2, store, 6).result(timeout=120) == 6
    out2 = zeros_like_state(sd2)
    assert load_sharded(out2, store) == 6
    assert_state_equal(sd2, out2)


def test_async_save_failure_is_commit_error() -> None:
    faulty = FaultInjectingStore(mem(), [fail_data_upload()])
    fut = async_save_sharded(sample_state(), faulty, 1)
    with pytest.raises(CommitError):
        fut.result(timeout=120)


def test_reused_writer_uses_a_fresh_attempt_per_save() -> None:
    store = mem()
    writer = ObjckptStorageWriter(store, step=1)
    dcp.save(sample_state(0), storage_writer=writer)
    first = writer.attempt
    dcp.save(sample_state(1), storage_writer=writer, checkpoint_id=2)  # reset(step=2)
    assert writer.attempt != first
    assert [m.step for m in Reader(store).candidates()] == [2, 1]


def test_plan_caching_is_refused() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    store = mem()
    try:
        save_sharded(sample_state(0), store, 1, planner=DefaultSavePlanner(enable_plan_caching=True))
        # The second save would replay the first plan (and its attempt id): refused, not committed.
        with pytest.raises(CommitError, match="stale DCP save plan"):
            save_sharded(sample_state(0), store, 2, planner=DefaultSavePlanner(enable_plan_caching=True))
    finally:
        for cache in (
            "_cached_save_plan",
            "_cached_all_plans",
            "_cached_global_plan",
            "_cached_metadata",
            "_cached_final_save_plan",
        ):
            getattr(SavePlanner, cache, {}).clear()
    assert [m.step for m in Reader(store).candidates()] == [1]


def test_ranks_must_resolve_the_same_checkpoint() -> None:
    store = mem()
    save_sharded(sample_state(), store, 1)
    reader = ObjckptStorageReader(store)
    reader.read_metadata()
    same = _ResolvedCheckpoint(reader.manifest.step, reader.manifest.attempt)
    other = _ResolvedCheckpoint(0, "0" * 16)
    assert reader.prepare_global_plan([LoadPlan([], same), LoadPlan([], same)])
    with pytest.raises(DistributedError, match="rank 1: step 0"):
        reader.prepare_global_plan([LoadPlan([], same), LoadPlan([], other)])


# ------------------------------------------------------------------- FSDP2, multi-process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Odd sizes so FSDP's row sharding is uneven at both world sizes.
        self.layers = torch.nn.ModuleList([torch.nn.Linear(13, 11), torch.nn.Linear(11, 7)])

    def forward(self, x: Any) -> Any:
        return self.layers[1](torch.relu(self.layers[0](x)))


def _fsdp_worker(
    rank: int, world: int, port: int, root: str, out: str, load_step: int | None, save_step: int | None
) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        try:
            # Loading phases start from different weights, so equality proves the load.
            torch.manual_seed(0 if load_step is None else 1000 + world)
            model = _Net()
            mesh = init_device_mesh("cpu", (world,))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optim = torch.optim.AdamW(model.parameters(), lr=0.05)
            if load_step is None:
                torch.manual_seed(1)
                model(torch.randn(5, 13)).pow(2).sum().backward()  # one step: optimizer state
                optim.step()
                optim.zero_grad()
            else:
                msd, osd = get_state_dict(model, optim)
                state = {"model": msd, "optim": osd}
                step = load_sharded(state, root, None if load_step == -1 else load_step)
                set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
                Path(out, f"loaded-{rank}").write_text(str(step))
            if save_step is not None:
                msd, osd = get_state_dict(model, optim)
                save_sharded({"model": msd, "optim": osd}, root, save_step)
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            fm = get_model_state_dict(model, options=full)
            fo = get_optimizer_state_dict(model, optim, options=full)
            if rank == 0:
                torch.save({"model": fm, "optim": fo}, Path(out, "full.pt"))
            dist.barrier()
        finally:
            dist.destroy_process_group()
    except BaseException:
        Path(out, f"error-{rank}").write_text(traceback.format_exc())
        raise


def _run_world(world: int, root: str, out: Path, *, load_step: int | None, save_step: int | None) -> dict:
    import multiprocessing

    out.mkdir()
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_fsdp_worker, args=(r, world, port, root, str(out), load_step, save_step))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=240)  # a bound on a hang, not a performance assertion
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = {f.name: f.read_text() for f in out.glob("error-*")}
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    if load_step is not None:
        loaded = {Path(out, f"loaded-{r}").read_text() for r in range(world)}
        assert len(loaded) == 1, loaded
    return torch.load(out / "full.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp2_reshard_4_to_2_to_4(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    reference = _run_world(4, root, tmp_path / "w4", load_step=None, save_step=100)
    at2 = _run_world(2, root, tmp_path / "w2", load_step=100, save_step=200)
    assert (tmp_path / "w2" / "loaded-0").read_text() == "100"
    assert_state_equal(reference, at2)
    back = _run_world(4, root, tmp_path / "w4b", load_step=-1, save_step=None)  # latest: 200
    assert (tmp_path / "w4b" / "loaded-0").read_text() == "200"
    assert_state_equal(reference, back)
    m = Reader(__import__("objckpt").open_store(root)).latest()
    assert m.step == 200 and m.world_size == 2 and m.parent == 100
