"""The write path of every store: ``put`` and ``put_stream`` (bounded parallel multipart).

:class:`_StoreWrites` is a mixin of :class:`~objckpt.store.base.Store`: the public write
methods, derived once for every backend from the upload primitives (``_put_buffers``,
``_create_upload``, ``_upload_part_buffers``, ``_complete_upload``, ``_abort_upload``). It lives
in its own module so that ``base.py`` stays the contract a reader can take in at once; the
members of ``Store`` it calls are declared below for the type checker only (``mypy`` checks them
against ``Store``'s definitions, so they cannot drift).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, TypeVar

from .._crc import Buffer, crc32c_b64, encode_crc32c
from ..errors import AlreadyExistsError
from ._parts import _cut_parts, _Part
from ._types import BytesSource, ObjectMeta, PartResult, PutMode, StreamChecksums, UploadHandle

T = TypeVar("T")


class _StoreWrites:
    """``put`` / ``put_stream`` for :class:`~objckpt.store.base.Store` (a mixin; see the module doc)."""

    if TYPE_CHECKING:  # defined by Store (base.py)
        part_size: int
        max_in_flight: int

        def check_key(self, key: str, operation: str = "") -> None: ...
        def _call(self, fn: Callable[..., T], *args: Any) -> T: ...
        def _check_mode(self, mode: PutMode, key: str) -> None: ...
        def _check_part_size(self, part_size: int, key: str) -> None: ...
        def _executor(self) -> ThreadPoolExecutor: ...
        def _head(self, key: str) -> ObjectMeta: ...
        def _put_buffers(
            self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str
        ) -> ObjectMeta: ...
        def _create_upload(self, key: str, mode: PutMode) -> UploadHandle: ...
        def _upload_part_buffers(
            self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
        ) -> PartResult: ...
        def _complete_upload(
            self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
        ) -> ObjectMeta: ...
        def _abort_upload(self, handle: UploadHandle) -> None: ...

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
        return self._put_checked(key, [view], view.nbytes, crc32c_b64(view), mode)

    def _put_checked(
        self, key: str, buffers: list[memoryview], size: int, crc: str, mode: PutMode
    ) -> ObjectMeta:
        tries = 0

        def attempt() -> ObjectMeta:
            nonlocal tries
            tries += 1
            return self._put_buffers(key, buffers, mode, crc)

        try:
            return self._call(attempt)
        except AlreadyExistsError:
            # A create retried after a transient error may have landed the first time (the
            # response was lost). The same size and CRC32C means the object is our own bytes.
            if tries > 1:
                meta = self._call(self._head, key)
                if meta.size == size and meta.crc32c == crc:
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
        checksums: StreamChecksums | None = None,
        borrow: bool = False,
        single_request_max: int | None = None,
    ) -> ObjectMeta:
        """Stream ``source`` into one object with bounded memory; default mode is create-if-absent.

        Sources no larger than ``single_request_max`` bytes (default: one part) are written with
        a single ``put``; larger ones go through the backend's multipart upload with at most
        ``max_in_flight`` parts buffered or in flight. Every request body carries its CRC32C,
        which the server verifies. The returned meta's ``crc32c`` is the full-object CRC32C
        computed while streaming. ``progress(n)`` is called with each part's byte count once
        that part is uploaded (a single request: the whole size, once).

        ``single_request_max`` is for a caller that writes several objects at once, so their
        parts' parallelism is not needed inside each one: one request instead of a multipart
        upload's create, parts and completion (S3 bills and rate-limits per request; the server
        has no parts to assemble). The parts are read ahead until the source ends or exceeds it,
        so it is capped at ``part_size x max_in_flight``: the memory bound below still holds.

        Each byte is CRC32C-hashed once: per piece (a source buffer's share of one part), the
        part's and the whole object's values combined from those; ``checksums`` (optional)
        receives them, with each source buffer's own CRC32C. A part inside one source buffer is
        a view of it; a part straddling buffers is assembled by copying, unless ``borrow``: the
        caller keeps every source buffer alive and unchanged until this returns (views of live
        tensors), so such a part is sent as the list of views (no copy; memory then is the
        source's, not ``part_size x max_in_flight``).

        Atomicity: the object appears only at completion, whole. On any failure (including
        KeyboardInterrupt) the upload is aborted and the error re-raised. Raises what ``put``
        raises.
        """
        self.check_key(key, "put")
        self._check_mode(mode, key)
        part_size = part_size or self.part_size
        self._check_part_size(part_size, key)
        max_in_flight = max_in_flight or self.max_in_flight
        sums = checksums if checksums is not None else StreamChecksums()
        one_request = max(part_size, min(single_request_max or 0, part_size * max_in_flight))
        parts = _cut_parts(source, part_size, borrow, sums)
        # Read ahead while what was read fits in one request: at most max_in_flight + 1 parts.
        head: list[_Part] = []
        read = 0
        for part in parts:
            head.append(part)
            read += part.size
            if read > one_request:
                break
        else:  # the source ended: one request, no multipart overhead
            buffers = [buf for p in head for buf in p.buffers]
            del head
            sums.parts = min(sums.parts, 1)  # the receipt counts requests' parts: one
            meta = self._put_checked(key, buffers, read, sums.b64, mode)
            if progress:
                progress(read)
            return meta
        # Hand the parts read ahead over without keeping references here: a part must be
        # freed as soon as its upload is done, or the memory bound grows by the read-ahead.
        del part
        return self._multipart(key, _chain(head, parts), mode, max_in_flight, progress, sums)

    def _multipart(
        self,
        key: str,
        parts: Iterator[_Part],
        mode: PutMode,
        max_in_flight: int,
        progress: Callable[[int], None] | None,
        sums: StreamChecksums,
    ) -> ObjectMeta:
        handle: UploadHandle = self._call(self._create_upload, key, mode)
        results: list[PartResult] = []
        in_flight: set[Future[PartResult]] = set()
        pool = self._executor()
        offset = 0
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
                # The task takes the buffers out of their holder, so they are released when
                # the upload returns, not when the pool gets round to dropping its arguments.
                crc = encode_crc32c(part.crc)
                holder = [part.buffers]
                in_flight.add(pool.submit(self._upload_held, handle, number, offset, holder, crc))
                offset += part.size
                del part, holder
            while in_flight:
                done, in_flight = _wait_first(in_flight)
                results.extend(_collect(done, progress))
            results.sort(key=lambda r: r.part_number)
            return self._call(self._complete_upload, handle, results, sums.size, sums.b64)
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
        self, handle: UploadHandle, number: int, offset: int, holder: list[list[memoryview]], crc: str
    ) -> PartResult:
        buffers = holder.pop()
        return self._call(self._upload_part_buffers, handle, number, offset, buffers, crc)


def _chain(head: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
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
