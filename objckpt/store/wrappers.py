"""Store wrappers: a run-root prefix, request counting, fault injection.

Each wraps another :class:`Store` and overrides its *primitives*, delegating to the inner store's
primitives. The wrapper's public methods are the base class's, so key validation, the retry
policy, multipart bounding and stream verification apply once, at the outermost store, and an
injected fault is retried exactly like a real server's error. ``location``, ``part_size``,
``max_in_flight``, ``retry`` and ``capabilities`` are the inner store's unless given (keyword
arguments): a wrapper guarantees what its inner store guarantees. Closing a wrapper closes the
inner store unless it was made with ``close_inner=False``. Public attributes the wrapper lacks
(e.g. ``MemoryStore.corrupt``) are looked up on the inner store.

* :class:`PrefixStore` roots keys at ``prefix/`` of the inner store (the run root on a bucket).
* :class:`CountingStore` counts primitive calls (request-count tests).
* :class:`FaultInjectingStore` makes matching primitive calls fail (:class:`Fault`).

Op names are the primitive names without the leading underscore::

    put open head list_page list_prefixes delete_batch
    create_upload upload_part complete_upload abort_upload list_uploads

(``get``, ``get_stream`` and ``get_verified`` all read through ``open``; ``get_into`` (ranged
restores) reads through the inner store's own ``_read_into``, counted and faulted as ``open``:
the same one ranged GET; GC's ``abort_upload``
of a pending upload goes through ``abort_upload``.) A :class:`Fault` naming any other op is a
``ValueError``, so a rule cannot silently match nothing.

Stacking order matters: ``FaultInjectingStore(CountingStore(s))`` counts only requests that
reached ``s``; ``CountingStore(FaultInjectingStore(s))`` counts every try, failed ones included.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from .._retry import RetryPolicy
from ..errors import ChecksumMismatchError, ConfigError, StoreError, TransientError
from ._reads import fill_from
from .base import (
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
    key_problem,
)

T = TypeVar("T")

#: the primitive (op) names, from the contract itself: a new primitive needs no list here
_OPS = frozenset(name[1:] for name in Store.__abstractmethods__)


class _Wrapper(Store):
    """Delegates every primitive to ``inner`` through :meth:`_invoke` (the hook subclasses use)."""

    def __init__(
        self,
        inner: Store,
        *,
        location: str | None = None,
        part_size: int | None = None,
        max_in_flight: int | None = None,
        retry: RetryPolicy | None = None,
        capabilities: Capabilities | None = None,
        close_inner: bool = True,
    ) -> None:
        super().__init__(
            location=location if location is not None else inner.location,
            part_size=part_size or inner.part_size,
            max_in_flight=max_in_flight or inner.max_in_flight,
            retry=retry or inner.retry,
            capabilities=capabilities or inner.capabilities,
        )
        self.inner = inner
        self.min_part_size = inner.min_part_size  # the server's limit holds through the wrapper
        self.cheap_multipart = inner.cheap_multipart  # how the writers spread (writer.spread_for)
        self.cheap_reads = inner.cheap_reads  # whether restores read once (exchange.reads_once_by_default)
        self._close_inner = close_inner
        self.scheme = inner.scheme  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # Backend-specific public helpers (e.g. MemoryStore.corrupt) stay reachable.
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _key_rule(self, key: str) -> str | None:
        # The inner backend's stricter rules hold through the wrapper (e.g. file://'s reserved
        # names), applied to the key the inner store will see.
        return self.inner._key_rule(key)

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    # -- primitives: one line each, so every op goes through _invoke

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        return self._invoke("put", key, None, self.inner._put, key, data, mode, crc32c)

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        # the inner backend's own vectored write (S3 streamed body, file writev), not the
        # default that joins the buffers (a copy of the object); the op is still "put"
        return self._invoke("put", key, None, self.inner._put_buffers, key, buffers, mode, crc32c)

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        # Not a generator: the call is counted (and may fail) when the stream is opened.
        return self._invoke("open", key, None, self.inner._open, key, start, end)

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # the inner backend's own scatter read (S3 readinto, file preadv), not the default that
        # buffers each chunk of _open; one ranged GET, so it is the op "open"
        return self._invoke("open", key, None, self.inner._read_into, key, start, buffers)

    def _head(self, key: str) -> ObjectMeta:
        return self._invoke("head", key, None, self.inner._head, key)

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        return self._invoke("list_page", prefix, None, self.inner._list_page, prefix, start_after, limit)

    def _list_prefixes(self, prefix: str) -> list[str]:
        return self._invoke("list_prefixes", prefix, None, self.inner._list_prefixes, prefix)

    def _delete_batch(self, keys: list[str]) -> None:
        first = keys[0] if keys else ""
        return self._invoke("delete_batch", first, list(keys), self.inner._delete_batch, keys)

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        return self._invoke("create_upload", key, None, self.inner._create_upload, key, mode)

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        return self._invoke(
            "upload_part",
            handle.key,
            None,
            self.inner._upload_part,
            handle,
            part_number,
            offset,
            data,
            crc32c,
        )

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        # the inner backend's vectored part (no assembly copy of a part spanning tensors)
        return self._invoke(
            "upload_part",
            handle.key,
            None,
            self.inner._upload_part_buffers,
            handle,
            part_number,
            offset,
            buffers,
            crc32c,
        )

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        return self._invoke(
            "complete_upload", handle.key, None, self.inner._complete_upload, handle, parts, size, crc32c
        )

    def _abort_upload(self, handle: UploadHandle) -> None:
        return self._invoke("abort_upload", handle.key, None, self.inner._abort_upload, handle)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        return self._invoke("list_uploads", prefix, None, self.inner._list_uploads, prefix)

    def _close(self) -> None:
        # The wrapper owns its inner store unless told otherwise (close_inner=False: a wrapper
        # put around a store that someone else closes, e.g. a test fixture's).
        if self._close_inner:
            self.inner.close()


class PrefixStore(_Wrapper):
    """Keys of ``inner`` under ``prefix/``, as a store of their own (object_store's PrefixStore).

    ``open_store("s3://bucket/run")`` is ``PrefixStore(S3Store("bucket"), "run")``: the bucket
    backends address the bucket and this is the one place a run root's prefix is added to keys
    and taken off listings, metas, pending uploads and errors. Its location is the inner one
    plus ``/prefix`` (``s3://bucket/run``); its errors name the key relative to it. Atomicity
    and errors are the inner store's, unchanged.

    Raises:
        ConfigError: a ``prefix`` that breaks the key rule (empty, ``.`` or ``..`` segments...).
    """

    def __init__(self, inner: Store, prefix: str, **options: Any) -> None:
        prefix = prefix.strip("/")
        problem = key_problem(prefix) if prefix else None
        if problem:
            raise ConfigError(f"invalid store prefix {prefix!r} under {inner.location}: {problem}")
        base = inner.location if inner.location.endswith("://") else inner.location.rstrip("/") + "/"
        options.setdefault("location", base + prefix if prefix else inner.location)
        super().__init__(inner, **options)
        self.prefix = prefix
        self._root = prefix + "/" if prefix else ""

    def __repr__(self) -> str:
        return f"PrefixStore({self.inner!r}, {self.prefix!r})"

    # -- mapping

    def _full(self, key: str) -> str:
        return self._root + key

    def _rel(self, key: str) -> str:
        return key[len(self._root) :] if key.startswith(self._root) else key

    def _meta(self, meta: ObjectMeta) -> ObjectMeta:
        return dataclasses.replace(meta, key=self._rel(meta.key))

    def _inner_handle(self, handle: UploadHandle) -> UploadHandle:
        inner = handle.state.get("inner")
        if inner is None:  # rebuilt from a PendingUpload (abort_upload): key and id only
            inner = UploadHandle(key=self._full(handle.key), mode=handle.mode, upload_id=handle.upload_id)
        return inner

    @contextmanager
    def _relative_errors(self) -> Iterator[None]:
        """Errors of the inner store name the key relative to this store, and its location. (For
        a key below the prefix the message already reads ``inner location/prefix/key``, the same
        text; an error about the whole store, key ``""``, gets this store's location.)"""
        try:
            yield
        except (StoreError, ChecksumMismatchError) as exc:
            self._relocate(exc)
            raise

    def _relocate(self, exc: StoreError | ChecksumMismatchError) -> None:
        key, location = exc.key, exc.location
        if not self._root or location != self.inner.location:
            return
        if key and not key.startswith(self._root):
            return  # not one of ours (e.g. a backend's private name): leave it as it is
        old, new = _where(exc, location, key), _where(exc, self.location, self._rel(key))
        exc.key, exc.location = self._rel(key), self.location
        if old != new and exc.message.endswith(old):
            exc._set_message(exc.message[: -len(old)] + new)

    def _key_rule(self, key: str) -> str | None:
        return self.inner._key_rule(self._full(key))

    # -- primitives

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        with self._relative_errors():
            return self._meta(self.inner._put(self._full(key), data, mode, crc32c))

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        # the inner backend's vectored write, not the default join (a copy of the object)
        with self._relative_errors():
            return self._meta(self.inner._put_buffers(self._full(key), buffers, mode, crc32c))

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        with self._relative_errors():
            stream = self.inner._open(self._full(key), start, end)  # a wrapper may fail here
        return self._relative_stream(stream)

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # the inner backend's own scatter read (S3 readinto, file preadv), not the default that
        # buffers each chunk of _open and copies it
        with self._relative_errors():
            return self.inner._read_into(self._full(key), start, buffers)

    def _relative_stream(self, stream: Iterator[bytes]) -> Iterator[bytes]:
        with self._relative_errors():
            yield from stream

    def _head(self, key: str) -> ObjectMeta:
        with self._relative_errors():
            return self._meta(self.inner._head(self._full(key)))

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        after = None if start_after is None else self._full(start_after)
        with self._relative_errors():
            page, more = self.inner._list_page(self._full(prefix), after, limit)
        return [self._meta(m) for m in page], more

    def _list_prefixes(self, prefix: str) -> list[str]:
        with self._relative_errors():
            return [self._rel(p) for p in self.inner._list_prefixes(self._full(prefix))]

    def _delete_batch(self, keys: list[str]) -> None:
        with self._relative_errors():
            self.inner._delete_batch([self._full(k) for k in keys])

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        with self._relative_errors():
            inner = self.inner._create_upload(self._full(key), mode)
        return UploadHandle(key=key, mode=mode, upload_id=inner.upload_id, state={"inner": inner})

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        with self._relative_errors():
            return self.inner._upload_part(self._inner_handle(handle), part_number, offset, data, crc32c)

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        # the inner backend's vectored part, not the default join (a copy of the part)
        with self._relative_errors():
            return self.inner._upload_part_buffers(
                self._inner_handle(handle), part_number, offset, buffers, crc32c
            )

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        with self._relative_errors():
            return self._meta(self.inner._complete_upload(self._inner_handle(handle), parts, size, crc32c))

    def _abort_upload(self, handle: UploadHandle) -> None:
        with self._relative_errors():
            self.inner._abort_upload(self._inner_handle(handle))

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        with self._relative_errors():
            found = self.inner._list_uploads(self._full(prefix))
        return [dataclasses.replace(u, key=self._rel(u.key)) for u in found if u.key.startswith(self._root)]


class CountingStore(_Wrapper):
    """Wraps ``inner``; counts every primitive call (each retry is a call).

    Attributes:
        counts: op -> number of calls.
        calls: ``(op, key or prefix)`` in call order. A ``delete_batch`` call adds one entry per
            key (so deletion order can be asserted) but counts once.
    """

    def __init__(self, inner: Store, **options: Any) -> None:
        super().__init__(inner, **options)
        self.counts: collections.Counter[str] = collections.Counter()
        self.calls: list[tuple[str, str]] = []
        self._count_lock = threading.Lock()

    def reset(self) -> None:
        with self._count_lock:
            self.counts.clear()
            self.calls.clear()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Any, *args: Any) -> Any:
        with self._count_lock:
            self.counts[op] += 1
            if keys:
                self.calls.extend((op, k) for k in keys)
            else:
                self.calls.append((op, key))
        return fn(*args)


@dataclass
class Fault:
    """One fault rule for :class:`FaultInjectingStore`.

    Attributes:
        op: primitive name (see module doc) or ``"*"``.
        key: fnmatch pattern on the key / prefix (a ``delete_batch`` matches if any key does).
        error: exception class or instance to raise; a class is instantiated with a message naming
            the op and the key, and the store's location.
        times: how many matching calls fail; ``None``: every one.
        after: ``True``: perform the call, then raise (a lost response: the write happened).
        probability: chance that a matching call fails (the store's seeded RNG decides).
        after_bytes: ``open`` only: a read (``get``, ``get_stream``) yields this many bytes, then
            raises mid-stream (a connection reset during a download); ``times`` counts the reads
            that got that far. ``None``: raise when opening.
    """

    op: str = "*"
    key: str = "*"
    error: StoreError | type[StoreError] = TransientError
    times: int | None = 1
    after: bool = False
    probability: float = 1.0
    after_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.op != "*" and self.op not in _OPS:
            raise ValueError(f"Fault op {self.op!r} is not a primitive; use one of {sorted(_OPS)} or '*'")
        if self.after_bytes is not None and self.op not in ("open", "*"):
            raise ValueError("after_bytes breaks a read stream: it needs op='open'")

    def matches(self, op: str, key: str, keys: list[str] | None) -> bool:
        if self.op not in ("*", op):
            return False
        if self.times is not None and self.times <= 0:
            return False
        candidates = keys if keys else [key]
        return any(fnmatch.fnmatchcase(k, self.key) for k in candidates)


class FaultInjectingStore(_Wrapper):
    """Wraps ``inner``; matching primitive calls raise the fault's error (first matching rule
    wins). Thread-safe; with ``probability < 1`` the outcome follows the seeded RNG.

    Attributes:
        faults: the rules, in match order (append with :meth:`add`).
        injected: ``(op, key)`` of every fault that fired, in order.
    """

    def __init__(self, inner: Store, faults: Iterable[Fault] = (), *, seed: int = 0, **options: Any) -> None:
        super().__init__(inner, **options)
        self.faults: list[Fault] = list(faults)
        self.injected: list[tuple[str, str]] = []
        self._rng = random.Random(seed)
        self._fault_lock = threading.Lock()

    def add(self, fault: Fault) -> None:
        with self._fault_lock:
            self.faults.append(fault)

    def _pick(self, op: str, key: str, keys: list[str] | None) -> Fault | None:
        with self._fault_lock:
            for fault in self.faults:
                if not fault.matches(op, key, keys):
                    continue
                if fault.probability < 1.0 and self._rng.random() >= fault.probability:
                    continue
                # A broken-stream fault counts when it fires (_break_stream): a read that ends
                # before the fault point (a small object) was not failed and uses up nothing.
                if fault.times is not None and not (op == "open" and fault.after_bytes is not None):
                    fault.times -= 1
                return fault
        return None

    def _make_error(self, fault: Fault, op: str, key: str) -> BaseException:
        error = fault.error
        with self._fault_lock:
            self.injected.append((op, key))
        if isinstance(error, BaseException):
            return error
        message = f"injected fault on {op}"
        try:
            return error(message, key=key, location=self.location, operation=op)
        except TypeError:  # not a StoreError: e.g. ChecksumMismatchError, ConnectionResetError
            try:
                return error(message, key=key, location=self.location)
            except TypeError:
                return error(message)

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Any, *args: Any) -> Any:
        fault = self._pick(op, key, keys)
        if fault is None:
            return fn(*args)
        if op == "open" and fault.after_bytes is not None:
            return self._break_stream(fn(*args), fault, key)
        if fault.after:
            fn(*args)
        raise self._make_error(fault, op, key)

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        fault = self._pick("open", key, None)
        if fault is None:
            return self.inner._read_into(key, start, buffers)
        if fault.after_bytes is not None:
            # a reset mid-download: the bytes before the fault point land, then the error (a
            # stream to break is needed, so this one read goes through the inner _open)
            total = sum(b.nbytes for b in buffers)
            stream = self._break_stream(self.inner._open(key, start, start + total), fault, key)
            return fill_from(stream, buffers)
        if fault.after:
            self.inner._read_into(key, start, buffers)
        raise self._make_error(fault, "open", key)

    def _break_stream(self, stream: Iterator[bytes], fault: Fault, key: str) -> Iterator[bytes]:
        budget = fault.after_bytes or 0
        armed = True
        for chunk in stream:
            if armed and len(chunk) >= budget:
                armed = self._fire(fault)
                if armed:
                    if budget:
                        yield chunk[:budget]
                    close = getattr(stream, "close", None)
                    if close is not None:
                        close()
                    raise self._make_error(fault, "open", key)
            budget -= len(chunk)
            yield chunk
        # The stream ended before the fault point (or the rule was used up meanwhile by another
        # stream): nothing to break.

    def _fire(self, fault: Fault) -> bool:
        with self._fault_lock:
            if fault.times is None:
                return True
            if fault.times <= 0:
                return False
            fault.times -= 1
            return True


def _where(exc: StoreError | ChecksumMismatchError, location: str, key: str) -> str:
    """The ``[operation location/key]`` suffix objckpt.errors puts on a message (same format)."""
    if isinstance(exc, StoreError):
        if not (location or key):
            return ""
        joined = location.rstrip("/") + "/" + key if location else key
        return f" [{exc.operation + ' ' if exc.operation else ''}{joined}]"
    if not (key or location):
        return ""
    return f" [{location.rstrip('/') + '/' if location else ''}{key}]"


__all__ = ["CountingStore", "Fault", "FaultInjectingStore", "PrefixStore"]
