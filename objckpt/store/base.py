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
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import IO, TYPE_CHECKING, Any, ClassVar, Literal, Union

from .._crc import Buffer, Crc32c, crc32c_b64, encode_crc32c
from .._retry import RetryPolicy
from ..errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    ConfigError,
    InvalidKeyError,
    NotSupportedError,
    TransientError,
)
from ._options import Option
from .pacing import Pacer, is_throttling

if TYPE_CHECKING:
    from ._uri import ParsedURI

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


#: the time budget of the request in progress on this thread (an absolute ``time.monotonic()``
#: deadline), shared by every store: a request made while another is being retried (GCS's
#: cleanup inside a compose, the pointer's compare-and-swap rounds) gets what remains of it
_budget = threading.local()


def budget_remaining() -> float | None:
    """Seconds left of the innermost :func:`time_budget` on this thread, or ``None``."""
    deadline = getattr(_budget, "deadline", None)
    return None if deadline is None else deadline - time.monotonic()


@contextmanager
def time_budget(seconds: float) -> Iterator[None]:
    """Every store request made on this thread inside the block shares one time budget of
    ``seconds`` (or what remains of an enclosing budget, if less): each request's retry policy
    is cut down to what is left, so a loop of requests (compare-and-swap rounds, a cleanup
    inside a publish) ends within the budget however many requests it makes. A request whose
    budget is spent still gets its one first try."""
    previous = getattr(_budget, "deadline", None)
    deadline = time.monotonic() + max(0.0, seconds)
    _budget.deadline = deadline if previous is None else min(previous, deadline)
    try:
        yield
    finally:
        _budget.deadline = previous


