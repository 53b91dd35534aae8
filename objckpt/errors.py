"""Exceptions raised by objckpt.

Every exception objckpt raises on purpose derives from :class:`ObjckptError` (a plain
``Exception``: never ``BaseException``, so ``except Exception`` in a training loop still sees it).
Store errors also derive from the matching built-in, so code written against fsspec-style
``FileNotFoundError`` / ``FileExistsError`` / ``PermissionError`` keeps working::

    ObjckptError
    ├── ConfigError (ValueError)             bad URI, unknown option, missing extra
    ├── StoreError                           one request against one object store failed
    │   ├── NotFoundError (FileNotFoundError)
    │   ├── AlreadyExistsError (FileExistsError)   create-if-absent lost: the object exists
    │   ├── PreconditionFailedError                compare-and-swap lost: the version moved
    │   ├── PermissionDeniedError (PermissionError)
    │   ├── NotSupportedError (NotImplementedError) the backend cannot honour this mode
    │   ├── InvalidKeyError (ValueError)          a key that could escape the store root
    │   └── TransientError                         throttling, 5xx, timeouts, resets: the ONLY
    │                                              error a retry policy retries
    ├── IntegrityError                       bytes or metadata are not what was promised
    │   ├── ChecksumMismatchError            size / CRC32C / ETag differs
    │   └── ManifestError                    manifest or pointer fails validation
    ├── CommitError                          a save did not commit; ``failures`` per rank
    │   └── CommitConflict                   another attempt already committed this step
    ├── NoCheckpointError (LookupError)      nothing committed (or nothing valid) to restore
    └── DistributedError                     ranks disagree, or a collective timed out

Messages always name the key and the bucket/root they concern, never credentials.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "AlreadyExistsError",
    "ChecksumMismatchError",
    "CommitConflict",
    "CommitError",
    "ConfigError",
    "DistributedError",
    "IntegrityError",
    "InvalidKeyError",
    "ManifestError",
    "NoCheckpointError",
    "NotFoundError",
    "NotSupportedError",
    "ObjckptError",
    "PermissionDeniedError",
    "PreconditionFailedError",
    "StoreError",
    "TransientError",
]


class ObjckptError(Exception):
    """Root of every error objckpt raises on purpose."""

    def __init__(self, message: str = "") -> None:
        # Built-ins such as OSError interpret positional args specially; keep one plain message.
        Exception.__init__(self, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ConfigError(ObjckptError, ValueError):
    """A URI, option or installation problem that no retry can fix."""


class StoreError(ObjckptError):
    """A request against an object store failed.

    Attributes:
        key: the object key relative to the store root ("" when the error is about the store).
        location: a human-readable location such as ``s3://bucket/run`` (never credentials).
        operation: what was being done (``put``, ``get``, ``head``, ``list``, ...).
    """

    def __init__(self, message: str = "", *, key: str = "", location: str = "", operation: str = "") -> None:
        self.key = key
        self.location = location
        self.operation = operation
        where = ""
        if location or key:
            joined = location.rstrip("/") + "/" + key if location else key
            where = f" [{operation + ' ' if operation else ''}{joined}]"
        super().__init__(f"{message}{where}")


class NotFoundError(StoreError, FileNotFoundError):
    """The object (or the bucket) does not exist."""


class AlreadyExistsError(StoreError, FileExistsError):
    """A create-if-absent write found the key already present; nothing was written."""


class PreconditionFailedError(StoreError):
    """A compare-and-swap write found a different version; nothing was written."""


class PermissionDeniedError(StoreError, PermissionError):
    """Credentials are missing or do not grant the request."""


class NotSupportedError(StoreError, NotImplementedError):
    """The backend cannot honour the requested mode; it never silently degrades."""


class InvalidKeyError(StoreError, ValueError):
    """A key that cannot name an object below the root (absolute, ``..``, empty segment, ...)."""


class TransientError(StoreError):
    """Throttling, server errors, timeouts and connection resets: safe to retry."""


class IntegrityError(ObjckptError):
    """Data or metadata read back is not what was written."""


class ChecksumMismatchError(IntegrityError):
    """Size, CRC32C or ETag of an object differs from its receipt."""

    def __init__(self, message: str, *, key: str = "", location: str = "") -> None:
        self.key = key
        self.location = location
        if key or location:
            message = f"{message} [{location.rstrip('/') + '/' if location else ''}{key}]"
        super().__init__(message)


class ManifestError(IntegrityError):
    """A manifest or pointer is malformed, of an unknown version, or fails its self-checksum."""

    def __init__(self, message: str, *, key: str = "") -> None:
        self.key = key
        super().__init__(message)


class CommitError(ObjckptError):
    """A save was not committed. ``failures`` maps each failing rank to its reason.

    Raised identically on every rank of a distributed save, so no rank trains on believing a
    checkpoint exists that does not.
    """

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures: dict[int, str] = dict(failures or {})
        if self.failures:
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
            message = f"{message} (failing ranks {sorted(self.failures)}: {detail})"
        super().__init__(message)


class CommitConflict(CommitError):
    """A different attempt already committed this step; this attempt was not committed."""


class NoCheckpointError(ObjckptError, LookupError):
    """No committed (and valid) checkpoint exists under the run root."""


class DistributedError(ObjckptError):
    """Ranks disagree (e.g. on the restored step) or a collective did not complete in time."""
