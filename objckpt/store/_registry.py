"""The scheme registry: URI scheme -> backend class path, imported lazily.

Built in: ``memory``, ``file``, ``s3`` (extra ``objckpt[s3]``), ``gs`` (extra ``objckpt[gcs]``).
A third-party backend is one package: it either calls :func:`register_backend` or declares an
entry point in the ``objckpt.backends`` group (name: the scheme, value: ``"module:Class"``)::

    [project.entry-points."objckpt.backends"]
    az = "objckpt_azure:AzureStore"

Nothing is imported until a URI of that scheme is opened, so ``pip install objckpt`` without
extras imports fine; a backend whose SDK is missing raises :class:`ConfigError` with the install
hint ("install objckpt[gcs] to use gs:// URIs"). Built-in and explicitly registered schemes win
over entry points of the same name (logged).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ._options import COMMON_OPTIONS, Option

if TYPE_CHECKING:
    from .base import Store

log = logging.getLogger("objckpt.store")

ENTRY_POINT_GROUP = "objckpt.backends"
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")
_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass
class _Entry:
    target: str | type[Store]  # "module:Class", or the class itself
    extra: str | None  # pip extra that provides the SDK (install hint)
    origin: str  # "built-in", "register_backend", or "entry point <dist>"
    cls: type[Store] | None = None  # cached once imported


_lock = threading.Lock()
_entries: dict[str, _Entry] = {
    "memory": _Entry("objckpt.store.memory:MemoryStore", None, "built-in"),
    "file": _Entry("objckpt.store.local:LocalStore", None, "built-in"),
    "s3": _Entry("objckpt.store.s3:S3Store", "s3", "built-in"),
    "gs": _Entry("objckpt.store.gcs:GCSStore", "gcs", "built-in"),
}
_entry_points_loaded = False


def register_backend(
    scheme: str, target: str | type[Store], extra: str | None = None, *, replace: bool = False
) -> None:
    """Make ``scheme://`` URIs open ``target`` (``"package.module:Class"`` or a Store class).

    ``extra`` names the pip extra of objckpt that installs the backend's SDK, for the install
    hint when importing it fails. The class is imported at the first ``open_store`` of that
    scheme, not here.

    Raises:
        ValueError: a malformed scheme or target, or ``scheme`` already registered (pass
            ``replace=True`` to replace it deliberately).
    """
    scheme = scheme.lower()
    if not _SCHEME.fullmatch(scheme):
        raise ValueError(f"not a URI scheme: {scheme!r}")
    if isinstance(target, str) and not _TARGET.fullmatch(target):
        raise ValueError(f"backend target must be 'package.module:Class', got {target!r}")
    with _lock:
        if scheme in _entries and not replace:
            raise ValueError(
                f"{scheme}:// is already registered ({_entries[scheme].origin}); pass replace=True"
            )
        _entries[scheme] = _Entry(target, extra, "register_backend")


def _load_entry_points() -> None:
    """Add the ``objckpt.backends`` entry points, once (after built-ins and explicit ones)."""
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        try:
            found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        except Exception:  # noqa: BLE001 - broken installed metadata must not break built-in schemes
            log.warning("could not read %s entry points", ENTRY_POINT_GROUP, exc_info=True)
            return
        for ep in found:
            scheme = ep.name.lower()
            dist = getattr(getattr(ep, "dist", None), "name", None) or "an installed package"
            if not _SCHEME.fullmatch(scheme) or not _TARGET.fullmatch(ep.value.strip()):
                log.warning(
                    "ignoring malformed %s entry point %r = %r from %s",
                    ENTRY_POINT_GROUP,
                    ep.name,
                    ep.value,
                    dist,
                )
                continue
            if scheme in _entries:
                log.info(
                    "%s:// from %s ignored: already registered (%s)", scheme, dist, _entries[scheme].origin
                )
                continue
            _entries[scheme] = _Entry(ep.value.strip(), None, f"entry point of {dist}")


def known_schemes() -> list[str]:
    """Every registered scheme (built-in, registered, entry points), sorted."""
    _load_entry_points()
    with _lock:
        return sorted(_entries)


def backend_class(scheme: str) -> type[Store]:
    """The Store class for ``scheme``, imported on first use.

    Raises:
        ConfigError: unknown scheme, or the backend cannot be imported (the message says what
            to install).
    """
    from .base import Store

    scheme = scheme.lower()
    _load_entry_points()
    with _lock:
        entry = _entries.get(scheme)
    if entry is None:
        raise ConfigError(f"unsupported URI scheme {scheme!r}; use one of {', '.join(known_schemes())}")
    if entry.cls is not None:
        return entry.cls
    target = entry.target
    if isinstance(target, str):
        module_name, _, class_name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if entry.extra:
                hint = f"; install objckpt[{entry.extra}] to use {scheme}:// URIs"
            elif entry.origin.startswith("entry point"):
                hint = f" (registered by the {entry.origin}; reinstall it)"
            else:
                hint = ""
            raise ConfigError(f"cannot load the {scheme}:// backend: {exc}{hint}") from exc
        cls: Any = getattr(module, class_name, None)
        if cls is None:
            raise ConfigError(f"the {scheme}:// backend {target!r} does not exist ({entry.origin})")
    else:
        cls = target
    if not (isinstance(cls, type) and issubclass(cls, Store)):
        raise ConfigError(f"the {scheme}:// backend {target!r} is not a Store subclass ({entry.origin})")
    entry.cls = cls
    return cls


def options_for(scheme: str) -> tuple[Option, ...]:
    """Every option ``scheme://`` stores take: the common ones, then the backend's own (for
    ``--help`` listings and docs). Imports the backend (ConfigError with the install hint)."""
    return COMMON_OPTIONS + tuple(backend_class(scheme).OPTIONS)


def schemes_taking(name: str) -> list[str]:
    """The schemes whose backends (those that import) take the option ``name``: for the hint in
    an unknown-option error. Backends that fail to import are skipped."""
    found = []
    for scheme in known_schemes():
        try:
            if any(o.name == name for o in options_for(scheme)):
                found.append(scheme)
        except ConfigError:
            continue
    return found


__all__ = [
    "ENTRY_POINT_GROUP",
    "backend_class",
    "known_schemes",
    "options_for",
    "register_backend",
    "schemes_taking",
]
