"""The shard format: exact round-trips, streaming, and refusal of hostile input."""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
from collections import OrderedDict

import numpy as np
import pytest
import torch

from objckpt.training import serialization as ser
from objckpt.training.serialization import (
    SerializationError,
    TensorRef,
    UnsupportedStateError,
    decode,
    decode_stream,
    dumps,
    encode,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

ALL_DTYPES = [getattr(torch, n) for n in ser._TORCH_DTYPE_NAMES if hasattr(torch, n)]


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # random bit patterns: NaN payloads, negative zero, subnormals, all of it
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype: torch.dtype) -> None:
    t = _random_tensor(dtype, (3, 5))
    back = decode(dumps({"t": t, "scalar": t[0, 0].clone(), "empty": t[:0]}))
    assert back["t"].dtype == dtype and back["t"].shape == (3, 5)
    assert _bytes(back["t"]) == _bytes(t)
    assert back["scalar"].shape == () and _bytes(back["scalar"]) == _bytes(t[0, 0])
    assert back["empty"].shape == (0, 5)


def test_non_contiguous_and_special_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    views = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "conj": torch.tensor([1 + 2j, 3 - 1j]).conj(),
        "neg": torch.tensor([1.0, -2.0])._neg_view(),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "grad": torch.ones(2, requires_grad=True) * 2,
    }
    back = decode(dumps(views))
    for name, t in views.items():
        assert torch.equal(back[name], t.detach().resolve_conj().resolve_neg()), name
        assert back[name].is_contiguous() and type(back[name]) is torch.Tensor


def test_nested_structures_round_trip() -> None:
    sd = OrderedDict(w=torch.randn(2, 2))
    sd._metadata = OrderedDict({"": {"version": 2}})  # what nn.Module.state_dict() carries
    obj = {
        "sd": sd,
        "list": [1, 2.5, "x", None, True, False, [], {}],
        "tuple": (1, (2, 3), torch.Size([4, 5])),
        "int_keys": {0: "a", 1: {"b": 2}, (1, 2): "tuple key", None: 3, 2.5: "f"},
        "floats": [float("nan"), float("inf"), -float("inf"), -0.0, 1e-310, 2**-1074],
        "big": [2**64 + 1, -(2**100)],
        "bytes": b"\x00\xffabc",
        "unicode": 'ümlaut ✓ \u0000 "quoted"',
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "np": np.arange(6, dtype=">i4").reshape(2, 3),
        "np_f16": np.array([1.5, np.nan], dtype=np.float16),
        "np_scalar": np.float32(2.5),
        "np_bool": np.bool_(True),
        "ref": TensorRef(7),
    }
    back = decode(dumps(obj))
    assert torch.equal(back["sd"]["w"], sd["w"]) and back["sd"]._metadata == {"": {"version": 2}}
    assert back["list"] == obj["list"]
    assert back["tuple"] == (1, (2, 3), (4, 5)) and isinstance(back["tuple"][1], tuple)
    assert back["int_keys"] == obj["int_keys"]
    assert struct.pack("<6d", *back["floats"]) == struct.pack("<6d", *obj["floats"])
    assert back["big"] == obj["big"]
    for k in ("bytes", "unicode", "dtype", "device", "ref"):
        assert back[k] == obj[k], k
    assert back["np"].dtype == np.dtype(">i4") and back["np"].tobytes() == obj["np"].tobytes()
    assert back["np_f16"].tobytes() == obj["np_f16"].tobytes()
    assert type(back["np_scalar"]) is np.float32 and back["np_scalar"] == 2.5
    assert type(back["np_bool"]) is np.bool_


def test_shared_tensor_is_written_once() -> None:
    t = torch.randn(100)
    enc = encode({"a": t, "b": t, "c": [t]})
    assert len(enc.arrays) == 1
    back = decode(enc.to_bytes())
    assert back["a"] is back["b"] is back["c"][0]


