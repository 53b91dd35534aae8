"""Manifest and pointer encoding/validation (invariants 6, 7, 11, 12)."""

from __future__ import annotations

import hashlib
import json
import pickle

import pytest

from objckpt import layout
from objckpt._crc import crc32c_b64
from objckpt.errors import ManifestError
from objckpt.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MAX_OBJECT_SIZE,
    Manifest,
    Pointer,
    ShardReceipt,
    canonical_json,
)

from .helpers import forge_manifest

STEP = 120
ATTEMPT = "0123456789abcdef"
OTHER = "fedcba9876543210"


def receipt(
    rank: int, name: str = "model.pt", *, step: int = STEP, attempt: str = ATTEMPT, size: int = 5
) -> ShardReceipt:
    return ShardReceipt(
        key=layout.shard_key(step, attempt, rank, name),
        size=size,
        version="v1",
        crc32c=crc32c_b64(b"hello"),
        rank=rank,
        name=name,
        parts=1,
    )


def manifest(**kw: object) -> Manifest:
    args = dict(
        step=STEP,
        attempt=ATTEMPT,
        world_size=2,
        shards=[receipt(0), receipt(1)],
        topology={"world_size": 2, "nodes": 1},
        run={"config_hash": "abc", "dataset_snapshot": "ds-7", "software": {"torch": "2.4.1"}},
        progress={"global_step": STEP, "epoch": 3},
        parent=100,
        metadata={"note": "ü"},
    )
    args.update(kw)
    return Manifest.create(**args)  # type: ignore[arg-type]


# -- invariant 7: what a manifest records


def test_manifest_records_every_required_field_and_round_trips():
    m = manifest()
    d = json.loads(m.encode())
    assert d["format"] == FORMAT and d["format_version"] == FORMAT_VERSION
    assert (d["step"], d["attempt"], d["world_size"]) == (STEP, ATTEMPT, 2)
    assert (d["timeline"], d["parent"]) == (0, {"timeline": 0, "step": 100})
    assert d["topology"] == {"world_size": 2, "nodes": 1}
    assert d["run"]["config_hash"] == "abc" and d["run"]["dataset_snapshot"] == "ds-7"
    assert set(d["run"]["software"]) >= {"objckpt", "python", "torch"}
    assert d["progress"] == {"global_step": STEP, "epoch": 3}
    assert [s["key"] for s in d["shards"]] == [receipt(0).key, receipt(1).key]
    assert set(d["shards"][0]) >= {"key", "size", "version", "crc32c", "rank", "name"}
    assert d["created_at"].endswith("Z") and len(d["checksum"]) == 64
    assert Manifest.decode(m.encode(), key=m.key) == m


def test_manifest_encoding_is_canonical():
    m = manifest()
    data = m.encode()
    assert data == canonical_json(json.loads(data))  # sorted keys, no whitespace
    assert b" " not in data.replace(b"\xc3\xbc", b"")  # no whitespace (payload has none)
    assert "ü".encode() in data  # UTF-8, not \u escapes


def test_manifest_self_checksum_detects_any_changed_byte():
    m = manifest()
    tampered = m.encode().replace(b'"epoch":3', b'"epoch":4')
    with pytest.raises(ManifestError, match="checksum") as ei:
        Manifest.decode(tampered, key=m.key)
    assert ei.value.key == m.key and m.key in str(ei.value)


def test_receipt_to_dict_from_dict_round_trip_and_sha256():
    r = ShardReceipt(
        key=receipt(0).key,
        size=5,
        version="etag",
        crc32c=crc32c_b64(b"hello"),
        rank=0,
        name="model.pt",
        parts=2,
        sha256="a" * 64,
    )
    assert ShardReceipt.from_dict(r.to_dict()) == r
    with pytest.raises(ManifestError):
        ShardReceipt.from_dict({**r.to_dict(), "size": -1}, key="k")


# -- invariant 11: validation of untrusted manifests


@pytest.mark.parametrize(
    "bad_key, reason",
    [
        (f"data/{STEP:020d}-{ATTEMPT}/00000/../../../../etc/passwd", "escape"),
        (f"/data/{STEP:020d}-{ATTEMPT}/00000/model.pt", "absolute"),
        (f"s3://other-bucket/data/{STEP:020d}-{ATTEMPT}/00000/model.pt", "other scheme"),
        (f"data/{STEP:020d}-{OTHER}/00000/model.pt", "other attempt"),
        (f"data/{STEP - 20:020d}-{ATTEMPT}/00000/model.pt", "other step"),
        (f"data/{STEP:020d}-{ATTEMPT}/00001/model.pt", "other rank's prefix"),
    ],
)
def test_decode_rejects_shard_keys_outside_own_attempt(bad_key, reason):
    m = manifest()
    shards = [s.to_dict() for s in m.shards]
    shards[0]["key"] = bad_key  # rank 0's shard
    data = forge_manifest(m, shards=shards)  # checksum recomputed: only the key check can catch it
    with pytest.raises(ManifestError) as ei:
        Manifest.decode(data, key=m.key)
    assert m.key in str(ei.value), reason


def test_create_refuses_to_mix_attempts():
    with pytest.raises(ValueError, match="outside"):
        manifest(shards=[receipt(0), receipt(1, attempt=OTHER)])


