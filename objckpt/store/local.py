"""``file:///abs/path``: a store on a local (POSIX) filesystem.

Layout below the root::

    <root>/<key>                         one regular file per object; parent dirs made as needed
    <root>/.objckpt-staging/<name>       in-progress writes (never listed as objects)
    <root>/.objckpt-locks/<00..ff>       256 lock files striping the key space (never listed)

Atomicity (each write lands a *new inode*, fully written and fsync'd, before it gets its name):

* ``CREATE``: ``os.link(staging, target)``; the kernel refuses an existing name (``EEXIST`` ->
  :class:`AlreadyExistsError`), so two racing creators cannot both win. No lock is needed. On a
  filesystem without hard links (some FUSE/SMB mounts: ``link`` fails with ``EPERM``/``ENOTSUP``)
  a CREATE raises :class:`NotSupportedError` naming the root, unless the store was opened with
  ``create=lock`` (``file:///path?create=lock``): then CREATE takes the key's stripe lock, tries
  the link, and where links are refused checks the name and replaces it under that lock. That is
  atomic only among objckpt writers that share the lock files (this host, or NFS with working
  ``flock``), not against other programs writing the directory, which is why it is opt-in.
* ``OVERWRITE``: ``os.replace(staging, target)``, under the key's stripe lock.
* ``update(version)``: under the key's stripe lock, ``stat`` the target, compare its version,
  ``os.replace``. Because overwrite and delete take the same lock, no writer can slip between the
  compare and the replace. (Locks are ``fcntl.flock``, so they hold between threads and between
  processes on this host, and on NFS where the server supports them.)

Then the parent directory is fsync'd, so an acknowledged write survives a crash. A failed write
unlinks its staging file: no partial object is ever visible.

Version tokens are ``f"{inode:x}-{mtime_ns:x}-{size:x}"``. The mtime is *set* by the writer to a
nanosecond clock value that is strictly increasing within a process, because the kernel's own
timestamps are only jiffy-granular and inode numbers are reused on ext4: without it, a write could
reproduce the token of an earlier, deleted file (ABA) and a stale compare-and-swap would succeed.
This relies on the filesystem storing nanosecond timestamps (ext4, xfs, btrfs, tmpfs do).

CRC32C: each object's base64 CRC32C is stored in the extended attribute ``user.objckpt.crc32c``
when the filesystem supports user xattrs (one ``getxattr`` per head/list entry); otherwise
``ObjectMeta.crc32c`` is ``None`` and readers verify while streaming as usual. The "server"
verifies every ``put`` body and every streamed part against its CRC32C before writing it
(:class:`ChecksumMismatchError`).

Streamed uploads write a staging file with ``os.pwrite`` at each part's offset (parts arrive
concurrently) and complete like a ``put``. The staging file's name records the upload's start
time and key (base64url; a ``~key`` side file when the name would be too long), so
:meth:`list_uploads` reports uploads left by a crashed process and GC can abort them.

Keys follow the one key rule of every store (:func:`~objckpt.store.base.key_problem`: no empty,
``.`` or ``..`` segment, no leading ``/``, NUL or backslash); file:// also reserves a first
segment starting with ``.objckpt-``. Others are rejected with :class:`InvalidKeyError` (a
``ValueError``) before any filesystem call, so no key can name a file outside the root.

Symbolic links *inside* the root are never followed (the root itself may be one: that is the
user's configuration). Every path below the root is walked one directory at a time with
``O_NOFOLLOW`` from the directory above it (``openat``), and the object is opened, linked,
renamed, stat'ed or unlinked relative to its directory's descriptor, so a link swapped in between
two calls is not followed either. A symlink where an object or a directory of keys would be is
not an object: reads and ``head`` raise :class:`NotFoundError` saying so (for a restore that is
damage: the checkpoint is rejected loudly, never read from outside the root), listings skip it,
and a write or delete through a symlinked directory raises :class:`PermissionDeniedError`. A
filesystem cannot hold both ``a`` and ``a/b``; writing one while the other exists raises
:class:`NotSupportedError`.

Errors: ``ENOENT`` -> :class:`NotFoundError`, ``EACCES``/``EPERM``/``EROFS`` ->
:class:`PermissionDeniedError`, ``ENOSPC``/``EDQUOT`` -> :class:`StoreError` saying the disk is
full (not transient: retrying will not free space), ``EAGAIN``/``EBUSY``/``ETIMEDOUT``/``ESTALE``
-> :class:`TransientError`, anything else -> :class:`StoreError`; each names the key and root.

POSIX only (``fcntl``, ``os.link``, ``os.pwrite``).

Options (URI query parameters or ``open_store`` keywords; see :data:`LocalStore.OPTIONS`):

==========  ===========================================================================
``create``  ``link`` (default): CREATE by hard link, atomic against every writer;
            ``lock``: also allow filesystems without hard links (see above)
==========  ===========================================================================
"""

