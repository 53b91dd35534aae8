"""Restoring at another world size (the elastic rule), partial restores and ``strict=False``.

The manager runs on a ThreadWorld here (ranks as threads of this process, the coordination
layer's own test world), so a 2-rank save and a 3-rank restore take milliseconds; the same
scenarios with real processes, DDP and gloo are in ``test_elastic_mp.py``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

import objckpt.training.manager as manager_module
from objckpt.coordination import ThreadWorld
from objckpt.reader import Reader
from objckpt.store.memory import MemoryStore
from objckpt.training.data import ResumableDataLoader
from objckpt.training.manager import CheckpointManager
from objckpt.training.sampler import ResumableDistributedSampler
from objckpt.training.state import TrainingProgress, TrainingStateError

N = 96
BATCH = 4


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``world(n, fn)`` runs ``fn(rank, n)`` on n threads, each with a CheckpointManager comm of
    a ThreadWorld of n ranks; returns the per-rank results (raising the first error)."""
    local = threading.local()
    real = manager_module.make_comm
    # outside world(): the real one (no process group: a single process)
    monkeypatch.setattr(manager_module, "make_comm", lambda **kw: getattr(local, "comm", None) or real(**kw))

    def run(n: int, fn: Any) -> list[Any]:
        def body(comm: Any) -> Any:
            local.comm = comm
            return fn(comm.rank, comm.world_size)

        results = ThreadWorld(n, timeout=60).run(body)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    return run


def _make_template() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


_TEMPLATE = _make_template()


def _model() -> torch.nn.Module:
    # a copy, not a new init: ranks are threads sharing the global torch RNG
    import copy

    return copy.deepcopy(_TEMPLATE)


def _state(rank: int, world_size: int) -> dict[str, Any]:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sampler = ResumableDistributedSampler(N, num_replicas=world_size, rank=rank, seed=5)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "loader": ResumableDataLoader(list(range(N)), batch_size=BATCH, sampler=sampler),
        "progress": TrainingProgress(),
        "noise": np.random.default_rng(100 + rank),
        "counters": {"rank": rank},
    }