@pytest.mark.parametrize(
    "change, match",
    [
        ({"format_version": 99}, "format_version"),
        ({"format": "someone.else"}, "format"),
        ({"step": STEP + 1}, "stored at"),  # copied to another step's key
        ({"parent": STEP}, "parent"),
        ({"world_size": 1}, "world_size"),  # rank 1's shard then is out of range
        ({"extra": 1}, "unknown field"),
        ({"attempt": "../../x"}, "attempt"),
        ({"created_at": "yesterday"}, "created_at"),
        ({"step": True}, "step"),
    ],
)
def test_decode_rejects_bad_schema(change, match):
    m = manifest()
    with pytest.raises(ManifestError, match=match):
        Manifest.decode(forge_manifest(m, **change), key=m.key)


@pytest.mark.parametrize("size", [-1, MAX_OBJECT_SIZE + 1, 1.5, "5", None])
def test_decode_rejects_absurd_sizes(size):
    m = manifest()
    shards = [s.to_dict() for s in m.shards]
    shards[1]["size"] = size
    with pytest.raises(ManifestError, match="size"):
        Manifest.decode(forge_manifest(m, shards=shards), key=m.key)


@pytest.mark.parametrize(
    "data",
    [b"", b"not json", b"[1,2]", b'{"a":1,"a":2}', b'{"x":NaN}', b"\xff\xfe", b"[" * 100000],
)
def test_decode_rejects_non_json(data):
    with pytest.raises(ManifestError) as ei:
        Manifest.decode(data, key=layout.manifest_key(STEP))
    assert layout.manifest_key(STEP) in str(ei.value)


def test_decode_rejects_duplicate_shard_keys():
    m = manifest()
    shards = [s.to_dict() for s in m.shards]
    with pytest.raises(ManifestError, match="twice"):
        Manifest.decode(forge_manifest(m, shards=shards + shards[:1]), key=m.key)


# -- invariant 12: never execute code from the store

_EXECUTED: list[str] = []


def _record(what: str) -> None:  # pickled by reference, so unpickling really calls it
    _EXECUTED.append(what)


class _Boom:
    def __reduce__(self):
        return (_record, ("pwned",))


def test_decode_never_unpickles():
    payload = pickle.dumps(_Boom())
    with pytest.raises(ManifestError):
        Manifest.decode(payload, key=layout.manifest_key(STEP))
    with pytest.raises(ManifestError):
        Pointer.decode(payload)
    assert _EXECUTED == []


# -- pointer


def test_pointer_round_trip_and_validation():
    m = manifest()
    p = Pointer.for_manifest(m)
    assert Pointer.decode(p.encode()) == p
    body = {k: v for k, v in json.loads(p.encode()).items() if k != "checksum"}
    for change, match in (
        ({"step": STEP + 1}, "not step"),
        ({"format_version": 9}, "format_version"),
        ({"manifest": "../x.json"}, "run root"),
    ):
        forged = {**body, **change}
        forged["checksum"] = hashlib.sha256(canonical_json(forged)).hexdigest()
        with pytest.raises(ManifestError, match=match):
            Pointer.decode(canonical_json(forged))
    with pytest.raises(ManifestError, match="checksum"):
        Pointer.decode(p.encode().replace(b"120", b"121"))


def test_a_revision_1_manifest_is_read_as_timeline_0() -> None:
    """Revision-1 run roots stay readable: format_version 1, integer parent, no timeline."""
    import hashlib

    from objckpt.manifest import canonical_json

    m = manifest()
    body = {k: v for k, v in m.body().items() if k not in ("timeline", "references")}
    body["format_version"] = 1
    body["parent"] = 100
    raw = canonical_json({**body, "checksum": hashlib.sha256(canonical_json(body)).hexdigest()})
    old = Manifest.decode(raw, key=m.key)
    assert (old.timeline, old.step, old.parent_ref, old.format_version) == (0, STEP, (0, 100), 1)
    assert old.encode() == raw  # re-encoded in its own version: its checksum still holds


def test_timelines_have_their_own_keys_and_parents_must_be_older() -> None:
    m = Manifest.create(
        step=10, attempt=ATTEMPT, world_size=1, shards=[], timeline=2, parent=30, parent_timeline=0
    )
    assert m.key == "manifests/t0000000002-00000000000000000010.json" and m.label == "t2:10"
    assert Manifest.decode(m.encode(), key=m.key).parent_ref == (0, 30)
    with pytest.raises(ManifestError, match="stored at"):
        Manifest.decode(m.encode(), key="manifests/00000000000000000010.json")  # timeline 0's key
    with pytest.raises(ValueError, match="not older"):
        Manifest.create(
            step=10, attempt=ATTEMPT, world_size=1, shards=[], timeline=1, parent=10, parent_timeline=1
        )
    with pytest.raises(ValueError, match="not older"):
        Manifest.create(
            step=50, attempt=ATTEMPT, world_size=1, shards=[], timeline=1, parent=10, parent_timeline=2
        )  # noqa: E501


@pytest.mark.parametrize("bad_key", ["../outside/model.pt", "/abs/model.pt", "s3://other/model.pt"])
def test_a_reference_outside_the_run_root_is_value_error_on_create_and_manifest_error_on_decode(bad_key):
    # one key check, the reference's receipt check: the error types the docstrings promise
    from objckpt.manifest import Reference

    ref = Reference(bad_key, 5, "v1", crc32c_b64(b"hello"), 0, 100, 0, "model.pt")
    with pytest.raises(ValueError, match="invalid manifest") as info:
        manifest(references=[ref])
    assert not isinstance(info.value, ManifestError)
    good = manifest()
    with pytest.raises(ManifestError, match="reference #0"):
        Manifest.decode(forge_manifest(good, references=[ref.to_dict()]), key=good.key)
