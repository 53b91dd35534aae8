"""Every exception objckpt raises, the one rule for what counts as damage, and the wire codec
that lets every rank of a job raise the same error.

Every exception objckpt raises on purpose derives from :class:`ObjckptError` (a plain
``Exception``: never ``BaseException``, so ``except Exception`` in a training loop still sees it).
Store errors also derive from the matching built-in, so code written against fsspec-style
``FileNotFoundError`` / ``FileExistsError`` / ``PermissionError`` keeps working::

    ObjckptError
    ├── ConfigError (ValueError)                 bad URI, unknown option, missing extra
    ├── StoreError                               one request against one object store failed
    │   ├── NotFoundError (FileNotFoundError)    the object does not exist
    │   │   └── BucketNotFoundError              the bucket / root itself does not exist
    │   ├── AlreadyExistsError (FileExistsError) create-if-absent lost: the object exists
    │   ├── PreconditionFailedError              compare-and-swap lost: the version moved
    │   ├── PermissionDeniedError (PermissionError)
    │   ├── NotSupportedError (NotImplementedError)  the backend cannot honour this mode
    │   ├── InvalidKeyError (ValueError)         a key that could escape the store root
    │   └── TransientError                       throttling, 5xx, timeouts, resets: the ONLY
    │                                            error a retry policy retries
    ├── IntegrityError                           DAMAGE: the bytes are not what was committed
    │   ├── ChecksumMismatchError                size / CRC32C / ETag differs
    │   ├── ManifestError                        manifest or pointer fails validation
    │   └── SerializationError                   a shard's container is malformed or hostile
    ├── LoadRefusedError                         intact bytes that the load policy refuses
    │                                            (e.g. a pickle torch.load(weights_only) rejects)
    ├── CommitError                              a save did not commit; ``failures`` per rank
    │   ├── CommitConflict                       another attempt already committed this step
    │   └── SaveAbandonedError                   the save was abandoned before its commit
    ├── NoCheckpointError (LookupError)          nothing committed (or nothing valid) to restore
    ├── DistributedError                         ranks disagree, or a collective timed out
    ├── TrainingStateError (ValueError)          state that cannot be saved or restored as asked
    │   └── StagingBudgetError                   async staging needs more than the budget
    └── UnsupportedStateError (TypeError)        a value the pickle-free format cannot hold

Messages always name the key and the bucket/root they concern, never credentials.

**Damage** (invariant 11b of docs/PROTOCOL.md) is decided by :func:`is_damage` alone: only what
the bytes say (integrity failures, missing or malformed objects). Outages that outlast the retry
budget, permission and configuration errors, and policy refusals are errors that propagate; they
never make a reader fall back to an older checkpoint, which would silently lose work.

**Across ranks** an error travels as JSON (:func:`encode_error` / :func:`decode_error`): every
subclass of :class:`ObjckptError` is registered by being defined, so a new error class needs no
allow-list entry anywhere; nothing is imported or evaluated when decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

__all__ = [
    "AlreadyExistsError",
    "BucketNotFoundError",
    "ChecksumMismatchError",
    "CommitConflict",
    "CommitError",
    "ConfigError",
    "DistributedError",
    "IntegrityError",
    "InvalidKeyError",
    "LoadRefusedError",
    "ManifestError",
    "NoCheckpointError",
    "NotFoundError",
    "NotSupportedError",
    "ObjckptError",
    "PermissionDeniedError",
    "PreconditionFailedError",
    "SaveAbandonedError",
    "SerializationError",
    "StagingBudgetError",
    "StoreError",
    "TrainingStateError",
    "TransientError",
    "UnsupportedStateError",
    "decode_error",
    "describe",
    "encode_error",
    "is_damage",
    "with_rank",
]

#: every ObjckptError subclass, by ``module.qualname`` and by bare name (the wire codec's table)
_REGISTRY: dict[str, type[ObjckptError]] = {}


class ObjckptError(Exception):
    """Root of every error objckpt raises on purpose."""

    #: attributes that travel with the error across ranks (JSON values); subclasses extend it
    wire_fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Registration by definition: the wire codec knows every subclass without a list.
        _REGISTRY[f"{cls.__module__}.{cls.__qualname__}"] = cls
        _REGISTRY.setdefault(cls.__name__, cls)

    def __init__(self, message: str = "") -> None:
        # Built-ins such as OSError interpret positional args specially; keep one plain message.
        Exception.__init__(self, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def _set_message(self, message: str) -> None:
        self.message = message
        self.args = (message,)


_REGISTRY["objckpt.errors.ObjckptError"] = ObjckptError
_REGISTRY["ObjckptError"] = ObjckptError


class ConfigError(ObjckptError, ValueError):
    """A URI, option or installation problem that no retry can fix."""


class StoreError(ObjckptError):
    """A request against an object store failed.

    Attributes:
        key: the object key relative to the store root ("" when the error is about the store).
        location: a human-readable location such as ``s3://bucket/run`` (never credentials).
        operation: what was being done (``put``, ``get``, ``head``, ``list``, ...).
    """

    wire_fields = ("key", "location", "operation")

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
    """The object does not exist."""


class BucketNotFoundError(NotFoundError):
    """The bucket (or the root directory) itself does not exist: a configuration problem, never
    evidence that a checkpoint is damaged."""


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
    """Data or metadata read back is not what was written: the checkpoint is damaged."""


class ChecksumMismatchError(IntegrityError):
    """Size, CRC32C or ETag of an object differs from its receipt (or a server rejected a body
    whose checksum did not match the one sent with it)."""

    wire_fields = ("key", "location")

    def __init__(self, message: str, *, key: str = "", location: str = "") -> None:
        self.key = key
        self.location = location
        if key or location:
            message = f"{message} [{location.rstrip('/') + '/' if location else ''}{key}]"
        super().__init__(message)


class ManifestError(IntegrityError):
    """A manifest or pointer is malformed, of an unknown version, or fails its self-checksum."""

    wire_fields = ("key",)

    def __init__(self, message: str, *, key: str = "") -> None:
        self.key = key
        super().__init__(message)


class SerializationError(IntegrityError):
    """A shard's bytes are not a valid objckpt state container (truncated, malformed, hostile)."""


