"""State -> shard bytes: the encoder of :mod:`.serialization`'s container (formats 1 and 2).

:func:`encode` walks a state tree once, writing its JSON header and collecting every tensor and
numpy array it reaches into a table (identity dedup: an object reachable twice is written once);
:class:`EncodedState` then streams the header and the arrays' bytes straight from their memory.
Nothing is copied until the stream is consumed, and nothing is written to the store here.

Separate from :mod:`.serialization` only for length, mirroring :mod:`._state_decode`: that
module keeps the format's definition (its docstring), the dtype allow-list and the header
checks, which this one imports. :mod:`._chunked` (format 3) reuses :class:`_Encoder` to walk the
tree and :func:`_bytes_view` to stream the arrays. Every name here is also importable from
:mod:`.serialization` (its ``__getattr__``), where callers have always found it.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedStateError
from .serialization import (
    _DTYPE_NAMES,
    _NUMPY_DTYPE_RE,
    _PREFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    MAX_DEPTH,
    VIEWS_FORMAT_VERSION,
    TensorRef,
    ViewRef,
    _align,
)

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = ["EncodedState", "dumps", "encode", "validate"]


@dataclass
class _Array:
    kind: str  # "torch" | "numpy"
    obj: Any
    dtype: str
    shape: list[int]
    nbytes: int
    offset: int = 0


class EncodedState:
    """A state dict ready to stream: ``size`` bytes, produced by iterating :meth:`buffers`.

    The buffers alias the tensors' memory; do not modify the tensors until the stream has been
    consumed. The stream can be produced more than once (a retried upload starts over).
    """

    def __init__(self, header: bytes, arrays: list[_Array], data_size: int) -> None:
        self.header = header
        self.arrays = arrays
        self.data_size = data_size
        self.data_start = _align(_PREFIX.size + len(header))
        self.size = self.data_start + data_size

    def buffers(self) -> Iterator[memoryview]:
        """Header, padding and every array's bytes, in file order."""
        yield memoryview(_PREFIX.pack(MAGIC, len(self.header)) + self.header)
        pos = _PREFIX.size + len(self.header)
        for arr in self.arrays:
            start = self.data_start + arr.offset
            if start > pos:
                yield memoryview(bytes(start - pos))
                pos = start
            if arr.nbytes:
                yield _bytes_view(arr)
                pos += arr.nbytes
        if pos < self.size:
            yield memoryview(bytes(self.size - pos))

    def __iter__(self) -> Iterator[memoryview]:
        return self.buffers()

    def to_bytes(self) -> bytes:
        return b"".join(bytes(b) for b in self.buffers())


def _bytes_view(arr: _Array) -> memoryview:
    if arr.kind == "torch":
        t: torch.Tensor = arr.obj
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # one tensor at a time, only while it is being sent
        t = t.resolve_conj().resolve_neg().contiguous()
        flat = t.reshape(-1).view(torch.uint8)
        return flat.numpy().data.cast("B")
    a = arr.obj
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return memoryview(a.reshape(-1).view(np.uint8)).cast("B")


