"""Store backends, chosen by URI scheme.

``open_store("s3://bucket/run?endpoint_url=http://127.0.0.1:9000")`` parses the URI once, finds
the backend in the scheme registry (:func:`register_backend`, or an ``objckpt.backends`` entry
point), imports it lazily (so ``pip install objckpt`` without extras still imports; a missing SDK
raises a :class:`ConfigError` naming the extra to install), and converts the options against the
backend's declared :class:`Option` specs in one place. Options come as URI query parameters or
keyword arguments (keywords win); an unknown option or a bad value is a ``ConfigError``, and a
secret's value never appears in a message. :func:`options_for` lists a scheme's options.

Bucket backends (S3, GCS) address a bucket; the run root's prefix is applied by a
:class:`PrefixStore` around them, so their keys are mapped in one place.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ._options import COMMON_OPTIONS, Option, parse_options, parse_size, store_kwargs
from ._registry import ENTRY_POINT_GROUP, backend_class, known_schemes, options_for, register_backend
from ._registry import schemes_taking as _schemes_taking
from ._uri import ParsedURI, parse_uri
from .base import (
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
    iter_parts,
    key_problem,
)
from .wrappers import PrefixStore


def open_store(uri: str, *, check: bool | str = False, **options: Any) -> Store:
    """Open the store for a run root.

    Opening makes no request by default (the CLI, tests and tools open stores freely, even for
    servers that are not up yet). ``check=True`` then calls :meth:`Store.check` (one LIST: the
    server answers, the bucket exists, the credentials may read the run root); ``check="write"``
    also writes and deletes a probe object. The store is closed if the check fails.

    Raises:
        ConfigError: malformed URI, unknown option (naming the schemes that do take it), a bad
            option value (e.g. an S3 ``part_size`` below the server's minimum part), or the
            backend's extra is not installed.
        StoreError: with ``check``, what :meth:`Store.check` raises (``BucketNotFoundError``,
            ``PermissionDeniedError``, ``TransientError`` past the retry budget).
    """
    if check not in (False, True, "write"):
        raise ConfigError(f"check must be False, True or 'write', got {check!r}")
    parsed = parse_uri(uri)
    cls = backend_class(parsed.scheme)
    values = parse_options(
        parsed.scheme,
        COMMON_OPTIONS + tuple(cls.OPTIONS),
        parsed.options,
        options,
        elsewhere=_schemes_taking,
    )
    kwargs = store_kwargs(values)
    store = cls.from_uri(parsed, {**values, **kwargs})
    if check:
        try:
            store.check(write=check == "write")
        except BaseException:
            store.close()
            raise
    return store


__all__ = [
    "COMMON_OPTIONS",
    "Capabilities",
    "ENTRY_POINT_GROUP",
    "ObjectMeta",
    "Option",
    "ParsedURI",
    "PartResult",
    "PendingUpload",
    "PrefixStore",
    "PutMode",
    "Store",
    "UploadHandle",
    "iter_parts",
    "key_problem",
    "known_schemes",
    "open_store",
    "options_for",
    "parse_size",
    "parse_uri",
    "register_backend",
]
