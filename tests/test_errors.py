"""The error tree, its wire codec and the one damage rule (invariant 11b)."""

from __future__ import annotations

import pytest

from objckpt import errors
from objckpt.errors import (
    BucketNotFoundError,
    ChecksumMismatchError,
    CommitConflict,
    CommitError,
    ConfigError,
    DistributedError,
    IntegrityError,
    LoadRefusedError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    ObjckptError,
    PermissionDeniedError,
    SerializationError,
    StoreError,
    TrainingStateError,
    TransientError,
    decode_error,
    encode_error,
    is_damage,
)
from objckpt.reader import Reader
from objckpt.store.wrappers import Fault, FaultInjectingStore
from tests.protocol.helpers import FAST_RETRY, memory_store, save


def _every_error_class() -> list[type[ObjckptError]]:
    return [getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)]


def test_every_public_exception_has_one_root() -> None:
    classes = _every_error_class()
    assert len(classes) >= 20
    assert all(issubclass(cls, ObjckptError) for cls in classes)
    assert all(issubclass(cls, Exception) for cls in classes)  # never a bare BaseException
    # the tree in the module docstring names every class
    for cls in classes:
        assert cls.__name__ in errors.__doc__, cls


@pytest.mark.parametrize("cls", _every_error_class(), ids=lambda c: c.__name__)
def test_every_error_crosses_the_wire_as_itself(cls: type[ObjckptError]) -> None:
    exc = cls.__new__(cls)
    ObjckptError.__init__(exc, f"a {cls.__name__} on rank 3")
    back = decode_error(encode_error(exc))
    assert type(back) is cls and str(back) == str(exc)


def test_fields_travel_with_the_error() -> None:
    commit = CommitConflict("step 7 lost", {3: "attempt abc won", 0: "late"})
    back = decode_error(encode_error(commit))
    assert type(back) is CommitConflict and back.failures == {3: "attempt abc won", 0: "late"}
    assert str(back) == str(commit)
    store = PermissionDeniedError("denied", key="manifests/x.json", location="s3://b/run", operation="get")
    back = decode_error(encode_error(store))
    assert (back.key, back.location, back.operation) == ("manifests/x.json", "s3://b/run", "get")
    assert isinstance(back, PermissionError)  # the built-in family survives too


def test_a_new_error_class_joins_the_codec_by_being_defined() -> None:
    class PluginQuotaError(StoreError):
        """Defined here, after objckpt was imported: no list anywhere names it."""

    back = decode_error(encode_error(PluginQuotaError("quota", key="k", location="memory://x")))
    assert type(back) is PluginQuotaError and back.key == "k"


def test_foreign_errors_become_distributed_errors_and_nothing_is_evaluated() -> None:
    back = decode_error({"type": "os.system", "message": "rm -rf /"})
    assert type(back) is DistributedError and "os.system: rm -rf /" in str(back)
    assert type(decode_error(encode_error(ValueError("bad step")))) is ValueError
    assert type(decode_error(encode_error(ZeroDivisionError("x")))) is DistributedError


@pytest.mark.parametrize(
    "exc",
    [
        ChecksumMismatchError("crc"),
        ManifestError("schema"),
        SerializationError("truncated"),
        IntegrityError("bytes"),
        NotFoundError("shard gone", key="data/x"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_damage_is_what_the_bytes_say(exc: BaseException) -> None:
    assert is_damage(exc)


@pytest.mark.parametrize(
    "exc",
    [
        TransientError("503 SlowDown after the budget"),
        PermissionDeniedError("403"),
        BucketNotFoundError("no such bucket"),
        ConfigError("bad option"),
        LoadRefusedError("weights_only refuses it"),
        TrainingStateError("shape mismatch"),
        DistributedError("timeout"),
        NoCheckpointError("nothing"),
        CommitError("x"),
        StoreError("400"),
        OSError("disk"),
        RuntimeError("?"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_everything_else_is_not_damage(exc: BaseException) -> None:
    assert not is_damage(exc)


# -- the bug: outages and permission errors rolled jobs back silently through Reader.restore


@pytest.mark.parametrize("error", [TransientError, PermissionDeniedError])
def test_reader_restore_raises_an_outage_instead_of_falling_back(error: type) -> None:
    store = memory_store()
    save(store, 10)
    newest = save(store, 20)
    faulty = FaultInjectingStore(
        store, [Fault(op="open", key="data/*", error=error, times=None)], retry=FAST_RETRY
    )
    with pytest.raises(error):
        Reader(faulty).restore(lambda m: Reader(faulty).read_shard(m.shards[0]))
    assert newest.step == 20


def test_reader_restore_falls_back_on_damage_only() -> None:
    store = memory_store()
    save(store, 10)
    newest = save(store, 20)
    store.corrupt(newest.shards[0].key, b"x" * newest.shards[0].size)
    manifest, data = Reader(store).restore(lambda m: Reader(store).read_shard(m.shards[0]))
    assert manifest.step == 10


@pytest.mark.parametrize("error", [TransientError, PermissionDeniedError])
def test_verify_raises_an_outage_instead_of_reporting_bad_objects(error: type) -> None:
    store = memory_store()
    m = save(store, 10)
    faulty = FaultInjectingStore(
        store, [Fault(op="open", key="data/*", error=error, times=None)], retry=FAST_RETRY
    )
    with pytest.raises(error):
        Reader(faulty).verify(m)
    store.corrupt(m.shards[0].key, b"y" * m.shards[0].size)
    problems = Reader(store).verify(m)
    assert [p.key for p in problems] == [m.shards[0].key] and "CRC32C" in problems[0].reason


def test_a_shard_check_raises_an_outage_and_reports_a_missing_shard() -> None:
    store = memory_store()
    m = save(store, 10)
    faulty = FaultInjectingStore(
        store, [Fault(op="head", key="data/*", error=TransientError, times=None)], retry=FAST_RETRY
    )
    with pytest.raises(TransientError):
        Reader(faulty).check(m)
    store.delete([m.shards[1].key])
    assert [p.reason for p in Reader(store).check(m)] == ["shard is missing"]
