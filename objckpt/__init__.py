"""objckpt: complete, coordinated, immutable-until-committed checkpoints on object storage."""

from __future__ import annotations

from ._retry import RetryPolicy
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
from .store import ObjectMeta, PutMode, Store, open_store

__version__ = "0.1.0"

__all__ = [
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
