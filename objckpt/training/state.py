"""Capture and restore of the whole resumable training state (invariant 14).

A *state* is a dict of named things the user already has::

    {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler,
     "sampler": sampler, "progress": progress, "aug_rng": np_generator}

Supported values: ``nn.Module`` (DDP and ``torch.compile`` wrappers are unwrapped, so the
checkpoint's keys do not depend on the wrapper), ``torch.optim.Optimizer``, anything with
``state_dict()``/``load_state_dict()`` (LR schedulers, ``GradScaler``, samplers, torchdata's
``StatefulDataLoader``, :class:`TrainingProgress`), random generators (``random.Random``,
``numpy.random.Generator``, ``torch.Generator``) and plain ``dict`` s (restored in place).
Each rank's global RNG (Python ``random``, NumPy's legacy global state, torch CPU and every CUDA
device when available) is captured automatically.

Restoring is staged: :func:`check_restorable` validates a decoded checkpoint against the live
objects (names, tensor shapes, optimizer groups) before anything is modified, then
:func:`apply_state` loads modules, optimizers, other stateful objects, dicts, progress, and the
RNG LAST, because loading any of the others might draw random numbers.

``strict=False`` relaxes exactly two things, and reports both in a :class:`RestoreReport`:
a module's state-dict keys that only one side has (``missing_keys``: left as they are,
``unexpected_keys``: ignored), and whole entries of the state the checkpoint holds nothing for
(``missing_entries``: left untouched). Shapes, optimizer groups and generator kinds are checked
either way: a mismatch there cannot be loaded meaningfully.

Generator and global RNG state (capture, restore, and the elastic derivation for new ranks) is
in :mod:`._rng`; its public names stay importable from here.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TrainingStateError
from ._rng import (
    _check_global_rng,
    _rng_state,
    _set_rng_state,
    capture_global_rng,
    derive_global_rng,
    derive_rng_item,
    restore_global_rng,
)

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "RestoreReport",
    "TrainingProgress",
    "TrainingStateError",
    "apply_state",
    "capture_global_rng",
    "capture_item",
    "check_restorable",
    "classify",
    "derive_global_rng",
    "derive_rng_item",
    "restore_global_rng",
]

log = logging.getLogger("objckpt.training")


@dataclass
class TrainingProgress:
    """Where training is. Save it with the rest of the state; the manager records it in the
    manifest and refuses to save between optimizer steps.

    Attributes:
        epoch: current epoch (0-based).
        global_step: optimizer steps taken so far.
        samples_seen: samples consumed so far (by this rank or globally: your convention).
        accumulation_step: micro-batches accumulated since the last optimizer step; must be 0
            when saving (gradients are not saved, so a mid-accumulation checkpoint could not be
            resumed bit for bit).
        extra: any other JSON-like counters (best metric, tokens seen, ...).
    """

    epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    accumulation_step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def at_step_boundary(self) -> bool:
        return self.accumulation_step == 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "accumulation_step": self.accumulation_step,
            "extra": dict(self.extra),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        unknown = set(state) - {"epoch", "global_step", "samples_seen", "accumulation_step", "extra"}
        if unknown:
            raise TrainingStateError(f"TrainingProgress state has unknown fields {sorted(unknown)}")
        self.epoch = int(state.get("epoch", 0))
        self.global_step = int(state.get("global_step", 0))
        self.samples_seen = int(state.get("samples_seen", 0))
        self.accumulation_step = int(state.get("accumulation_step", 0))
        self.extra = dict(state.get("extra", {}))

    def summary(self) -> dict[str, Any]:
        """The JSON summary recorded in the manifest."""
        out = self.state_dict()
        out["extra"] = {
            k: v for k, v in self.extra.items() if isinstance(v, (int, float, str, bool)) or v is None
        }
        return out


@dataclass
class RestoreReport:
    """What a restore loaded, for inspection (``CheckpointManager.last_restore``).

    Attributes:
        step: the checkpoint step restored.
        saved_world_size: ranks of the job that wrote it; ``world_size``: ranks restoring it.
        missing_keys: per state entry, the keys of the live module the checkpoint lacks (left
            as they were; only with ``strict=False``).
        unexpected_keys: per state entry, the checkpoint's keys the live module lacks (ignored;
            only with ``strict=False``).
        missing_entries: state entries the checkpoint holds nothing for (left untouched; only
            with ``strict=False``).
        per_rank: how this rank's per-rank state was chosen at another world size (the elastic
            rule), ``None`` at the same world size.
    """

    step: int | None = None
    saved_world_size: int | None = None
    world_size: int | None = None
    missing_keys: dict[str, list[str]] = field(default_factory=dict)
    unexpected_keys: dict[str, list[str]] = field(default_factory=dict)
    missing_entries: list[str] = field(default_factory=list)
    per_rank: str | None = None

    @property
    def complete(self) -> bool:
        """True when every key of every entry was loaded (always so with ``strict=True``)."""
        return not (self.missing_keys or self.unexpected_keys or self.missing_entries)

    def describe(self) -> str:
        parts = [f"{n}: {len(k)} missing key(s) {_head(k)}" for n, k in self.missing_keys.items()]
        parts += [f"{n}: {len(k)} unexpected key(s) {_head(k)}" for n, k in self.unexpected_keys.items()]
        if self.missing_entries:
            parts.append(f"entries not in the checkpoint (left untouched): {self.missing_entries}")
        return "; ".join(parts) or "everything loaded"


def _head(keys: list[str], n: int = 10) -> str:
    return f"{keys[:n]}{'...' if len(keys) > n else ''}"


# ---------------------------------------------------------------------------------- kinds

MODULE, OPTIMIZER, STATEFUL, RNG, DICT = "module", "optimizer", "stateful", "rng", "dict"
#: the order in which kinds are applied on restore: RNG last
_APPLY_ORDER = (MODULE, OPTIMIZER, STATEFUL, DICT, RNG)


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` keys are wrapper-independent (DDP, DP, torch.compile)."""
    while True:
        inner = getattr(module, "module", None)
        if isinstance(inner, torch.nn.Module) and type(module).__name__ in (
            "DistributedDataParallel",
            "DataParallel",
        ):
            module = inner
            continue
        orig = getattr(module, "_orig_mod", None)
        if isinstance(orig, torch.nn.Module):
            module = orig
            continue
        return module