from __future__ import annotations

import base64
import errno
import fcntl
import os
import stat
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from .._crc import crc32c_b64
from ..errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    ConfigError,
    InvalidKeyError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from ._options import Option, choice
from ._writeback import write_back
from .base import (
    DEFAULT_READ_CHUNK,
    Capabilities,
    ObjectMeta,
    PartResult,
    PendingUpload,
    PutMode,
    Store,
    UploadHandle,
    advance,
)

if TYPE_CHECKING:
    from ._uri import ParsedURI

STAGING_DIR = ".objckpt-staging"
#: buffers one preadv/pwritev call takes (Linux IOV_MAX)
_IOV_MAX = 1024
LOCKS_DIR = ".objckpt-locks"
RESERVED_PREFIX = ".objckpt-"
XATTR_CRC32C = "user.objckpt.crc32c"
LOCK_STRIPES = 256

_KIND_PUT = "put"
_KIND_UPLOAD = "up"
_KEY_SIDE_SUFFIX = "~key"  # '~' is not in the base64url alphabet, so it never ends a data name
_MAX_NAME = 255

_TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.EINTR}
_PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}

_clock_lock = threading.Lock()
_last_ns = 0


def _unique_ns() -> int:
    """Wall-clock nanoseconds, strictly increasing within this process (see module doc)."""
    global _last_ns
    with _clock_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        return _last_ns


