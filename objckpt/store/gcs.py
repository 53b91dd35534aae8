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
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from .._crc import crc32c_b64
from ..errors import (
    AlreadyExistsError,
    BucketNotFoundError,
    ChecksumMismatchError,
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from ._options import Option, anything, boolean, seconds, size, text
from ._util import ViewReader
from .base import (
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
)
from .wrappers import PrefixStore

try:  # google-cloud-storage >= 3 vendors resumable-media; older versions use the package
    from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
except ImportError:  # pragma: no cover - google-cloud-storage 2.x
    from google.resumable_media import DataCorruption, InvalidResponse

if TYPE_CHECKING:
    from ._uri import ParsedURI

log = logging.getLogger("objckpt.store.gcs")

#: GCS: at most 32 sources per compose request
MAX_COMPOSE_SOURCES = 32
#: GCS: a composite object has at most 1,024 components, however it was composed
MAX_COMPONENTS = 1024
DEFAULT_READ_CHUNK = 8 * 1024 * 1024
DEFAULT_TIMEOUT = 60.0

#: private area under the store's private root; never listed, never a user key
PRIVATE = ".objckpt/"
_META_KEY = "objckpt-key"
_META_UPLOAD = "objckpt-upload"

# ---------------------------------------------------------------------------- error mapping

_DENIED = "access denied (check the credentials and the bucket's IAM)"
_RETRYABLE = "server error, retryable"

#: THE table for server answers: HTTP status -> (objckpt error class, what it means). Three
#: statuses need more than the status (see GCSStore._map_error): 412 (which write mode), 404
#: (object or bucket) and 400 (a checksum the server refused, or another rejection).
GCS_ERROR_STATUSES: dict[int, tuple[type[StoreError], str]] = {
    401: (PermissionDeniedError, _DENIED),
    403: (PermissionDeniedError, _DENIED),
    **dict.fromkeys((408, 429, 500, 502, 503, 504), (TransientError, _RETRYABLE)),
}

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    requests.exceptions.ConnectionError,  # refused, reset, DNS, proxy
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,  # body cut short
    requests.exceptions.ContentDecodingError,
    ConnectionError,
    TimeoutError,
    auth_exc.TransportError,  # token refresh could not reach the token server
)
#: the table for exceptions that are not server answers, checked in order (first match wins)
GCS_CLIENT_ERRORS: tuple[tuple[tuple[type[BaseException], ...], type[StoreError], str], ...] = (
    # bytes damaged in transit: the stored object is fine, a new download may succeed
    ((DataCorruption,), TransientError, "download corrupted in transit"),
    ((auth_exc.RefreshError,), PermissionDeniedError, "could not obtain a Google access token"),
    ((auth_exc.DefaultCredentialsError,), PermissionDeniedError, "no usable Google credentials"),
    ((requests.exceptions.SSLError,), StoreError, "TLS error talking to the endpoint"),  # no healing
    (_CONNECTION_ERRORS, TransientError, "connection problem"),
)
#: everything the SDK raises: what the one translation point catches (other errors are bugs
#: and propagate unchanged)
_SDK_ERRORS: tuple[type[BaseException], ...] = (
    gexc.GoogleAPIError,
    InvalidResponse,
    DataCorruption,
    auth_exc.GoogleAuthError,
    requests.exceptions.RequestException,
    ConnectionError,
    TimeoutError,
)


def _status_of(exc: BaseException) -> int:
    if isinstance(exc, gexc.GoogleAPICallError) and exc.code is not None:
        return int(exc.code)
    response = getattr(exc, "response", None)
    return int(getattr(response, "status_code", 0) or 0)


