"""CheckpointManager checks its run root when it is constructed: a missing bucket, refused
credentials or an impossible part size fail there, naming the bucket, not at the first save
after the upload (before: the first save discovered them)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from objckpt.errors import BucketNotFoundError, ConfigError  # noqa: E402
from objckpt.store.memory import MemoryStore  # noqa: E402
from objckpt.store.wrappers import CountingStore  # noqa: E402
from objckpt.training.manager import CheckpointManager  # noqa: E402
from tests.backends import Backend  # noqa: E402


def test_a_missing_bucket_fails_at_construction(backend_s3_moto: Backend) -> None:
    store = backend_s3_moto.missing_bucket()
    with pytest.raises(BucketNotFoundError, match="objckpt-no-such-bucket"):
        CheckpointManager(store)
    CheckpointManager(store, check=False).close()  # no request: nothing found out yet
    store.close()


def test_a_part_size_below_the_s3_minimum_fails_at_construction() -> None:
    pytest.importorskip("boto3")
    with pytest.raises(ConfigError, match="s3://bucket-x"):
        CheckpointManager("s3://bucket-x/run", endpoint_url="http://127.0.0.1:9", part_size="1MiB")


def test_the_check_is_one_request_and_write_probes_leave_nothing() -> None:
    store = CountingStore(MemoryStore("mgr-check"))
    CheckpointManager(store).close()
    assert store.counts["list_page"] == 1 and sum(store.counts.values()) == 1
    CheckpointManager(store, check="write").close()
    assert list(store.list("")) == []
    with pytest.raises(ValueError, match="check"):
        CheckpointManager(store, check="maybe")
