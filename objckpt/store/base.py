"""The store contract: the one interface every backend (memory, file, S3, GCS) implements.

Shaped after arrow-rs ``object_store``: a handful of primitives that a backend implements
(underscore methods), and the public methods derived from them here, once, for every backend:

* every key a public method takes is checked by :func:`key_problem` (one rule for every backend,
  plus the backend's stricter :meth:`Store._key_rule`) before any request: an invalid key raises
  :class:`InvalidKeyError` naming the key and the location;
* every primitive call goes through the store's :class:`RetryPolicy` (only ``TransientError`` is
  retried, so a wrapper that injects faults into the primitives is retried like a real server);
* ``get`` and ``get_stream`` both read through the one ranged primitive ``_open(key, start, end)``;
  ``get_stream`` resumes a broken download from its offset and verifies size and CRC32C;
* ``list`` paginates with ``start_after`` so a listing interrupted by a transient error resumes;
* ``put_stream`` re-chunks any byte source into parts and uploads at most ``max_in_flight`` parts
  at a time, each with its CRC32C, so peak memory is ``part_size x (max_in_flight + 1)`` whatever
  the object's size; on any failure the upload is aborted and nothing becomes visible;
* ``abort_upload(PendingUpload)`` (GC) goes through ``_abort_upload`` with a handle rebuilt from
  the pending upload, so a backend aborts uploads one way.

Keys are ``/``-separated and relative to the store's root (the run root). Writes take a
:class:`PutMode`: overwrite, create-if-absent, or update-if-version-matches. A mode a backend
cannot honour raises :class:`NotSupportedError`; it never degrades to check-then-write. What a
backend guarantees is its declared :class:`Capabilities`; a backend that declares nothing
guarantees nothing, so protocol code refuses to commit on it (fail closed).

Where the pieces live (each module small enough to read at once; this one re-exports every name
the others define that objckpt imports from ``objckpt.store.base``): the value types, size
constants and :func:`key_problem` in ``_types.py``; the per-thread time budget in
``_budget.py``; the write path (``put``, ``put_stream``) in ``_writes.py`` and the read path
(``get``, ``get_into``, ``get_stream``, ``get_verified``) in ``_reads.py``, two mixins that
:class:`Store` inherits; the part-cutting and buffer helpers in ``_parts.py``.
"""

from __future__ import annotations

import builtins
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from .._crc import encode_crc32c
from .._retry import RetryPolicy
from ..errors import ConfigError, InvalidKeyError, NotSupportedError
from ._budget import budget_remaining, time_budget, within_budget
from ._options import Option
from ._parts import _joined, advance, iter_parts
from ._reads import _StoreReads
from ._types import (
    BIG_OBJECT_SIZE,
    BIG_PART_SIZE,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_PART_SIZE,
    DEFAULT_READ_CHUNK,
    MAX_DELETE_BATCH,
    MAX_PARTS,
    PROBE_PREFIX,
    BytesSource,
    Capabilities,
    MiB,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    StreamChecksums,
    UploadHandle,
    key_problem,
)
from ._writes import _StoreWrites
from .pacing import Pacer

if TYPE_CHECKING:
    from ._uri import ParsedURI

T = TypeVar("T")


