"""``gs://bucket/prefix``: Google Cloud Storage (and fake-gcs-server for tests).

:class:`GCSStore` addresses a bucket; ``open_store`` puts the run root's prefix on it with a
:class:`~objckpt.store.wrappers.PrefixStore` and keeps the store's private area (below) under
the run root. How each guarantee maps onto GCS (every one is the server's own; there is never a
check-then-write on the client):

* create-if-absent is ``ifGenerationMatch=0``; compare-and-swap is ``ifGenerationMatch=<gen>``;
  the version token is the object's generation (as a string). A 412 becomes
  :class:`AlreadyExistsError` (create) or :class:`PreconditionFailedError` (update).
* every upload carries the CRC32C computed by the base class in the object metadata, which GCS
  checks against the bytes it received and rejects on mismatch. The server's CRC32C of the stored
  object (returned by every upload) is compared with ours as well, so a server or proxy that does
  not check (fake-gcs-server does not) still cannot make a corrupted write look successful.
  Either way the caller gets :class:`ChecksumMismatchError`.
* ``put`` is one request: a multipart (metadata + media) upload up to 8 MiB, a single-session
  resumable upload above that (google-cloud-storage's own threshold).
* ``put_stream`` is a *parallel composite upload*: each part becomes a temporary object under
  ``<private root>/.objckpt/parts/<upload id>/`` (uploaded from the base class's thread pool, at
  most ``max_in_flight`` at a time); completion composes them (at most 32 sources per compose, so
  a tree for more) into a staged temporary, checks the staged object's size and CRC32C against
  the full-object CRC32C streamed by the base class, and only then publishes it with one more
  compose onto the target under the write's precondition. The target therefore appears at
  once, whole and verified, or not at all. Temporaries are deleted afterwards; ``abort`` deletes
  them; a marker object ``<private root>/.objckpt/uploads/<upload id>`` (metadata: target key)
  lets ``list_uploads`` find abandoned uploads for GC. Nothing under ``.objckpt/`` is ever
  returned by ``list`` or ``list_prefixes``, and user keys may not start with it.
  GCS allows at most 1,024 components in a composite object, so one ``put_stream`` may have at
  most 1,024 parts: objects larger than ``1024 x part_size`` fail with a :class:`StoreError`
  telling to raise ``part_size``.
* reads are ranged GETs: one for a bounded range (``get(byte_range=)``), ``read_chunk``-sized
  ones for an open-ended read; the first one's answer names the object's generation and every
  later range of the same read is pinned to it, so a read never mixes two versions. An object delivered whole by one answer is checked against the CRC32C the server
  sends with it (a mismatch is corruption in transit: :class:`TransientError`, retried).
* google-cloud-storage's own retries are off (``retry=None`` on every call): tenacity in
  :class:`~objckpt._retry.RetryPolicy` is the one retry layer.

SDK exceptions are translated at this edge, by one table (:data:`GCS_ERROR_STATUSES`, then
:data:`GCS_CLIENT_ERRORS`) and one function (:meth:`GCSStore._map_error`), applied by one context
manager (:meth:`GCSStore._mapped`) around every SDK call; nothing above this module sees
google-cloud-storage, google-api-core or requests exceptions.

Options: :attr:`GCSStore.OPTIONS` (``objckpt.store.options_for("gs")`` lists them with the common
ones); ``credentials`` and ``client`` are keyword-only objects.

This module holds :class:`GCSStore` itself (single-object writes, reads, HEAD, LIST, DELETE);
the rest lives in private modules, each one concern: ``_gcs_client.py`` (options, the client,
the translation point and the helpers every primitive shares: the base class),
``_gcs_compose.py`` (parallel composite uploads, a mixin on it) and ``_gcs_errors.py`` (the
error tables). The names objckpt and its users import (``__all__``) are imported from here as
before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from google.api_core import exceptions as gexc

from .._crc import crc32c_b64
from ..errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    NotFoundError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from ._gcs_compose import MAX_COMPONENTS, MAX_COMPOSE_SOURCES, _GCSComposite
from ._gcs_errors import _SDK_ERRORS, GCS_CLIENT_ERRORS, GCS_ERROR_STATUSES
from .base import Capabilities, ObjectMeta, PutMode, Store
from .wrappers import PrefixStore

if TYPE_CHECKING:
    from ._uri import ParsedURI

#: one logger for the GCS store, whichever of its modules logs
log = logging.getLogger("objckpt.store.gcs")


class GCSStore(_GCSComposite):
    """Objects in ``gs://bucket`` (keys are full object names; ``open_store`` wraps the store in
    a :class:`PrefixStore` for a run root below the bucket). Thread-safe (one client, shared;
    requests made lazily, none in the constructor).

    Atomicity: ``put`` is one upload request; ``put_stream`` becomes visible only with the final
    compose, whole and CRC32C-verified. CREATE and update modes are enforced by the server
    (``ifGenerationMatch``).

    Lost responses: when a conditional write was applied but its answer lost, the retry meets a
    412 caused by itself. A composite upload recognises its own object exactly (the publishing
    compose stamps the upload id into the object's metadata); a ``put`` retried after a transient
    error accepts an existing object with exactly its size and CRC32C as its own.

    Raises (from every method): :class:`TransientError` (429, 408, 5xx, timeouts, connection
    resets; retried by the store's policy), :class:`PermissionDeniedError` (401/403, no usable
    credentials), :class:`NotFoundError` (no such object), :class:`BucketNotFoundError` (no such
    bucket), :class:`AlreadyExistsError` / :class:`PreconditionFailedError` (conditional write
    lost), :class:`ChecksumMismatchError` (the server refused or stored other bytes than sent),
    :class:`StoreError` (400 and any other rejection), :class:`InvalidKeyError` (the key rule, or
    a key in the private area; no request made).
    """

    scheme = "gs"
    # Every precondition is the server's (ifGenerationMatch), decided atomically by GCS.
    capabilities = Capabilities.ALL

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> Store:
        """``gs://bucket/prefix?...``: the bucket's store (private area under the prefix), inside
        a :class:`PrefixStore` for the prefix."""
        store = cls(parsed.bucket, private_root=parsed.prefix, **options)
        return PrefixStore(store, parsed.prefix) if parsed.prefix else store

    def __repr__(self) -> str:  # never the credentials
        return f"GCSStore({self.location!r})"

    # ------------------------------------------------------------------ writes (composite: _gcs_compose.py)

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """One upload request (resumable above 8 MiB), atomic, conditional on ``mode``."""
        return self._put_buffers(key, [data], mode, crc32c)

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        """:meth:`_put` of consecutive buffers, sent as one body without joining them."""
        generation = self._generation_or_refuse(mode, key)
        size = sum(b.nbytes for b in buffers)
        attempt = (key, crc32c, size, mode)
        retrying = getattr(self._unsure, "put", None) == attempt
        self._unsure.put = None
        try:
            blob = self._upload(key, buffers, crc32c, if_generation_match=generation)
        except _SDK_ERRORS as exc:
            mapped = self._map_error(exc, "put", key, mode)
            if isinstance(mapped, TransientError):
                # The server may have applied the write before the error (a lost response):
                # the retry that follows, on this thread, may meet our own object.
                self._unsure.put = attempt
            elif retrying and isinstance(mapped, (AlreadyExistsError, PreconditionFailedError)):
                mine = self._same_content(key, size, crc32c)
                if mine is not None:
                    return mine
            if mapped is exc:
                raise
            raise mapped from exc
        self._reject_mismatch(blob, crc32c, key, "put")
        return self._meta(blob, key)

    def _same_content(self, key: str, size: int, crc32c: str) -> ObjectMeta | None:
        """The object at ``key`` if it holds exactly the bytes we tried to write (same size and
        CRC32C), else ``None``. Asked only when a retry of a conditional write that may have
        been applied (its try ended in a transient error) meets a 412: then the object is the
        earlier try's, and failing with a conflict against ourselves would be wrong."""
        try:
            meta = self._head(key)
        except StoreError:
            return None
        if meta.size == size and meta.crc32c == crc32c:
            log.info("%s/%s: a retried write found its own earlier write", self.location, key)
            return meta
        return None

    # ------------------------------------------------------------------ reads

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        """Bytes ``[start, end)``: one ranged GET for a bounded range, ranged GETs of
        ``read_chunk`` bytes for an open-ended read (``end=None``).

        No HEAD first: the first range's answer names the generation (``x-goog-generation``), and
        every later range is pinned to it, so one read never mixes two versions (a generation
        replaced mid-read is a :class:`NotFoundError` saying so). A short answer is the end of
        the object; a range at or past the end answers 416, which is the end too. When the first
        answer holds the whole object, its bytes are checked against the ``x-goog-hash`` CRC32C
        it came with (a mismatch is damage in transit: :class:`TransientError`, retried).
        """
        bucket = self._bucket
        generation: int | None = None
        pos = start
        while end is None or pos < end:
            # A bounded range (only get() asks for one, and returns it whole) is one request;
            # an open-ended read streams read_chunk ranges, so its memory stays bounded.
            want = self.read_chunk if end is None else end - pos
            blob = bucket.blob(key, generation=generation)
            try:
                with self._mapped("get", key):
                    chunk = blob.download_as_bytes(
                        start=pos, end=pos + want - 1, checksum=None, timeout=self.timeout, retry=None
                    )
            except BucketNotFoundError:
                raise
            except NotFoundError as exc:
                if generation is None:
                    raise
                raise NotFoundError(
                    f"generation {generation} was replaced or deleted while being read",
                    key=key,
                    location=self.location,
                    operation="get",
                ) from exc
            except StoreError as exc:
                if isinstance(exc.__cause__, gexc.RequestRangeNotSatisfiable):
                    return  # at or past the end: no bytes, like a slice
                raise
            if generation is None:
                generation = int(blob.generation) if blob.generation is not None else None
                whole = pos == 0 and len(chunk) < want
                if whole and blob.crc32c and crc32c_b64(chunk) != blob.crc32c:
                    raise TransientError(
                        f"download corrupted in transit: CRC32C {crc32c_b64(chunk)}, the server "
                        f"says {blob.crc32c}",
                        key=key,
                        location=self.location,
                        operation="get",
                    )
            if chunk:
                yield chunk
            if len(chunk) < want:
                return
            pos += len(chunk)

    def _head(self, key: str) -> ObjectMeta:
        blob = self._bucket.blob(key)
        with self._mapped("head", key):
            blob.reload(timeout=self.timeout, retry=None)
        return self._meta(blob, key)

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        out: list[ObjectMeta] = []
        token = None
        with self._mapped("list", prefix):
            while True:
                it = self.client.list_blobs(
                    self.bucket_name,
                    prefix=prefix,
                    # inclusive on the server: the equal key is skipped below
                    start_offset=start_after,
                    page_size=limit,
                    page_token=token,
                    timeout=self.timeout,
                    retry=None,
                )
                page = next(it.pages)
                for blob in page:
                    name = blob.name
                    if (start_after is not None and name <= start_after) or name.startswith(self._private):
                        continue
                    out.append(self._meta(blob, name))
                token = it.next_page_token
                # Keep going past pages that held only hidden keys: an empty page with more to
                # come would end the caller's listing early.
                if out or not token:
                    return out, bool(token)

    def _list_prefixes(self, prefix: str) -> list[str]:
        with self._mapped("list_prefixes", prefix):
            it = self.client.list_blobs(
                self.bucket_name, prefix=prefix, delimiter="/", timeout=self.timeout, retry=None
            )
            for _ in it:  # the prefixes accumulate as the pages go by
                pass
            found = list(it.prefixes)
        return sorted(p for p in found if not p.startswith(self._private))

    # ------------------------------------------------------------------ deletes

    def _delete_batch(self, keys: list[str]) -> None:
        with self._mapped("delete", keys[0] if len(keys) == 1 else ""):
            self._delete_names(keys)

    def _close(self) -> None:
        with self._client_lock:
            pool, self._aux = self._aux, None
            client = self._client if self._owns_client else None
            if self._owns_client:
                self._client = None  # a later call builds a fresh one
        if pool is not None:
            pool.shutdown(wait=True)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing is best effort; nothing to do about it
                log.debug("closing the GCS client failed", exc_info=True)


__all__ = ["GCSStore", "GCS_CLIENT_ERRORS", "GCS_ERROR_STATUSES", "MAX_COMPONENTS", "MAX_COMPOSE_SOURCES"]
