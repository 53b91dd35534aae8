"""file:// never follows a symbolic link inside a run root (reads, head, writes, deletes,
listings). Before the fix a symlinked shard made a restore return the bytes of a file outside
the run root, and a symlinked directory made writes land outside it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from objckpt.coordination import LocalComm, RestoreSession, SaveSession
from objckpt.errors import NotFoundError, PermissionDeniedError, is_damage
from objckpt.reader import Reader
from objckpt.store import PutMode, open_store
from objckpt.store.local import LocalStore


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "run").mkdir()
    (tmp_path / "outside").mkdir()
    return tmp_path


def _store(root: Path) -> LocalStore:
    store = open_store(f"file://{root / 'run'}")
    assert isinstance(store, LocalStore)
    return store


def test_a_symlinked_object_is_not_read(root: Path) -> None:
    secret = root / "outside" / "secret"
    secret.write_bytes(b"outside the run root")
    store = _store(root)
    store.put("a/real", b"inside")
    os.symlink(secret, root / "run" / "a" / "link")
    for read in (lambda: store.get("a/link"), lambda: store.head("a/link"),
                 lambda: b"".join(store.get_stream("a/link"))):  # fmt: skip
        with pytest.raises(NotFoundError, match="symbolic link") as info:
            read()
        assert is_damage(info.value)  # for a restore: reject the checkpoint, never read outside
    assert [m.key for m in store.list("a/")] == ["a/real"]


def test_a_symlinked_directory_is_not_read_or_written(root: Path) -> None:
    (root / "outside" / "d").mkdir()
    (root / "outside" / "d" / "x").write_bytes(b"outside")
    os.symlink(root / "outside" / "d", root / "run" / "d")
    store = _store(root)
    with pytest.raises(NotFoundError, match="symbolic link"):
        store.get("d/x")
    with pytest.raises(NotFoundError, match="symbolic link"):
        store.head("d/x")
    assert list(store.list("d/")) == [] and list(store.list("")) == []
    for mode in (PutMode.CREATE, PutMode.OVERWRITE):
        with pytest.raises(PermissionDeniedError, match="symbolic link"):
            store.put("d/new", b"would land outside", mode=mode)
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        store.put_stream("d/big", [b"p" * 1000] * 3, part_size=1000)
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        store.delete(["d/x"])
    assert sorted(os.listdir(root / "outside" / "d")) == ["x"]  # nothing written or deleted there
    assert (root / "outside" / "d" / "x").read_bytes() == b"outside"


def test_overwriting_or_deleting_a_symlinked_object_touches_only_the_link(root: Path) -> None:
    target = root / "outside" / "t"
    target.write_bytes(b"keep me")
    store = _store(root)
    store.put("k/obj", b"v")
    os.symlink(target, root / "run" / "k" / "link")
    store.delete(["k/link"])
    assert not os.path.lexists(root / "run" / "k" / "link") and target.read_bytes() == b"keep me"
    os.symlink(target, root / "run" / "k" / "link")
    store.put("k/link", b"new", mode=PutMode.OVERWRITE)  # replaces the link itself
    assert target.read_bytes() == b"keep me" and store.get("k/link") == b"new"


def test_staging_and_lock_directories_must_not_be_links(root: Path) -> None:
    os.symlink(root / "outside", root / "run" / ".objckpt-staging")
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        _store(root).put("x", b"y")
    assert os.listdir(root / "outside") == []


def test_the_root_itself_may_be_a_link(root: Path) -> None:
    os.symlink(root / "run", root / "alias")
    store = open_store(f"file://{root / 'alias'}")
    store.put("a/b", b"c")
    assert store.get("a/b") == b"c" and [m.key for m in store.list("")] == ["a/b"]


def _shard(manifest, name="state.bin"):  # type: ignore[no-untyped-def]
    return manifest.shard(0, name)


def test_a_restore_never_returns_the_bytes_of_a_symlinked_shard(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's reproduction: a shard of the newest checkpoint replaced by a link to a file
    outside the run root holding the very same bytes. The restore must reject that checkpoint
    (loudly) and restore its parent, reading nothing outside the root."""
    store = _store(root)
    session = SaveSession(store, LocalComm())
    session.save(10, lambda t: t.writer.write("state.bin", b"step 10 " * 100))
    m20 = session.save(20, lambda t: t.writer.write("state.bin", b"step 20 " * 100))
    path = root / "run" / _shard(m20).key
    outside = root / "outside" / "copy"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    os.symlink(outside, path)

    reader = Reader(_store(root))
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        restored = RestoreSession(reader.store, LocalComm()).restore(lambda m: reader.read_shard(_shard(m)))
    assert restored is not None and restored.step == 10
    assert restored.value == b"step 10 " * 100
    assert restored.fallbacks and "symbolic link" in restored.fallbacks[0][1]
    assert "rejecting checkpoint step 20" in caplog.text


def test_a_symlinked_checkpoint_directory_is_rejected_whole(root: Path) -> None:
    store = _store(root)
    session = SaveSession(store, LocalComm())
    session.save(10, lambda t: t.writer.write("state.bin", b"ten"))
    m20 = session.save(20, lambda t: t.writer.write("state.bin", b"twenty"))
    rank_dir = root / "run" / _shard(m20).key.rsplit("/", 1)[0]
    moved = root / "outside" / "rank0"
    rank_dir.rename(moved)
    os.symlink(moved, rank_dir)
    reader = Reader(_store(root))
    restored = RestoreSession(reader.store, LocalComm()).restore(lambda m: reader.read_shard(_shard(m)))
    assert restored is not None and restored.step == 10 and restored.value == b"ten"
