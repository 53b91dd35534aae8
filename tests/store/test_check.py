"""What can be checked when a store is opened, is: a part size the server refuses (S3's 5 MiB
minimum part) fails at construction naming the bucket, and ``Store.check()`` /
``open_store(check=True)`` / ``CheckpointManager`` find a missing bucket, refused credentials or
an unusable root with one request, before the first save uploads anything.

``open_store`` alone makes no request (CLI and tests open stores for servers not up yet).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from objckpt.errors import BucketNotFoundError, ConfigError, PermissionDeniedError
from objckpt.store import open_store
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore
from tests.backends import Backend

MiB = 1024 * 1024


def test_check_is_one_request_and_leaves_nothing(backend: Backend) -> None:
    store = backend.new_store()
    counting = CountingStore(store, close_inner=False)
    counting.check()
    assert sum(counting.counts.values()) == 1
    counting.check(write=True)
    assert list(store.list("")) == []
    store.close()


def test_a_missing_bucket_is_found_by_check_naming_it(backend: Backend) -> None:
    if backend.missing_bucket is None:
        pytest.skip(f"{backend.name}: no bucket that can be missing")
    store = backend.missing_bucket()  # opening it makes no request, so it succeeds
    with pytest.raises(BucketNotFoundError, match="objckpt-no-such-bucket"):
        store.check()
    store.close()


def test_open_store_checks_only_when_asked(backend: Backend) -> None:
    if backend.uri_for is None or backend.missing_bucket is None:
        pytest.skip(f"{backend.name}: no URI form with a bucket that can be missing")
    good = backend.uri_for("t-check")
    open_store(good, check=True).close()
    open_store(good, check="write").close()
    bad = good.replace(good.split("://", 1)[1].split("/", 1)[0], "objckpt-no-such-bucket", 1)
    open_store(bad).close()  # no request: no error
    with pytest.raises(BucketNotFoundError, match="objckpt-no-such-bucket"):
        open_store(bad, check=True)


def test_open_store_refuses_a_bad_check_value() -> None:
    with pytest.raises(ConfigError, match="check"):
        open_store("memory://x", check="yes")


# ------------------------------------------------------------------ S3 part size


def test_s3_part_size_below_the_minimum_fails_at_construction_naming_the_bucket() -> None:
    pytest.importorskip("boto3")
    with pytest.raises(ConfigError, match=r"part_size 1,048,576 is below .*s3://some-bucket.*5,242,880"):
        open_store("s3://some-bucket/run?part_size=1MiB&endpoint_url=http://127.0.0.1:9")
    # the default and anything >= 5 MiB are fine; a server that accepts smaller parts says so
    open_store("s3://some-bucket/run?endpoint_url=http://127.0.0.1:9").close()
    open_store("s3://some-bucket/run?part_size=5MiB&endpoint_url=http://127.0.0.1:9").close()
    small = open_store("s3://bkt/run?part_size=64KiB&min_part_size=64KiB&endpoint_url=http://127.0.0.1:9")
    assert small.part_size == 64 * 1024 and small.min_part_size == 64 * 1024
    small.close()


def test_a_per_call_part_size_below_the_minimum_fails_before_uploading() -> None:
    pytest.importorskip("boto3")
    store = CountingStore(open_store("s3://bkt/run?endpoint_url=http://127.0.0.1:9"))
    with pytest.raises(ConfigError, match="below the smallest part"):
        store.put_stream("big", b"x" * (3 * MiB), part_size=MiB)
    assert sum(store.counts.values()) == 0  # nothing sent
    store.close()


def test_the_check_also_refuses_a_bad_part_size() -> None:
    store = MemoryStore("m")
    store.min_part_size = 32 * MiB  # above the 16 MiB default part
    with pytest.raises(ConfigError, match="below the smallest part"):
        store.check()


# ------------------------------------------------------------------ file://


def test_file_check_accepts_a_root_that_will_be_created(tmp_path: Path) -> None:
    open_store(f"file://{tmp_path}/not/yet/there", check=True).close()
    assert not (tmp_path / "not").exists()  # checking creates nothing


def test_file_check_refuses_a_root_that_cannot_exist(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        open_store(f"file://{tmp_path}/afile/run", check=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_file_check_refuses_an_unwritable_parent(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionDeniedError):
        open_store(f"file://{locked}/run", check=True)
