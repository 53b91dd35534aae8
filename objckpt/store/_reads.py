"""The read path of every store: ``get``, ``get_into``, ``get_stream`` and ``get_verified``.

:class:`_StoreReads` is a mixin of :class:`~objckpt.store.base.Store`: the public read methods,
derived once for every backend from the one ranged primitive ``_open(key, start, end)`` (and
``_read_into``, which a backend may override to receive into memory). ``get_stream`` resumes a
broken download from its offset and verifies size and CRC32C at the end.

Its own module, with its own ``time`` global: the scale simulator replaces that global with its
virtual clock (``objckpt.testing.scale.clock.PATCHED_MODULES``), so a stream's resume backoff
sleeps in simulated time. The members of ``Store`` it calls are declared below for the type
checker only (``mypy`` checks them against ``Store``'s definitions).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from .._crc import Crc32c
from .._retry import RetryPolicy
from ..errors import ChecksumMismatchError, TransientError
from ._budget import within_budget
from ._parts import _Scatter
from ._types import DEFAULT_READ_CHUNK
from .pacing import Pacer, is_throttling

T = TypeVar("T")


class _StoreReads:
    """``get`` / ``get_into`` / ``get_stream`` for :class:`~objckpt.store.base.Store` (a mixin;
    see the module doc)."""

    if TYPE_CHECKING:  # defined by Store (base.py)
        location: str
        retry: RetryPolicy
        pacing: Pacer | None

        def check_key(self, key: str, operation: str = "") -> None: ...
        def _call(self, fn: Callable[..., T], *args: Any) -> T: ...
        def _notify_retry(self, exc: BaseException, attempt: int) -> None: ...
        def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]: ...

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

    def get_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> int:
        """Read bytes ``[start, start + total)`` of the object straight into ``buffers`` (writable,
        filled in order, ``total`` their summed size): one request, retried whole on a transient
        error. Returns how many bytes were read, fewer only where the object ends first.

        Backends that can receive into memory (file:// ``preadv``, S3 ``readinto``) do so;
        the default copies each chunk of :meth:`_open` once into place.

        Raises:
            NotFoundError: no such key.
            InvalidKeyError: ``key`` breaks the key rule (no request made).
        """
        self.check_key(key, "get")
        if start < 0:
            raise ValueError(f"bad start {start} for key {key!r}")
        views = [memoryview(b).cast("B") for b in buffers]
        if not any(v.nbytes for v in views):
            return 0
        return int(self._call(self._read_into, key, start, views))

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        """Fill ``buffers`` from ``[start, start + total)``; a backend overrides this to read
        into them without an intermediate chunk."""
        total = sum(b.nbytes for b in buffers)
        return fill_from(self._open(key, start, start + total), buffers)

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
        return within_budget(self.retry)

    def get_verified(
        self, key: str, *, expected_size: int | None = None, expected_crc32c: str | None = None
    ) -> bytes:
        """The whole object, only if its size and CRC32C match (``ChecksumMismatchError``)."""
        return b"".join(self.get_stream(key, expected_size=expected_size, expected_crc32c=expected_crc32c))


def fill_from(chunks: Iterable[bytes], buffers: list[memoryview]) -> int:
    """Copy ``chunks`` once, in order, into ``buffers``; how many bytes landed. A chunk stream
    that raises part-way leaves the bytes before it in place (the caller retries whole)."""
    fill = _Scatter(buffers)
    for chunk in chunks:
        fill.write(memoryview(chunk).cast("B"))
    return fill.filled
