"""GCS error translation: the tables for google-cloud-storage's exceptions, and how a server
answer's status and message are read.

:data:`GCS_ERROR_STATUSES` maps server answers by HTTP status, :data:`GCS_CLIENT_ERRORS` the
exceptions that are not answers (corrupted downloads, credentials, TLS, connections);
``_SDK_ERRORS`` is everything the one translation point (``GCSStore._mapped``, in
``_gcs_client.py``) catches. The statuses that need more than a table (412, 404, 400) are decided
by ``GCSStore._map_error`` there. ``objckpt.store.gcs`` re-exports the public tables.
"""

from __future__ import annotations

import json

import requests
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc

from ..errors import PermissionDeniedError, StoreError, TransientError

try:  # google-cloud-storage >= 3 vendors resumable-media; older versions use the package
    from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
except ImportError:  # pragma: no cover - google-cloud-storage 2.x
    from google.resumable_media import DataCorruption, InvalidResponse

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


# the two resumable-media exceptions are exported from here, where their version-dependent import is
__all__ = ["GCS_CLIENT_ERRORS", "GCS_ERROR_STATUSES", "DataCorruption", "InvalidResponse"]