class Store(ABC):
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

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One request under the retry policy: its time budget, cut down to what remains of an
        enclosing :func:`time_budget` (so nested requests never restart the clock), is shared
        with any request made while this one runs on this thread."""
        policy = self.retry
        left = budget_remaining()
        if left is not None and left < policy.deadline:
            policy = dataclasses.replace(policy, deadline=round(max(0.0, left), 1))
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

    def put(self, key: str, data: Buffer, *, mode: PutMode = PutMode.OVERWRITE) -> ObjectMeta:
        """Write ``data`` as one object, atomically: readers see the old object or the new one.

        Raises:
            AlreadyExistsError: ``mode`` is CREATE and the key exists (nothing written).
            PreconditionFailedError: ``mode`` is an update and the version moved.
            NotSupportedError: the backend cannot enforce ``mode``.
            InvalidKeyError: ``key`` breaks the key rule (no request made).
            ChecksumMismatchError: the server rejected the body's CRC32C (nothing written).
        """
        self.check_key(key, "put")
        view = memoryview(data).cast("B")
        self._check_mode(mode, key)
        crc = crc32c_b64(view)
        tries = 0

        def attempt() -> ObjectMeta:
            nonlocal tries
            tries += 1
            return self._put(key, view, mode, crc)

        try:
            return self._call(attempt)
        except AlreadyExistsError:
            # A create retried after a transient error may have landed the first time (the
            # response was lost). The same size and CRC32C means the object is our own bytes.
            if tries > 1:
                meta = self._call(self._head, key)
                if meta.size == view.nbytes and meta.crc32c == crc:
                    return meta
            raise

    def put_stream(
        self,
        key: str,
        source: BytesSource,
        *,
        mode: PutMode = PutMode.CREATE,
        part_size: int | None = None,
        max_in_flight: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ObjectMeta:
        """Stream ``source`` into one object with bounded memory; default mode is create-if-absent.

        Sources no larger than one part are written with a single ``put``. Larger ones go through
        the backend's multipart upload with at most ``max_in_flight`` parts buffered or in flight;
        each part carries its CRC32C. The returned meta's ``crc32c`` is the full-object CRC32C
        computed while streaming. ``progress(n)`` is called with each part's byte count once
        that part is uploaded.

        Atomicity: the object appears only at completion, whole. On any failure (including
        KeyboardInterrupt) the upload is aborted and the error re-raised. Raises what ``put``
        raises.
        """
        self.check_key(key, "put")
        self._check_mode(mode, key)
        part_size = part_size or self.part_size
        self._check_part_size(part_size, key)
        max_in_flight = max_in_flight or self.max_in_flight
        parts = iter_parts(source, part_size)
        first = next(parts, None)
        if first is None:
            first = memoryview(b"")
        second = next(parts, None)
        if second is None:  # fits in one request: no multipart overhead
            meta = self.put(key, first, mode=mode)
            if progress:
                progress(first.nbytes)
            return meta
        # Hand the two parts read ahead over without keeping references here: a part must be
        # freed as soon as its upload is done, or the memory bound grows by two parts.
        head = [first, second]
        del first, second
        return self._multipart(key, _chain(head, parts), mode, max_in_flight, progress)

    def _multipart(
        self,
        key: str,
        parts: Iterator[memoryview],
        mode: PutMode,
        max_in_flight: int,
        progress: Callable[[int], None] | None,
    ) -> ObjectMeta:
        handle: UploadHandle = self._call(self._create_upload, key, mode)
        whole = Crc32c()
        results: list[PartResult] = []
        in_flight: set[Future[PartResult]] = set()
        pool = self._executor()
        try:
            for number in itertools.count(1):
                # Bound memory: wait for a slot before taking the next part off the source, so
                # at most max_in_flight parts exist plus the one the source is assembling.
                while len(in_flight) >= max_in_flight:
                    done, in_flight = _wait_first(in_flight)
                    results.extend(_collect(done, progress))
                part = next(parts, None)
                if part is None:
                    break
                offset = whole.size
                whole.update(part)
                crc = crc32c_b64(part)
                # The task takes the part out of its holder, so the buffer is released when the
                # upload returns, not when the pool gets round to dropping the task's arguments.
                in_flight.add(pool.submit(self._upload_held, handle, number, offset, [part], crc))
                del part
            while in_flight:
                done, in_flight = _wait_first(in_flight)
                results.extend(_collect(done, progress))
            results.sort(key=lambda r: r.part_number)
            return self._call(self._complete_upload, handle, results, whole.size, whole.b64)
        except BaseException:
            for fut in in_flight:
                fut.cancel()
            wait(in_flight)
            try:
                self._call(self._abort_upload, handle)
            except Exception:  # noqa: BLE001 - the original error matters more; GC sweeps leftovers
                pass
            raise

    def _upload_held(
        self, handle: UploadHandle, number: int, offset: int, holder: list[memoryview], crc: str
    ) -> PartResult:
        data = holder.pop()
        return self._call(self._upload_part, handle, number, offset, data, crc)

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        """Whole object, or bytes ``[start, end)`` of it (clamped at the object's end, like an
        HTTP range). One ``_open`` call, retried whole on a transient error.

        Raises:
            NotFoundError: no such key.
            InvalidKeyError: ``key`` breaks the key rule (no request made).
        """
        self.check_key(key, "get")
        start, end = 0, None
        if byte_range is not None:
            start, end = byte_range
            if start < 0 or end < start:
                raise ValueError(f"bad byte range {byte_range} for key {key!r}")
            if end == start:
                return b""
        return self._call(self._read, key, start, end)

    def _read(self, key: str, start: int, end: int | None) -> bytes:
        # One chunk is returned as is (bytes.join of a single bytes object does not copy).
        return b"".join(self._open(key, start, end))

    def get_stream(
        self,
        key: str,
        *,
        expected_size: int | None = None,
        expected_crc32c: str | None = None,
    ) -> Iterator[bytes]:
        """Stream an object, resuming after transient errors, verifying it at the end.

        The final ``next()`` raises :class:`ChecksumMismatchError` if the size or CRC32C differ
        from what was expected; consumers must not use the bytes before the stream is exhausted.
        An invalid key raises :class:`InvalidKeyError` here, before any request; a missing
        object raises :class:`NotFoundError` at the first ``next()``.
        """
        self.check_key(key, "get")
        return self._stream(key, expected_size, expected_crc32c)

    def _stream(self, key: str, expected_size: int | None, expected_crc32c: str | None) -> Iterator[bytes]:
        crc = Crc32c()
        retries = 0
        streak_started = time.monotonic()
        while True:
            resumed_at = crc.size
            pacer = self.pacing
            epoch = pacer.admit() if pacer is not None else 0  # a stream holds no slot
            try:
                for chunk in self._open(key, crc.size, None):
                    crc.update(chunk)
                    if expected_size is not None and crc.size > expected_size:
                        raise ChecksumMismatchError(
                            f"object is larger than its receipt's {expected_size} bytes",
                            key=key,
                            location=self.location,
                        )
                    yield chunk
                if pacer is not None:
                    pacer.report(epoch, throttled=False)
                break
            except TransientError as exc:
                if pacer is not None:
                    pacer.report(epoch, throttled=is_throttling(exc))
                # A resume that delivered a real amount of data earns a fresh budget: a long
                # download may meet several unrelated resets. One that delivered little or
                # nothing counts against the policy's attempts and deadline.
                if crc.size - resumed_at >= DEFAULT_READ_CHUNK:
                    retries = 0
                if retries == 0:
                    streak_started = time.monotonic()
                retries += 1
                policy = self._stream_policy()
                spent = time.monotonic() - streak_started
                if retries >= policy.max_attempts or spent >= policy.deadline:
                    raise policy.exhausted(exc, retries, spent) from exc.__cause__
                self._notify_retry(exc, retries)
                # never sleep past the budget: the last try starts before it ends
                time.sleep(min(policy.backoff(retries), max(0.0, policy.deadline - spent)))
        if expected_size is not None and crc.size != expected_size:
            raise ChecksumMismatchError(
                f"size mismatch: read {crc.size} bytes, receipt says {expected_size}",
                key=key,
                location=self.location,
            )
        if expected_crc32c is not None and crc.b64 != expected_crc32c:
            raise ChecksumMismatchError(
                f"CRC32C mismatch: read {crc.b64}, receipt says {expected_crc32c}",
                key=key,
                location=self.location,
            )

    def _stream_policy(self) -> RetryPolicy:
        """The policy for the resumes of a stream: the store's, cut down to what remains of an
        enclosing :func:`time_budget` (as for every request)."""
        left = budget_remaining()
        if left is not None and left < self.retry.deadline:
            return dataclasses.replace(self.retry, deadline=round(max(0.0, left), 1))
        return self.retry

    def get_verified(
        self, key: str, *, expected_size: int | None = None, expected_crc32c: str | None = None
    ) -> bytes:
        """The whole object, only if its size and CRC32C match (``ChecksumMismatchError``)."""
        return b"".join(self.get_stream(key, expected_size=expected_size, expected_crc32c=expected_crc32c))

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

    def list_prefixes(self, prefix: str = "") -> list[str]:
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

    def list_uploads(self, prefix: str = "") -> list[PendingUpload]:
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


def iter_parts(source: BytesSource, part_size: int) -> Iterator[memoryview]:
    """Re-chunk ``source`` into ``part_size`` views (the last may be shorter).

    Zero-copy where a part lies inside one source buffer (e.g. a tensor's memory); a part that
    spans buffers is assembled in a fresh bytearray, so at most one part is held here.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source).cast("B")
        for start in range(0, view.nbytes, part_size):
            yield view[start : start + part_size]
        return
    if hasattr(source, "readinto") or hasattr(source, "read"):
        yield from _iter_file_parts(source, part_size)  # type: ignore[arg-type]
        return
    pending: bytearray | None = None
    for chunk in source:  # type: ignore[union-attr]
        view = memoryview(chunk).cast("B")
        pos = 0
        if pending is not None:
            take = min(part_size - len(pending), view.nbytes)
            pending += view[:take]
            pos = take
            if len(pending) < part_size:
                continue
            yield memoryview(pending)
            pending = None
        while view.nbytes - pos >= part_size:
            yield view[pos : pos + part_size]
            pos += part_size
        if pos < view.nbytes:
            pending = bytearray(view[pos:])
    if pending:
        yield memoryview(pending)


