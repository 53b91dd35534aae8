"""The GCS store's configuration and what every one of its primitives shares: the lazily built
client, the bucket handle, error translation, one-object uploads, listings and deletes by name.

:class:`_GCSClient` is the base of :class:`~objckpt.store.gcs.GCSStore` and of its composite
upload mixin (``_gcs_compose.py``): the constructor (``GCSStore``'s options; no request, no
credential lookup), the ``google.cloud.storage.Client`` built on first use, ``_mapped`` /
``_map_error`` (THE translation point, with the 404 bucket-or-object triage), and the helpers a
put and a composite upload both use (``_upload``, ``_reject_mismatch``, ``_list_names``,
``_delete_names``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from ..errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
)
from ._gcs_errors import (
    _SDK_ERRORS,
    GCS_CLIENT_ERRORS,
    GCS_ERROR_STATUSES,
    InvalidResponse,
    _server_message,
    _status_of,
)
from ._options import Option, anything, boolean, seconds, size, text
from ._util import BuffersReader
from .base import ObjectMeta, PutMode, Store

#: one logger for the GCS store, whichever of its modules logs
log = logging.getLogger("objckpt.store.gcs")

#: bytes per ranged GET of an open-ended read. Not the store-wide ``DEFAULT_READ_CHUNK`` (4 MiB,
#: the piece size *within* one response for S3, file:// and memory): here each chunk is its own
#: request, so the size sets the request count of a stream (4 MiB would double it). No benchmark
#: has measured the choice; keep it apart from the buffer-piece default.
DEFAULT_READ_CHUNK = 8 * 1024 * 1024
DEFAULT_TIMEOUT = 60.0

#: private area under the store's private root; never listed, never a user key
PRIVATE = ".objckpt/"


class _GCSClient(Store):
    """Configuration, client and shared plumbing of :class:`~objckpt.store.gcs.GCSStore` (see
    the module doc); no primitive is implemented here."""

    OPTIONS = (
        Option("endpoint_url", text, None, "API endpoint, e.g. http://127.0.0.1:4443 for fake-gcs-server"),
        Option("project", text, None, "project for the client (default: the credentials' project)"),
        Option(
            "anonymous",
            boolean,
            None,
            "true: no credentials (emulators); default true with an endpoint_url, else the "
            "Application Default Credentials chain",
        ),
        Option("timeout", seconds, DEFAULT_TIMEOUT, "seconds per HTTP request"),
        Option("read_chunk", size, "8MiB", "bytes per ranged GET while reading"),
        Option(
            "credentials", anything, None, "a google.auth credentials object", secret=True, keyword_only=True
        ),
        Option("client", anything, None, "a ready google.cloud.storage.Client (tests)", keyword_only=True),
    )

    def __init__(
        self,
        bucket: str,
        *,
        private_root: str = "",
        endpoint_url: str | None = None,
        project: str | None = None,
        anonymous: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        read_chunk: int = DEFAULT_READ_CHUNK,
        credentials: Any = None,
        client: Any = None,
        **store_kwargs: Any,
    ) -> None:
        """Open ``gs://bucket``. No request is made (and no credential looked up) here.

        ``private_root``: where the private area lives (``<private_root>/.objckpt/``);
        ``open_store`` passes the run root's prefix, so the temporaries of a run stay under its
        root (one prefix-scoped IAM grant covers them) and keys under ``<run>/.objckpt/`` are
        reserved.

        Raises:
            ConfigError: an invalid option.
        """
        self.bucket_name = bucket
        super().__init__(location=f"gs://{bucket}", **store_kwargs)
        if timeout <= 0 or read_chunk < 1:
            raise ConfigError(f"timeout and read_chunk must be positive for {self.location}")
        root = private_root.strip("/")
        self._private = (root + "/" if root else "") + PRIVATE
        self._parts = self._private + "parts/"
        self._uploads = self._private + "uploads/"
        self.endpoint_url = endpoint_url.rstrip("/") if endpoint_url else None
        self.project = project
        self.anonymous = (endpoint_url is not None) if anonymous is None else anonymous
        self.timeout = timeout
        self.read_chunk = read_chunk
        self._credentials = credentials
        self._client = client
        self._owns_client = client is None  # an injected client is the caller's to close
        self._client_lock = threading.Lock()
        self._aux: ThreadPoolExecutor | None = None
        # set once the bucket is known to exist (404 triage); read and written only under
        # _bucket_lock, held across the probe, so concurrent first uses ask once (_bucket_exists)
        self._bucket_seen = False
        self._bucket_lock = threading.Lock()
        # per thread: the put whose last try ended in a transient error (it may have been
        # applied); the store's retry loop re-calls _put on the same thread
        self._unsure = threading.local()

    # ------------------------------------------------------------------ plumbing

    @property
    def client(self) -> Any:
        """The ``google.cloud.storage.Client``, built on first use."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        kwargs: dict[str, Any] = {}
        if self.endpoint_url:
            kwargs["client_options"] = {"api_endpoint": self.endpoint_url}
        credentials = self._credentials
        if credentials is None and self.anonymous:
            # google-auth leaves AnonymousCredentials.__init__ unannotated.
            credentials = AnonymousCredentials()  # type: ignore[no-untyped-call]
        if credentials is not None:
            kwargs["credentials"] = credentials
        project = self.project or ("objckpt-anonymous" if self.anonymous else None)
        try:
            client = storage.Client(project=project, **kwargs)
        except auth_exc.DefaultCredentialsError as exc:
            raise PermissionDeniedError(
                "no usable Google credentials (set up Application Default Credentials, or pass "
                "anonymous=true for an emulator)",
                location=self.location,
                operation="connect",
            ) from exc
        try:
            # Room for every part in flight plus listings/deletes, so connections are reused
            # instead of being dropped with "connection pool is full". Retries stay off.
            size = max(16, 2 * self.max_in_flight)
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=size, max_retries=0)
            client._http.mount("https://", adapter)
            client._http.mount("http://", adapter)
        except (AttributeError, TypeError):  # pragma: no cover - a performance tweak only
            log.debug("could not resize the HTTP connection pool", exc_info=True)
        return client

    @property
    def _bucket(self) -> Any:
        return self.client.bucket(self.bucket_name)

    def _aux_pool(self) -> ThreadPoolExecutor:
        """Threads for fan-out *within* one primitive (deletes, compose levels). Separate from
        the base class's part pool, whose threads may be the ones waiting on this one."""
        with self._client_lock:
            if self._aux is None:
                self._aux = ThreadPoolExecutor(max_workers=8, thread_name_prefix="objckpt-gcs")
            return self._aux

    def _meta(self, blob: Any, key: str | None = None) -> ObjectMeta:
        return ObjectMeta(
            key=blob.name if key is None else key,
            size=int(blob.size or 0),
            version=str(blob.generation),
            crc32c=blob.crc32c,
            last_modified=blob.updated or blob.time_created,
        )

    def _key_rule(self, key: str) -> str | None:
        if key.startswith(self._private):
            return f"keys under {self._private!r} are reserved for objckpt's temporary upload parts"
        return None

    @staticmethod
    def _generation_match(mode: PutMode) -> int | None:
        if mode.kind == "create":
            return 0
        if mode.kind == "update":
            return int(mode.version)  # type: ignore[arg-type]
        return None

    def _generation_or_refuse(self, mode: PutMode, key: str) -> int | None:
        try:
            return self._generation_match(mode)
        except ValueError:  # not a generation: it cannot match the current one
            raise PreconditionFailedError(
                f"{mode.version!r} is not a GCS generation", key=key, location=self.location, operation="put"
            ) from None

    def _bucket_missing(self, exc: BaseException, operation: str) -> bool:
        """Whether a 404 is about the bucket rather than the object."""
        message = _server_message(exc).lower()
        # GCS: "The specified bucket does not exist." (an object's 404, "No such object:
        # <bucket>/<name>", may contain the word bucket in the names)
        if "bucket does not exist" in message or "bucket not found" in message:
            return True
        if operation in ("put", "list", "list_prefixes", "create_upload", "list_uploads", "upload_part"):
            return True  # these address the bucket only
        # fake-gcs-server says just "Not Found" for both: ask (once). Cannot tell: report the
        # object as missing, as the server said.
        return self._bucket_exists() is False

    def _bucket_exists(self) -> bool | None:
        """Whether the bucket exists, asked of the server until it is known to (then
        remembered); ``None``: the probe failed, so nothing is remembered and the next call asks
        again. One probe for every 404 triage; the lock is held across it, so threads that meet
        their first 404 together make one request, not one each."""
        with self._bucket_lock:
            if self._bucket_seen:
                return True
            try:
                exists = bool(self._bucket.exists(timeout=self.timeout, retry=None))
            except _SDK_ERRORS:
                return None
            self._bucket_seen = exists
            return exists

    def _map_error(
        self, exc: BaseException, operation: str, key: str, mode: PutMode | None = None
    ) -> BaseException:
        """Translate one SDK exception into the objckpt error a caller can act on.

        A server answer: 412 is :class:`AlreadyExistsError` (CREATE) or
        :class:`PreconditionFailedError`; 404 is :class:`BucketNotFoundError` when the bucket is
        missing (the message says so, the call addresses only the bucket, or the bucket was
        asked about once), else :class:`NotFoundError`; 400 speaking of a checksum or CRC32C is
        :class:`ChecksumMismatchError`; other statuses come from :data:`GCS_ERROR_STATUSES`,
        and anything left is :class:`StoreError` (permanent). Other exceptions go through
        :data:`GCS_CLIENT_ERRORS`. Returns ``exc`` itself when it is not an SDK error.

        The caller raises the result ``from exc`` so ``__cause__`` keeps the SDK error. Messages
        carry the HTTP status and the server's message, never request headers or credentials.
        """
        where = {"key": key, "location": self.location, "operation": operation}
        if isinstance(exc, (StoreError, ChecksumMismatchError)):
            return exc
        if isinstance(exc, (gexc.GoogleAPICallError, InvalidResponse)):
            status = _status_of(exc)
            detail = f"HTTP {status}: {_server_message(exc)}"
            if status == 412:
                if mode is not None and mode.kind == "create":
                    return AlreadyExistsError(f"object already exists; {detail}", **where)
                if mode is not None and mode.kind == "update":
                    return PreconditionFailedError(f"generation is not {mode.version}; {detail}", **where)
                return PreconditionFailedError(f"precondition failed; {detail}", **where)
            if status == 404:
                if self._bucket_missing(exc, operation):
                    return BucketNotFoundError(
                        f"bucket {self.bucket_name!r} does not exist; {detail}", **where
                    )
                return NotFoundError(f"no such object; {detail}", **where)
            if status == 400 and ("crc32c" in detail.lower() or "checksum" in detail.lower()):
                return ChecksumMismatchError(
                    f"server rejected the data: checksum mismatch ({detail}); the bytes sent do not "
                    "match their CRC32C",
                    key=key,
                    location=self.location,
                )
            cls, meaning = GCS_ERROR_STATUSES.get(status, (StoreError, "request rejected"))
            return cls(f"{meaning}; {detail}", **where)
        for types, cls, meaning in GCS_CLIENT_ERRORS:
            if isinstance(exc, types):
                return cls(f"{meaning}: {type(exc).__name__}: {exc}", **where)
        return exc

    @contextmanager
    def _mapped(self, operation: str, key: str, mode: PutMode | None = None) -> Iterator[None]:
        """THE translation point: an SDK exception raised inside becomes its objckpt error
        (:meth:`_map_error`), ``__cause__`` kept. Exactly once: no retry here."""
        try:
            yield
        except _SDK_ERRORS as exc:
            mapped = self._map_error(exc, operation, key, mode)
            if mapped is exc:
                raise
            raise mapped from exc

    # ------------------------------------------------------------------ uploads (one object: put, parts)

    def _upload(
        self,
        name: str,
        buffers: list[memoryview],
        crc32c: str,
        *,
        if_generation_match: int | None,
        metadata: dict[str, str] | None = None,
    ) -> Any:
        """Upload one object in one upload session; the server checks ``crc32c`` (sent in the
        object metadata) and we check the CRC32C it reports back. ``buffers`` are consecutive,
        sent as one body without joining them. Returns the blob. SDK errors are raised
        as they are (the caller maps them with the write's mode)."""
        body = BuffersReader(buffers)
        blob = self._bucket.blob(name)
        blob.crc32c = crc32c  # part of the upload's metadata: GCS rejects a mismatch (400)
        if metadata:
            blob.metadata = metadata
        blob.upload_from_file(
            body,
            size=len(body),
            content_type="application/octet-stream",
            if_generation_match=if_generation_match,
            checksum=None,  # ours is already in the metadata; do not hash the bytes twice
            retry=None,
            timeout=self.timeout,
        )
        return blob

    def _reject_mismatch(self, blob: Any, crc32c: str, key: str, operation: str) -> None:
        """The server stored bytes whose CRC32C is not the one we computed: take our write
        back (only that generation, never a later writer's) and fail like a server that refused
        the body (:class:`ChecksumMismatchError`)."""
        if blob.crc32c == crc32c:
            return
        try:
            self._bucket.blob(blob.name).delete(
                if_generation_match=blob.generation, timeout=self.timeout, retry=None
            )
        except _SDK_ERRORS:  # gone or replaced already: nothing of ours to take back
            log.warning("could not delete %s after a CRC32C mismatch", blob.name, exc_info=True)
        raise ChecksumMismatchError(
            f"checksum mismatch on {operation}: the server stored CRC32C {blob.crc32c}, the bytes "
            f"sent have {crc32c}; the write was deleted",
            key=key,
            location=self.location,
        )

    # ------------------------------------------------------------------ names (listings, deletes)

    def _list_names(self, full_prefix: str) -> Iterator[Any]:
        """Every object whose name starts with ``full_prefix`` (all pages)."""
        return iter(
            self.client.list_blobs(self.bucket_name, prefix=full_prefix, timeout=self.timeout, retry=None)
        )

    def _delete_names(self, names: list[str]) -> None:
        """Delete object names concurrently; absent ones are fine (a retried batch sees its own
        earlier deletes), a missing bucket is not. SDK errors are raised as they are."""

        def one(name: str) -> bool:
            try:
                self._bucket.blob(name).delete(timeout=self.timeout, retry=None)
            except gexc.NotFound:
                return False
            return True

        if not names:
            return
        results = list(self._aux_pool().map(one, names))
        # A failed probe cannot tell: the deletes themselves did not fail (and, unlike before,
        # nothing is remembered, so a later 404 asks again, as _bucket_missing does).
        if not all(results) and self._bucket_exists() is False:
            raise BucketNotFoundError(
                f"bucket {self.bucket_name!r} does not exist",
                key="",
                location=self.location,
                operation="delete",
            )


__all__ = ["DEFAULT_READ_CHUNK", "DEFAULT_TIMEOUT", "PRIVATE"]
