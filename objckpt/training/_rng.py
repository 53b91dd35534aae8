"""Random-generator state: capture, restore and derivation for new ranks (invariant 14).

Three things, all about RNG state and nothing else of the training state:

* one generator the user put in the state (``random.Random``, ``numpy.random.Generator``,
  ``torch.Generator``): :func:`_rng_state` / :func:`_set_rng_state`;
* this process's global RNGs (Python ``random``, NumPy's legacy global state, torch CPU, every
  CUDA device): :func:`capture_global_rng`, :func:`restore_global_rng` (called LAST on restore:
  loading anything else might draw random numbers) and :func:`_check_global_rng`, the check
  :func:`.state.check_restorable` runs before anything is modified;
* the elastic rule for a rank that did not exist in the job that saved (:func:`derive_global_rng`,
  :func:`derive_rng_item`): fresh streams seeded from a digest of rank 0's saved state, the step
  and the rank, so a restore is repeatable and no two new ranks share a stream.

Separate from :mod:`.state` (which classifies, checks and applies the whole state and calls into
this module) for length; every public name here is also importable from :mod:`.state`, where
callers have always found it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import TrainingStateError

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "capture_global_rng",
    "derive_global_rng",
    "derive_rng_item",
    "restore_global_rng",
]


# ---------------------------------------------------------------------------------- one generator


def _rng_state(gen: Any) -> Any:
    if isinstance(gen, random.Random):
        return {"type": "python", "state": gen.getstate()}
    if isinstance(gen, torch.Generator):
        return {"type": "torch", "device": str(gen.device), "state": gen.get_state()}
    return {"type": "numpy", "state": gen.bit_generator.state}


def _set_rng_state(name: str, gen: Any, saved: Any) -> None:
    want = {"python": random.Random, "torch": torch.Generator}.get(saved.get("type"))
    if isinstance(gen, random.Random) and want is random.Random:
        gen.setstate(_python_state(saved["state"]))
    elif isinstance(gen, torch.Generator) and want is torch.Generator:
        gen.set_state(saved["state"])
    elif np is not None and isinstance(gen, np.random.Generator) and saved.get("type") == "numpy":
        state = saved["state"]
        if state.get("bit_generator") != type(gen.bit_generator).__name__:
            raise TrainingStateError(
                f"state[{name!r}]: checkpoint holds a {state.get('bit_generator')} generator, "
                f"the live one is {type(gen.bit_generator).__name__}"
            )
        gen.bit_generator.state = state
    else:
        raise TrainingStateError(
            f"state[{name!r}]: checkpoint holds a {saved.get('type')} generator, the live object is "
            f"a {type(gen).__qualname__}"
        )


def _python_state(state: Any) -> tuple[Any, ...]:
    # random.setstate wants (version, tuple_of_625_ints, gauss_next) with tuples, not lists
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


# ---------------------------------------------------------------------------------- global RNG


def capture_global_rng() -> dict[str, Any]:
    """This process's global RNG states: Python ``random``, NumPy legacy, torch CPU, every CUDA
    device (when CUDA is available and initialised)."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        out["numpy"] = np.random.get_state(legacy=True)
    # torch leaves torch.cuda.is_initialized unannotated.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_global_rng(state: Mapping[str, Any]) -> None:
    """Set the global RNGs captured by :func:`capture_global_rng` (call LAST when restoring).

    Raises:
        TrainingStateError: the state holds CUDA (or NumPy) RNG state this process cannot take;
            checked before any generator is set.
    """
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            raise TrainingStateError(
                f"the checkpoint holds RNG state for {len(cuda)} CUDA device(s) but CUDA is not available"
            )
        if torch.cuda.device_count() != len(cuda):
            raise TrainingStateError(
                f"the checkpoint holds RNG state for {len(cuda)} CUDA device(s), this process sees "
                f"{torch.cuda.device_count()}"
            )
    if "numpy" in state and np is None:
        raise TrainingStateError("the checkpoint holds NumPy RNG state but NumPy is not installed")
    random.setstate(_python_state(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys, int(pos), int(has_gauss), float(cached)))
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def _check_global_rng(state: Any) -> None:
    if not isinstance(state, Mapping) or "python" not in state or "torch" not in state:
        raise TrainingStateError("the checkpoint's RNG record is incomplete")
    cuda = state.get("cuda")
    if cuda and (not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda)):
        seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise TrainingStateError(
            f"the checkpoint holds RNG state for {len(cuda)} CUDA device(s), this process sees {seen}"
        )


# ---------------------------------------------------------------------------------- elastic RNG


def _seed(*parts: Any) -> int:
    h = hashlib.sha256(b"objckpt-elastic-rng")
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest()[:8], "little") & (2**63 - 1)


def derive_global_rng(saved: Mapping[str, Any], *, rank: int, step: int) -> dict[str, Any]:
    """Global RNG states for a rank that did not exist in the job that wrote ``saved`` (rank
    0's :func:`capture_global_rng` record): seeded from a digest of that record's torch state,
    the step and ``rank``, so the same restore always gives the same streams and no two new
    ranks share one. Nothing in this process is changed."""
    seed = _seed(bytes(saved["torch"].numpy()), step, rank)
    out: dict[str, Any] = {
        "python": random.Random(seed).getstate(),
        "torch": torch.Generator().manual_seed(seed).get_state(),
    }
    if np is not None:
        out["numpy"] = np.random.RandomState(seed % 2**32).get_state(legacy=True)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        out["cuda"] = [
            torch.Generator(device=f"cuda:{i}").manual_seed(seed + i).get_state()
            for i in range(torch.cuda.device_count())
        ]
    return out


def derive_rng_item(name: str, gen: Any, saved: Any, *, rank: int, step: int) -> dict[str, Any]:
    """The state for the live generator ``gen`` on a rank that did not exist in the job that
    saved ``saved`` (rank 0's state of ``state[name]``): a fresh generator of ``gen``'s kind,
    seeded from a digest of ``saved``, ``name``, the step and ``rank``.

    Raises:
        TrainingStateError: ``saved`` is not a generator state.
    """
    if not isinstance(saved, Mapping) or "state" not in saved:
        raise TrainingStateError(f"state[{name!r}]: the checkpoint holds no generator state")
    from .serialization import dumps  # the shard codec is a stable byte encoding of the state

    seed = _seed(dumps(saved["state"]), name, step, rank)
    if isinstance(gen, random.Random):
        return {"type": "python", "state": random.Random(seed).getstate()}
    if isinstance(gen, torch.Generator):
        fresh = torch.Generator(device=gen.device).manual_seed(seed)
        return {"type": "torch", "device": str(gen.device), "state": fresh.get_state()}
    return {"type": "numpy", "state": type(gen.bit_generator)(seed).state}
