"""S3 reads: the ``_open`` and ``_read_into`` primitives of :class:`~objckpt.store.s3.S3Store`.

One GetObject (ranged unless the whole object is read), or, for reads larger than ``part_size``,
parallel ranged GETs ``read_concurrency`` at a time, on their own thread pool, every range after
the first pinned to the first one's ETag so a read never mixes two versions. ``_read_into`` reads
a ranged GET's body straight into the caller's buffers. A mixin on
:class:`~objckpt.store._s3_client._S3Client`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import botocore.exceptions as bexc

from ..errors import StoreError, TransientError
from ._s3_client import _S3Client
from ._s3_errors import _client_error_parts


class _S3Reads(_S3Client):
    """The read primitives of :class:`~objckpt.store.s3.S3Store` (see the module doc)."""

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` (``end=None``: to the end), streamed.

        Reads larger than ``part_size`` fan out into parallel ranged GETs
        (:meth:`_read_parallel`) unless ``read_concurrency`` is 1; otherwise one GetObject (with
        a Range header unless the whole object is read), yielded in ``read_chunk`` pieces. The
        first request is made at the first ``next()``. A read that fails mid-body raises
        :class:`TransientError`; ``get`` retries, ``get_stream`` resumes from its offset.
        """
        if self.read_concurrency > 1 and (end is None or end - start > self.part_size):
            yield from self._read_parallel(key, start, end)
            return
        kwargs: dict[str, Any] = {"Key": key}
        if start or end is not None:
            kwargs["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        try:
            resp = self._request("get", key, self._client.get_object, **kwargs)
        except StoreError as exc:
            if _is_invalid_range(exc):
                return  # starts at or past the end: nothing there, like a slice
            raise
        # A bounded range (only get() asks for one: it returns the bytes whole anyway) or a body
        # no larger than part_size (the memory unit the store budgets per range) comes as one
        # chunk, so get() returns it without joining pieces: a copy that costs as much as the
        # read itself on a fast server.
        whole = end is not None or int(resp.get("ContentLength") or 0) <= self.part_size
        yield from self._iter_body(resp["Body"], key, whole=whole)

    def _iter_body(self, body: Any, key: str, *, whole: bool = False) -> Iterator[bytes]:
        try:
            while True:
                with self._mapped("get", key):
                    chunk = body.read() if whole else body.read(self.read_chunk)
                if not chunk:
                    return
                yield chunk
                if whole:
                    return
        finally:
            body.close()

    def _read_body(self, body: Any, key: str) -> bytes:
        try:
            with self._mapped("get", key):
                data: bytes = body.read()
                return data
        finally:
            body.close()

    def _read_parallel(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Bytes ``[start, end)`` as ``part_size`` ranged GETs, ``read_concurrency`` at a time.

        One connection's GET is far slower than several in parallel (S3's own advice; measured
        2x on LocalStack), so large reads fan out like uploads do. The first range is streamed
        and tells the object's size and ETag; later ranges carry ``If-Match: <etag>``, so an
        object replaced mid-read fails (TransientError, the caller re-reads) instead of mixing
        versions. Memory: at most ``read_concurrency + 1`` ranges of ``part_size``.
        """
        size = self.part_size
        first_stop = start + size if end is None else min(end, start + size)
        try:
            resp = self._request(
                "get", key, self._client.get_object, Key=key, Range=f"bytes={start}-{first_stop - 1}"
            )
        except StoreError as exc:
            if _is_invalid_range(exc):
                return  # start at or past the end (or an empty object)
            raise
        total = _object_size(resp, start)
        etag = resp.get("ETag")
        yield from self._iter_body(resp["Body"], key)
        stop = total if end is None else min(end, total)
        pos = first_stop
        if pos >= stop:
            return
        pool = self._read_executor()
        pending: deque[Future[bytes]] = deque()
        try:
            while pending or pos < stop:
                while pos < stop and len(pending) < self.read_concurrency:
                    n = min(size, stop - pos)
                    pending.append(pool.submit(self._get_range, key, pos, pos + n, etag))
                    pos += n
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()

    def _read_executor(self) -> ThreadPoolExecutor:
        # Reads get their own threads: a task on the upload pool never waits for one here, and
        # a put_stream fed by a get_stream of the same store cannot starve either side.
        with self._read_pool_lock:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(
                    max_workers=self.read_concurrency, thread_name_prefix="objckpt-s3-read"
                )
            return self._read_pool

    def _get_range(self, key: str, start: int, end: int, etag: str | None) -> bytes:
        kwargs: dict[str, Any] = {"Key": key, "Range": f"bytes={start}-{end - 1}"}
        if etag:
            kwargs["IfMatch"] = etag
        try:
            resp = self._request("get", key, self._client.get_object, **kwargs)
        except StoreError as exc:
            cause = exc.__cause__
            if isinstance(cause, bexc.ClientError) and _client_error_parts(cause)[1] == 412:
                raise TransientError(
                    "object was replaced while being read", key=key, location=self.location, operation="get"
                ) from exc
            raise
        data = self._read_body(resp["Body"], key)
        if len(data) != end - start:
            raise TransientError(
                f"short ranged read: {len(data)} of {end - start} bytes at {start}",
                key=key,
                location=self.location,
                operation="get",
            )
        return data

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # One ranged GET whose body the socket reads straight into the buffers (readinto): no
        # bytes object per chunk, no join.
        total = sum(b.nbytes for b in buffers)
        try:
            resp = self._request(
                "get", key, self._client.get_object, Key=key, Range=f"bytes={start}-{start + total - 1}"
            )
        except StoreError as exc:
            if _is_invalid_range(exc):
                return 0  # starts at or past the end
            raise
        body = resp["Body"]
        filled = 0
        try:
            for buf in buffers:
                pos = 0
                while pos < buf.nbytes:
                    with self._mapped("get", key):
                        n = body.readinto(buf[pos:])
                    if not n:
                        return filled
                    pos += n
                    filled += n
            return filled
        finally:
            body.close()


def _object_size(resp: dict[str, Any], start: int) -> int:
    """Total size from ``Content-Range: bytes a-b/total`` (or a server that sent it all)."""
    content_range = resp.get("ContentRange") or ""
    total = content_range.rpartition("/")[2]
    if total.isdigit():
        return int(total)
    return start + int(resp.get("ContentLength", 0))


def _is_invalid_range(exc: StoreError) -> bool:
    cause = exc.__cause__
    if isinstance(cause, bexc.ClientError):
        code, status, _ = _client_error_parts(cause)
        return code == "InvalidRange" or status == 416
    return False
