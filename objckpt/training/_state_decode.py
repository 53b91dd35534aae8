"""Shard bytes -> state: the decoder of :mod:`.serialization`'s container (formats 1 and 2; a
version-3 stream is handed to :mod:`._chunked_decode`).

Every size the header declares is checked against the verified receipt before anything is
allocated (invariant 11), and only containers, numbers, strings, tensors and arrays of
allow-listed dtypes are ever built (invariant 12: nothing from the store can run code).
Separate from the encoder only for length; every name is importable from :mod:`.serialization`,
where callers use it.
"""

from __future__ import annotations

import base64
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from .._crc import Buffer
from .serialization import (
    _PREFIX,
    _TORCH_DTYPES,
    ALIGN,
    CHUNKED_FORMAT_VERSION,
    FORMAT_VERSION,
    MAX_DEPTH,
    VIEWS_FORMAT_VERSION,
    TensorRef,
    ViewRef,
    _align,
    _fail,
    _is_int,
    _parse_header,
    _parse_prefix,
)

if TYPE_CHECKING:
    from ._chunked import Resolver

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def check_array_table(entries: Any, data_size: Any) -> list[tuple[str, Any, list[int], int, int]]:
    """Validate a format 1/2 array table against its data size (dtypes allow-listed, offsets
    aligned, in order, not overlapping, inside the data): per array ``(kind, dtype, shape,
    nbytes, offset)``. Raises SerializationError before anything is built from it."""
    if not isinstance(entries, list) or not _is_int(data_size) or data_size < 0:
        raise _fail("bad array table")
    out: list[tuple[str, Any, list[int], int, int]] = []
    end = 0
    from ._chunked_decode import _check_entry  # that module imports this one's primitives

    for i, e in enumerate(entries):
        kind, dt, shape, nbytes = _check_entry(i, e)
        offset = e.get("offset")
        if not (_is_int(offset) and offset >= end):
            raise _fail(f"array {i}: bad or overlapping offset/nbytes ({offset!r}, {nbytes!r})")
        if offset % ALIGN or offset + nbytes > data_size:
            raise _fail(f"array {i}: bytes [{offset}, {offset}+{nbytes}) lie outside the data")
        out.append((kind, dt, shape, nbytes, offset))
        end = offset + nbytes
    return out


def _alloc_arrays(entries: Any, data_size: Any) -> list[Any]:
    """Validate the array table and allocate (uninitialised) destination arrays."""
    return [
        torch.empty(shape, dtype=dt) if kind == "torch" else np.empty(shape, dtype=dt)
        for kind, dt, shape, _, _ in check_array_table(entries, data_size)
    ]


def check_data_size(header: dict[str, Any], header_end: int, total_size: int | None) -> tuple[int, int]:
    """Where a format 1/2 shard's data starts and the shard size its header describes, checked
    against the verified ``total_size`` (when known). Raises SerializationError."""
    data_size = header.get("data_size")
    if not _is_int(data_size) or data_size < 0:
        raise _fail(f"bad data size {data_size!r}")
    data_start = _align(header_end)
    expected = data_start + data_size
    # Invariant 11: a size declared inside the stored object is checked against the verified
    # receipt BEFORE anything is allocated from it, so a hostile header (a huge tensor with a
    # self-consistent receipt) is rejected as damage instead of exhausting memory.
    if total_size is not None and expected != total_size:
        raise _fail(f"header describes {expected} bytes but the shard has {total_size}")
    return data_start, expected


def _dest_view(arr: Any) -> memoryview:
    if isinstance(arr, torch.Tensor):
        return arr.reshape(-1).view(torch.uint8).numpy().data.cast("B")
    return memoryview(arr.reshape(-1).view(np.uint8)).cast("B")