class Store(_StoreWrites, _StoreReads, ABC):
    """One object store location (bucket + prefix, or directory). Thread-safe.

    Subclasses implement the underscore primitives, declare :attr:`capabilities` and
    :attr:`OPTIONS`, and (to be opened by URI) :meth:`from_uri`; callers use the public methods.
    """

    #: scheme, e.g. ``s3``; set by subclasses
    scheme: ClassVar[str] = ""
    #: the options this backend takes besides the common ones (``_options.COMMON_OPTIONS``)
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    #: what this backend guarantees; a subclass (or instance) that declares nothing guarantees
    #: nothing, so committing refuses it (fail closed)
    capabilities: Capabilities = Capabilities.NONE
    #: the smallest non-final part the server accepts (S3: 5 MiB); ``put_stream`` refuses a
    #: smaller ``part_size`` before uploading anything
    min_part_size: int = 1
    #: :meth:`part_size_for` picks the part size from the object's size (``False``: always
    #: ``part_size``)
    auto_part_size: bool = True
    #: set per instance by ``__init__`` (this default covers subclasses that skip it)
    pacing: Pacer | None = None
    #: a multipart upload costs about what one request does (file://: its parts are ``pwrite`` s
    #: into one staging file, written back as they land, and its completion is a rename), so a
    #: writer keeps a rank's bytes in one object instead of spreading them over several written
    #: by one request each (``writer.spread_for``: measured on file://, 512 MiB, 8 objects at once
    #: took 1.12-1.22x as long as one multipart upload). ``False`` for object stores, where every
    #: upload is a create, its parts and a completion that makes the server assemble the object.
    cheap_multipart: bool = False
    #: reading an object costs about a memory copy (file://: the page cache), less than sending
    #: its bytes over the process group, and no request rate limits it, so restores read what
    #: every rank loads on every rank instead of once per job (the one rule, with measurements:
    #: ``coordination.exchange.reads_once_by_default``). ``False`` for object stores, where each
    #: rank's reads are requests to a server.
    cheap_reads: bool = False

    def __init__(
        self,
        *,
        location: str,
        part_size: int = DEFAULT_PART_SIZE,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        retry: RetryPolicy | None = None,
        capabilities: Capabilities | None = None,
    ) -> None:
        if part_size < 1:
            raise ConfigError(f"part_size must be positive, got {part_size}")
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.location = location
        self.part_size = part_size
        self.max_in_flight = max_in_flight
        self.retry = retry or RetryPolicy()
        if capabilities is not None:  # else the class's declaration
            self.capabilities = capabilities
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._retry_listeners: list[Callable[[BaseException, int], None]] = []
        #: AIMD limit on this store's concurrent requests, cut on throttling (``pacing.py``);
        #: ``None``: off (each request only retries)
        self.pacing: Pacer | None = Pacer()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> Store:
        """The store for a parsed run-root URI. ``options`` are already checked against
        :attr:`OPTIONS` and converted (``open_store`` does that, once); the common ones arrive
        as ``Store.__init__`` keywords (``part_size``, ``max_in_flight``, ``retry``).

        Raises:
            ConfigError: the backend cannot be opened from a URI (override to allow it).
        """
        raise ConfigError(f"{cls.__name__} cannot be opened from a URI")

    # ------------------------------------------------------------------ primitives (backends)

    @abstractmethod
    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """Write one whole object atomically under ``mode``; the server verifies ``crc32c``
        (:class:`ChecksumMismatchError` when the body does not match it)."""

    @abstractmethod
    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the object (``end=None``: to its end), as chunks.

        Ranges are clamped at the object's end like HTTP ranges: a ``start`` at or past the end
        yields nothing. Raises :class:`NotFoundError` for a missing key (possibly only at the
        first ``next()``) and may raise :class:`TransientError` mid-iteration; the caller
        retries (``get``) or resumes from its offset (``get_stream``). One call never mixes
        bytes of two versions of the object.
        """

    @abstractmethod
    def _head(self, key: str) -> ObjectMeta: ...

    @abstractmethod
    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        """Up to ``limit`` objects under ``prefix`` with key > ``start_after``, sorted by key,
        and whether more may follow."""

    @abstractmethod
    def _list_prefixes(self, prefix: str) -> list[str]:
        """The distinct 'directories' (ending in ``/``) directly below ``prefix``."""

    @abstractmethod
    def _delete_batch(self, keys: list[str]) -> None:
        """Delete up to ``MAX_DELETE_BATCH`` keys; absent keys are not an error."""

    @abstractmethod
    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle: ...

    @abstractmethod
    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        """Upload one part; the server verifies ``crc32c`` (:class:`ChecksumMismatchError`)."""

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        """Upload one part given as consecutive buffers whose CRC32C ``put_stream`` computed from
        these very buffers. A backend that can send several buffers as one body (file://
        ``pwritev``, S3's and GCS's streamed bodies) overrides this, and the wrappers forward
        it; the default joins them (one copy) for :meth:`_upload_part`."""
        return self._upload_part(handle, part_number, offset, _joined(buffers), crc32c)

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        """:meth:`_put` of consecutive buffers whose CRC32C the caller computed from them (a
        ``put_stream`` that fits one request); the default joins them (one copy). S3 and GCS
        send them as one streamed body, file:// writes them without re-hashing (there is no
        transport between the hash and the write to protect), and the wrappers forward it."""
        return self._put(key, _joined(buffers), mode, crc32c)

    @abstractmethod
    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        """Make the object visible, atomically, honouring ``handle.mode``."""

    @abstractmethod
    def _abort_upload(self, handle: UploadHandle) -> None:
        """Discard an upload's parts; idempotent. Nothing becomes visible. Must work with a
        handle rebuilt from a :class:`PendingUpload` (``key`` and ``upload_id`` only)."""

    @abstractmethod
    def _list_uploads(self, prefix: str) -> list[PendingUpload]: ...

    def _close(self) -> None:  # noqa: B027 - optional hook, not abstract: most backends have nothing to release
        """Release SDK clients; override when there are any."""

    def _key_rule(self, key: str) -> str | None:
        """A backend's stricter key rule on top of :func:`key_problem`: why ``key`` is refused,
        or ``None`` (e.g. file:// reserves the ``.objckpt-`` prefix)."""
        return None

    # ------------------------------------------------------------------ public API

    def check_key(self, key: str, operation: str = "") -> None:
        """Raise :class:`InvalidKeyError` (naming the key and this store's location) unless
        ``key`` is valid here; no request is made. Every public method that takes a key calls
        this first."""
        problem = key_problem(key) or self._key_rule(key)
        if problem:
            raise InvalidKeyError(
                f"invalid key: {problem}", key=str(key), location=self.location, operation=operation
            )

    def add_retry_listener(self, listener: Callable[[BaseException, int], None]) -> None:
        """Call ``listener(error, attempt)`` before each retry (metrics, tests)."""
        self._retry_listeners.append(listener)

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """One request under the retry policy: its time budget, cut down to what remains of an
        enclosing :func:`time_budget` (so nested requests never restart the clock), is shared
        with any request made while this one runs on this thread."""
        policy = within_budget(self.retry)
        if self.pacing is not None:
            fn = self.pacing.wrap(fn)  # each try holds a slot; a throttled one cuts the limit
        with time_budget(policy.deadline):
            return policy.call(fn, *args, on_retry=self._notify_retry)

    def part_size_for(self, size: int | None) -> int:
        """The part size for an object of ``size`` bytes (``None``: unknown): ``part_size``, at
        least :data:`BIG_PART_SIZE` for objects over :data:`BIG_OBJECT_SIZE`, always large
        enough for :data:`MAX_PARTS` parts, never below ``min_part_size``; rounded up to MiB."""
        part = self.part_size
        if size is None or not self.auto_part_size:
            return part
        if size > BIG_OBJECT_SIZE:
            part = max(part, BIG_PART_SIZE)
        need = -(-size // MAX_PARTS)
        if need > part:
            part = -(-need // MiB) * MiB
        return max(part, self.min_part_size)

    def _notify_retry(self, exc: BaseException, attempt: int) -> None:
        for listener in self._retry_listeners:
            listener(exc, attempt)

    def head(self, key: str) -> ObjectMeta:
        """Size, version and (when known) CRC32C.

        Raises:
            NotFoundError: no such key.
            InvalidKeyError: ``key`` breaks the key rule (no request made).
        """
        self.check_key(key, "head")
        return self._call(self._head, key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        """Objects under ``prefix`` (plain string prefix), ascending by key, after ``start_after``.

        Paginated (1,000 a request); each page is retried on its own.
        """
        cursor = start_after
        while True:
            page, more = self._call(self._list_page, prefix, cursor, 1000)
            yield from page
            if not more or not page:
                return
            cursor = page[-1].key

    def list_prefixes(self, prefix: str = "") -> builtins.list[str]:
        """Sub-'directories' (each ending in ``/``) directly under ``prefix``, sorted."""
        return sorted(self._call(self._list_prefixes, prefix))

    def delete(self, keys: Iterable[str]) -> None:
        """Delete keys in batches of up to 1,000; absent keys are ignored. Not atomic as a whole:
        callers order deletions so that a crash part-way leaves nothing dangling.

        Raises:
            InvalidKeyError: a key breaks the key rule (nothing of its batch is deleted).
        """
        batch: list[str] = []
        for key in keys:
            self.check_key(key, "delete")
            batch.append(key)
            if len(batch) == MAX_DELETE_BATCH:
                self._call(self._delete_batch, batch)
                batch = []
        if batch:
            self._call(self._delete_batch, batch)

    def list_uploads(self, prefix: str = "") -> builtins.list[PendingUpload]:
        """Started but never completed streamed uploads under ``prefix`` (for GC)."""
        return self._call(self._list_uploads, prefix)

    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort one pending upload found by :meth:`list_uploads`; idempotent.

        Goes through ``_abort_upload`` with a handle rebuilt from ``upload``. The key is not
        checked against the key rule: GC must be able to abort an upload whatever its key.
        """
        handle = UploadHandle(key=upload.key, mode=PutMode.OVERWRITE, upload_id=upload.upload_id)
        self._call(self._abort_upload, handle)

    def check(self, *, write: bool = False) -> None:
        """Check that the run root can be used, with as few requests as it takes; nothing is
        left behind. ``open_store`` never calls this by itself (opening makes no request);
        ``CheckpointManager`` does at construction, ``open_store(..., check=True)`` on request.

        * always: one LIST of at most one key under the root (retried like any request): the
          server answers, the bucket (or root) exists, the credentials are accepted and may read
          the run root;
        * ``write=True``: also a create-if-absent write of a small probe object under
          ``objckpt-probe/`` and its deletion (create, delete permissions).

        Raises (the message names the location): :class:`BucketNotFoundError`,
        :class:`PermissionDeniedError`, :class:`TransientError` (unreachable past the retry
        budget), :class:`ConfigError` (e.g. a part size the server refuses).
        """
        self._check_part_size(self.part_size, "")
        self._call(self._probe)
        if write:
            key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            mode = PutMode.CREATE if self.capabilities.create_if_absent else PutMode.OVERWRITE
            self.put(key, b"objckpt write probe\n", mode=mode)
            self.delete([key])

    def _probe(self) -> None:
        """The read probe of :meth:`check` (one request); backends may refine it."""
        self._list_page("", None, 1)

    def _check_part_size(self, part_size: int, key: str) -> None:
        if part_size < self.min_part_size:
            raise ConfigError(
                f"part_size {part_size:,} is below the smallest part {self.location} accepts "
                f"({self.min_part_size:,} bytes): a multipart upload would be refused only when it "
                "completes, after every part was sent; raise part_size (or, for a server that "
                "accepts smaller parts, lower min_part_size)"
                + (f" [put {self.location.rstrip('/')}/{key}]" if key else f" [{self.location}]")
            )

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        self._close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                # Shared by concurrent put_stream calls; each bounds its own parts in flight.
                self._pool = ThreadPoolExecutor(
                    max_workers=max(self.max_in_flight, 4), thread_name_prefix="objckpt-part"
                )
            return self._pool

    def _check_mode(self, mode: PutMode, key: str) -> None:
        caps = self.capabilities
        if mode.kind == "create" and not caps.create_if_absent:
            raise NotSupportedError(
                "this store cannot enforce create-if-absent", key=key, location=self.location
            )
        if mode.kind == "update" and not caps.compare_and_swap:
            raise NotSupportedError(
                "this store cannot enforce compare-and-swap", key=key, location=self.location
            )


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
    "Store",
    "StreamChecksums",
    "UploadHandle",
    "advance",
    "encode_crc32c",
    "iter_parts",
    "budget_remaining",
    "key_problem",
    "time_budget",
]
