"""One rank of a 2-process CPU (gloo) DeepSpeed run (launched by tests/integrations/launch.py).

``python -m tests.integrations.deepspeed_worker ROOT OUT``: for ZeRO stage 1 (synchronous
engine) and stage 2 (``decoupled=True``): train 3 steps, ``save_checkpoint`` through
``ObjckptCheckpointEngine``, train 2 more steps; then build a fresh engine from another seed,
``load_checkpoint`` from the store into an empty scratch folder, train the same 2 steps, and
check parameters and this rank's ZeRO optimizer partition are bitwise equal. Writes
``OUT/rank<R>.json`` with what it saw.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_BUILD_OPS", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def tensors(obj, prefix=""):  # type: ignore[no-untyped-def]
    """Every tensor in a nested state, by path."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, f"{prefix}/{i}")


def main(root: str, out: str) -> None:
    torch.set_num_threads(1)
    import deepspeed

    # Skip the ShareMemComm JIT build (a C++ compile of ~54 minutes on 2 shared cores); gloo
    # collectives do not need it.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    import torch.distributed as dist

    from objckpt.integrations.deepspeed import ObjckptCheckpointEngine, load_checkpoint
    from objckpt.reader import Reader

    rank = dist.get_rank()
    report: dict = {}

    def make(stage: int, seed: int):  # type: ignore[no-untyped-def]
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        return engine

    def train(engine, steps) -> None:  # type: ignore[no-untyped-def]
        for step in steps:
            x, y = batch(step, rank)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()

    def state(engine) -> dict:  # type: ignore[no-untyped-def]
        out = {f"module{k}": v.detach().clone() for k, v in tensors(engine.module.state_dict())}
        out.update({f"optim{k}": v.detach().clone() for k, v in tensors(engine.optimizer.state_dict())})
        return out

    for stage, decoupled in ((1, False), (2, True)):
        run_root = f"{root}/zero{stage}"
        engine = make(stage, seed=1)
        ckpt = ObjckptCheckpointEngine.attach(engine, run_root, decoupled=decoupled)
        train(engine, range(3))
        saved = state(engine)
        engine.save_checkpoint(f"{out}/scratch-save-{stage}-{rank}")
        # decoupled: uploaded in the background, committed at the next optimizer step
        after_save = Reader(ckpt.store).steps()
        train(engine, range(3, 5))
        expected = state(engine)
        committed = Reader(ckpt.store).steps()
        ckpt.cleanup()
        assert after_save == ([] if decoupled else [3]) and committed == [3], (after_save, committed)
        local = sorted(os.listdir(f"{out}/scratch-save-{stage}-{rank}"))
        scratch = f"{out}/scratch-save-{stage}-{rank}"
        assert not any(f.endswith(".pt") for _, _, fs in os.walk(scratch) for f in fs), local

        fresh = make(stage, seed=2)
        ObjckptCheckpointEngine.attach(fresh, run_root)
        load_path, _ = load_checkpoint(fresh, f"{out}/scratch-load-{stage}-{rank}")
        loaded = state(fresh)
        assert loaded.keys() == saved.keys(), (sorted(loaded), sorted(saved))
        bad_load = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        train(fresh, range(3, 5))
        resumed = state(fresh)
        bad_resume = [k for k in expected if not torch.equal(expected[k], resumed[k])]
        report[f"zero{stage}"] = {
            "after_save": after_save,
            "committed": committed,
            "local": local,
            "load_path": load_path,
            "global_steps": fresh.global_steps,
            "n_tensors": len(saved),
            "bad_load": bad_load,
            "bad_resume": bad_resume,
        }
        assert not bad_load and not bad_resume, report
    with open(f"{out}/rank{rank}.json", "w") as fh:
        json.dump(report, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