def classify(name: str, obj: Any) -> str:
    """What kind of state ``obj`` is (``module``, ``optimizer``, ``rng``, ``stateful``, ``dict``).

    Raises:
        TrainingStateError: ``obj`` cannot be restored in place (e.g. a bare float).
    """
    if isinstance(obj, torch.nn.Module):
        return MODULE
    if isinstance(obj, torch.optim.Optimizer):
        return OPTIMIZER
    if isinstance(obj, (random.Random, torch.Generator)) or (
        np is not None and isinstance(obj, np.random.Generator)
    ):
        return RNG
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return STATEFUL
    if isinstance(obj, dict):
        return DICT
    raise TrainingStateError(
        f"state[{name!r}] is a {type(obj).__qualname__}, which cannot be restored in place: pass "
        "objects with state_dict()/load_state_dict(), random generators, or a dict (e.g. keep "
        "counters in TrainingProgress.extra)"
    )


def capture_item(name: str, obj: Any, kind: str | None = None) -> Any:
    """The serializable state of one item (references to live tensors, not copies)."""
    kind = kind or classify(name, obj)
    if kind == MODULE:
        return unwrap_module(obj).state_dict()
    if kind == RNG:
        return _rng_state(obj)
    if kind == DICT:
        return dict(obj)
    return obj.state_dict()


# ---------------------------------------------------------------------------------- staging


def check_restorable(
    state: Mapping[str, Any], saved: Mapping[str, Any], *, rng: Any = None, strict: bool = True
) -> RestoreReport:
    """Validate a decoded checkpoint against the live objects without modifying anything.

    Returns what would not be loaded (empty with ``strict=True``, which raises instead).

    Raises:
        TrainingStateError: a name is missing from the checkpoint (``strict=True``), a module's
            keys differ (``strict=True``), a tensor has the wrong shape (the message names the
            tensor), an optimizer has a different number of parameter groups or parameters, or a
            generator is of another kind.
    """
    report = RestoreReport()
    missing = [n for n in state if n not in saved]
    if missing and strict:
        raise TrainingStateError(
            f"the checkpoint has no state for {sorted(missing)} (it holds {sorted(saved)}); "
            "restore(..., strict=False) leaves such entries untouched"
        )
    report.missing_entries = missing
    for name, obj in state.items():
        if name not in saved:
            continue
        kind = classify(name, obj)
        value = saved[name]
        if kind == MODULE:
            _check_module(name, unwrap_module(obj), value, strict=strict, report=report)
        elif kind == OPTIMIZER:
            _check_optimizer(name, obj, value)
        elif kind == RNG:
            if not isinstance(value, Mapping) or "type" not in value or "state" not in value:
                raise TrainingStateError(f"state[{name!r}]: the checkpoint holds no generator state")
        elif kind == DICT and not isinstance(value, Mapping):
            raise TrainingStateError(
                f"state[{name!r}]: the checkpoint holds a {type(value).__name__}, not a dict"
            )
    if rng is not None:
        _check_global_rng(rng)
    return report


