"""A manager restore reads a shard larger than one part by ranges straight into the staged
tensors (:mod:`objckpt.training._ranged_restore`). Counted, never timed: the bytes each request
delivers and where they land, the CRC32C passes per byte, and what damage or a hostile header
does (the restore falls back; nothing is allocated from a size the receipt does not allow)."""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from objckpt import _crc  # noqa: E402
from objckpt.errors import ChecksumMismatchError, SerializationError  # noqa: E402
from objckpt.manifest import ShardReceipt  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.store.base import PutMode  # noqa: E402
from objckpt.store.memory import MemoryStore  # noqa: E402
from objckpt.training import serialization  # noqa: E402
from objckpt.training._chunked import _FOOTER, TAIL_READ  # noqa: E402
from objckpt.training._ranged_restore import (  # noqa: E402
    PROBE_BYTES,
    SLICE_BYTES,
    decode_ranged,
    ranged_applies,
)
from objckpt.training.manager import CheckpointManager  # noqa: E402
from objckpt.training.shards import REPLICATED_SHARD  # noqa: E402
from tests.backends import Backend  # noqa: E402

MiB = 1024 * 1024
PART = 1 * MiB
#: odd sizes, so arrays straddle ranges and are separated by alignment padding
SIZES = [3 * MiB + 4, 1 * MiB + 12, 7, 2 * MiB + 100, 5]


def _model(seed: float) -> Any:
    params = [torch.full((n // 4 or 1,), seed + i) for i, n in enumerate(SIZES)]
    return torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=False) for p in params])