def test_encoding_streams_tensor_memory_without_copying() -> None:
    t = torch.randn(1000)
    buffers = list(encode({"t": t}).buffers())
    views = [b for b in buffers if b.nbytes == t.numel() * 4]
    assert len(views) == 1
    # the buffer aliases the tensor's memory
    t[0] = 42.0
    assert struct.unpack("<f", views[0][:4])[0] == 42.0


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_decode_stream_any_chunking(chunk: int) -> None:
    obj = {"a": torch.randn(33, 3), "b": [torch.arange(5)], "c": np.ones(9)}
    data = dumps(obj)
    back = decode_stream((data[i : i + chunk] for i in range(0, len(data), chunk)), total_size=len(data))
    assert torch.equal(back["a"], obj["a"]) and torch.equal(back["b"][0], obj["b"][0])


def test_unsupported_values_name_their_path() -> None:
    class Foo:
        pass

    with pytest.raises(UnsupportedStateError, match=r"state\['opt'\]\['groups'\]\[0\]\['fn'\].*Foo"):
        encode({"opt": {"groups": [{"fn": Foo()}]}})
    with pytest.raises(UnsupportedStateError, match="sparse"):
        encode({"s": torch.eye(2).to_sparse()})
    with pytest.raises(UnsupportedStateError, match="meta"):
        encode({"m": torch.empty(2, device="meta")})
    with pytest.raises(UnsupportedStateError, match="numpy dtype"):
        encode({"o": np.array([object()])})
    with pytest.raises(UnsupportedStateError, match="set"):
        encode({"s": {1, 2}})


# ---------------------------------------------------------------------------------- hostile


class _Boom:
    def __reduce__(self) -> tuple:
        return (exec, ("raise SystemExit('pickle payload executed')",))


def test_pickle_payload_is_never_executed() -> None:
    payload = pickle.dumps({"x": _Boom()})
    with pytest.raises(SerializationError, match="pickle"):
        decode(payload)
    buf = io.BytesIO()
    torch.save({"x": torch.ones(1)}, buf)  # a torch.save zip file is refused just the same
    with pytest.raises(SerializationError, match="bad magic"):
        decode(buf.getvalue())


def _forge(header: dict, data: bytes = b"", *, header_bytes: bytes | None = None) -> bytes:
    raw = header_bytes if header_bytes is not None else json.dumps(header).encode()
    prefix = struct.pack("<8sQ", ser.MAGIC, len(raw)) + raw
    pad = (-len(prefix)) % ser.ALIGN
    return prefix + bytes(pad) + data


def _header(tree: object, arrays: list | None = None, data_size: int = 0) -> dict:
    return {
        "format": "objckpt-state",
        "version": 1,
        "tree": tree,
        "arrays": arrays or [],
        "data_size": data_size,
    }


@pytest.mark.parametrize(
    "blob, match",
    [
        (b"", "truncated"),
        (b"OBJCKPT\x00", "truncated"),
        (struct.pack("<8sQ", ser.MAGIC, 2**40), "header length"),
        (_forge({}, header_bytes=b"{not json"), "not valid JSON"),
        (_forge({}, header_bytes=b"[1]"), "not a JSON object"),
        (_forge({**_header(1), "version": 99}), "unsupported format version"),
        (_forge({**_header(1), "format": "pickle"}), "unknown format"),
        (_forge(_header({"__reduce__": ["os.system", "echo pwned"]})), "unknown node tag"),
        (_forge(_header({"t": 0})), "out of range"),
        (_forge(_header({"dt": "__class__"})), "not allowed"),
        (_forge(_header({"dev": "cpu; rm -rf /"})), "bad device"),
        (
            _forge(
                _header(
                    {"t": 0},
                    [{"kind": "torch", "dtype": "os.system", "shape": [1], "offset": 0, "nbytes": 1}],
                    64,
                ),
                bytes(64),
            ),
            "not allowed",
        ),
        (
            _forge(
                _header(
                    {"a": 0}, [{"kind": "numpy", "dtype": "|O8", "shape": [1], "offset": 0, "nbytes": 8}], 64
                ),
                bytes(64),
            ),
            "not allowed",
        ),
        (
            _forge(
                _header(
                    {"t": 0},
                    [{"kind": "torch", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 8}],
                    64,
                ),
                bytes(64),
            ),
            "do not fit",
        ),
        (
            _forge(
                _header(
                    {"t": 0},
                    [{"kind": "torch", "dtype": "float32", "shape": [-1], "offset": 0, "nbytes": 4}],
                    64,
                ),
                bytes(64),
            ),
            "bad shape",
        ),
        (
            _forge(
                _header(
                    {"t": 0},
                    [{"kind": "torch", "dtype": "uint8", "shape": [128], "offset": 0, "nbytes": 128}],
                    64,
                ),
                bytes(64),
            ),
            "outside the data",
        ),
        (_forge(_header([1], [], 64), bytes(32)), "header describes"),
        (_forge(_header([1], [], 0), bytes(10)), "header describes"),
        (_forge(_header(json.loads("[" * 150 + "]" * 150))), "deeper"),
        (_forge(_header({"M": [[[1], 2]]})), "unhashable"),
        (_forge(_header({"T": [1], "x": 2})), "unexpected keys"),
    ],
)
def test_hostile_or_malformed_shards_are_refused(blob: bytes, match: str) -> None:
    with pytest.raises(SerializationError, match=match):
        decode(blob)