def _iter_file_parts(fileobj: IO[bytes], part_size: int) -> Iterator[memoryview]:
    while True:
        buf = bytearray(part_size)
        filled = 0
        while filled < part_size:
            if hasattr(fileobj, "readinto"):
                n = fileobj.readinto(memoryview(buf)[filled:])  # type: ignore[attr-defined]
            else:
                data = fileobj.read(part_size - filled)
                n = len(data)
                buf[filled : filled + n] = data
            if not n:
                break
            filled += n
        if filled:
            yield memoryview(buf)[:filled]
        if filled < part_size:
            return


def _chain(head: list[memoryview], rest: Iterator[memoryview]) -> Iterator[memoryview]:
    """``head``'s parts, then ``rest``'s; keeps no reference to a part it has handed out."""
    while head:
        yield head.pop(0)
    yield from rest


def _wait_first(
    futures: set[Future[PartResult]],
) -> tuple[set[Future[PartResult]], set[Future[PartResult]]]:
    done, pending = wait(futures, return_when=FIRST_COMPLETED)
    return set(done), set(pending)


def _collect(done: set[Future[PartResult]], progress: Callable[[int], None] | None) -> list[PartResult]:
    out = []
    for fut in done:
        result = fut.result()  # re-raises the part's error
        if progress:
            progress(result.size)
        out.append(result)
    return out


__all__ = [
    "BytesSource",
    "Capabilities",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_PART_SIZE",
    "ObjectMeta",
    "PartResult",
    "PendingUpload",
    "PutMode",
    "Store",
    "UploadHandle",
    "encode_crc32c",
    "iter_parts",
    "budget_remaining",
    "key_problem",
    "time_budget",
]
