"""Semantics specific to the file:// backend (the contract suite covers the shared ones)."""

from __future__ import annotations

import errno
import os
import stat
import threading

import pytest

from objckpt._crc import crc32c_b64
from objckpt.errors import (
    AlreadyExistsError,
    ChecksumMismatchError,
    ConfigError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
    PreconditionFailedError,
    StoreError,
    TransientError,
)
from objckpt.store import PutMode, open_store
from objckpt.store.local import LOCKS_DIR, STAGING_DIR, XATTR_CRC32C, InvalidKeyError, LocalStore

MiB = 1024 * 1024


@pytest.fixture
def root(tmp_path):
    return tmp_path / "run"


@pytest.fixture
def store(root):
    s = open_store(f"file://{root}")
    yield s
    s.close()


def _staging(root) -> list[str]:
    path = root / STAGING_DIR
    return sorted(os.listdir(path)) if path.exists() else []


def _files(root) -> list[str]:
    """Every regular file below ``root``, staging and locks excluded, relative."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in (STAGING_DIR, LOCKS_DIR)]
        out += [os.path.relpath(os.path.join(dirpath, f), root) for f in filenames]
    return sorted(out)


def _fd_under(fd: int, root) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
    except OSError:
        return False


def _assert_disk_full(err: StoreError, key: str, root) -> None:
    assert not isinstance(err, TransientError)  # retrying does not free space
    assert "disk full" in str(err)
    assert key in str(err) and f"file://{root}" in str(err)


# ---------------------------------------------------------------- failures leave nothing behind


def test_enospc_mid_put_maps_to_disk_full_and_leaves_no_partial_file(store, root, monkeypatch):
    store.put("keep", b"old")
    real_write = os.write
    calls = []

    def write(fd, data):
        if not _fd_under(fd, root):
            return real_write(fd, data)
        calls.append(fd)
        if len(calls) == 1:  # the first write lands half the bytes, the next finds the disk full
            return real_write(fd, memoryview(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(StoreError) as info:
        store.put("shard", b"x" * 10_000, mode=PutMode.CREATE)
    _assert_disk_full(info.value, "shard", root)
    with pytest.raises(StoreError):
        store.put("keep", b"new content")  # overwrite fails too ...
    monkeypatch.undo()
    assert store.get("keep") == b"old"  # ... and the old object is intact
    with pytest.raises(NotFoundError):
        store.head("shard")
    assert _files(root) == ["keep"]
    assert _staging(root) == []


def test_enospc_in_a_streamed_part_aborts_and_leaves_nothing(store, root, monkeypatch):
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        if _fd_under(fd, root) and offset >= MiB:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(StoreError) as info:
        store.put_stream("big", bytes(3 * MiB), part_size=MiB)
    _assert_disk_full(info.value, "big", root)
    monkeypatch.undo()
    with pytest.raises(NotFoundError):
        store.head("big")
    assert store.list_uploads() == []
    assert _staging(root) == []
    assert _files(root) == []


def test_failed_conditional_write_cleans_its_staging_file(store, root):
    v1 = store.put("p", b"1", mode=PutMode.CREATE)
    store.put("p", b"2", mode=PutMode.update(v1.version))
    with pytest.raises(AlreadyExistsError):
        store.put("p", b"3", mode=PutMode.CREATE)
    with pytest.raises(PreconditionFailedError):
        store.put("p", b"4", mode=PutMode.update(v1.version))
    with pytest.raises(AlreadyExistsError):
        store.put_stream("p", bytes(3 * MiB), part_size=MiB)
    assert store.get("p") == b"2"
    assert _staging(root) == []


def test_put_with_wrong_crc32c_is_rejected_before_anything_is_written(store, root):
    with pytest.raises(ChecksumMismatchError):
        store._put("k", memoryview(b"bytes"), PutMode.CREATE, crc32c_b64(b"other"))
    assert _files(root) == [] and _staging(root) == []


def test_eacces_maps_to_permission_denied_naming_key_and_root(store, root, monkeypatch):
    # Tests may run as root, where chmod does not deny anything: inject the errno instead.
    store.put("k", b"x")
    real_open = os.open

    def deny(path, *args, **kwargs):
        if str(path).startswith(str(root)) and STAGING_DIR not in str(path) and LOCKS_DIR not in str(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(PermissionDeniedError) as info:
        store.get("k")
    assert isinstance(info.value, PermissionError)
    assert "k" in str(info.value) and f"file://{root}" in str(info.value)


def test_enoent_and_not_a_directory_map_to_not_found(store):
    store.put("file", b"x")
    for key in ("missing", "file/below", "no/such/dir"):
        with pytest.raises(NotFoundError):
            store.get(key)
        with pytest.raises(NotFoundError):
            store.head(key)


# ---------------------------------------------------------------- staging and uploads


def test_staging_files_are_never_listed_and_pending_uploads_are_recoverable(root):
    store = LocalStore(root)
    store.put("obj", b"x")
    short = store._create_upload("data/shard.pt", PutMode.CREATE)
    store._upload_part(short, 1, 0, memoryview(b"abc"), crc32c_b64(b"abc"))
    long_key = "data/" + "x" * 300
    long = store._create_upload(long_key, PutMode.CREATE)

    assert [m.key for m in store.list("")] == ["obj"]
    assert store.list_prefixes("") == []
    assert [m.key for m in store.list(".objckpt")] == []

    # A second process (a fresh store on the same root) finds them: key and start time recorded.
    other = LocalStore(root)
    pending = other.list_uploads("data/")
    assert sorted(u.key for u in pending) == sorted(["data/shard.pt", long_key])
    assert all(u.initiated is not None for u in pending)
    assert other.list_uploads("nothing/") == []
    for upload in pending:
        other.abort_upload(upload)
        other.abort_upload(upload)  # idempotent
    assert other.list_uploads() == []
    assert _staging(root) == []
    with pytest.raises(NotFoundError):  # a late part does not resurrect an aborted upload
        store._upload_part(long, 1, 0, memoryview(b"abc"), crc32c_b64(b"abc"))


def test_parts_written_out_of_order_assemble_correctly(store):
    parts = [bytes([i]) * 1000 for i in range(5)]
    handle = store._create_upload("k", PutMode.CREATE)
    results = []
    threads = []
    for number in (5, 3, 1, 4, 2):
        data = parts[number - 1]

        def upload(number=number, data=data):
            results.append(
                store._upload_part(handle, number, (number - 1) * 1000, memoryview(data), crc32c_b64(data))
            )

        threads.append(threading.Thread(target=upload))
        threads[-1].start()
    for t in threads:
        t.join()
    whole = b"".join(parts)
    meta = store._complete_upload(
        handle, sorted(results, key=lambda r: r.part_number), len(whole), crc32c_b64(whole)
    )
    assert store.get("k") == whole
    assert meta.version == store.head("k").version


def test_complete_rejects_parts_that_do_not_tile_the_object(store):
    handle = store._create_upload("k", PutMode.CREATE)
    first = store._upload_part(handle, 1, 0, memoryview(b"aaaa"), crc32c_b64(b"aaaa"))
    with pytest.raises(StoreError):
        store._complete_upload(handle, [first], 8, crc32c_b64(b"aaaa"))
    store._abort_upload(handle)
    with pytest.raises(NotFoundError):
        store.head("k")


# ---------------------------------------------------------------- durability


def test_put_fsyncs_the_file_and_its_directory(store, root, monkeypatch):
    real_fsync = os.fsync
    synced = []

    def fsync(fd):
        st = os.fstat(fd)
        synced.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store.put("a/b/c", b"data", mode=PutMode.CREATE)
    kinds = [kind for kind, _ in synced]
    assert kinds.index("file") < len(kinds) - 1  # data synced before the name is
    assert ("dir", str(root / "a" / "b")) == synced[-1]  # the new name is durable
    assert ("dir", str(root / "a")) in synced  # and so are the directories made for it

    synced.clear()
    store.put_stream("big", bytes(3 * MiB), part_size=MiB)
    assert [k for k, _ in synced] == ["file", "dir"]

    synced.clear()
    store.delete(["a/b/c"])
    assert synced[-1] == ("dir", str(root / "a" / "b"))
    assert "file" not in [k for k, _ in synced]


# ---------------------------------------------------------------- keys


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/etc/passwd",
        "../escape",
        "a/../../escape",
        "a/./b",
        "a//b",
        "trailing/",
        ".",
        "..",
        "nul\x00byte",
        f"{STAGING_DIR}/x",
        f"{LOCKS_DIR}/00",
        ".objckpt-anything",
    ],
)
def test_keys_cannot_escape_the_root_or_reach_internal_files(store, root, tmp_path, key):
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.put_stream(key, bytes(3000), part_size=1000),
        lambda: store.get(key),
        lambda: store.head(key),
        lambda: store.delete([key]),
        lambda: b"".join(store.get_stream(key)),
    ):
        with pytest.raises(InvalidKeyError) as info:
            call()
        assert isinstance(info.value, ValueError)
    assert sorted(os.listdir(tmp_path)) == (["run"] if root.exists() else [])
    assert _files(root) == []
    assert list(store.list("../")) == [] and store.list_prefixes("../") == []


def test_listing_is_in_plain_string_order_not_directory_order(store):
    keys = ["a/b", "a-b", "a.c", "a0", "a/b-c/d", "a/b/c", "B", "a/bc"]
    for key in keys:
        if key == "a/b":
            continue  # "a/b" cannot be both an object and a directory here
        store.put(key, b"")
    expected = sorted(k for k in keys if k != "a/b")
    assert [m.key for m in store.list("")] == expected
    assert [m.key for m in store.list("a/b")] == ["a/b-c/d", "a/b/c", "a/bc"]
    # pagination boundaries inside and across directories
    for i in range(len(expected)):
        assert [m.key for m in store.list("", start_after=expected[i])] == expected[i + 1 :]


def test_object_and_directory_of_the_same_name_cannot_coexist(store, root):
    store.put("a/b", b"x")
    with pytest.raises(NotSupportedError):
        store.put("a/b/c", b"y")
    with pytest.raises(NotSupportedError):
        store.put("a", b"y", mode=PutMode.CREATE)
    with pytest.raises(NotSupportedError):
        store.put("a", b"y")
    with pytest.raises(NotFoundError):
        store.head("a")
    store.delete(["a"])  # a directory is not an object: nothing happens
    assert store.get("a/b") == b"x"


def test_empty_directories_left_by_deletes_are_not_listed_as_prefixes(store):
    store.put("d/1/x", b"x")
    store.put("d/2/x", b"x")
    store.delete(["d/1/x"])
    assert store.list_prefixes("d/") == ["d/2/"]
    assert store.list_prefixes("") == ["d/"]


# ---------------------------------------------------------------- versions and metadata


def test_every_write_gets_a_distinct_version_even_when_inodes_are_reused(store):
    # ext4 hands a freed inode to the next file and kernel mtimes are jiffy-coarse, so without
    # the writer's unique mtime these tokens would repeat (ABA) and a stale CAS could succeed.
    seen = set()
    for _ in range(200):
        meta = store.put("ptr", b"same size")
        assert meta.version not in seen
        seen.add(meta.version)


def test_update_does_not_accept_a_version_token_of_an_overwritten_object(store):
    first = store.put("ptr", b"1")
    store.put("ptr", b"1")  # same bytes, new version
    with pytest.raises(PreconditionFailedError):
        store.put("ptr", b"2", mode=PutMode.update(first.version))


def test_crc32c_is_stored_when_the_filesystem_has_user_xattrs(store, root):
    meta = store.put("k", b"payload")
    try:
        stored = os.getxattr(root / "k", XATTR_CRC32C).decode()
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    assert stored == meta.crc32c == crc32c_b64(b"payload")
    assert store.head("k").crc32c == meta.crc32c
    assert [m.crc32c for m in store.list("")] == [meta.crc32c]


def test_files_written_by_other_tools_are_listed_without_crc(store, root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "foreign").write_bytes(b"abc")
    (meta,) = store.list("")
    assert (meta.key, meta.size, meta.crc32c) == ("foreign", 3, None)
    assert store.get_verified("foreign", expected_crc32c=crc32c_b64(b"abc")) == b"abc"


def test_missing_root_reads_as_empty_and_the_first_write_creates_it(root):
    store = LocalStore(root)
    assert list(store.list("")) == [] and store.list_prefixes() == [] and store.list_uploads() == []
    with pytest.raises(NotFoundError):
        store.head("k")
    store.delete(["k"])
    assert not root.exists()
    store.put("deep/k", b"x", mode=PutMode.CREATE)
    assert store.get("deep/k") == b"x"


def _no_hard_links(monkeypatch) -> list[tuple[str, str]]:
    calls = []

    def no_link(src, dst, *_args, **_kwargs):
        calls.append((str(src), str(dst)))
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    return calls


def test_create_without_hard_links_is_refused_naming_the_root_and_the_option(store, root, monkeypatch):
    links = _no_hard_links(monkeypatch)
    with pytest.raises(NotSupportedError) as info:
        store.put("k", b"first", mode=PutMode.CREATE)
    message = str(info.value)
    assert f"file://{root}" in message and "hard links" in message and "create=lock" in message
    assert links  # the link was tried: the refusal is the filesystem's, not a guess
    with pytest.raises(NotSupportedError):
        store.put_stream("big", bytes(3 * MiB), part_size=MiB)
    monkeypatch.undo()
    with pytest.raises(NotFoundError):  # nothing written, nothing staged
        store.head("k")
    assert _files(root) == [] and _staging(root) == []
    assert store.list_uploads() == []
    # overwrite and update never link: they work on such a filesystem as they are
    _no_hard_links(monkeypatch)
    v1 = store.put("k", b"1")
    store.put("k", b"2", mode=PutMode.update(v1.version))
    assert store.get("k") == b"2"


def test_create_lock_opts_in_to_a_locked_check_without_hard_links(root, monkeypatch):
    store = open_store(f"file://{root}?create=lock")
    _no_hard_links(monkeypatch)
    store.put("k", b"first", mode=PutMode.CREATE)
    with pytest.raises(AlreadyExistsError):
        store.put("k", b"second", mode=PutMode.CREATE)
    with pytest.raises(AlreadyExistsError):
        store.put_stream("k", bytes(3 * MiB), part_size=MiB)
    assert store.get("k") == b"first"
    assert _staging(root) == []
    with pytest.raises(ConfigError, match="create"):
        open_store(f"file://{root}?create=maybe")


def test_create_lock_racers_without_hard_links_have_one_winner(root, monkeypatch):
    _no_hard_links(monkeypatch)
    n = 8
    stores = [open_store(f"file://{root}?create=lock") for _ in range(n)]  # as if 8 processes
    barrier = threading.Barrier(n)
    winners = []

    def attempt(i):
        barrier.wait()
        try:
            stores[i].put("race", f"w{i}".encode(), mode=PutMode.CREATE)
            winners.append(i)
        except AlreadyExistsError:
            pass

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(winners) == 1
    assert stores[0].get("race") == f"w{winners[0]}".encode()


def test_lock_files_stay_bounded_and_out_of_listings(store, root):
    keys = [f"k{i}" for i in range(300)]  # more keys than stripes
    for key in keys:
        store.put(key, b"x")
    store.delete(keys)
    assert len(os.listdir(root / LOCKS_DIR)) <= 256
    assert list(store.list("")) == []