def _lstat_at(dfd: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` in directory ``dfd``; ``None`` when absent."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _token(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _write_all(fd: int, buffers: list[memoryview], offset: int | None) -> int:
    """Write ``buffers`` in order (``writev``, or ``pwritev`` at ``offset``), resuming after
    short writes; returns the bytes written."""
    pending = [b for b in buffers if b.nbytes]
    total = 0
    while pending:
        if len(pending) == 1:  # the plain calls for one buffer
            n = os.write(fd, pending[0]) if offset is None else os.pwrite(fd, pending[0], offset + total)
        else:
            batch = pending[:_IOV_MAX]
            n = os.writev(fd, batch) if offset is None else os.pwritev(fd, batch, offset + total)
        total += n
        pending = advance(pending, n)
    return total


class LocalStore(Store):
    """Objects as files below a root directory. Thread- and process-safe; see the module doc."""

    scheme = "file"
    OPTIONS = (
        Option(
            "create",
            choice("link", "lock"),
            "link",
            "how CREATE is enforced: link (hard link, atomic against every writer) or lock (also "
            "on filesystems without hard links; atomic only among objckpt writers)",
        ),
    )
    # CREATE by hard link and update/overwrite under flock: every guarantee holds under races
    # (with create=lock, among objckpt writers, which the user opted into).
    capabilities = Capabilities.ALL

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

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> LocalStore:
        # The path is the root itself (there is no bucket): no PrefixStore needed.
        return cls(parsed.prefix, **options)

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

    @contextmanager
    def _parent_fd(self, key: str, operation: str, *, create: bool, write: bool) -> Iterator[int | None]:
        """A descriptor of ``key``'s directory, opened one segment at a time from the root with
        ``O_NOFOLLOW`` (never through a symbolic link); ``None`` when a directory is missing and
        ``create`` is false. ``create`` makes missing directories, fsync'ing each parent that got
        an entry. A symlinked directory raises (see :meth:`_symlink_error`); a segment that is an
        object yields ``None`` for reads and raises :class:`NotSupportedError` for writes."""
        self.check_key(key, operation)
        dirs = key.split("/")[:-1]
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            fd = os.open(self.root, flags)
        except FileNotFoundError:
            if not create:
                yield None
                return
            self._ensure_dir(self.root, key, operation)
            try:
                fd = os.open(self.root, flags)
            except OSError as exc:
                raise self._error(exc, key, operation) from exc
        except OSError as exc:
            raise self._error(exc, key, operation) from exc
        try:
            for i, seg in enumerate(dirs):
                nfd = self._open_dir(fd, seg, "/".join(dirs[: i + 1]), key, operation, create, write)
                os.close(fd)
                fd = nfd
                if fd < 0:
                    yield None
                    return
            yield fd
        finally:
            if fd >= 0:
                os.close(fd)

    def _open_dir(
        self, dfd: int, seg: str, shown: str, key: str, operation: str, create: bool, write: bool
    ) -> int:
        """Open directory ``seg`` below ``dfd`` without following a link; -1 when absent (or an
        object) and not ``create``."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(2):
            try:
                return os.open(seg, flags, dir_fd=dfd)
            except FileNotFoundError:
                if not create:
                    return -1
                try:
                    os.mkdir(seg, 0o777, dir_fd=dfd)
                except FileExistsError:
                    pass  # a concurrent writer made it (or it is not a directory: checked next)
                except OSError as exc:
                    raise self._error(exc, key, operation) from exc
                else:
                    self._fsync_fd(dfd, key, operation)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise self._error(exc, key, operation) from exc
                try:
                    st = os.stat(seg, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # vanished meanwhile: try again
                except OSError as exc2:
                    raise self._error(exc2, key, operation) from exc2
                if stat.S_ISLNK(st.st_mode):
                    raise self._symlink_error(shown, key, operation, write=write) from None
                if not write:
                    return -1  # an object where a directory would be: nothing below it
                raise NotSupportedError(
                    f"a file:// store cannot hold both an object and keys below it ({shown!r} is an object)",
                    key=key,
                    location=self.location,
                    operation=operation,
                ) from None
        raise self._error(OSError(errno.ENOENT, "directory vanished while being created"), key, operation)

    def _fsync_fd(self, fd: int, key: str, operation: str) -> None:
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # some filesystems refuse dir fsync
                raise self._error(exc, key, operation) from exc

    def _private_dir(self, path: str, key: str, operation: str) -> None:
        """The staging and lock directories must not be symbolic links either."""
        if os.path.islink(path):
            raise self._symlink_error(os.path.basename(path), key, operation, write=True)

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

    # ------------------------------------------------------------------ directories, locks

    def _ensure_dir(self, path: str, key: str, operation: str) -> None:
        """Create ``path`` and missing parents up to the root, fsync'ing each parent that got a
        new entry so the object's name survives a crash."""
        missing = []
        probe = path
        while not os.path.isdir(probe):
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except FileExistsError:
                if not os.path.isdir(directory):
                    raise NotSupportedError(
                        "a file:// store cannot hold both an object and keys below it "
                        f"({os.path.relpath(directory, self.root)!r} is an object)",
                        key=key,
                        location=self.location,
                        operation=operation,
                    ) from None
                continue  # a concurrent writer made it
            except OSError as exc:
                raise self._error(exc, key, operation) from exc
            self._fsync_dir(os.path.dirname(directory), key, operation)

    def _fsync_dir(self, path: str, key: str, operation: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise self._error(exc, key, operation) from exc
        try:
            self._fsync_fd(fd, key, operation)
        finally:
            os.close(fd)

    @contextmanager
    def _key_lock(self, key: str, operation: str) -> Iterator[None]:
        """Exclusive lock for ``key``'s stripe. Striped (256 files) rather than one file per key
        so lock files stay bounded although overwrite and delete take them too."""
        stripe = zlib.crc32(key.encode("utf-8", "surrogateescape")) % LOCK_STRIPES
        path = os.path.join(self._locks, f"{stripe:02x}")
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self._private_dir(self._locks, key, operation)
        try:
            try:
                fd = os.open(path, flags, 0o666)
            except FileNotFoundError:
                self._ensure_dir(self._locks, key, operation)
                fd = os.open(path, flags, 0o666)
        except StoreError:
            raise
        except OSError as exc:
            raise self._error(exc, key, operation) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh open file description per call: threads too
            yield
        finally:
            os.close(fd)  # releases the lock

    # ------------------------------------------------------------------ staging

    def _new_staging(self, kind: str, key: str, operation: str) -> tuple[str, str]:
        """Create an empty staging file for ``key``; returns (name, path).

        The name is ``<kind>.<start ns hex>.<uuid>.<base64url key>``, or ``...<uuid>~long`` with
        the key in a ``~key`` side file when that would exceed the filesystem's name limit.
        """
        upload_id = f"{kind}.{time.time_ns():x}.{uuid.uuid4().hex}"
        encoded = base64.urlsafe_b64encode(key.encode("utf-8")).decode("ascii").rstrip("=")
        name = f"{upload_id}.{encoded}"
        side = None
        if len(name) > _MAX_NAME:
            name = f"{upload_id}~long"
            side = os.path.join(self._staging, upload_id + _KEY_SIDE_SUFFIX)
        path = os.path.join(self._staging, name)
        self._private_dir(self._staging, key, operation)
        for tries in (1, 2):
            try:
                if side is not None:
                    with open(side, "xb") as f:
                        f.write(key.encode("utf-8"))
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                os.close(fd)
                return name, path
            except FileNotFoundError as exc:
                if tries == 2:
                    raise self._error(exc, key, operation) from exc
                self._ensure_dir(self._staging, key, operation)
            except OSError as exc:
                self._discard(name)
                raise self._error(exc, key, operation) from exc
        raise AssertionError("unreachable")

    def _discard(self, name: str) -> None:
        """Remove a staging file and its side file; absent is fine."""
        if "/" in name or not name.startswith((_KIND_PUT + ".", _KIND_UPLOAD + ".")):
            raise ValueError(f"not a staging upload id of {self.location}: {name!r}")
        paths = [os.path.join(self._staging, name)]
        if name.endswith("~long"):
            paths.append(os.path.join(self._staging, name[: -len("~long")] + _KEY_SIDE_SUFFIX))
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _parse_staging(self, name: str) -> PendingUpload | None:
        if name.endswith(_KEY_SIDE_SUFFIX):
            return None
        parts = name.split(".", 3)
        if len(parts) < 3 or parts[0] not in (_KIND_PUT, _KIND_UPLOAD):
            return None
        try:
            started = datetime.fromtimestamp(int(parts[1], 16) / 1e9, tz=timezone.utc)
            if name.endswith("~long"):
                side = os.path.join(self._staging, name[: -len("~long")] + _KEY_SIDE_SUFFIX)
                with open(side, "rb") as f:
                    key = f.read().decode("utf-8")
            else:
                encoded = parts[3]
                key = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode("utf-8")
        except (ValueError, IndexError, OSError):
            return None  # not ours, or half-written: GC of the staging dir can remove it by age
        return PendingUpload(key=key, upload_id=name, initiated=started)

    def _seal(self, fd: int, crc32c: str) -> os.stat_result:
        """Record the CRC32C, stamp a unique mtime, fsync; returns the final stat."""
        if self._xattrs:
            try:
                os.setxattr(fd, XATTR_CRC32C, crc32c.encode("ascii"))
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self._xattrs = False  # filesystem without user xattrs: crc32c stays None
        stamp = _unique_ns()
        os.utime(fd, ns=(stamp, stamp))
        os.fsync(fd)
        return os.fstat(fd)

    def _commit(self, name: str, key: str, mode: PutMode, operation: str) -> None:
        """Give the sealed staging file ``name`` the key's name, honouring ``mode``, then fsync
        the directory. The staging name is removed (or left for the caller to discard on error)."""
        staging = os.path.join(self._staging, name)
        with self._parent_fd(key, operation, create=True, write=True) as dfd:
            assert dfd is not None
            target = key.rsplit("/", 1)[-1]  # relative to dfd: never through a symlinked directory
            try:
                if mode.kind == "create":
                    self._link_create(staging, dfd, target, key, operation)
                else:
                    with self._key_lock(key, operation):
                        if mode.kind == "update":
                            st = _lstat_at(dfd, target)
                            if st is None or not stat.S_ISREG(st.st_mode) or _token(st) != mode.version:
                                current = (
                                    _token(st) if st is not None and stat.S_ISREG(st.st_mode) else "absent"
                                )
                                raise PreconditionFailedError(
                                    f"version is {current}, expected {mode.version}",
                                    key=key,
                                    location=self.location,
                                    operation=operation,
                                )
                        self._replace(staging, dfd, target, key, operation)
            except StoreError:
                raise  # already mapped (AlreadyExistsError is also an OSError)
            except OSError as exc:
                raise self._error(exc, key, operation) from exc
            self._fsync_fd(dfd, key, operation)

    def _link_create(self, staging: str, dfd: int, target: str, key: str, operation: str) -> None:
        if self.create == "lock":
            # Opted in: the lock makes link-or-check-and-replace one step among objckpt writers.
            with self._key_lock(key, operation):
                try:
                    os.link(staging, target, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    self._exists_error(dfd, target, key, operation)
                except OSError as exc:
                    if exc.errno not in _NO_LINK_ERRNOS:
                        raise
                    if _lstat_at(dfd, target) is not None:
                        self._exists_error(dfd, target, key, operation)
                    os.replace(staging, target, dst_dir_fd=dfd)
            return
        try:
            os.link(staging, target, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            self._exists_error(dfd, target, key, operation)
        except OSError as exc:
            if exc.errno not in _NO_LINK_ERRNOS:
                raise
            # Never degrade silently to check-then-write: that would let another program's
            # write between the check and the replace be overwritten.
            raise NotSupportedError(
                f"the filesystem holding {self.root} refuses hard links "
                f"({errno.errorcode.get(exc.errno or 0, exc.errno)}), which file:// needs to enforce "
                "create-if-absent atomically; use a filesystem with hard links, or open the store "
                f"with file://{self.root}?create=lock to check under objckpt's lock files instead "
                "(atomic only among objckpt writers)",
                key=key,
                location=self.location,
                operation=operation,
            ) from exc
        # after a link the staging name still exists; the caller discards it

    def _exists_error(self, dfd: int, target: str, key: str, operation: str) -> None:
        st = _lstat_at(dfd, target)
        if st is not None and stat.S_ISDIR(st.st_mode):
            raise NotSupportedError(
                "a file:// store cannot hold both an object and keys below it "
                "(the key is a directory of other keys)",
                key=key,
                location=self.location,
                operation=operation,
            )
        raise AlreadyExistsError(
            "object already exists", key=key, location=self.location, operation=operation
        )

    def _replace(self, staging: str, dfd: int, target: str, key: str, operation: str) -> None:
        # a symbolic link at the target is replaced itself (rename never follows it)
        try:
            os.replace(staging, target, dst_dir_fd=dfd)
        except IsADirectoryError:
            raise NotSupportedError(
                "a file:// store cannot hold both an object and keys below it "
                "(the key is a directory of other keys)",
                key=key,
                location=self.location,
                operation=operation,
            ) from None

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

    # ------------------------------------------------------------------ writes

    def _put(self, key: str, data: memoryview, mode: PutMode, crc32c: str) -> ObjectMeta:
        """Atomic create/overwrite/update of one object (see module doc).

        Raises AlreadyExistsError, PreconditionFailedError, ChecksumMismatchError (body does not
        match ``crc32c``), NotSupportedError (key clashes with a directory), InvalidKeyError, and
        the mapped filesystem errors; on any error no object is written or changed.
        """
        self._path(key, "put")
        if crc32c_b64(data) != crc32c:
            raise ChecksumMismatchError(
                f"body does not match its CRC32C {crc32c}", key=key, location=self.location
            )
        return self._put_buffers(key, [data], mode, crc32c)

    def _put_buffers(self, key: str, buffers: list[memoryview], mode: PutMode, crc32c: str) -> ObjectMeta:
        """``_put`` of buffers whose CRC32C the caller (``Store.put``/``put_stream``) computed
        from these very buffers: written with ``writev``, not hashed again."""
        self._path(key, "put")
        name, path = self._new_staging(_KIND_PUT, key, "put")
        try:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    _write_all(fd, buffers, None)
                    st = self._seal(fd, crc32c)
                finally:
                    os.close(fd)
            except OSError as exc:
                raise self._error(exc, key, "put") from exc
            self._commit(name, key, mode, "put")
        except BaseException:
            self._discard(name)
            raise
        self._discard(name)  # replace/fallback consumed it already; link left it
        return self._meta(key, st, crc32c)

    def _create_upload(self, key: str, mode: PutMode) -> UploadHandle:
        self._path(key, "create_upload")
        name, path = self._new_staging(_KIND_UPLOAD, key, "create_upload")
        return UploadHandle(key=key, mode=mode, upload_id=name, state={"path": path})

    def _upload_part(
        self, handle: UploadHandle, part_number: int, offset: int, data: memoryview, crc32c: str
    ) -> PartResult:
        """Verify the part's CRC32C, then ``pwrite`` it at its offset (idempotent on retry).

        Raises ChecksumMismatchError for a corrupted part, NotFoundError if the upload was aborted.
        """
        if crc32c_b64(data) != crc32c:
            raise ChecksumMismatchError(
                f"part {part_number} does not match its CRC32C {crc32c}",
                key=handle.key,
                location=self.location,
            )
        return self._upload_part_buffers(handle, part_number, offset, [data], crc32c)

    def _upload_part_buffers(
        self, handle: UploadHandle, part_number: int, offset: int, buffers: list[memoryview], crc32c: str
    ) -> PartResult:
        """A part given as buffers ``put_stream`` hashed itself: ``pwritev`` at its offset, no
        assembly copy, no second hash (idempotent on retry); then its pages are written back
        from this thread (:mod:`._writeback`; the completion's fsync stays the durability point)."""
        try:
            # No O_CREAT: a part arriving after an abort must not resurrect the upload.
            fd = os.open(handle.state["path"], os.O_WRONLY | os.O_CLOEXEC)
            try:
                size = _write_all(fd, buffers, offset)
                # this part's disk write now, on this thread, not in the one fsync at the end
                write_back(fd, offset, size)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error(exc, handle.key, "upload_part") from exc
        return PartResult(part_number, offset, size, crc32c)

    def _complete_upload(
        self, handle: UploadHandle, parts: list[PartResult], size: int, crc32c: str
    ) -> ObjectMeta:
        """Check the parts tile ``[0, size)``, fsync, and commit like ``_put`` (atomic)."""
        expected = 0
        for part in sorted(parts, key=lambda p: p.offset):
            if part.offset != expected:
                raise StoreError(
                    f"parts do not tile the object: gap or overlap at byte {expected}",
                    key=handle.key,
                    location=self.location,
                    operation="complete_upload",
                )
            expected += part.size
        if expected != size:
            raise StoreError(
                f"parts add up to {expected} bytes, expected {size}",
                key=handle.key,
                location=self.location,
                operation="complete_upload",
            )
        try:
            fd = os.open(handle.state["path"], os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(fd, size)  # a retried larger earlier part cannot leave a tail
                st = self._seal(fd, crc32c)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._error(exc, handle.key, "complete_upload") from exc
        self._commit(handle.upload_id, handle.key, handle.mode, "complete_upload")
        self._discard(handle.upload_id)
        return self._meta(handle.key, st, crc32c)

    def _abort_upload(self, handle: UploadHandle) -> None:
        self._discard(handle.upload_id)

    def _list_uploads(self, prefix: str) -> list[PendingUpload]:
        try:
            names = os.listdir(self._staging)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._error(exc, prefix, "list_uploads") from exc
        found = []
        for name in sorted(names):
            upload = self._parse_staging(name)
            if upload is not None and upload.key.startswith(prefix):
                found.append(upload)
        return found

    def _delete_batch(self, keys: list[str]) -> None:
        """Unlink each key (absent ones ignored), then fsync each touched directory once, so a
        caller that deletes a manifest before its shards keeps that order across a crash."""
        touched: dict[str, str] = {}  # directory -> one key deleted there
        for key in keys:
            with self._parent_fd(key, "delete", create=False, write=True) as dfd:
                if dfd is None:
                    continue  # absent: nothing to lock (and nothing created on a missing root)
                name = key.rsplit("/", 1)[-1]
                st = _lstat_at(dfd, name)
                if st is None or stat.S_ISDIR(st.st_mode):
                    continue  # absent, or a "directory" of other keys, which is not an object
                try:
                    with self._key_lock(key, "delete"):
                        os.unlink(name, dir_fd=dfd)  # a symbolic link is removed, never followed
                except StoreError:
                    raise
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    continue
                except OSError as exc:
                    if exc.errno in (errno.EISDIR, errno.EPERM) and stat.S_ISDIR(
                        (_lstat_at(dfd, name) or st).st_mode
                    ):
                        continue
                    raise self._error(exc, key, "delete") from exc
                touched.setdefault(key.rpartition("/")[0], key)
        for _, key in sorted(touched.items()):
            with self._parent_fd(key, "delete", create=False, write=True) as dfd:
                if dfd is not None:
                    self._fsync_fd(dfd, key, "delete")

    # ------------------------------------------------------------------ reads

    def _open_read(self, key: str, operation: str = "get") -> int:
        """The object's file, opened without following a symbolic link anywhere below the root."""
        with self._parent_fd(key, operation, create=False, write=False) as dfd:
            if dfd is None:
                raise NotFoundError("no such object", key=key, location=self.location, operation=operation)
            name = key.rsplit("/", 1)[-1]
            try:
                fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise self._symlink_error(key, key, operation, write=False) from None
                raise self._error(exc, key, operation) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a "directory" of other keys is not an object
            os.close(fd)
            raise NotFoundError("no such object", key=key, location=self.location, operation=operation)
        return fd

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        # A generator throughout: the file is opened at the first next() and closed when the
        # stream ends or is closed, so an abandoned stream never leaks a descriptor.
        fd = self._open_read(key)
        try:
            pos = start
            while end is None or pos < end:
                want = DEFAULT_READ_CHUNK if end is None else min(end - pos, DEFAULT_READ_CHUNK)
                try:
                    chunk = os.pread(fd, want, pos)
                except OSError as exc:
                    raise self._error(exc, key, "get") from exc
                if not chunk:
                    return  # past the end: ranges are clamped, like HTTP range requests
                pos += len(chunk)
                yield chunk
        finally:
            os.close(fd)

    def _read_into(self, key: str, start: int, buffers: list[memoryview]) -> int:
        # preadv: the kernel copies the page cache straight into the destination (a tensor's
        # memory), with the GIL released; no chunk is allocated on the way.
        fd = self._open_read(key)
        try:
            pending, pos, filled = buffers, start, 0
            while pending:
                try:
                    n = os.preadv(fd, pending[:_IOV_MAX], pos)
                except OSError as exc:
                    raise self._error(exc, key, "get") from exc
                if not n:
                    break  # the object ends first: like a clamped range
                pos, filled = pos + n, filled + n
                pending = advance(pending, n)
            return filled
        finally:
            os.close(fd)

    def _head(self, key: str) -> ObjectMeta:
        fd = self._open_read(key, "head")
        try:
            return self._meta(key, os.fstat(fd), self._read_crc(fd))
        finally:
            os.close(fd)

    def _start_dir(self, prefix: str) -> tuple[str, str] | None:
        """(directory to walk, key prefix of its entries) for ``prefix``; ``None`` when no valid
        key can start with ``prefix``."""
        dirs = prefix.split("/")[:-1]  # the last segment is a partial name, used as a filter
        if any(seg in ("", ".", "..") or "\x00" in seg for seg in dirs):
            return None
        if dirs and dirs[0].startswith(RESERVED_PREFIX):
            return None
        path = self.root
        for seg in dirs:  # a symlinked directory holds no objects (listings never follow links)
            path = os.path.join(path, seg)
            if os.path.islink(path):
                return None
        return path, "".join(seg + "/" for seg in dirs)

    def _walk(
        self, directory: str, key_prefix: str, prefix: str, start_after: str | None
    ) -> Iterator[tuple[str, str]]:
        """(key, path) of every file below ``directory`` whose key starts with ``prefix`` and is
        greater than ``start_after``, in plain string order (as S3 lists), not directory order.

        A directory ``d`` sorts as ``"d/"``: every key below it starts with that, so ordering
        siblings that way and descending in order yields keys sorted. Subtrees entirely before
        ``start_after`` or outside ``prefix`` are skipped without being read.
        """
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        items = []
        for entry in entries:
            name = entry.name
            if not key_prefix and name.startswith(RESERVED_PREFIX):
                continue  # staging and lock files are not objects
            try:
                if entry.is_dir(follow_symlinks=False):
                    items.append((key_prefix + name + "/", entry.path, True))
                elif entry.is_file(follow_symlinks=False):
                    items.append((key_prefix + name, entry.path, False))
            except OSError:
                continue  # vanished while listing
        items.sort()
        for key, path, is_dir in items:
            if is_dir:
                if not (key.startswith(prefix) or prefix.startswith(key)):
                    continue
                if start_after is not None and key < start_after and not start_after.startswith(key):
                    continue  # every key below is < start_after
                yield from self._walk(path, key, prefix, start_after)
            elif key.startswith(prefix) and (start_after is None or key > start_after):
                yield key, path

    def _list_page(self, prefix: str, start_after: str | None, limit: int) -> tuple[list[ObjectMeta], bool]:
        start = self._start_dir(prefix)
        if start is None:
            return [], False
        page: list[ObjectMeta] = []
        try:
            for key, path in self._walk(start[0], start[1], prefix, start_after):
                if len(page) == limit:
                    return page, True
                try:
                    st = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # deleted since the directory was read
                page.append(self._meta(key, st, self._read_crc(path)))
        except OSError as exc:
            raise self._error(exc, prefix, "list") from exc
        return page, False

    def _list_prefixes(self, prefix: str) -> list[str]:
        """Subdirectories directly below ``prefix`` that hold at least one object (like S3, an
        empty directory left behind by deletes is not a prefix)."""
        start = self._start_dir(prefix)
        if start is None:
            return []
        directory, key_prefix = start
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise self._error(exc, prefix, "list") from exc
        found = []
        for entry in entries:
            key = key_prefix + entry.name + "/"
            if not key_prefix and entry.name.startswith(RESERVED_PREFIX):
                continue
            if key.startswith(prefix) and entry.is_dir(follow_symlinks=False):
                if next(self._walk(entry.path, key, key, None), None) is not None:
                    found.append(key)
        return sorted(found)


__all__ = ["InvalidKeyError", "LocalStore"]
