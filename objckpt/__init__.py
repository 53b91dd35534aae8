"""objckpt: complete, coordinated, immutable-until-committed checkpoints on object storage."""

from __future__ import annotations

from ._retry import RetryPolicy
from ._version import __version__
from .commit import Coordinator
from .errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    CommitConflict,
    CommitError,
    ConfigError,
    DistributedError,
    IntegrityError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    NotSupportedError,
    ObjckptError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from .gc import RetentionPolicy, plan_gc, run_gc
from .manifest import Manifest, ShardReceipt
from .metrics import (
    BaseMetricsCallback,
    CheckpointMetrics,
    JsonLogCallback,
    MetricsCallback,
    PrometheusExporter,
)
from .planner import suggest_interval
from .reader import Reader
from .replicate import replicate
from .store import ObjectMeta, PutMode, Store, open_store
from .writer import ShardWriter

# The torch integration is imported on first use, so `import objckpt` works without torch.
_LAZY = {
    "CheckpointManager": "objckpt.training.manager",
    "ResumableDistributedSampler": "objckpt.training.sampler",
    "ObjckptStorageWriter": "objckpt.training.dcp",
    "ObjckptStorageReader": "objckpt.training.dcp",
    "save_sharded": "objckpt.training.dcp",
    "async_save_sharded": "objckpt.training.dcp",
    "load_sharded": "objckpt.training.dcp",
    "TrainingProgress": "objckpt.training.state",
    "TrainingStateError": "objckpt.training.state",
    "hash_config": "objckpt.training.manager",
    "SaveHandle": "objckpt.training.manager",
    "SaveAbandonedError": "objckpt.training.manager",
    "StagingBudgetError": "objckpt.training.manager",
    "SerializationError": "objckpt.training.serialization",
    "UnsupportedStateError": "objckpt.training.serialization",
}


#: packages of the ``torch`` extra: a lazy name that needs a missing one says how to install it
_TORCH_EXTRA = ("torch", "numpy")


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'objckpt' has no attribute {name!r}")
    import importlib

    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _TORCH_EXTRA:
            raise
        raise ModuleNotFoundError(
            f"objckpt.{name} needs {missing}, which is not installed: pip install 'objckpt[torch]' ({exc})",
            name=exc.name,
        ) from exc
    return getattr(imported, name)


__all__ = [
    "BaseMetricsCallback",
    "CheckpointManager",
    "CheckpointMetrics",
    "Coordinator",
    "JsonLogCallback",
    "Manifest",
    "MetricsCallback",
    "ObjckptStorageReader",
    "ObjckptStorageWriter",
    "PrometheusExporter",
    "Reader",
    "ResumableDistributedSampler",
    "RetentionPolicy",
    "ShardReceipt",
    "SaveAbandonedError",
    "SaveHandle",
    "SerializationError",
    "ShardWriter",
    "StagingBudgetError",
    "TrainingProgress",
    "TrainingStateError",
    "UnsupportedStateError",
    "async_save_sharded",
    "hash_config",
    "load_sharded",
    "plan_gc",
    "replicate",
    "run_gc",
    "save_sharded",
    "suggest_interval",
    "AlreadyExistsError",
    "ChecksumMismatchError",
    "CommitConflict",
    "CommitError",
    "ConfigError",
    "DistributedError",
    "IntegrityError",
    "ManifestError",
    "NoCheckpointError",
    "NotFoundError",
    "NotSupportedError",
    "ObjckptError",
    "ObjectMeta",
    "PermissionDeniedError",
    "PreconditionFailedError",
    "PutMode",
    "RetryPolicy",
    "Store",
    "StoreError",
    "TransientError",
    "__version__",
    "open_store",
]