class LoadRefusedError(ObjckptError):
    """The committed bytes are intact (their checksums match) but the load policy refuses them,
    e.g. a pickled bytes item that ``torch.load(weights_only=True)`` will not rebuild. Not damage:
    falling back would restore older state although nothing is broken. Allow the class
    (``torch.serialization.add_safe_globals``) or restore with a policy that permits it."""


class CommitError(ObjckptError):
    """A save was not committed. ``failures`` maps each failing rank to its reason.

    Raised identically on every rank of a distributed save, so no rank trains on believing a
    checkpoint exists that does not.
    """

    wire_fields = ("failures",)

    def __init__(self, message: str, failures: Mapping[int, str] | None = None) -> None:
        self.failures: dict[int, str] = dict(failures or {})
        if self.failures:
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(self.failures.items()))
            message = f"{message} (failing ranks {sorted(self.failures)}: {detail})"
        super().__init__(message)

    def _after_wire(self) -> None:
        # JSON object keys are strings; ranks are ints
        self.failures = {int(k): str(v) for k, v in dict(getattr(self, "failures", None) or {}).items()}


class CommitConflict(CommitError):
    """A different attempt already committed this step; this attempt was not committed."""


class SaveAbandonedError(CommitError):
    """The save was abandoned (``close(abandon=True)`` or ``SaveHandle.abandon()`` on some rank)
    before it was committed: no manifest was written; its uploads were aborted."""


class NoCheckpointError(ObjckptError, LookupError):
    """No committed (and valid) checkpoint exists under the run root."""


class DistributedError(ObjckptError):
    """Ranks disagree (e.g. on the restored step) or a collective did not complete in time."""


class TrainingStateError(ObjckptError, ValueError):
    """The training state cannot be saved or restored as asked (not at an optimizer-step
    boundary, a value of an unsupported kind, a checkpoint that does not fit the model)."""


class StagingBudgetError(TrainingStateError):
    """The state needs more host staging memory than ``max_staging_bytes`` allows; raised
    before anything is staged or written."""