class _Encoder:
    def __init__(self, path_root: str = "state", strip: int = 0) -> None:
        self.path_root = path_root
        self.strip = strip
        self.arrays: list[_Array] = []
        self.offset = 0
        # identity dedup: a tensor object reachable twice (tied weights) is written once; the
        # object is kept referenced by `arrays`, so its id cannot be reused meanwhile
        self.seen: dict[int, int] = {}
        self.views = False  # a ViewRef was written: the shard is format version 2

    def _path_str(self, path: tuple[Any, ...]) -> str:
        return self.path_root + "".join(f"[{p!r}]" for p in path[self.strip :])

    def add(self, kind: str, obj: Any, dtype: str, shape: list[int], nbytes: int) -> int:
        key = id(obj)
        if key in self.seen:
            return self.seen[key]
        self.offset = _align(self.offset)
        self.arrays.append(_Array(kind, obj, dtype, shape, nbytes, self.offset))
        self.offset += nbytes
        self.seen[key] = len(self.arrays) - 1
        return len(self.arrays) - 1

    def node(self, obj: Any, path: tuple[Any, ...], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(f"{self._path_str(path)}: nested deeper than {MAX_DEPTH} levels")
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"t": self.tensor(obj, path)}
        if np is not None and isinstance(obj, np.ndarray):
            return {"a": self.ndarray(obj, path)}
        if np is not None and isinstance(obj, np.generic):  # before float: np.float64 is a float
            return {"s": self.ndarray(np.asarray(obj), path)}
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, list):
            return [self.node(v, path + (i,), depth + 1) for i, v in enumerate(obj)]
        if isinstance(obj, tuple):  # includes torch.Size and namedtuples (restored as tuples)
            return {"T": [self.node(v, path + (i,), depth + 1) for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            out: dict[str, Any]
            if all(isinstance(k, str) for k in obj):
                out = {"D": {k: self.node(v, path + (k,), depth + 1) for k, v in obj.items()}}
            else:
                out = {
                    "M": [
                        [self.node(k, path + ("<key>",), depth + 1), self.node(v, path + (k,), depth + 1)]
                        for k, v in obj.items()
                    ]
                }
            meta = getattr(obj, "_metadata", None)  # nn.Module.state_dict() version info
            if isinstance(meta, dict):
                out["meta"] = self.node(dict(meta), path + ("_metadata",), depth + 1)
            return out
        if isinstance(obj, (bytes, bytearray)):
            return {"b": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, torch.dtype):
            if obj not in _DTYPE_NAMES:
                raise UnsupportedStateError(f"{self._path_str(path)}: dtype {obj} is not supported")
            return {"dt": _DTYPE_NAMES[obj]}
        if isinstance(obj, torch.device):
            return {"dev": str(obj)}
        if isinstance(obj, TensorRef):
            return {"r": int(obj.index)}
        if isinstance(obj, ViewRef):
            if obj.dtype not in _DTYPE_NAMES:
                raise UnsupportedStateError(f"{self._path_str(path)}: dtype {obj.dtype} is not supported")
            self.views = True
            return {
                "w": [
                    int(obj.index),
                    _DTYPE_NAMES[obj.dtype],
                    [int(n) for n in obj.shape],
                    [int(n) for n in obj.stride],
                    int(obj.offset),
                ]
            }
        raise UnsupportedStateError(
            f"{self._path_str(path)}: cannot serialize a {type(obj).__module__}.{type(obj).__qualname__} "
            "(supported: None, bool, int, float, str, bytes, list, tuple, dict, torch.Tensor, "
            "numpy arrays and scalars, torch.dtype, torch.device)"
        )

    def tensor(self, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedStateError(
                f"{self._path_str(path)}: tensor subclass {type(t).__qualname__} is not supported "
                "(sharded DTensors go through objckpt.training.dcp)"
            )
        if t.layout != torch.strided:
            raise UnsupportedStateError(f"{self._path_str(path)}: {t.layout} tensors are not supported")
        if t.device.type == "meta":
            raise UnsupportedStateError(f"{self._path_str(path)}: meta tensors have no data to save")
        name = _DTYPE_NAMES.get(t.dtype)
        if name is None:
            raise UnsupportedStateError(f"{self._path_str(path)}: dtype {t.dtype} is not supported")
        return self.add("torch", t, name, list(t.shape), t.numel() * t.element_size())

    def ndarray(self, a: Any, path: tuple[Any, ...]) -> int:
        dt = a.dtype
        if dt.byteorder == "=":
            dt = dt.newbyteorder("<" if struct.pack("=H", 1) == b"\x01\x00" else ">")
        if not _NUMPY_DTYPE_RE.match(dt.str) or dt.hasobject:
            raise UnsupportedStateError(f"{self._path_str(path)}: numpy dtype {a.dtype} is not supported")
        return self.add("numpy", a, dt.str, list(a.shape), int(a.nbytes))


def encode(obj: Any, *, path_root: str = "state", strip: int = 0) -> EncodedState:
    """Describe ``obj`` for streaming; no tensor bytes are copied here.

    Error messages name a value's path as ``path_root`` followed by its keys, leaving out the
    first ``strip`` keys (for containers the caller wrapped around the user's state).

    Raises:
        UnsupportedStateError: ``obj`` contains a value the format cannot represent (the message
            names its path, e.g. ``state['optimizer']['param_groups'][0]['foo']``).
    """
    enc = _Encoder(path_root, strip)
    tree = enc.node(obj, (), 0)
    entries = [
        {"kind": a.kind, "dtype": a.dtype, "shape": a.shape, "offset": a.offset, "nbytes": a.nbytes}
        for a in enc.arrays
    ]
    data_size = _align(enc.offset) if enc.arrays else 0
    header = {
        "format": FORMAT_NAME,
        "version": VIEWS_FORMAT_VERSION if enc.views else FORMAT_VERSION,
        "tree": tree,
        "arrays": entries,
        "data_size": data_size,
    }
    raw = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
    return EncodedState(raw, enc.arrays, data_size)


def validate(obj: Any, *, path_root: str = "state") -> None:
    """Check that :func:`encode` accepts ``obj`` (a walk, no JSON, no copies).

    Raises:
        UnsupportedStateError: naming the path of the first value that cannot be written.
    """
    _Encoder(path_root).node(obj, (), 0)


def dumps(obj: Any) -> bytes:
    """``encode(obj)`` as one bytes object (small states, tests)."""
    return encode(obj).to_bytes()
