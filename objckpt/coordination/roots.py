"""Opening the run root every API is configured with (a URI or a ready :class:`Store`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..store import Store, open_store

__all__ = ["open_root"]


def open_root(uri_or_store: str | Store, options: Mapping[str, Any] | None = None) -> tuple[Store, bool]:
    """The run root's store, and whether it was opened here (so the caller closes it).

    A URI is opened with ``options`` (the same option spec as :func:`objckpt.store.open_store`:
    ``endpoint_url``, ``path_style``, ``part_size``, ...); a :class:`Store` is used as given.

    Raises:
        ConfigError: a malformed URI, an unknown option or value, a missing extra; options given
            together with a Store (they would be silently ignored).
    """
    if isinstance(uri_or_store, Store):
        if options:
            raise ConfigError(
                f"store options {sorted(options)} only apply when a run-root URI is given, not a Store "
                f"({uri_or_store.location}): pass them to open_store instead"
            )
        return uri_or_store, False
    if isinstance(uri_or_store, str):
        return open_store(uri_or_store, **dict(options or {})), True
    raise ConfigError(f"expected a run-root URI or a Store, got {type(uri_or_store).__name__}")
