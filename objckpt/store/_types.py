"""The value types of the store contract, its size constants and the one key rule.

Everything a caller or a backend passes to or gets from a :class:`~objckpt.store.base.Store`
(``PutMode``, ``ObjectMeta``, ``Capabilities``, the upload handle and part results, the
checksums ``put_stream`` reports) and :func:`key_problem`. They live apart from the ``Store``
class so that the store's own modules (the read and write paths, the part helpers) can use them
without importing ``base``, which imports those modules; ``objckpt.store.base`` re-exports every
name, which is where the rest of objckpt imports them from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, Any, ClassVar, Literal, Union

from .._crc import Buffer, encode_crc32c

BytesSource = Union[Buffer, Iterable[Buffer], IO[bytes]]
"""What ``put_stream`` accepts: one buffer, an iterable of buffers, or a binary file object."""

MiB = 1024 * 1024
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_IN_FLIGHT = 8
#: S3's limit on the parts of one multipart upload
MAX_PARTS = 10_000
#: objects larger than this get parts of at least BIG_PART_SIZE (fewer requests per shard)
BIG_OBJECT_SIZE = 1024 * MiB
BIG_PART_SIZE = 32 * MiB
DEFAULT_READ_CHUNK = 4 * MiB
MAX_DELETE_BATCH = 1000
#: where ``Store.check(write=True)`` writes (and deletes) its probe object
PROBE_PREFIX = "objckpt-probe/"


@dataclass(frozen=True)
class PutMode:
    """How a write treats an existing object.

    * ``PutMode.OVERWRITE``: replace whatever is there.
    * ``PutMode.CREATE``: write only if the key is absent, else :class:`AlreadyExistsError`.
    * ``PutMode.update(version)``: write only if the current version equals ``version`` (the
      token returned by the previous write or head), else :class:`PreconditionFailedError`.
    """

    kind: Literal["overwrite", "create", "update"]
    version: str | None = None

    OVERWRITE: ClassVar[PutMode]
    CREATE: ClassVar[PutMode]

    @classmethod
    def update(cls, version: str) -> PutMode:
        if not version:
            raise ValueError("PutMode.update needs the version token of the object to replace")
        return cls("update", version)

    def __repr__(self) -> str:
        return (
            f"PutMode.update({self.version!r})" if self.kind == "update" else f"PutMode.{self.kind.upper()}"
        )


PutMode.OVERWRITE = PutMode("overwrite")
PutMode.CREATE = PutMode("create")


@dataclass(frozen=True)
class ObjectMeta:
    """What a store knows about one object.

    Attributes:
        key: relative to the store root.
        size: bytes.
        version: the token for ``PutMode.update`` and for receipts: the ETag on S3, the
            generation on GCS, a per-write unique token on file:// and memory://.
        crc32c: base64 full-object CRC32C when the backend knows it cheaply, else ``None``.
        last_modified: when the object was written (timezone-aware), if known.
    """

    key: str
    size: int
    version: str
    crc32c: str | None = None
    last_modified: datetime | None = None


@dataclass(frozen=True)
class PendingUpload:
    """A started, never completed multipart/resumable/staged upload (for GC)."""

    key: str
    upload_id: str
    initiated: datetime | None = None


@dataclass(frozen=True)
class Capabilities:
    """What a backend guarantees. Protocol code refuses to run on a store lacking what it needs.

    Every field must be given: there are no defaults, so a backend states each guarantee it
    makes, and :attr:`Store.capabilities` of a backend that declares nothing is
    :attr:`Capabilities.NONE` (fail closed).

    Attributes:
        create_if_absent: ``PutMode.CREATE`` is enforced by the server.
        compare_and_swap: ``PutMode.update`` is enforced by the server.
        atomic_conditionals: the two above hold under concurrent racing writers (moto: no).
    """

    create_if_absent: bool
    compare_and_swap: bool
    atomic_conditionals: bool

    #: nothing guaranteed: what a Store subclass that declares nothing gets
    NONE: ClassVar[Capabilities]
    #: every conditional write enforced, atomically under races
    ALL: ClassVar[Capabilities]


Capabilities.NONE = Capabilities(create_if_absent=False, compare_and_swap=False, atomic_conditionals=False)
Capabilities.ALL = Capabilities(create_if_absent=True, compare_and_swap=True, atomic_conditionals=True)


@dataclass
class UploadHandle:
    """Backend-private state of one in-progress streamed upload.

    ``abort_upload(PendingUpload)`` rebuilds a handle from a pending upload (``key``,
    ``upload_id``, ``mode=OVERWRITE``, empty ``state``), so ``_abort_upload`` must work from
    those two fields alone.
    """

    key: str
    mode: PutMode
    upload_id: str = ""
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PartResult:
    """What the backend returns for one uploaded part (consumed by ``_complete_upload``)."""

    part_number: int  # 1-based, as S3 numbers them
    offset: int
    size: int
    crc32c: str
    token: Any = None  # e.g. the S3 part ETag or the GCS temporary object name


@dataclass
class StreamChecksums:
    """What ``put_stream`` hashed while sending, from one CRC32C pass over each byte: every
    source buffer's ``(crc, size)`` in order (``chunks``), the whole object's ``crc``/``size``
    and the number of ``parts``. Part and whole values are combined from the pieces' CRCs
    (:func:`~objckpt._crc.crc32c_combine`), never by hashing the bytes again."""

    chunks: list[tuple[int, int]] = field(default_factory=list)
    crc: int = 0
    size: int = 0
    parts: int = 0

    @property
    def b64(self) -> str:
        return encode_crc32c(self.crc)


def key_problem(key: object) -> str | None:
    """Why ``key`` cannot name an object on any backend, or ``None`` when it can.

    THE key rule, for every backend: a key is a non-empty ``str`` of ``/``-separated segments,
    none empty, ``.`` or ``..`` (so no leading or trailing ``/`` and no ``//``), without NUL or
    backslash. Such a key cannot name anything outside the store root on a server or a
    filesystem that normalises paths, and every backend can hold it, so a checkpoint stays
    portable between backends. Backends may refuse more (:meth:`Store._key_rule`).
    """
    if not isinstance(key, str):
        return f"a key is a str, not {type(key).__name__}"
    if not key:
        return "empty key"
    if key.startswith("/"):
        return "keys are relative to the store root (no leading '/')"
    if "\x00" in key:
        return "NUL in key"
    if "\\" in key:
        return "backslash in key (the separator is '/')"
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        return "empty, '.' or '..' segment"
    return None


__all__ = [
    "BIG_OBJECT_SIZE",
    "BIG_PART_SIZE",
    "BytesSource",
    "Capabilities",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_PART_SIZE",
    "DEFAULT_READ_CHUNK",
    "MAX_DELETE_BATCH",
    "MAX_PARTS",
    "MiB",
    "ObjectMeta",
    "PROBE_PREFIX",
    "PartResult",
    "PendingUpload",
    "PutMode",
    "StreamChecksums",
    "UploadHandle",
    "key_problem",
]