class UnsupportedStateError(ObjckptError, TypeError):
    """A value in a state dict cannot be written by this format; the message names where it is."""


# ---------------------------------------------------------------------------------- damage


def is_damage(exc: BaseException) -> bool:
    """THE damage rule (invariant 11b): does ``exc`` say the checkpoint's bytes are bad?

    True for integrity failures (checksums, malformed manifests and containers) and for objects
    a committed manifest names that are missing. False for everything else: transient errors
    that outlasted the retry budget, permission and configuration errors, a missing bucket,
    policy refusals, disagreements between ranks. Only damage makes a reader fall back to an
    older checkpoint; anything else propagates, because falling back would silently lose work.

    Every path that could fall back (CheckpointManager, the DCP reader, the plug-ins, the CLI's
    ``latest``/``verify``/``cp``, GC's "newest checkpoint that verifies") asks this function.
    """
    if isinstance(exc, BucketNotFoundError):
        return False
    return isinstance(exc, (IntegrityError, NotFoundError))


def describe(exc: BaseException, *, with_key: bool = True) -> str:
    """``exc``'s message, naming the key it concerns when the message does not already."""
    text = str(exc)
    key = getattr(exc, "key", "")
    if with_key and key and key not in text:
        text = f"{key}: {text}"
    return text


def with_rank(exc: BaseException, rank: int) -> BaseException:
    """Prefix ``exc``'s message with ``rank N:`` (once), so an error raised on every rank says
    where it happened."""
    text = str(exc)
    if text.startswith(f"rank {rank}:"):
        return exc
    message = f"rank {rank}: {text}"
    if isinstance(exc, ObjckptError):
        exc._set_message(message)
    else:
        exc.args = (message,)
    return exc


# ---------------------------------------------------------------------------------- wire codec

#: built-in types rebuilt by name (their constructor takes one message); nothing else is
_BUILTINS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "RuntimeError": RuntimeError,
}


def _json_value(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def encode_error(exc: BaseException) -> dict[str, Any]:
    """A JSON description of ``exc``, so every rank can raise the same error."""
    cls = type(exc)
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(exc, ObjckptError) else cls.__name__
    out: dict[str, Any] = {"type": name, "message": str(exc)}
    if isinstance(exc, ObjckptError):
        fields: dict[str, Any] = {}
        for klass in cls.__mro__:
            for attr in getattr(klass, "wire_fields", ()):
                if attr in fields or not hasattr(exc, attr):
                    continue
                value = getattr(exc, attr)
                if isinstance(value, dict):
                    value = {str(k): v for k, v in value.items()}
                if _json_value(value):
                    fields[attr] = value
        if fields:
            out["fields"] = fields
    return out


def decode_error(data: Mapping[str, Any]) -> Exception:
    """Rebuild an error sent by :func:`encode_error`.

    objckpt's own types (by registration) and a few built-ins are rebuilt as themselves, with
    the exact message the sender had; anything else becomes a :class:`DistributedError` carrying
    the original type name and message. Nothing is imported or evaluated.
    """
    type_name = str(data.get("type", ""))
    message = str(data.get("message", ""))
    cls = _REGISTRY.get(type_name) or _REGISTRY.get(type_name.rsplit(".", 1)[-1])
    if cls is not None:
        exc = cls.__new__(cls)
        ObjckptError.__init__(exc, message)
        fields = data.get("fields")
        if isinstance(fields, Mapping):
            for attr, value in fields.items():
                if isinstance(attr, str) and not attr.startswith("_"):
                    setattr(exc, attr, value)
        for attr in ("key", "location", "operation"):
            if attr in _declared_fields(cls) and not hasattr(exc, attr):
                setattr(exc, attr, "")
        after = getattr(exc, "_after_wire", None)
        if callable(after):
            after()
        return exc
    builtin = _BUILTINS.get(type_name)
    if builtin is not None:
        return builtin(message)
    remote = DistributedError(f"{type_name}: {message}" if type_name else message)
    remote.remote_type = type_name  # type: ignore[attr-defined]
    return remote


def _declared_fields(cls: type) -> set[str]:
    return {attr for klass in cls.__mro__ for attr in getattr(klass, "wire_fields", ())}
