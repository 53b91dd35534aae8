"""Store wrappers for tests and diagnostics: count requests, inject faults.

Both wrap another :class:`Store` and override its *primitives*, delegating to the inner store's
primitives. The wrapper's public methods are the base class's, so its retry policy, multipart
bounding and stream verification apply to an injected fault exactly as to a real server's error.
``location``, ``part_size``, ``max_in_flight``, ``retry`` and ``capabilities`` are copied from the
inner store unless given (keyword arguments). Closing a wrapper closes the inner store unless it
was made with ``close_inner=False``. Public attributes the wrapper lacks (e.g.
``MemoryStore.corrupt``) are looked up on the inner store.

Op names are the primitive names without the leading underscore::

    put get open head list_page list_prefixes delete_batch
    create_upload upload_part complete_upload abort_upload list_uploads abort_pending

Stacking order matters: ``FaultInjectingStore(CountingStore(s))`` counts only requests that
reached ``s``; ``CountingStore(FaultInjectingStore(s))`` counts every try, failed ones included.
"""

from __future__ import annotations

import collections
import fnmatch
import random
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._retry import RetryPolicy
from ..errors import StoreError, TransientError
from .base import (
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
)

OPS = (
    "put",
    "get",
    "open",
    "head",
    "list_page",
    "list_prefixes",
    "delete_batch",
    "create_upload",
    "upload_part",
    "complete_upload",
    "abort_upload",
    "list_uploads",
    "abort_pending",
)


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
        self._close_inner = close_inner
        self.scheme = inner.scheme  # type: ignore[misc]

    def __getattr__(self, name: str) -> Any:
        # Backend-specific public helpers (e.g. MemoryStore.corrupt) stay reachable.
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _invoke(self, op: str, key: str, keys: list[str] | None, fn: Any, *args: Any) -> Any:
        return fn(*args)

    # -- primitives: one line each, so every op goes through _invoke

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        return self._invoke("put", key, None, self.inner._put, key, data, mode, crc32c)

    def _get(self, key: str, start: int, end: int | None) -> bytes:
        return self._invoke("get", key, None, self.inner._get, key, start, end)

    def _open(self, key: str, start: int) -> Iterator[bytes]:
        # Not a generator: the call is counted (and may fail) when the stream is opened.
        return self._invoke("open", key, None, self.inner._open, key, start)

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

    def _abort_pending(self, upload: PendingUpload) -> None:
        return self._invoke("abort_pending", upload.key, None, self.inner._abort_pending, upload)

    def _close(self) -> None:
        # The wrapper owns its inner store unless told otherwise (close_inner=False: a wrapper
        # put around a store that someone else closes, e.g. a test fixture's).
        if self._close_inner:
            self.inner.close()


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
        after_bytes: ``open`` only: the stream yields this many bytes, then raises mid-stream
            (a connection reset during a download). ``None``: raise when opening.
    """

    op: str = "*"
    key: str = "*"
    error: StoreError | type[StoreError] = TransientError
    times: int | None = 1
    after: bool = False
    probability: float = 1.0
    after_bytes: int | None = None

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
                if fault.times is not None:
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
            return error(message, key=key, location=self.location, operation=op)  # type: ignore[call-arg]
        except TypeError:  # not a StoreError: e.g. ChecksumMismatchError, ConnectionResetError
            try:
                return error(message, key=key, location=self.location)  # type: ignore[call-arg]
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

    def _break_stream(self, stream: Iterator[bytes], fault: Fault, key: str) -> Iterator[bytes]:
        budget = fault.after_bytes or 0
        for chunk in stream:
            if len(chunk) >= budget:
                if budget:
                    yield chunk[:budget]
                close = getattr(stream, "close", None)
                if close is not None:
                    close()
                raise self._make_error(fault, "open", key)
            budget -= len(chunk)
            yield chunk
        # The stream ended before the fault point: nothing to break.


__all__ = ["CountingStore", "Fault", "FaultInjectingStore", "OPS"]