def test_truncated_and_trailing_streams() -> None:
    data = dumps({"t": torch.randn(40)})
    with pytest.raises(SerializationError, match="truncated"):
        decode_stream([data[:-10]])
    with pytest.raises(SerializationError, match="trailing"):
        decode_stream([data, b"extra"])
    with pytest.raises(SerializationError):
        decode(data + b"x")


# ---------------------------------------------------------------- hostile sizes (invariant 11)


def _hostile_shard() -> bytes:
    """A well-formed container whose header declares a 4 TiB tensor over a few bytes of data."""
    import json as _json
    import struct as _struct

    huge = 1 << 40
    header = {
        "format": "objckpt-state",
        "version": 1,
        "tree": {"t": 0},
        "arrays": [{"kind": "torch", "dtype": "float32", "shape": [huge], "offset": 0, "nbytes": 4 * huge}],
        "data_size": 4 * huge,
    }
    raw = _json.dumps(header).encode()
    blob = ser.MAGIC + _struct.pack("<Q", len(raw)) + raw
    return blob + bytes(-len(blob) % ser.ALIGN) + b"\0" * 64


def test_a_header_declaring_more_than_the_shard_is_rejected_before_allocating(monkeypatch) -> None:
    allocated: list[int] = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        shape = args[0] if args else kwargs.get("size")
        allocated.append(int(torch.Size(shape).numel()) if shape is not None else 0)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(ser.torch, "empty", counting_empty)
    blob = _hostile_shard()
    with pytest.raises(SerializationError, match="header describes"):
        ser.decode_stream([blob], total_size=len(blob))
    assert all(n < 1 << 20 for n in allocated), allocated  # nothing was allocated from the header


def test_a_hostile_shard_with_a_consistent_receipt_makes_restore_fall_back(tmp_path) -> None:
    from objckpt import layout
    from objckpt.commit import Coordinator
    from objckpt.store import open_store
    from objckpt.training.manager import CheckpointManager
    from objckpt.writer import ShardWriter

    root = f"file://{tmp_path}/run"
    state = {"counters": {"seen": 1}}
    with CheckpointManager(root) as mgr:
        mgr.save(10, state)
        good = mgr.reader.latest()
    store = open_store(root)
    attempt = layout.new_attempt_id()
    writer = ShardWriter(store, step=20, attempt=attempt, rank=0)
    writer.write("rank.bin", _hostile_shard())  # the receipt matches these bytes exactly
    Coordinator(store, world_size=1).commit(20, attempt, {0: writer.receipts}, topology=good.topology)
    state["counters"]["seen"] = 99
    with CheckpointManager(root) as mgr:
        assert mgr.restore(state) == 10
        assert [s for s, _ in mgr.fallbacks] == [20] and "header describes" in mgr.fallbacks[0][1]
    assert state["counters"] == {"seen": 1}
