"""Shard format 3 (chunks, trailer header, references by identity): round trips and hostile input.

Every size a header declares is checked against what the verified receipts allow before anything
is allocated (invariant 11); a referenced range is used only after its CRC32C matches.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import torch

from objckpt._crc import crc32c_b64, crc32c_of
from objckpt.errors import ChecksumMismatchError, SerializationError
from objckpt.training import dedup
from objckpt.training import serialization as ser

KiB = 1024
ORIGIN = (0, 10, 0, "replicated.bin")


def options(**kw: Any) -> ser.ChunkOptions:
    base = dict(chunk_size=64 * KiB, hash_name=dedup.HASH_NAME, hash_fn=dedup.chunk_hash, min_bytes=4096)
    base.update(kw)
    return ser.ChunkOptions(**base)


def encode(obj: Any, **kw: Any) -> tuple[bytes, ser.ChunkedState]:
    state = ser.encode_chunked(obj, options(**kw))
    return b"".join(bytes(b) for b in state.buffers()), state


def sample_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(100_000, generator=g),  # 390 KiB: 7 chunks of 64 KiB
        "half": torch.randn(3000, generator=g).bfloat16(),
        "small": torch.arange(10),
        "empty": torch.empty(0, 3),
        "np": np.arange(5000, dtype=np.float64),
        "scalar": np.float32(2.5),
        "nested": {"x": [1, 2.5, None, "s"], "t": (True, b"raw")},
    }


def same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


def test_round_trip_without_a_parent_hashes_every_chunk() -> None:
    blob, state = encode(sample_state())
    assert state.size == len(blob) and state.reused_bytes == 0 and not state.used
    same(ser.decode(blob), sample_state())
    chunks = [c for a in state.header["arrays"] for c in a["chunks"]]
    hashed = [c for c in chunks if "h" in c]
    assert len(hashed) == 7 + 1 + 1  # big (7 chunks), half, np; small arrays carry no hash
    got = ser.read_header(lambda a, b: blob[a:b], len(blob))
    assert got is not None and got[0] == state.header


def _origin_and_index(obj: Any) -> tuple[bytes, dict[tuple[bytes, int], ser.ChunkTarget]]:
    blob, state = encode(obj)
    targets = {}
    for digest, _sample, length, ref, offset, stored, codec, crc in ser.index_entries(state.header):
        assert ref is None and digest is not None
        targets[(digest, length)] = ser.ChunkTarget(ORIGIN, offset, stored, codec, crc)
    return blob, targets


def resolver_for(origin: bytes, identity: Any = ORIGIN) -> ser.Resolver:
    return ser.Resolver({identity: len(origin)}, lambda ident, a, b: origin[a:b])


def test_unchanged_chunks_become_references_resolved_by_identity() -> None:
    obj = sample_state()
    origin, targets = _origin_and_index(obj)
    obj["big"][70_000] += 1  # one float in chunk 4 of 7
    blob, state = encode(obj, lookup=lambda d, n: targets.get((d, n)))
    assert state.used == {ORIGIN}
    big = state.header["arrays"][0]["chunks"]
    assert ["ref" in c for c in big] == [True, True, True, True, False, True, True]
    assert all(c["crc"] for c in big if "ref" in c)
    with pytest.raises(SerializationError, match="nothing was given to resolve"):
        ser.decode(blob)
    res = resolver_for(origin)
    same(ser.decode(blob, resolver=res), obj)
    assert res.requests <= 2  # the referenced chunks are coalesced into few ranged reads


def test_a_referenced_range_that_fails_its_crc32c_is_refused() -> None:
    obj = sample_state()
    origin, targets = _origin_and_index(obj)
    blob, _ = encode(obj, lookup=lambda d, n: targets.get((d, n)))
    rotten = bytearray(origin)
    rotten[200] ^= 1  # inside the first chunk of "big"
    with pytest.raises(ChecksumMismatchError, match="CRC32C"):
        ser.decode(blob, resolver=resolver_for(bytes(rotten)))
    short = ser.Resolver({ORIGIN: len(origin)}, lambda ident, a, b: origin[: len(origin) // 2][a:b])
    with pytest.raises(ChecksumMismatchError, match="returned"):
        ser.decode(blob, resolver=short)


def _rewrite(blob: bytes, change: Any) -> bytes:
    offset, length, _, magic = struct.unpack("<QQI4x8s", blob[-32:])
    header = json.loads(blob[offset : offset + length])
    change(header)
    raw = json.dumps(header).encode()
    return blob[:offset] + raw + struct.pack("<QQI4x8s", offset, len(raw), crc32c_of(raw), magic)


def _first_ref(h: dict[str, Any]) -> dict[str, Any]:
    return next(c for a in h["arrays"] for c in a["chunks"] if "ref" in c)


def _first_local(h: dict[str, Any]) -> dict[str, Any]:
    return next(c for a in h["arrays"] for c in a["chunks"] if "at" in c)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda h: _first_ref(h)["ref"].update(offset=10**12), "beyond"),
        (lambda h: _first_ref(h)["ref"].update({"from": [0, 9]}), "does not reference"),
        (lambda h: _first_ref(h).pop("crc"), "needs its CRC32C"),
        (lambda h: _first_ref(h)["ref"].update(name=7), "bad chunk reference"),
        (lambda h: _first_local(h).update(at=10**9), "outside the data"),
        (lambda h: _first_local(h).update(n=3), "does not fit"),
        (lambda h: _first_local(h).update(z="lz4"), "unknown codec"),
        (lambda h: h["arrays"][0]["chunks"].pop(), "need 7 chunks"),
        (lambda h: h["arrays"][0].update(nbytes=2**60, shape=[2**58]), "need"),
        (lambda h: h.update(chunk_size=3), "bad chunk size"),
        (lambda h: h.update(data_size=h["data_size"] + 1), "data bytes"),
        (lambda h: h["arrays"][2]["chunks"][0].update(at=h["arrays"][0]["chunks"][4]["at"] + 8), "overlap"),
        (lambda h: _first_ref(h).update(at=_first_local(h)["at"]), "malformed"),
        (lambda h: h["arrays"][0].update(dtype="os.system"), "not allowed"),
        (lambda h: h["arrays"][0]["chunks"][0].update(extra=1), "malformed"),
    ],
)
def test_a_hostile_header_is_refused_before_anything_is_allocated(change: Any, match: str) -> None:
    obj = sample_state()
    origin, targets = _origin_and_index(obj)
    obj["big"][70_000] += 1
    blob, _ = encode(obj, lookup=lambda d, n: targets.get((d, n)))
    with pytest.raises(SerializationError, match=match):
        ser.decode(_rewrite(blob, change), resolver=resolver_for(origin))


def test_a_damaged_footer_or_header_says_what_the_bytes_say() -> None:
    blob, _ = encode(sample_state())
    for at in (len(blob) - 5, len(blob) - 40):  # the footer's magic, then the header itself
        bad = bytearray(blob)
        bad[at] ^= 1
        with pytest.raises((SerializationError, ChecksumMismatchError)):
            ser.decode(bytes(bad))
    # through a verifying stream, the object's own CRC32C names the damage first
    bad = bytearray(blob)
    bad[-40] ^= 1
    want = crc32c_b64(blob)

    def stream() -> Any:
        data = bytes(bad)
        yield data
        if crc32c_b64(data) != want:
            raise ChecksumMismatchError("CRC32C mismatch")

    with pytest.raises(ChecksumMismatchError, match="CRC32C"):
        ser.decode_stream(stream(), total_size=len(bad), read_range=lambda a, b: bytes(bad[a:b]))


def test_the_header_read_first_must_be_the_one_streamed() -> None:
    blob, _ = encode(sample_state())
    offset, length, _, magic = struct.unpack("<QQI4x8s", blob[-32:])
    raw = blob[offset : offset + length].replace(b'"s"', b'"t"')  # the same size, other bytes
    other = blob[:offset] + raw + struct.pack("<QQI4x8s", offset, length, crc32c_of(raw), magic)
    assert len(other) == len(blob) and other != blob
    with pytest.raises(ChecksumMismatchError, match="differs"):
        ser.decode_stream([blob], total_size=len(blob), read_range=lambda a, b: other[a:b])


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_any_chunking_of_the_stream(chunk: int) -> None:
    blob, _ = encode(sample_state())
    back = ser.decode_stream(
        (blob[i : i + chunk] for i in range(0, len(blob), chunk)),
        total_size=len(blob),
        read_range=lambda a, b: blob[a:b],
    )
    same(back, sample_state())


def test_truncated_or_padded_shards_are_refused() -> None:
    blob, _ = encode(sample_state())
    with pytest.raises(SerializationError):
        ser.decode(blob[:-1])
    with pytest.raises(SerializationError):
        ser.decode(blob + b"\0")


def test_the_stream_is_cut_at_part_boundaries_so_parts_alias_tensor_memory() -> None:
    t = torch.randn(300_000)  # 1.2 MiB
    state = ser.encode_chunked({"t": t}, options(part_size=256 * KiB))
    pos, cuts = 0, []
    for buf in state.buffers():
        pos += buf.nbytes
        cuts.append(pos)
    inner = [c for c in cuts[1:-2]]
    assert inner and all(c % (256 * KiB) == 0 for c in inner)


def test_compressed_chunks_round_trip_and_keep_crc_over_raw_bytes() -> None:
    pytest.importorskip("zstandard")
    from objckpt.training.codec import CompressionPolicy

    policy = CompressionPolicy("zstd")
    g = torch.Generator().manual_seed(1)
    obj = {"w": (torch.randn(200_000, generator=g) * 0.01).bfloat16(), "z": torch.zeros(100_000)}
    blob, state = encode(obj, codec=policy.codec, compress=policy.try_compress, chunk_size=128 * KiB)
    assert state.compressed_to < state.compressed_from
    same(ser.decode(blob), obj)
    # a reference to a compressed chunk decompresses it and checks the CRC32C of the raw bytes
    targets = {}
    for digest, _s, length, _r, offset, stored, codec, crc in ser.index_entries(state.header):
        targets[(digest, length)] = ser.ChunkTarget(ORIGIN, offset, stored, codec, crc)
    again, st2 = encode(obj, lookup=lambda d, n: targets.get((d, n)), chunk_size=128 * KiB)
    assert st2.local_bytes < 1024 and any("z" in c for a in st2.header["arrays"] for c in a["chunks"])
    same(ser.decode(again, resolver=resolver_for(blob)), obj)
    bad = bytearray(blob)
    c = next(c for a in state.header["arrays"] for c in a["chunks"] if "z" in c)
    bad[c["at"] + c["n"] // 2] ^= 0x55
    with pytest.raises((ChecksumMismatchError, SerializationError)):
        ser.decode(again, resolver=resolver_for(bytes(bad)))


def test_old_formats_stay_readable() -> None:
    obj = sample_state()
    same(ser.decode(ser.dumps(obj)), obj)
    assert json.loads(ser.dumps(obj)[16:].split(b"\0")[0].rstrip(b" "))["version"] == 1