def _check_module(
    name: str,
    module: torch.nn.Module,
    saved: Any,
    *,
    strict: bool = True,
    report: RestoreReport | None = None,
) -> None:
    if not isinstance(saved, Mapping):
        raise TrainingStateError(
            f"state[{name!r}]: the checkpoint holds a {type(saved).__name__}, not a state dict"
        )
    live = module.state_dict()
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if (missing or unexpected) and strict:
        raise TrainingStateError(
            f"state[{name!r}] does not match the checkpoint: missing keys {_head(missing)}, unexpected "
            f"keys {_head(unexpected)} (restore(..., strict=False) loads the keys both have)"
        )
    if report is not None:
        if missing:
            report.missing_keys[name] = missing
        if unexpected:
            report.unexpected_keys[name] = unexpected
    for key, tensor in live.items():
        if key not in saved:
            continue
        value = saved[key]
        if isinstance(tensor, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise TrainingStateError(
                    f"state[{name!r}]: tensor {key!r} is a {type(value).__name__} in the checkpoint"
                )
            if tuple(value.shape) != tuple(tensor.shape):
                raise TrainingStateError(
                    f"state[{name!r}]: tensor {key!r} has shape {tuple(value.shape)} in the checkpoint "
                    f"but {tuple(tensor.shape)} in the model"
                )


def _check_optimizer(name: str, opt: torch.optim.Optimizer, saved: Any) -> None:
    if not isinstance(saved, Mapping) or "param_groups" not in saved or "state" not in saved:
        raise TrainingStateError(f"state[{name!r}]: the checkpoint holds no optimizer state dict")
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise TrainingStateError(
            f"state[{name!r}]: the checkpoint has {len(groups)} parameter group(s), the optimizer "
            f"{len(opt.param_groups)}"
        )
    for i, (g, live) in enumerate(zip(groups, opt.param_groups, strict=True)):
        if len(g["params"]) != len(live["params"]):
            raise TrainingStateError(
                f"state[{name!r}]: parameter group {i} has {len(g['params'])} parameter(s) in the "
                f"checkpoint, {len(live['params'])} in the optimizer"
            )
    # Per-parameter state whose leading tensors are parameter-shaped (Adam's exp_avg, SGD's
    # momentum_buffer) must match the parameter: load_state_dict would accept a mismatch and the
    # next step would fail far from the cause.
    ids = [pid for g in groups for pid in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    by_id = dict(zip(ids, params, strict=False))
    for pid, pstate in saved["state"].items():
        param = by_id.get(pid)
        if param is None or not isinstance(pstate, Mapping):
            continue
        for sk, sv in pstate.items():
            if (
                isinstance(sv, torch.Tensor)
                and sk
                in (
                    "exp_avg",
                    "exp_avg_sq",
                    "max_exp_avg_sq",
                    "momentum_buffer",
                    "square_avg",
                    "acc_delta",
                    "sum",
                    "ax",
                    "exp_inf",
                )
                and tuple(sv.shape) != tuple(param.shape)
            ):
                raise TrainingStateError(
                    f"state[{name!r}]: optimizer state {sk!r} of parameter {pid} has shape "
                    f"{tuple(sv.shape)} in the checkpoint but the parameter is {tuple(param.shape)}"
                )


def apply_state(
    state: Mapping[str, Any], saved: Mapping[str, Any], *, rng: Any = None, strict: bool = True
) -> None:
    """Load ``saved`` into the live objects of ``state``; the global RNG (``rng``) last.

    Call :func:`check_restorable` first (with the same ``strict``): this function assumes the
    checkpoint fits. With ``strict=False`` entries ``saved`` lacks are skipped and modules are
    loaded with ``load_state_dict(strict=False)``.

    Raises:
        TrainingStateError or the object's own error from ``load_state_dict``; objects loaded
        before the failure stay loaded (which is why everything checkable is checked first).
    """
    kinds = {name: classify(name, obj) for name, obj in state.items()}
    for kind in _APPLY_ORDER:
        for name, obj in state.items():
            if kinds[name] != kind or name not in saved:
                continue
            value = saved[name]
            if kind == MODULE:
                unwrap_module(obj).load_state_dict(value, strict=strict)
            elif kind == RNG:
                _set_rng_state(name, obj, value)
            elif kind == DICT:
                obj.clear()
                obj.update(value)
            else:
                obj.load_state_dict(value)
    if rng is not None:
        restore_global_rng(rng)  # last of all: nothing after this may draw random numbers


def progress_of(state: Mapping[str, Any]) -> TrainingProgress | None:
    """The :class:`TrainingProgress` in ``state``, if any (the first one found)."""
    for obj in state.values():
        if isinstance(obj, TrainingProgress):
            return obj
    return None


def check_step_boundary(state: Mapping[str, Any]) -> None:
    """Raise :class:`TrainingStateError` unless every progress counter is at an optimizer-step
    boundary (accumulation position 0)."""
    for name, obj in state.items():
        if isinstance(obj, TrainingProgress) and not obj.at_step_boundary:
            raise TrainingStateError(
                f"cannot save in the middle of gradient accumulation: state[{name!r}]."
                f"accumulation_step is {obj.accumulation_step} (must be 0). Save right after "
                "optimizer.step(): gradients are not checkpointed, so a mid-accumulation "
                "checkpoint could not be resumed exactly"
            )
