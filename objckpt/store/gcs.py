"""``gs://bucket/prefix``: Google Cloud Storage (and fake-gcs-server for tests).

How each guarantee maps onto GCS (every one is the server's own; there is never a check-then-write
on the client):

* create-if-absent is ``ifGenerationMatch=0``; compare-and-swap is ``ifGenerationMatch=<gen>``;
  the version token is the object's generation (as a string). A 412 becomes
  :class:`AlreadyExistsError` (create) or :class:`PreconditionFailedError` (update).
* every upload carries the CRC32C computed by the base class in the object metadata, which GCS
  checks against the bytes it received and rejects on mismatch. The server's CRC32C of the stored
  object (returned by every upload) is compared with ours as well, so a server or proxy that does
  not check (fake-gcs-server does not) still cannot make a corrupted write look successful.
* ``put`` is one request: a multipart (metadata + media) upload up to 8 MiB, a single-session
  resumable upload above that (google-cloud-storage's own threshold).
* ``put_stream`` is a *parallel composite upload*: each part becomes a temporary object under
  ``<prefix>/.objckpt/parts/<upload id>/`` (uploaded from the base class's thread pool, at most
  ``max_in_flight`` at a time); completion composes them (at most 32 sources per compose, so a
  tree for more) into a staged temporary, checks the staged object's size and CRC32C against
  the full-object CRC32C streamed by the base class, and only then publishes it with one more
  compose onto the target under the write's precondition. The target therefore appears at
  once, whole and verified, or not at all. Temporaries are deleted afterwards; ``abort`` deletes
  them; a marker object ``<prefix>/.objckpt/uploads/<upload id>`` (metadata: target key) lets
  ``list_uploads`` find abandoned uploads for GC. Nothing under ``.objckpt/`` is ever returned
  by ``list`` or ``list_prefixes``, and user keys may not start with it.
  GCS allows at most 1,024 components in a composite object, so one ``put_stream`` may have at
  most 1,024 parts: objects larger than ``1024 x part_size`` fail with a :class:`StoreError`
  telling to raise ``part_size``.
* google-cloud-storage's own retries are off (``retry=None`` on every call): tenacity in
  :class:`~objckpt._retry.RetryPolicy` is the one retry layer.

SDK exceptions are translated at this edge (:meth:`GCSStore._map_error`); nothing above this
module sees google-cloud-storage, google-api-core or requests exceptions.

Options (URI query parameters or ``open_store`` keywords):

=================  ===========================================================================
``endpoint_url``   API endpoint, e.g. ``http://127.0.0.1:4443`` for fake-gcs-server
``project``        project for the client (default: the credentials' project)
``anonymous``      ``true``: no credentials (emulators). Default: true when ``endpoint_url`` is
                   given, else false (Application Default Credentials chain)
``timeout``        seconds per HTTP request (default 60)
``read_chunk``     bytes per ranged GET while streaming a download (default 8 MiB)
``credentials``    a ``google.auth`` credentials object (keyword only)
``client``         a ready ``google.cloud.storage.Client`` (keyword only; tests)
=================  ===========================================================================
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NoReturn

import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from .._crc import crc32c_b64
from ..errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidKeyError,
    NotFoundError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from ._util import ViewReader, as_bool
from .base import (
    MiB,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
)

try:  # google-cloud-storage >= 3 vendors resumable-media; older versions use the package
    from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
except ImportError:  # pragma: no cover - google-cloud-storage 2.x
    from google.resumable_media import DataCorruption, InvalidResponse  # type: ignore[no-redef]

if TYPE_CHECKING:
    from . import ParsedURI

log = logging.getLogger("objckpt.store.gcs")

#: google-cloud-storage sends objects up to this size as one multipart request
SINGLE_REQUEST_MAX = 8 * MiB
#: GCS: at most 32 sources per compose request
MAX_COMPOSE_SOURCES = 32
#: GCS: a composite object has at most 1,024 components, however it was composed
MAX_COMPONENTS = 1024
DEFAULT_READ_CHUNK = 8 * MiB
DEFAULT_TIMEOUT = 60.0

#: private area under the store root; never listed, never a user key
PRIVATE = ".objckpt/"
_PARTS = PRIVATE + "parts/"
_UPLOADS = PRIVATE + "uploads/"
_META_KEY = "objckpt-key"
_META_UPLOAD = "objckpt-upload"

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    requests.exceptions.ConnectionError,  # refused, reset, DNS, proxy
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,  # body cut short
    requests.exceptions.ContentDecodingError,
    ConnectionError,
    TimeoutError,
    auth_exc.TransportError,  # token refresh could not reach the token server
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
    """Objects under ``gs://bucket/prefix/``. Thread-safe (one client, shared; requests made
    lazily, none in the constructor).

    Atomicity: ``put`` is one upload request; ``put_stream`` becomes visible only with the final
    compose, whole and CRC32C-verified. CREATE and update modes are enforced by the server
    (``ifGenerationMatch``).

    Lost responses: when a conditional write was applied but its answer lost, the retry meets a
    412 caused by itself. A composite upload recognises its own object exactly (the publishing
    compose stamps the upload id into the object's metadata); a ``put`` retried after a transient
    error accepts an existing object with exactly its size and CRC32C as its own.

    Raises (from every method): :class:`TransientError` (429, 408, 5xx, timeouts, connection
    resets; retried by the store's policy), :class:`PermissionDeniedError` (401/403, no usable
    credentials), :class:`NotFoundError` (object, or the bucket: the message says which),
    :class:`AlreadyExistsError` / :class:`PreconditionFailedError` (conditional write lost),
    :class:`StoreError` (400 and any other rejection, e.g. a CRC32C mismatch).
    """

    scheme = "gs"
    OPTIONS = ("endpoint_url", "project", "anonymous", "timeout", "read_chunk", "credentials", "client")

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        project: str | None = None,
        anonymous: bool | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        read_chunk: int = DEFAULT_READ_CHUNK,
        credentials: Any = None,
        client: Any = None,
        **store_kwargs: Any,
    ) -> None:
        """Open ``gs://bucket/prefix``. No request is made (and no credential looked up) here.

        Raises:
            ConfigError: an invalid option.
        """
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        location = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        super().__init__(location=location, **store_kwargs)
        if timeout <= 0 or read_chunk < 1:
            raise ConfigError(f"timeout and read_chunk must be positive for {location}")
        self._root = self.prefix + "/" if self.prefix else ""
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
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> GCSStore:
        from . import common_store_kwargs, parse_size

        options = dict(options)
        kwargs = common_store_kwargs(options)
        if "anonymous" in options:
            kwargs["anonymous"] = as_bool("anonymous", options.pop("anonymous"))
        if "timeout" in options:
            value = options.pop("timeout")
            try:
                kwargs["timeout"] = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"timeout must be a number of seconds, got {value!r}") from None
        if "read_chunk" in options:
            kwargs["read_chunk"] = parse_size(options.pop("read_chunk"))
        for name in ("endpoint_url", "project", "credentials", "client"):
            if name in options:
                kwargs[name] = options.pop(name)
        return cls(parsed.bucket, parsed.prefix, **kwargs)

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
            credentials = AnonymousCredentials()
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
        except Exception:  # pragma: no cover - a performance tweak only
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

    def _name(self, key: str) -> str:
        return self._root + key

    def _key(self, name: str) -> str:
        return name[len(self._root) :]

    def _meta(self, blob: Any, key: str | None = None) -> ObjectMeta:
        return ObjectMeta(
            key=self._key(blob.name) if key is None else key,
            size=int(blob.size or 0),
            version=str(blob.generation),
            crc32c=blob.crc32c,
            last_modified=blob.updated or blob.time_created,
        )

    def _check_key(self, key: str, operation: str) -> None:
        if key.startswith(PRIVATE):
            raise InvalidKeyError(
                f"keys under {PRIVATE!r} are reserved for objckpt's temporary upload parts",
                key=key,
                location=self.location,
                operation=operation,
            )

    @staticmethod
    def _generation_match(mode: PutMode) -> int | None:
        if mode.kind == "create":
            return 0
        if mode.kind == "update":
            return int(mode.version)  # type: ignore[arg-type]
        return None

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
        except Exception:
            return False
        self._bucket_seen = exists
        return not exists

    def _map_error(
        self, exc: BaseException, operation: str, key: str, mode: PutMode | None = None
    ) -> BaseException:
        """Translate one SDK exception into the objckpt error a caller can act on.

        ====================================================  ===================================
        408, 429, 500, 502, 503, 504; timeouts, refused or     :class:`TransientError`
        reset connections, a body cut short
        412                                                    :class:`AlreadyExistsError`
                                                               (CREATE) or
                                                               :class:`PreconditionFailedError`
        404 naming the bucket (or on a bucket-level call)      :class:`NotFoundError` "bucket ...
                                                               does not exist"
        404                                                    :class:`NotFoundError`
        401, 403; no credentials                               :class:`PermissionDeniedError`
        400 and every other status                             :class:`StoreError` (permanent)
        a download whose CRC32C the SDK found wrong            :class:`TransientError`
        ====================================================  ===================================

        The caller raises the result ``from exc`` so ``__cause__`` keeps the SDK error. Messages
        carry the HTTP status and the server's message, never request headers or credentials.
        """
        where = {"key": key, "location": self.location, "operation": operation}
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, DataCorruption):
            # Bytes damaged in transit: the stored object is fine, a new download may succeed.
            return TransientError(f"download corrupted in transit: {exc}", **where)
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
                    return NotFoundError(f"bucket {self.bucket_name!r} does not exist; {detail}", **where)
                return NotFoundError(f"no such object; {detail}", **where)
            if status in (401, 403):
                return PermissionDeniedError(
                    f"access denied (check the credentials and the bucket's IAM); {detail}", **where
                )
            if status in _TRANSIENT_STATUS:
                return TransientError(f"server error, retryable; {detail}", **where)
            if status == 400 and ("crc32c" in detail.lower() or "checksum" in detail.lower()):
                return StoreError(
                    f"server rejected the data: checksum mismatch ({detail}); the bytes sent do "
                    "not match their CRC32C",
                    **where,
                )
            return StoreError(f"request rejected; {detail}", **where)
        if isinstance(exc, auth_exc.RefreshError):
            return PermissionDeniedError(f"could not obtain a Google access token: {exc}", **where)
        if isinstance(exc, auth_exc.DefaultCredentialsError):
            return PermissionDeniedError(f"no usable Google credentials: {exc}", **where)
        if isinstance(exc, requests.exceptions.SSLError):  # certificates do not heal on retry
            return StoreError(f"TLS error talking to the endpoint: {exc}", **where)
        if isinstance(exc, _CONNECTION_ERRORS):
            return TransientError(f"connection problem: {type(exc).__name__}: {exc}", **where)
        return exc

    def _raise(self, exc: BaseException, operation: str, key: str, mode: PutMode | None = None) -> NoReturn:
        mapped = self._map_error(exc, operation, key, mode)
        if mapped is exc:
            raise exc
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
        object metadata) and we check the CRC32C it reports back. Returns the blob."""
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
        back (only that generation, never a later writer's) and fail."""
        if blob.crc32c == crc32c:
            return
        try:
            self._bucket.blob(blob.name).delete(
                if_generation_match=blob.generation, timeout=self.timeout, retry=None
            )
        except Exception:  # gone or replaced already: nothing of ours to take back
            log.warning("could not delete %s after a CRC32C mismatch", blob.name, exc_info=True)
        raise StoreError(
            f"checksum mismatch: the server stored CRC32C {blob.crc32c}, the bytes sent have "
            f"{crc32c}; the write was deleted",
            key=key,
            location=self.location,
            operation=operation,
        )

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """One upload request (resumable above 8 MiB), atomic, conditional on ``mode``."""
        self._check_key(key, "put")
        try:
            generation = self._generation_match(mode)
        except ValueError:
            raise PreconditionFailedError(
                f"{mode.version!r} is not a GCS generation", key=key, location=self.location, operation="put"
            ) from None
        attempt = (key, crc32c, data.nbytes, mode)
        retrying = getattr(self._unsure, "put", None) == attempt
        self._unsure.put = None
        try:
            blob = self._upload(self._name(key), data, crc32c, if_generation_match=generation)
        except Exception as exc:
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
        self._check_key(key, "put")
        try:
            self._generation_match(mode)
        except ValueError:
            raise PreconditionFailedError(
                f"{mode.version!r} is not a GCS generation", key=key, location=self.location, operation="put"
            ) from None
        upload_id = uuid.uuid4().hex
        marker = memoryview(upload_id.encode())
        try:
            # The marker names the target key, so GC can find and abort an abandoned upload.
            self._upload(
                self._name(_UPLOADS + upload_id),
                marker,
                crc32c_b64(marker),
                if_generation_match=0,
                metadata={_META_KEY: key},
            )
        except Exception as exc:
            self._raise(exc, "create_upload", key)
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
        name = self._name(f"{_PARTS}{handle.upload_id}/{part_number:05d}")
        try:
            # Unconditional: the name is private to this upload, and a retry after a lost
            # response must be able to replace the part.
            blob = self._upload(name, data, crc32c, if_generation_match=None)
        except Exception as exc:
            self._raise(exc, "upload_part", handle.key)
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
        size and CRC32C, then publish it onto the key with one conditional compose."""
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
        try:
            while len(level) > MAX_COMPOSE_SOURCES:
                groups = [
                    level[i : i + MAX_COMPOSE_SOURCES] for i in range(0, len(level), MAX_COMPOSE_SOURCES)
                ]
                names = [self._name(f"{_PARTS}{uid}/c{depth}-{i:05d}") for i in range(len(groups))]
                blobs = list(self._aux_pool().map(lambda ng: self._compose(ng[0], ng[1]), zip(names, groups)))
                level = [(b.name, b.generation) for b in blobs]
                depth += 1
            staged = self._compose(self._name(f"{_PARTS}{uid}/whole"), level)
        except Exception as exc:
            self._raise(exc, "complete_upload", key)
        if int(staged.size or 0) != size or staged.crc32c != crc32c:
            raise StoreError(
                f"composed object does not match its parts: {staged.size} bytes, CRC32C "
                f"{staged.crc32c}; expected {size} bytes, CRC32C {crc32c}; nothing was published",
                key=key,
                location=self.location,
                operation="complete_upload",
            )
        mode = handle.mode
        target = self._name(key)
        try:
            final = self._compose(
                target,
                [(staged.name, staged.generation)],
                if_generation_match=self._generation_match(mode),
                metadata={_META_UPLOAD: uid},
            )
        except Exception as exc:
            mapped = self._map_error(exc, "complete_upload", key, mode)
            mine = (
                self._published_by(target, uid)
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
        except Exception:
            return None
        if blob is not None and (blob.metadata or {}).get(_META_UPLOAD) == upload_id:
            return blob
        return None

    def _cleanup(self, upload_id: str) -> None:
        """After a successful publish: retried like any request, but a failure is only logged
        (the object is published; leftovers are found by ``list_uploads``)."""

        def discard() -> None:
            try:
                self._discard(upload_id)
            except Exception as exc:
                self._raise(exc, "abort_upload", "")

        try:
            self.retry.call(discard, on_retry=self._notify_retry)
        except Exception:
            log.warning("left temporary parts of upload %s for GC", upload_id, exc_info=True)

    def _discard(self, upload_id: str) -> None:
        # Parts before the marker: while any part exists, the marker that finds it does too.
        names = [b.name for b in self._list_names(self._name(f"{_PARTS}{upload_id}/"))]
        self._delete_names(names)
        self._delete_names([self._name(_UPLOADS + upload_id)])

    def _abort_upload(self, handle: UploadHandle) -> None:
        try:
            self._discard(handle.upload_id)
        except Exception as exc:
            self._raise(exc, "abort_upload", handle.key)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        try:
            markers = list(self._list_names(self._name(_UPLOADS)))
        except Exception as exc:
            self._raise(exc, "list_uploads", prefix)
        found = []
        for blob in markers:
            key = (blob.metadata or {}).get(_META_KEY)
            if key is not None and key.startswith(prefix):
                found.append(PendingUpload(key, blob.name.rsplit("/", 1)[1], blob.time_created))
        return sorted(found, key=lambda u: (u.key, u.upload_id))

    def _abort_pending(self, upload: PendingUpload) -> None:
        try:
            self._discard(upload.upload_id)
        except Exception as exc:
            self._raise(exc, "abort_upload", upload.key)

    # ------------------------------------------------------------------ reads

    def _get(self, key: str, start: int, end: int | None) -> bytes:
        blob = self._bucket.blob(self._name(key))
        try:
            if start == 0 and end is None:
                # Whole object: the SDK checks the bytes against the CRC32C header it gets.
                return blob.download_as_bytes(checksum="crc32c", timeout=self.timeout, retry=None)
            return blob.download_as_bytes(
                start=start,
                end=None if end is None else end - 1,
                checksum=None,
                timeout=self.timeout,
                retry=None,
            )
        except gexc.RequestRangeNotSatisfiable:
            return b""  # the range starts at or past the end: no bytes, like a slice
        except Exception as exc:
            self._raise(exc, "get", key)
        raise AssertionError("unreachable")

    def _open(self, key: str, start: int) -> Iterator[bytes]:
        """Ranged GETs of ``read_chunk`` bytes, all of the generation found first, so a stream
        never mixes two versions of an object."""
        name = self._name(key)
        head = self._head(key)
        generation = int(head.version)
        pos = start
        while pos < head.size:
            end = min(pos + self.read_chunk, head.size)
            try:
                chunk = self._bucket.blob(name, generation=generation).download_as_bytes(
                    start=pos, end=end - 1, checksum=None, timeout=self.timeout, retry=None
                )
            except Exception as exc:
                mapped = self._map_error(exc, "get", key)
                if isinstance(mapped, NotFoundError):
                    mapped = NotFoundError(
                        f"generation {generation} was replaced or deleted while being read",
                        key=key,
                        location=self.location,
                        operation="get",
                    )
                if mapped is exc:
                    raise
                raise mapped from exc
            if not chunk:
                raise TransientError(
                    f"server sent no bytes at offset {pos} of {head.size}",
                    key=key,
                    location=self.location,
                    operation="get",
                )
            pos += len(chunk)
            yield chunk

    def _head(self, key: str) -> ObjectMeta:
        blob = self._bucket.blob(self._name(key))
        try:
            blob.reload(timeout=self.timeout, retry=None)
        except Exception as exc:
            self._raise(exc, "head", key)
        return self._meta(blob, key)

    def _list_names(self, full_prefix: str) -> Iterator[Any]:
        """Every object whose full name starts with ``full_prefix`` (all pages)."""
        return iter(
            self.client.list_blobs(self.bucket_name, prefix=full_prefix, timeout=self.timeout, retry=None)
        )

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        out: list[ObjectMeta] = []
        token = None
        try:
            while True:
                it = self.client.list_blobs(
                    self.bucket_name,
                    prefix=self._name(prefix),
                    # inclusive on the server: the equal key is skipped below
                    start_offset=self._name(start_after) if start_after is not None else None,
                    page_size=limit,
                    page_token=token,
                    timeout=self.timeout,
                    retry=None,
                )
                page = next(it.pages)
                for blob in page:
                    key = self._key(blob.name)
                    if (start_after is not None and key <= start_after) or key.startswith(PRIVATE):
                        continue
                    out.append(self._meta(blob, key))
                token = it.next_page_token
                # Keep going past pages that held only hidden keys: an empty page with more to
                # come would end the caller's listing early.
                if out or not token:
                    return out, bool(token)
        except Exception as exc:
            self._raise(exc, "list", prefix)
        raise AssertionError("unreachable")

    def _list_prefixes(self, prefix: str) -> list[str]:
        try:
            it = self.client.list_blobs(
                self.bucket_name,
                prefix=self._name(prefix),
                delimiter="/",
                timeout=self.timeout,
                retry=None,
            )
            for _ in it:  # the prefixes accumulate as the pages go by
                pass
            found = [self._key(p) for p in it.prefixes]
        except Exception as exc:
            self._raise(exc, "list_prefixes", prefix)
        return sorted(p for p in found if not p.startswith(PRIVATE))

    # ------------------------------------------------------------------ deletes

    def _delete_names(self, names: list[str]) -> None:
        """Delete full object names concurrently; absent ones are fine (a retried batch sees
        its own earlier deletes), a missing bucket is not."""

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
            except Exception:
                exists = True  # cannot tell; the deletes themselves did not fail
            if not exists:
                raise NotFoundError(
                    f"bucket {self.bucket_name!r} does not exist",
                    key="",
                    location=self.location,
                    operation="delete",
                )
            self._bucket_seen = True

    def _delete_batch(self, keys: list[str]) -> None:
        try:
            self._delete_names([self._name(k) for k in keys])
        except Exception as exc:
            self._raise(exc, "delete", keys[0] if len(keys) == 1 else "")

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
            except Exception:  # pragma: no cover - closing is best effort
                log.debug("closing the GCS client failed", exc_info=True)


__all__ = ["GCSStore", "MAX_COMPONENTS", "MAX_COMPOSE_SOURCES", "SINGLE_REQUEST_MAX"]
