"""The file:// store's configuration and the rules every primitive shares.

:class:`_LocalBase` is the base of :class:`~objckpt.store.local.LocalStore` and of its mixins
(``_local_dirs.py``, ``_local_staging.py``, ``_local_writes.py``, ``_local_reads.py``): the
option, the constructor, the run root's probe, the reserved-key rule, symbolic-link refusals,
the one ``OSError`` translation (:meth:`_LocalBase._error`), and the ``ObjectMeta`` of a
``stat`` with its CRC32C extended attribute.
"""

from __future__ import annotations

import errno
import os
import stat
from datetime import datetime, timezone
from typing import Any

from ..errors import ConfigError, NotFoundError, PermissionDeniedError, StoreError, TransientError
from ._local_util import (
    _FULL_ERRNOS,
    _PERMISSION_ERRNOS,
    _TRANSIENT_ERRNOS,
    LOCKS_DIR,
    RESERVED_PREFIX,
    STAGING_DIR,
    XATTR_CRC32C,
    _token,
)
from ._options import Option, choice
from .base import ObjectMeta, Store


class _LocalBase(Store):
    """Configuration, key and error rules of :class:`~objckpt.store.local.LocalStore` (see the
    module doc); no primitive is implemented here."""

    OPTIONS = (
        Option(
            "create",
            choice("link", "lock"),
            "link",
            "how CREATE is enforced: link (hard link, atomic against every writer) or lock (also "
            "on filesystems without hard links; atomic only among objckpt writers)",
        ),
    )

    def __init__(self, root: str | os.PathLike[str], *, create: str = "link", **options: Any) -> None:
        if create not in ("link", "lock"):
            raise ConfigError(f"create must be 'link' or 'lock', got {create!r}")
        self.create = create
        root = os.fspath(root)
        if not os.path.isabs(root):
            raise ConfigError(f"file:// store root must be an absolute path, got {root!r}")
        if any(seg in (".", "..") for seg in root.split("/")):
            raise ConfigError(f"'.' and '..' are not allowed in a run root: {root!r}")
        self.root = os.path.normpath(root)
        super().__init__(location=f"file://{self.root}", **options)
        self._staging = os.path.join(self.root, STAGING_DIR)
        self._locks = os.path.join(self.root, LOCKS_DIR)
        self._xattrs = hasattr(os, "setxattr")  # cleared on the first ENOTSUP

    def _probe(self) -> None:
        """The root is a directory, or can be made one (its nearest existing ancestor is a
        writable directory): file:// creates the root at the first write, so a missing root is
        not an error, but one that can never be created is."""
        probe = self.root
        while True:
            try:
                st = os.stat(probe)
            except (FileNotFoundError, NotADirectoryError):
                parent = os.path.dirname(probe)
                if parent == probe:
                    break
                probe = parent
                continue
            except OSError as exc:
                raise self._error(exc, "", "check") from exc
            if not stat.S_ISDIR(st.st_mode):
                raise ConfigError(f"the run root's path {probe!r} is not a directory [{self.location}]")
            if probe != self.root and not os.access(probe, os.W_OK | os.X_OK):
                raise PermissionDeniedError(
                    f"cannot create the run root: {probe!r} is not writable",
                    location=self.location,
                    operation="check",
                )
            break
        super()._probe()

    # ------------------------------------------------------------------ keys and errors

    def _key_rule(self, key: str) -> str | None:
        if key.split("/", 1)[0].startswith(RESERVED_PREFIX):
            return f"the first segment {RESERVED_PREFIX}* is reserved for file:// staging and locks"
        return None

    def _path(self, key: str, operation: str) -> str:
        """The file for ``key``. Checked again here (the same rule as the public methods) so a
        primitive called directly cannot name a file outside the root either."""
        self.check_key(key, operation)
        return os.path.join(self.root, *key.split("/"))

    def _symlink_error(self, what: str, key: str, operation: str, *, write: bool) -> StoreError:
        kw = dict(key=key, location=self.location, operation=operation)
        why = f"{what!r} is a symbolic link; a file:// store never follows symbolic links inside its run root"
        if write:
            return PermissionDeniedError(
                f"refusing to write through a symbolic link: {why} (make the run root itself the link, "
                "or mount the other filesystem there)",
                **kw,
            )
        return NotFoundError(f"not an object: {why} (it may point outside the run root)", **kw)

    def _error(self, exc: OSError, key: str, operation: str) -> StoreError:
        """Map an ``OSError`` to the objckpt error for it (the caller raises ``from exc``)."""
        code = exc.errno
        detail = exc.strerror or str(exc)
        kw = dict(key=key, location=self.location, operation=operation)
        if code in (errno.ENOENT, errno.ENOTDIR):
            return NotFoundError(f"no such object ({detail})", **kw)
        if code in _PERMISSION_ERRNOS:
            return PermissionDeniedError(f"permission denied ({detail})", **kw)
        if code in _FULL_ERRNOS:
            return StoreError(
                f"disk full: no space left on the device holding {self.root} ({detail}); "
                "free space or raise the quota, retrying will not help",
                **kw,
            )
        if code in _TRANSIENT_ERRNOS:
            return TransientError(f"temporary filesystem error ({detail})", **kw)
        return StoreError(f"filesystem error {errno.errorcode.get(code or 0, code)} ({detail})", **kw)

    def _meta(self, key: str, st: os.stat_result, crc32c: str | None) -> ObjectMeta:
        return ObjectMeta(
            key=key,
            size=st.st_size,
            version=_token(st),
            crc32c=crc32c,
            last_modified=datetime.fromtimestamp(st.st_mtime_ns / 1e9, tz=timezone.utc),
        )

    def _read_crc(self, path: str | int) -> str | None:
        if not self._xattrs:
            return None
        try:
            if isinstance(path, int):
                return os.getxattr(path, XATTR_CRC32C).decode("ascii")
            return os.getxattr(path, XATTR_CRC32C, follow_symlinks=False).decode("ascii")
        except (OSError, UnicodeDecodeError):
            return None  # written by something else, or xattrs unsupported