def _train(state: dict[str, Any], steps: int) -> list[int]:
    """``steps`` optimizer steps, one batch each, the same update on every rank (as DDP's
    averaged gradients would be); returns the sample ids this rank consumed."""
    seen: list[int] = []
    model, opt = state["model"], state["optimizer"]
    it = iter(state["loader"])
    for _ in range(steps):
        batch = next(it)
        seen += batch.tolist()
        g = torch.Generator().manual_seed(state["progress"].global_step)  # identical on every rank
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        state["scheduler"].step()
        state["progress"].global_step += 1
        state["progress"].samples_seen += len(batch)
        state["noise"].random()
    return seen


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    import copy

    return copy.deepcopy(
        {
            "model": state["model"].state_dict(),
            "optimizer": state["optimizer"].state_dict(),
            "scheduler": state["scheduler"].state_dict(),
            "progress": state["progress"].state_dict(),
            "loader": state["loader"].state_dict(),
            "noise": state["noise"].bit_generator.state,
            "counters": dict(state["counters"]),
        }
    )


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert _bits(a) == _bits(b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _save_two_ranks(world: Any, store: MemoryStore, steps: int) -> list[dict[str, Any]]:
    def fn(rank: int, n: int) -> dict[str, Any]:
        state = _state(rank, n)
        seen = _train(state, steps)
        with CheckpointManager(store) as mgr:
            mgr.save(steps, state)
        return {"seen": seen, **_snapshot(state)}

    return world(2, fn)


# ------------------------------------------------------------------------- the sampler alone


def _epoch(sampler: ResumableDistributedSampler) -> list[int]:
    return list(sampler)


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (2, 1), (4, 2), (1, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_repartitioned_epoch_has_no_repeats_and_no_gaps(old: int, new: int, shuffle: bool) -> None:
    n = 120  # divisible by every world size here: DistributedSampler adds no padding
    olds = [
        ResumableDistributedSampler(n, num_replicas=old, rank=r, seed=3, shuffle=shuffle) for r in range(old)
    ]
    consumed = []
    for s in olds:
        s.set_epoch(2)
        it = iter(s)
        consumed += [next(it) for _ in range(12)]
    states = [s.state_dict() for s in olds]
    rest = []
    for r in range(new):
        s = ResumableDistributedSampler(n, num_replicas=new, rank=r, seed=3, shuffle=shuffle)
        s.load_state_dict(s.reshard_state(states, num_replicas=new, rank=r))
        s.set_epoch(2)  # the training loop's usual call keeps the re-partitioned position
        assert len(s) == (n - 12 * old) // new
        rest.append(_epoch(s))
    seen = consumed + [i for part in rest for i in part]
    assert sorted(seen) == list(range(n))  # every sample of the epoch exactly once
    assert len({len(p) for p in rest}) == 1  # the ranks stay in lockstep
    # the next epoch is a normal one at the new world size
    s.set_epoch(3)
    plain = ResumableDistributedSampler(n, num_replicas=new, rank=new - 1, seed=3, shuffle=shuffle)
    plain.set_epoch(3)
    assert _epoch(s) == _epoch(plain)


def test_uneven_positions_padding_and_chained_repartitions() -> None:
    n = 50
    olds = [ResumableDistributedSampler(n, num_replicas=2, rank=r, seed=1) for r in range(2)]
    consumed = []
    for s, k in zip(olds, (7, 4), strict=True):  # rank 0 is 3 samples ahead
        it = iter(s)
        consumed += [next(it) for _ in range(k)]
    mid = []
    states3 = []
    for r in range(3):
        s = ResumableDistributedSampler(n, num_replicas=3, rank=r, seed=1)
        s.load_state_dict(s.reshard_state([o.state_dict() for o in olds], num_replicas=3, rank=r))
        it = iter(s)
        mid += [next(it) for _ in range(5)]
        states3.append(s.state_dict())
    assert len(states3[0]["resharded"]) == 1
    tails = []
    for r in range(2):  # and back to 2 ranks, within the same epoch
        s = ResumableDistributedSampler(n, num_replicas=2, rank=r, seed=1)
        s.load_state_dict(s.reshard_state(states3, num_replicas=2, rank=r))
        tails.append(_epoch(s))
    seen = consumed + mid + [i for t in tails for i in t]
    remaining = n - len(consumed) - len(mid)
    pad = -remaining % 2  # DistributedSampler's own padding, the only repeats
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) == pad


def test_drop_last_repartition_repeats_nothing() -> None:
    n = 41
    olds = [ResumableDistributedSampler(n, num_replicas=2, rank=r, seed=1, drop_last=True) for r in range(2)]
    consumed = []
    for s in olds:
        it = iter(s)
        consumed += [next(it) for _ in range(6)]
    rest = []
    for r in range(3):
        s = ResumableDistributedSampler(n, num_replicas=3, rank=r, seed=1, drop_last=True)
        s.load_state_dict(s.reshard_state([o.state_dict() for o in olds], num_replicas=3, rank=r))
        rest += _epoch(s)
    seen = consumed + rest
    assert len(seen) == len(set(seen))  # nothing repeated; at most new_world - 1 samples dropped
    assert n - len(seen) < 3


def test_states_of_different_jobs_are_not_repartitioned() -> None:
    a = ResumableDistributedSampler(10, num_replicas=2, rank=0, seed=1).state_dict()
    b = ResumableDistributedSampler(10, num_replicas=2, rank=1, seed=2).state_dict()
    s = ResumableDistributedSampler(10, num_replicas=3, rank=0, seed=1)
    with pytest.raises(TrainingStateError, match="ranks 0 and 1 differ in 'seed'"):
        s.reshard_state([a, b], num_replicas=3, rank=0)
    with pytest.raises(TrainingStateError, match="num_replicas=2 but 1 rank"):
        s.reshard_state([a], num_replicas=3, rank=0)
    with pytest.raises(TrainingStateError, match="num_replicas"):  # no mapping: still refused
        s.load_state_dict(a)


# ------------------------------------------------------------------------- the manager


@pytest.mark.parametrize("new", [1, 3])
def test_restore_at_another_world_size_follows_the_elastic_rule(world: Any, new: int) -> None:
    store = MemoryStore()
    saved = _save_two_ranks(world, store, steps=3)

    def restore(rank: int, n: int) -> dict[str, Any]:
        state = _state(rank, n)
        state["counters"]["rank"] = -1
        with CheckpointManager(store) as mgr:
            assert mgr.restore(state) == 3
            report = mgr.last_restore
        snap = _snapshot(state)
        return {"snap": snap, "rest": [i for b in state["loader"] for i in b.tolist()], "report": report}

    out = world(new, restore)
    again = world(new, restore)
    for rank, got in enumerate(out):
        snap, report = got["snap"], got["report"]
        # replicated state: bit for bit on every rank, whatever the world size
        for key in ("model", "optimizer"):
            _assert_same(saved[0][key], snap[key], f"rank {rank} {key}")
        # per-rank state: a rank that existed keeps its own, a new rank gets rank 0's
        own = saved[rank] if rank < 2 else saved[0]
        for key in ("scheduler", "progress", "counters"):
            _assert_same(own[key], snap[key], f"rank {rank} {key}")
        if rank < 2:
            assert snap["noise"] == saved[rank]["noise"]  # its own generator, exactly
        else:  # a fresh stream: deterministic, and not a copy of another rank's
            assert snap["noise"] == again[rank]["snap"]["noise"]
            assert snap["noise"] not in (saved[0]["noise"], saved[1]["noise"])
        assert report.saved_world_size == 2 and report.world_size == new and report.complete
        assert ("keeps its own" if rank < 2 else "is new") in report.per_rank
    # the rest of the epoch, split across the new ranks: no sample repeated, none skipped
    before = saved[0]["seen"] + saved[1]["seen"]
    after = [i for got in out for i in got["rest"]]
    assert sorted(before + after) == list(range(N))
    assert len({len(got["rest"]) for got in out}) == 1


def test_a_loader_that_cannot_be_repartitioned_is_refused(world: Any) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    store = MemoryStore()
    _save_two_ranks(world, store, steps=2)

    def restore(rank: int, n: int) -> str:
        state = _state(rank, n)
        state["loader"] = StatefulDataLoader(list(range(N)), batch_size=BATCH)
        with CheckpointManager(store) as mgr:
            try:
                mgr.restore(state)
            except TrainingStateError as exc:
                return str(exc)
        return "restored"

    messages = world(3, restore)
    assert all("StatefulDataLoader" in m and "step 2" in m and "state['loader']" in m for m in messages)
    assert "rank 0 of 3" in messages[0]


def test_one_process_restores_only_the_model(world: Any) -> None:
    store = MemoryStore()
    saved = _save_two_ranks(world, store, steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with CheckpointManager(store) as mgr:  # no process group: world size 1
        assert mgr.restore({"model": model}) == 2
    _assert_same(saved[0]["model"], model.state_dict())


# ------------------------------------------------------------------------- strict=False


def test_strict_false_reports_missing_and_unexpected_keys(caplog: pytest.LogCaptureFixture) -> None:
    store = MemoryStore()
    old = {"model": _model(), "progress": TrainingProgress(global_step=4)}
    with CheckpointManager(store) as mgr:
        mgr.save(4, old)
    # the same layers plus a new one, and an entry the checkpoint never had
    torch.manual_seed(1)
    grown = torch.nn.Sequential(*_make_template(), torch.nn.Linear(2, 2))
    before = {k: v.clone() for k, v in grown.state_dict().items()}
    state = {"model": grown, "ema": {"decay": 0.5}, "progress": TrainingProgress()}
    with CheckpointManager(store) as mgr:
        with pytest.raises(TrainingStateError, match=r"missing keys \['3.weight', '3.bias'\].*strict=False"):
            mgr.restore({"model": grown})
        with pytest.raises(TrainingStateError, match=r"no state for \['ema'\].*strict=False"):
            mgr.restore(state)
        assert all(torch.equal(v, before[k]) for k, v in grown.state_dict().items())  # untouched
        with caplog.at_level(logging.WARNING, logger="objckpt.training"):
            assert mgr.restore(state, strict=False) == 4
        report = mgr.last_restore
    assert report.missing_keys == {"model": ["3.weight", "3.bias"]} and report.unexpected_keys == {}
    assert report.missing_entries == ["ema"] and not report.complete
    assert "strict=False" in caplog.text and "3.weight" in caplog.text and "ema" in caplog.text
    for k, v in old["model"].state_dict().items():
        assert torch.equal(grown.state_dict()[k], v)  # the shared layers are loaded
    assert torch.equal(grown[3].weight, before["3.weight"])  # the new one is left as it was
    assert state["ema"] == {"decay": 0.5} and state["progress"].global_step == 4

    small = _model()  # and the other way round: the checkpoint has keys the model lacks
    with CheckpointManager(store) as mgr:
        mgr.save(5, {"model": torch.nn.Sequential(*_model(), torch.nn.Linear(2, 2))})
        assert mgr.restore({"model": small}, strict=False) == 5
        assert mgr.last_restore.unexpected_keys == {"model": ["3.weight", "3.bias"]}
    with CheckpointManager(store) as mgr, pytest.raises(TrainingStateError, match="shape"):
        mgr.restore({"model": torch.nn.Sequential(torch.nn.Linear(4, 9))}, strict=False)  # shapes: always


# ------------------------------------------------------------------------- shared storage


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(2000, 64)
        self.head = torch.nn.Linear(64, 2000, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter


def _replicated_tensors(store: MemoryStore, step: int) -> list[torch.Tensor]:
    from objckpt.training.serialization import decode

    m = Reader(store).load(step)
    out = []
    for s in m.shards:
        if s.name == "replicated.bin":
            out += decode(store.get(s.key))["tensors"]
    return out


@pytest.mark.parametrize("replicated", [None, ()])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_tied_weights_are_written_once_and_stay_tied(replicated: Any, asynchronous: bool) -> None:
    from objckpt.training.serialization import decode

    store = MemoryStore()
    torch.manual_seed(0)
    lm = _TiedLM()
    with CheckpointManager(store, replicated=replicated) as mgr:
        if asynchronous:
            mgr.save_async(1, {"model": lm}).wait()
        else:
            mgr.save(1, {"model": lm})
    weight_bytes = 2000 * 64 * 4
    m = Reader(store).load(1)
    if replicated is None:
        tensors = _replicated_tensors(store, 1)
        assert [tuple(t.shape) for t in tensors] == [(2000, 64)]  # one copy, not two
    else:
        tensors = decode(store.get(m.shard(0, "rank.bin").key))["tensors"]
        assert [tuple(t.shape) for t in tensors] == [(2000, 64)]
    assert sum(s.size for s in m.shards) < weight_bytes + 64 * 1024  # + structure and RNG
    fresh = _TiedLM()
    with CheckpointManager(store, replicated=replicated) as mgr:
        mgr.restore({"model": fresh})
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, lm.embed.weight)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_views_into_one_storage_keep_sharing_it(asynchronous: bool) -> None:
    store = MemoryStore()
    base = torch.arange(24, dtype=torch.float32)
    buffers = {
        "base": base,
        "slice": base[2:7],
        "matrix_t": base.view(4, 6).t(),
        "row": base.view(4, 6)[1],
        "ints": base.view(torch.int32)[:4],  # another dtype over the same bytes
        "alone": torch.ones(3),
    }
    with CheckpointManager(store, replicated=()) as mgr:
        if asynchronous:
            handle = mgr.save_async(1, {"buffers": buffers})
            base.mul_(-1)  # after save_async returns: must not reach the checkpoint
            handle.wait()
            base.mul_(-1)
        else:
            mgr.save(1, {"buffers": buffers})
    from objckpt.training.serialization import decode

    shard = decode(store.get(Reader(store).load(1).shard(0, "rank.bin").key))
    assert [t.numel() for t in shard["tensors"]] == [24, 3]  # the 24 floats once, and "alone"
    restored: dict[str, Any] = {}
    with CheckpointManager(store, replicated=()) as mgr:
        mgr.restore({"buffers": restored})
    for k, v in buffers.items():
        r = restored[k]
        assert r.shape == v.shape and r.stride() == v.stride() and _bits(r) == _bits(v), k
    ptr = restored["base"].untyped_storage().data_ptr()
    assert all(restored[k].untyped_storage().data_ptr() == ptr for k in buffers if k != "alone")
    restored["base"][8] = 100.0  # a write through one is seen through the others
    assert restored["slice"].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert restored["row"][2] == 100.0 and restored["matrix_t"][2, 1] == 100.0


def test_views_of_a_large_storage_that_would_cost_more_are_written_apart() -> None:
    from objckpt.training.replicated import split_tensors

    big = torch.zeros(1000)
    tensors: list[torch.Tensor] = []
    split_tensors({"head": big[:4], "tail": big[-4:]}, tensors)
    assert [t.numel() for t in tensors] == [4, 4]  # not the 1000 floats between them
    tensors = []
    skeleton = split_tensors({"a": big[:600], "b": big[400:]}, tensors)
    assert [t.numel() * t.element_size() for t in tensors] == [4000]  # overlapping: once
    assert type(skeleton["a"]).__name__ == "ViewRef" and type(skeleton["b"]).__name__ == "ViewRef"