def _equal(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


class CountingMemoryStore(MemoryStore):
    """memory:// that records every ``get`` / ``get_into`` and where each buffer lands, and can
    flip one stored byte on the way out (bit rot: size, version and stored CRC unchanged)."""

    def __init__(self, location: str) -> None:
        super().__init__(location, part_size=PART, max_in_flight=2)
        self.lock = threading.Lock()
        self.get_bytes = 0
        self.into_tensor_bytes = 0  # bytes received into tensor memory (numpy views of it)
        self.into_scratch_bytes = 0  # bytes received into bytearrays (padding)
        self.largest_buffer = 0
        self.largest_request = 0
        self.rot: tuple[str, int] | None = None  # (key, offset) flipped when read

    def reset(self) -> None:
        self.get_bytes = self.into_tensor_bytes = self.into_scratch_bytes = 0
        self.largest_buffer = self.largest_request = 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        data = super().get(key, byte_range=byte_range)
        with self.lock:
            self.get_bytes += len(data)
        return data

    def get_into(self, key: str, start: int, buffers: Sequence[memoryview]) -> int:
        with self.lock:
            for b in buffers:
                if isinstance(b.obj, bytearray):
                    self.into_scratch_bytes += b.nbytes
                else:
                    self.into_tensor_bytes += b.nbytes
                self.largest_buffer = max(self.largest_buffer, b.nbytes)
            self.largest_request = max(self.largest_request, sum(b.nbytes for b in buffers))
        return super().get_into(key, start, buffers)

    def _open(self, key: str, start: int, end: int | None) -> Iterator[bytes]:
        pos = start
        for chunk in super()._open(key, start, end):
            if self.rot is not None and self.rot[0] == key and pos <= self.rot[1] < pos + len(chunk):
                flipped = bytearray(chunk)
                flipped[self.rot[1] - pos] ^= 0x01
                chunk = bytes(flipped)
            pos += len(chunk)
            yield chunk


def _replicated(store: Any, step: int) -> ShardReceipt:
    manifest = Reader(store).load(step)
    return next(s for s in manifest.shards if s.name == REPLICATED_SHARD)


def _header(store: Any, receipt: ShardReceipt) -> tuple[int, dict[str, Any]]:
    prefix = store.get(receipt.key, byte_range=(0, 16))
    (header_len,) = struct.unpack("<Q", prefix[8:])
    raw = store.get(receipt.key, byte_range=(16, 16 + header_len))
    return 16 + header_len, json.loads(raw)


def _footer(store: Any, receipt: ShardReceipt) -> tuple[int, int]:
    """A format-3 shard's (header offset, header length), from its footer."""
    tail = store.get(receipt.key, byte_range=(receipt.size - _FOOTER.size, receipt.size))
    offset, length, _, _ = _FOOTER.unpack(tail)
    return offset, length


@pytest.mark.parametrize("dedup", [False, True], ids=["format2", "format3"])
def test_a_large_shard_lands_in_the_tensors_with_one_crc_pass_per_byte(
    dedup: bool, hashed: list[int]
) -> None:
    store = CountingMemoryStore(f"ranged-counts-{dedup}")
    saved = _model(1.0)
    with CheckpointManager(store, keep_last=None, dedup=dedup) as mgr:
        mgr.save(1, {"model": saved})
        rep = _replicated(store, 1)
        assert ranged_applies(store, rep) and rep.size > 6 * MiB
        if dedup:
            header_at, header_len = _footer(store, rep)
            assert header_at >= rep.size - TAIL_READ
            tail = TAIL_READ  # read by read_header (its data bytes copied from it)
            twice = header_len  # the header is also checked against its footer's CRC32C
        else:
            tail = twice = 0
        hashed[0] = 0
        store.reset()
        decode_ranged(store, rep)
        # every byte checksummed exactly once (a format-3 header also against its footer)
        assert hashed[0] == rep.size + twice
        # only the probe and the tail arrive in buffers of their own; every other byte is read
        # once, into tensor memory but for the alignment padding between arrays
        assert store.get_bytes == PROBE_BYTES + tail
        assert store.into_tensor_bytes + store.into_scratch_bytes == rep.size - PROBE_BYTES - tail
        assert store.into_scratch_bytes < 64 * len(SIZES)
        assert store.largest_buffer <= SLICE_BYTES and store.largest_request <= PART
        store.reset()
        live = _model(0.0)
        assert mgr.restore({"model": live}) == 1
        # the manager's restore takes this path (the small rank.bin streams: no get_into)
        assert store.into_tensor_bytes + store.into_scratch_bytes == rep.size - PROBE_BYTES - tail
    assert _equal(live, saved)


def test_a_deduplicated_shard_reads_its_references_by_ranges_too() -> None:
    store = CountingMemoryStore("ranged-refs")
    model = _model(1.0)
    with CheckpointManager(store, keep_last=None) as mgr:
        mgr.save(1, {"model": model})
        with torch.no_grad():
            model[0].add_(1.0)  # the rest is referenced from step 1
        mgr.save(2, {"model": model})
        assert Reader(store).load(2).references
        live = _model(0.0)
        assert mgr.restore({"model": live}) == 2
    assert _equal(live, model)


@pytest.mark.parametrize("where", ["format2-array", "format2-padding", "format3-array"])
def test_a_flipped_byte_is_damage_and_the_restore_falls_back(where: str) -> None:
    store = CountingMemoryStore(f"ranged-rot-{where}")
    first, second = _model(1.0), _model(2.0)
    with CheckpointManager(store, keep_last=None, dedup=where.startswith("format3")) as mgr:
        mgr.save(1, {"model": first})
        mgr.save(2, {"model": second})
        rep = _replicated(store, 2)
        if where.startswith("format3"):
            offset = rep.size // 2  # inside this shard's own chunks
        else:
            header_end, header = _header(store, rep)
            data_start = (header_end + 63) // 64 * 64
            entry = header["arrays"][1]  # starts beyond the probe, in the second range
            offset = data_start + entry["offset"] + entry["nbytes"] // 2
            if where.endswith("padding"):  # after it: only the whole-object CRC32C covers it
                offset = data_start + entry["offset"] + entry["nbytes"]
                assert offset % 64, "the entry must end off alignment"
        store.rot = (rep.key, offset)
        with pytest.raises(ChecksumMismatchError):
            decode_ranged(store, rep)
        live = _model(0.0)
        assert mgr.restore({"model": live}) == 1
    assert _equal(live, first)


def test_bit_rot_on_file_falls_back(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path / 'run'}", part_size=str(PART), max_in_flight="2")
    first, second = _model(1.0), _model(2.0)
    with CheckpointManager(store, keep_last=None) as mgr:
        mgr.save(1, {"model": first})
        mgr.save(2, {"model": second})
        rep = _replicated(store, 2)
        path = tmp_path / "run" / rep.key
        st = os.stat(path)
        with open(path, "r+b") as f:  # same size, same mtime: only the CRC32C can tell
            f.seek(rep.size - 3)
            byte = f.read(1)
            f.seek(rep.size - 3)
            f.write(bytes([byte[0] ^ 0x10]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        live = _model(0.0)
        assert mgr.restore({"model": live}) == 1
    assert _equal(live, first)


def test_a_damaged_shard_on_s3_falls_back(backend_s3_moto: Backend) -> None:
    prefix = f"ranged-{os.getpid()}-{threading.get_ident()}"
    store = open_store(backend_s3_moto.uri_for(prefix) + "&part_size=5MiB")  # type: ignore[misc]
    big = [8 * MiB + 4, 3 * MiB]

    def model(seed: float) -> Any:
        ps = [torch.full((n // 4,), seed + i) for i, n in enumerate(big)]
        return torch.nn.ParameterList([torch.nn.Parameter(p, requires_grad=False) for p in ps])

    first, second = model(1.0), model(2.0)
    with CheckpointManager(store, keep_last=None) as mgr:
        mgr.save(1, {"model": first})
        mgr.save(2, {"model": second})
        rep = _replicated(store, 2)
        assert ranged_applies(store, rep)
        live = model(0.0)
        assert mgr.restore({"model": live}) == 2 and _equal(live, second)  # the ranged path, intact
        data = bytearray(store.get(rep.key))
        data[rep.size // 2] ^= 0x01
        store.put(rep.key, bytes(data), mode=PutMode.OVERWRITE)
        with pytest.raises(ChecksumMismatchError):
            decode_ranged(store, rep)
        live = model(0.0)
        assert mgr.restore({"model": live}) == 1
    assert _equal(live, first)


def _hostile(store: MemoryStore, key: str, shape: list[int], nbytes: int) -> ShardReceipt:
    """A shard whose (self-consistent) receipt is right but whose header declares ``shape``."""
    raw = serialization.dumps({"t": torch.zeros(PART)})  # > one part: the ranged path applies
    (header_len,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16 : 16 + header_len])
    header["arrays"][0].update(shape=shape, nbytes=nbytes)
    body = json.dumps(header).encode()
    head = raw[:8] + struct.pack("<Q", len(body)) + body
    data = head + bytes(-len(head) % 64) + raw[(16 + header_len + 63) // 64 * 64 :]
    meta = store.put(key, data, mode=PutMode.OVERWRITE)
    return ShardReceipt(key, len(data), meta.version, _crc.crc32c_b64(data), 0, REPLICATED_SHARD)


@pytest.mark.parametrize(
    ("shape", "nbytes"), [([2**40], 2**42), ([PART + 1], 4 * (PART + 1)), ([0, 2**61], 0)]
)
def test_a_hostile_header_is_refused_before_anything_is_allocated(
    shape: list[int], nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore("ranged-hostile", part_size=PART)
    receipt = _hostile(store, "data/1-a/0/replicated.bin", shape, nbytes)
    allocated: list[Any] = []
    real_empty = torch.empty

    def counting_empty(*args: Any, **kwargs: Any) -> Any:
        if args and args[0] != ():  # 0-d tensors tell an entry's item size while checking it
            allocated.append(args[0])
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    with pytest.raises(SerializationError):
        decode_ranged(store, receipt)
    assert allocated == []


def test_a_truncated_shard_or_header_is_refused() -> None:
    store = MemoryStore("ranged-truncated", part_size=PART)
    data = serialization.dumps({"t": torch.ones(PART)})
    meta = store.put("data/1-a/0/replicated.bin", data[:-100], mode=PutMode.OVERWRITE)
    crc = _crc.crc32c_b64(data)
    receipt = ShardReceipt("data/1-a/0/replicated.bin", len(data), meta.version, crc, 0, REPLICATED_SHARD)
    with pytest.raises(ChecksumMismatchError, match="truncated"):
        decode_ranged(store, receipt)
    # a header length beyond the receipt's size: refused before the header is read
    bad = data[:8] + struct.pack("<Q", len(data)) + data[16:]
    meta = store.put("data/1-a/0/replicated.bin", bad, mode=PutMode.OVERWRITE)
    receipt = ShardReceipt(
        "data/1-a/0/replicated.bin", len(bad), meta.version, _crc.crc32c_b64(bad), 0, REPLICATED_SHARD
    )
    with pytest.raises(SerializationError, match="exceeds the shard"):
        decode_ranged(store, receipt)


def test_a_small_shard_streams_and_a_large_header_takes_one_more_read() -> None:
    store = CountingMemoryStore("ranged-rule")
    small = ShardReceipt("data/1-a/0/rank.bin", PART, "v", _crc.crc32c_b64(b"x"), 0, "rank.bin")
    assert not ranged_applies(store, small)
    # a tree with a header longer than the probe
    tree = {f"name-{i:05d}-" + "x" * 40: torch.full((4,), float(i)) for i in range(2000)}
    tree["big"] = torch.arange(PART // 4 + 3, dtype=torch.float32)
    data = serialization.dumps(tree)
    meta = store.put("data/1-a/0/replicated.bin", data, mode=PutMode.OVERWRITE)
    receipt = ShardReceipt(
        "data/1-a/0/replicated.bin", len(data), meta.version, _crc.crc32c_b64(data), 0, REPLICATED_SHARD
    )
    header_end, _ = _header(store, receipt)
    assert header_end > PROBE_BYTES
    store.reset()
    out = decode_ranged(store, receipt)
    assert store.get_bytes == header_end  # the probe, then exactly the rest of the header
    assert torch.equal(out["big"], tree["big"]) and torch.equal(
        out["name-01999-" + "x" * 40], tree["name-01999-" + "x" * 40]
    )
