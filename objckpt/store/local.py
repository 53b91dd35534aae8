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
and ``EINTR`` (a syscall interrupted by a signal) -> :class:`TransientError`, anything else ->
:class:`StoreError`; each names the key and root.

POSIX only (``fcntl``, ``os.link``, ``os.pwrite``).

Options (URI query parameters or ``open_store`` keywords; see :data:`LocalStore.OPTIONS`):

==========  ===========================================================================
``create``  ``link`` (default): CREATE by hard link, atomic against every writer;
            ``lock``: also allow filesystems without hard links (see above)
==========  ===========================================================================

This module holds :class:`LocalStore` itself (scheme, capabilities, ``from_uri``); the rest
lives in private modules, each one concern: ``_local_base.py`` (the option, the constructor,
the key and error rules: the base class), ``_local_dirs.py`` (walking and creating directories
without following links, directory fsync, the stripe locks), ``_local_staging.py`` (staging
files and the atomic commit), ``_local_writes.py`` (puts, streamed uploads, deletes) and
``_local_reads.py`` (reads and listings), mixins on it; ``_local_util.py`` (reserved names,
errno tables, the unique clock, vectored writes). The names objckpt and its tests import are
imported from here as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InvalidKeyError
from ._local_reads import _LocalReads
from ._local_util import LOCKS_DIR, STAGING_DIR, XATTR_CRC32C
from ._local_writes import _LocalWrites
from .base import Capabilities

if TYPE_CHECKING:
    from ._uri import ParsedURI


class LocalStore(_LocalWrites, _LocalReads):
    """Objects as files below a root directory. Thread- and process-safe; see the module doc."""

    scheme = "file"
    # CREATE by hard link and update/overwrite under flock: every guarantee holds under races
    # (with create=lock, among objckpt writers, which the user opted into).
    capabilities = Capabilities.ALL
    # parts are pwrites into one staging file, the completion a rename (see Store)
    cheap_multipart = True
    # reads are page-cache copies (see Store)
    cheap_reads = True

    @classmethod
    def from_uri(cls, parsed: ParsedURI, options: dict[str, Any]) -> LocalStore:
        # The path is the root itself (there is no bucket): no PrefixStore needed.
        return cls(parsed.prefix, **options)


__all__ = ["InvalidKeyError", "LOCKS_DIR", "LocalStore", "STAGING_DIR", "XATTR_CRC32C"]