def _server_message(exc: BaseException) -> str:
    """The server's own words, without the request URL the SDK prefixes (it can be long, and
    it is the only place a signed URL or a user project would ever show)."""
    if isinstance(exc, gexc.GoogleAPICallError):
        for err in exc.errors or ():
            if isinstance(err, dict) and err.get("message"):
                return str(err["message"])
        text = str(exc.message or "")
        text = text.split(": ", 1)[1].split("\n", 1)[0] if ": " in text else text
        try:  # media requests carry the JSON error body as text
            return str(json.loads(text)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            return text[:300]
    return type(exc).__name__


class GCSStore(Store):
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
    # Every precondition is the server's (ifGenerationMatch), decided atomically by GCS.
    capabilities = Capabilities.ALL

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
        self._bucket_seen = False  # set once the bucket is known to exist (404 triage)
        # per thread: the put whose last try ended in a transient error (it may have been
        # applied); the store's retry loop re-calls _put on the same thread
        self._unsure = threading.local()

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> Store:
        """``gs://bucket/prefix?...``: the bucket's store (private area under the prefix), inside
        a :class:`PrefixStore` for the prefix."""
        store = cls(parsed.bucket, private_root=parsed.prefix, **options)
        return PrefixStore(store, parsed.prefix) if parsed.prefix else store

    def __repr__(self) -> str:  # never the credentials
        return f"GCSStore({self.location!r})"

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
        if self._bucket_seen:
            return False
        # fake-gcs-server says just "Not Found" for both: ask once, then remember.
        try:
            exists = bool(self._bucket.exists(timeout=self.timeout, retry=None))
        except _SDK_ERRORS:
            return False  # cannot tell: report the object as missing, as the server said
        self._bucket_seen = exists
        return not exists

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

    # ------------------------------------------------------------------ uploads

    def _upload(
        self,
        name: str,
        data: memoryview,
        crc32c: str,
        *,
        if_generation_match: int | None,
        metadata: dict[str, str] | None = None,
    ) -> Any:
        """Upload one object in one upload session; the server checks ``crc32c`` (sent in the
        object metadata) and we check the CRC32C it reports back. Returns the blob. SDK errors
        are raised as they are (the caller maps them with the write's mode)."""
        blob = self._bucket.blob(name)
        blob.crc32c = crc32c  # part of the upload's metadata: GCS rejects a mismatch (400)
        if metadata:
            blob.metadata = metadata
        blob.upload_from_file(
            ViewReader(data),
            size=data.nbytes,
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

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """One upload request (resumable above 8 MiB), atomic, conditional on ``mode``."""
        generation = self._generation_or_refuse(mode, key)
        attempt = (key, crc32c, data.nbytes, mode)
        retrying = getattr(self._unsure, "put", None) == attempt
        self._unsure.put = None
        try:
            blob = self._upload(key, data, crc32c, if_generation_match=generation)
        except _SDK_ERRORS as exc:
            mapped = self._map_error(exc, "put", key, mode)
            if isinstance(mapped, TransientError):
                # The server may have applied the write before the error (a lost response):
                # the retry that follows, on this thread, may meet our own object.
                self._unsure.put = attempt
            elif retrying and isinstance(mapped, (AlreadyExistsError, PreconditionFailedError)):
                mine = self._same_content(key, data.nbytes, crc32c)
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

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        self._generation_or_refuse(mode, key)
        upload_id = uuid.uuid4().hex
        marker = memoryview(upload_id.encode())
        with self._mapped("create_upload", key):
            # The marker names the target key, so GC can find and abort an abandoned upload.
            self._upload(
                self._uploads + upload_id,
                marker,
                crc32c_b64(marker),
                if_generation_match=0,
                metadata={_META_KEY: key},
            )
        return UploadHandle(key=key, mode=mode, upload_id=upload_id)

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        if part_number > MAX_COMPONENTS:
            raise StoreError(
                f"object needs more than {MAX_COMPONENTS} parts of {data.nbytes} bytes; a GCS "
                f"composite object has at most {MAX_COMPONENTS} components: raise part_size",
                key=handle.key,
                location=self.location,
                operation="upload_part",
            )
        name = f"{self._parts}{handle.upload_id}/{part_number:05d}"
        with self._mapped("upload_part", handle.key):
            # Unconditional: the name is private to this upload, and a retry after a lost
            # response must be able to replace the part.
            blob = self._upload(name, data, crc32c, if_generation_match=None)
        self._reject_mismatch(blob, crc32c, handle.key, "upload_part")
        return PartResult(part_number, offset, data.nbytes, crc32c, token=(name, blob.generation))

    def _compose(
        self,
        target: str,
        sources: list[tuple[str, int]],
        *,
        if_generation_match: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Any:
        bucket = self._bucket
        blob = bucket.blob(target)
        blob.content_type = "application/octet-stream"
        if metadata:
            blob.metadata = metadata
        # Each source is pinned to the generation we uploaded: a part replaced meanwhile is
        # a 404, never silently composed.
        blob.compose(
            [bucket.blob(name, generation=gen) for name, gen in sources],
            if_generation_match=if_generation_match,
            timeout=self.timeout,
            retry=None,
        )
        return blob

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        """Compose the parts (a tree of <= 32-source composes) into a staged object, verify its
        size and CRC32C (:class:`ChecksumMismatchError`, nothing published), then publish it
        onto the key with one conditional compose."""
        key, uid = handle.key, handle.upload_id
        numbers = [p.part_number for p in parts]
        if numbers != list(range(1, len(parts) + 1)) or sum(p.size for p in parts) != size:
            raise StoreError(
                f"parts {numbers[:5]}... do not add up to {size} bytes",
                key=key,
                location=self.location,
                operation="complete_upload",
            )
        level: list[tuple[str, int]] = [p.token for p in parts]
        depth = 0
        with self._mapped("complete_upload", key):
            while len(level) > MAX_COMPOSE_SOURCES:
                groups = [
                    level[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(level), MAX_COMPOSE_SOURCES)
                ]
                names = [f"{self._parts}{uid}/c{depth}-{i:05d}" for i in range(len(groups))]
                blobs = list(self._aux_pool().map(self._compose, names, groups))
                level = [(b.name, b.generation) for b in blobs]
                depth += 1
            staged = self._compose(f"{self._parts}{uid}/whole", level)
        if int(staged.size or 0) != size or staged.crc32c != crc32c:
            raise ChecksumMismatchError(
                f"composed object does not match its parts: {staged.size} bytes, CRC32C "
                f"{staged.crc32c}; expected {size} bytes, CRC32C {crc32c}; nothing was published",
                key=key,
                location=self.location,
            )
        mode = handle.mode
        try:
            final = self._compose(
                key,
                [(staged.name, staged.generation)],
                if_generation_match=self._generation_match(mode),
                metadata={_META_UPLOAD: uid},
            )
        except _SDK_ERRORS as exc:
            mapped = self._map_error(exc, "complete_upload", key, mode)
            mine = (
                self._published_by(key, uid)
                if isinstance(mapped, (AlreadyExistsError, PreconditionFailedError))
                else None
            )
            if mine is None:
                if mapped is exc:
                    raise
                raise mapped from exc
            final = mine  # a retry after a lost response: our own compose already published it
        self._reject_mismatch(final, crc32c, key, "complete_upload")
        self._cleanup(uid)
        return self._meta(final, key)

    def _published_by(self, name: str, upload_id: str) -> Any:
        """The object at ``name`` if this upload's compose wrote it, else ``None``."""
        try:
            blob = self._bucket.get_blob(name, timeout=self.timeout, retry=None)
        except _SDK_ERRORS:
            return None  # cannot tell: the caller reports the conflict the server answered
        if blob is not None and (blob.metadata or {}).get(_META_UPLOAD) == upload_id:
            return blob
        return None

    def _cleanup(self, upload_id: str) -> None:
        """After a successful publish: retried like any request, but a failure is only logged
        (the object is published; leftovers are found by ``list_uploads``)."""

        def discard() -> None:
            with self._mapped("abort_upload", ""):
                self._discard(upload_id)

        try:
            # Through _call: this runs inside the publishing request's own retry, so it gets
            # what remains of that request's time budget, never a fresh one of its own.
            self._call(discard)
        except StoreError:
            log.warning("left temporary parts of upload %s for GC", upload_id, exc_info=True)

    def _discard(self, upload_id: str) -> None:
        # Parts before the marker: while any part exists, the marker that finds it does too.
        names = [b.name for b in self._list_names(f"{self._parts}{upload_id}/")]
        self._delete_names(names)
        self._delete_names([self._uploads + upload_id])

    def _abort_upload(self, handle: UploadHandle) -> None:
        """Delete the upload's parts and marker; needs only the upload id (GC rebuilds handles)."""
        with self._mapped("abort_upload", handle.key):
            self._discard(handle.upload_id)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        with self._mapped("list_uploads", prefix):
            markers = list(self._list_names(self._uploads))
        found = []
        for blob in markers:
            key = (blob.metadata or {}).get(_META_KEY)
            if key is not None and key.startswith(prefix):
                found.append(PendingUpload(key, blob.name.rsplit("/", 1)[1], blob.time_created))
        return sorted(found, key=lambda u: (u.key, u.upload_id))

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

    def _list_names(self, full_prefix: str) -> Iterator[Any]:
        """Every object whose name starts with ``full_prefix`` (all pages)."""
        return iter(
            self.client.list_blobs(self.bucket_name, prefix=full_prefix, timeout=self.timeout, retry=None)
        )

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
        if not all(results) and not self._bucket_seen:
            try:
                exists = bool(self._bucket.exists(timeout=self.timeout, retry=None))
            except _SDK_ERRORS:
                exists = True  # cannot tell; the deletes themselves did not fail
            if not exists:
                raise BucketNotFoundError(
                    f"bucket {self.bucket_name!r} does not exist",
                    key="",
                    location=self.location,
                    operation="delete",
                )
            self._bucket_seen = True

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


__all__ = ["GCSStore", "MAX_COMPONENTS", "MAX_COMPOSE_SOURCES"]