class _Decoder:
    def __init__(self, arrays: list[Any], version: int = FORMAT_VERSION) -> None:
        self.arrays = arrays
        self.version = version

    def _index(self, v: Any, what: str) -> Any:
        if not _is_int(v) or not 0 <= v < len(self.arrays):
            raise _fail(f"{what} index {v!r} out of range")
        return self.arrays[v]

    def node(self, n: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise _fail(f"nesting deeper than {MAX_DEPTH} levels")
        if n is None or isinstance(n, (bool, int, float, str)):
            return n
        if isinstance(n, list):
            return [self.node(v, depth + 1) for v in n]
        if not isinstance(n, dict) or not n:
            raise _fail(f"unexpected node {str(n)[:80]!r}")
        extra = set(n) - {"D", "M", "meta"}
        if "D" in n or "M" in n:
            if extra or ("D" in n and "M" in n):
                raise _fail(f"unexpected keys {sorted(n)} in a dict node")
            if "D" in n:
                body = n["D"]
                if not isinstance(body, dict):
                    raise _fail("'D' node is not an object")
                out: dict[Any, Any] = OrderedDict((k, self.node(v, depth + 1)) for k, v in body.items())
            else:
                body = n["M"]
                if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
                    raise _fail("'M' node is not a list of pairs")
                out = OrderedDict()
                for k, v in body:
                    key = self.node(k, depth + 1)
                    try:
                        hash(key)
                    except TypeError:
                        raise _fail(f"unhashable dict key {str(k)[:80]!r}") from None
                    out[key] = self.node(v, depth + 1)
            if "meta" in n:
                meta = self.node(n["meta"], depth + 1)
                if not isinstance(meta, dict):
                    raise _fail("'meta' is not a dict")
                out._metadata = meta  # type: ignore[attr-defined]
            else:
                out = dict(out)
            return out
        if len(n) != 1:
            raise _fail(f"unexpected keys {sorted(n)[:5]} in a node")
        ((tag, v),) = n.items()
        if tag == "T":
            if not isinstance(v, list):
                raise _fail("'T' node is not a list")
            return tuple(self.node(x, depth + 1) for x in v)
        if tag in ("t", "a"):
            arr = self._index(v, "array")
            want = torch.Tensor if tag == "t" else (np.ndarray if np is not None else ())
            if not isinstance(arr, want):
                raise _fail(f"node {tag!r} refers to array {v} of the wrong kind")
            return arr
        if tag == "s":
            arr = self._index(v, "scalar")
            if np is None or not isinstance(arr, np.ndarray) or arr.ndim != 0:
                raise _fail(f"scalar node refers to array {v}, not a 0-d numpy array")
            return arr[()]
        if tag == "b":
            if not isinstance(v, str):
                raise _fail("'b' node is not a string")
            try:
                return base64.b64decode(v, validate=True)
            except ValueError:
                raise _fail("'b' node is not base64") from None
        if tag == "dt":
            if not isinstance(v, str) or v not in _TORCH_DTYPES:
                raise _fail(f"dtype {v!r} is not allowed")
            return _TORCH_DTYPES[v]
        if tag == "dev":
            if not isinstance(v, str) or not re.fullmatch(r"[a-z_]+(:\d+)?", v):
                raise _fail(f"bad device {v!r}")
            try:
                return torch.device(v)
            except RuntimeError:
                raise _fail(f"bad device {v!r}") from None
        if tag == "r":
            if not _is_int(v) or v < 0:
                raise _fail(f"bad tensor reference {v!r}")
            return TensorRef(v)
        if tag == "w" and self.version >= VIEWS_FORMAT_VERSION:
            return _view_ref(v)
        raise _fail(f"unknown node tag {tag!r}")


def _view_ref(v: Any) -> ViewRef:
    from ._chunked_decode import MAX_EXTENT_BYTES  # that module imports this one's primitives

    if not isinstance(v, list) or len(v) != 5:
        raise _fail(f"bad view node {str(v)[:80]!r}")
    index, dtype, shape, stride, offset = v

    def ints(xs: Any) -> bool:
        return (
            isinstance(xs, list)
            and len(xs) <= 64
            and all(_is_int(x) and 0 <= x <= MAX_EXTENT_BYTES for x in xs)
            and math.prod(max(x, 1) for x in xs) <= MAX_EXTENT_BYTES
        )

    if not (_is_int(index) and index >= 0 and _is_int(offset) and offset >= 0):
        raise _fail(f"bad view node {str(v)[:80]!r}")
    if not isinstance(dtype, str) or dtype not in _TORCH_DTYPES:
        raise _fail(f"view dtype {dtype!r} is not allowed")
    if not (ints(shape) and ints(stride) and len(shape) == len(stride)):
        raise _fail(f"bad view shape/stride {shape!r}/{stride!r}")
    return ViewRef(index, _TORCH_DTYPES[dtype], tuple(shape), tuple(stride), offset)


#: where one array's bytes lie in the shard: (absolute offset, nbytes, destination array)
Target = tuple[int, int, Any]


def allocate_for(
    header: dict[str, Any], header_end: int, total_size: int | None
) -> tuple[list[Any], list[Target], int]:
    """Check a format 1/2 ``header`` (parsed; its bytes end at ``header_end``) against the
    shard's verified size, then allocate its (uninitialised) arrays. Returns the arrays, the
    non-empty ones' byte ranges in the shard in order, and the shard's size as the header
    describes it.

    Raises:
        SerializationError: a size that does not fit ``total_size`` or a malformed array table,
            before anything is allocated.
    """
    data_start, expected = check_data_size(header, header_end, total_size)
    arrays = _alloc_arrays(header.get("arrays"), header.get("data_size"))
    targets = [
        (data_start + e["offset"], e["nbytes"], arrays[i])
        for i, e in enumerate(header["arrays"])
        if e["nbytes"]
    ]
    return arrays, targets, expected


def decode_stream(
    chunks: Iterable[Buffer],
    *,
    total_size: int | None = None,
    read_range: Callable[[int, int], bytes] | None = None,
    resolver: Resolver | None = None,
    on_header: Callable[[dict[str, Any]], None] | None = None,
) -> Any:
    """Rebuild the object from a stream of byte chunks (e.g. ``Reader.open_shard(receipt)``).

    The header is parsed first, every tensor is allocated, and then the array bytes are copied
    from each chunk straight into place. A version-3 shard also needs ``total_size``,
    ``read_range(start, end)`` (its footer and header are read first, one ranged GET) and, when it
    references ancestors' bytes, a :class:`Resolver`; ``on_header`` receives its header. The stream is consumed to its end, so a verifying
    stream raises its checksum error before anything is returned.

    Raises:
        SerializationError: truncated, trailing or malformed bytes, or a header naming anything
            outside the allow-list.
        ChecksumMismatchError: from the stream itself.
    """
    it = iter(chunks)
    buf = bytearray()
    pending: memoryview = memoryview(b"")

    def take(n: int) -> bytes:
        # read exactly n header bytes from the stream (the header is small)
        nonlocal pending
        while len(buf) < n:
            if pending.nbytes:
                need = n - len(buf)
                buf.extend(pending[:need])
                pending = pending[need:]
                continue
            chunk = next(it, None)
            if chunk is None:
                raise _fail(f"truncated: ended after {len(buf)} bytes, needed {n}")
            pending = memoryview(chunk).cast("B")
        out = bytes(buf[:n])
        del buf[:n]
        return out

    header_len = _parse_prefix(take(_PREFIX.size), total_size)
    header = _parse_header(take(header_len))
    pos = _PREFIX.size + header_len
    if header.get("version") == CHUNKED_FORMAT_VERSION:
        from ._chunked_decode import _chain_views, _decode_chunked  # it imports this module's primitives

        rest = _chain_views(pending, it)
        return _decode_chunked(rest, pos, total_size, read_range, resolver, on_header)
    arrays, targets, expected = allocate_for(header, pos, total_size)

    # Fill the arrays from the rest of the stream. `pos` is the absolute offset of `pending[0]`.
    ti = 0
    filled = 0  # bytes of targets[ti] already written
    views: dict[int, memoryview] = {}

    def feed(view: memoryview) -> None:
        nonlocal pos, ti, filled
        while view.nbytes:
            if ti < len(targets):
                start, nbytes, arr = targets[ti]
                cur = start + filled
                if pos < cur:  # padding before the array
                    skip = min(cur - pos, view.nbytes)
                    view, pos = view[skip:], pos + skip
                    continue
                dest = views.get(ti)
                if dest is None:
                    dest = views[ti] = _dest_view(arr)
                n = min(nbytes - filled, view.nbytes)
                dest[filled : filled + n] = view[:n]
                view, pos, filled = view[n:], pos + n, filled + n
                if filled == nbytes:
                    views.pop(ti, None)
                    ti, filled = ti + 1, 0
            else:  # trailing padding
                if pos + view.nbytes > expected:
                    raise _fail(f"{pos + view.nbytes - expected} unexpected trailing bytes")
                pos += view.nbytes
                return

    feed(pending)
    for chunk in it:
        feed(memoryview(chunk).cast("B"))
    if ti < len(targets) or pos != expected:
        raise _fail(f"truncated: ended at byte {pos} of {expected}")
    # the tree last: numpy scalars are read out of their (now filled) arrays
    return _Decoder(arrays, header["version"]).node(header["tree"], 0)


def decode(data: bytes | bytearray | memoryview, *, resolver: Resolver | None = None) -> Any:
    """Rebuild the object from a whole shard held in memory (see :func:`decode_stream`)."""
    view = memoryview(data).cast("B")

    def read_range(start: int, end: int) -> bytes:
        return bytes(view[start:end])

    return decode_stream([view], total_size=view.nbytes, read_range=read_range, resolver=resolver)


loads = decode
