"""The torch integration: whole-training-state checkpoints (:class:`CheckpointManager`), a
resumable distributed sampler, progress counters, and the sharded DCP plug-in (:mod:`.dcp`).

Names are imported on first use, so ``import objckpt.training.dcp`` does not load the manager.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointManager": "objckpt.training.manager",
    "hash_config": "objckpt.training.manager",
    "ResumableDistributedSampler": "objckpt.training.sampler",
    "ResumableDataLoader": "objckpt.training.data",
    "RestoreReport": "objckpt.training.state",
    "TrainingProgress": "objckpt.training.state",
    "TrainingStateError": "objckpt.training.state",
    "SerializationError": "objckpt.training.serialization",
    "UnsupportedStateError": "objckpt.training.serialization",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'objckpt.training' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
