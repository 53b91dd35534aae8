"""Shard bytes already in memory -> state, without copying the array bytes (issue 14).

A read-once restore holds every replicated shard whole in a buffer of its own (this rank's
download, or the exchange's receive buffer of another rank's shard), already checked against its
receipt's size and CRC32C. :func:`decode_borrowed` builds the staged tensors as views into that
buffer (each array on a storage of its own, so tensors that did not share a storage when saved
do not share one now) instead of allocating them and copying the bytes in: the buffer becomes
the staged state, so a restore holds one copy of the replicated bytes, not two.

Where a view is not possible the array is allocated and filled as :mod:`._state_decode` and
:mod:`._chunked_decode` would: a read-only buffer (every array), an array whose bytes are not
contiguous and raw in this object (a compressed chunk, a chunk referenced from an ancestor, a
version-3 array whose chunks are not laid out back to back).

Every size the header declares is checked against the buffer before anything is built
(invariant 11), with the same checks as the copying decoders (their functions, reused), and only
allow-listed dtypes are ever built (invariant 12).

A view keeps the whole buffer alive: drop the staged tensors once they are loaded (module
state is copied into the live parameters by ``load_state_dict``; other state that an object
keeps as given, e.g. an optimizer's, is detached first with :func:`detach`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._crc import Buffer
from ..tree import map_tree
from ._chunked import read_header
from ._chunked_decode import _plan_chunked, _resolve_remote
from ._state_decode import _Decoder, _dest_view, check_array_table, check_data_size, decode_stream
from .codec import decompress
from .serialization import (
    _PREFIX,
    CHUNKED_FORMAT_VERSION,
    _fail,
    _parse_header,
    _parse_prefix,
)

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = ["decode_borrowed", "detach"]


def decode_borrowed(
    data: Buffer,
    *,
    resolver: Any = None,
    on_header: Callable[[dict[str, Any]], None] | None = None,
    borrowed: set[int] | None = None,
) -> Any:
    """Rebuild the object of one whole, verified shard in ``data``; its tensors and arrays are
    views into ``data`` where possible (see the module docstring), so ``data`` must not change
    while they are in use. ``borrowed``: receives the ``data_ptr`` of every storage that is a
    view into ``data`` (what :func:`detach` copies). A read-only ``data`` is decoded by copying
    (:func:`.serialization.decode_stream`).

    Raises:
        SerializationError: truncated, trailing or malformed bytes, or a header naming anything
            outside the allow-list (before anything is built).
    """
    view = memoryview(data).cast("B")
    total = view.nbytes

    def read_range(start: int, end: int) -> bytes:
        return bytes(view[start:end])

    if view.readonly:
        return decode_stream(
            [view], total_size=total, read_range=read_range, resolver=resolver, on_header=on_header
        )
    header_len = _parse_prefix(bytes(view[: _PREFIX.size]), total)
    if _PREFIX.size + header_len > total:
        raise _fail(f"truncated: the header needs {_PREFIX.size + header_len} bytes, the shard has {total}")
    header = _parse_header(bytes(view[_PREFIX.size : _PREFIX.size + header_len]))
    pos = _PREFIX.size + header_len
    seen = borrowed if borrowed is not None else set()
    if header.get("version") == CHUNKED_FORMAT_VERSION:
        return _chunked(view, pos, read_range, resolver, on_header, seen)
    # the copying decoder's checks (invariants 11 and 12), before anything is built
    data_start, _ = check_data_size(header, pos, total)
    arrays = [
        _borrow(view, data_start + offset, kind, dt, shape, nbytes, seen)
        for kind, dt, shape, nbytes, offset in check_array_table(
            header.get("arrays"), header.get("data_size")
        )
    ]
    return _Decoder(arrays, header["version"]).node(header["tree"], 0)


def _borrow(
    view: memoryview, start: int, kind: str, dt: Any, shape: list[int], nbytes: int, seen: set[int]
) -> Any:
    """The array of ``nbytes`` at ``start`` in ``view``, as a view on a storage of its own.

    Version 3 packs chunks without alignment, so its views may start at an address that is not
    a multiple of the element size: CPU kernels load such tensors with unaligned loads (x86-64,
    AArch64), and the staged state is only read (copied into the live parameters, or moved onto
    an aligned storage of its own by :func:`detach`)."""
    if kind == "torch":
        if nbytes == 0:
            return torch.empty(shape, dtype=dt)
        raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=start)
        seen.add(raw.untyped_storage().data_ptr())
        return raw.view(dt).view(shape)
    dtype = np.dtype(dt)
    count = nbytes // dtype.itemsize if dtype.itemsize else 0
    if nbytes == 0:
        return np.empty(shape, dtype=dtype)
    return np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)


def _chunked(
    view: memoryview,
    data_start: int,
    read_range: Callable[[int, int], bytes],
    resolver: Any,
    on_header: Callable[[dict[str, Any]], None] | None,
    seen: set[int],
) -> Any:
    """Version 3: an array whose chunks all lie in this object, raw and back to back, is a view;
    any other array is allocated and filled (decompressed, or resolved from its ancestors)."""
    got = read_header(read_range, view.nbytes)
    if got is None:
        raise _fail("version-3 shard without a footer")
    header, header_offset = got
    specs, local, remote = _plan_chunked(header, data_start, header_offset, resolver)
    cs = int(header["chunk_size"])
    by_array: dict[int, list[Any]] = {}
    for c in local:
        by_array.setdefault(c.array, []).append(c)
    remote_arrays = {c.array for c in remote}
    arrays: list[Any] = []
    dests: list[Any] = []
    for i, (kind, dt, shape) in enumerate(specs):
        entry = header["arrays"][i]
        nbytes = entry["nbytes"]
        chunks = sorted(by_array.get(i, []), key=lambda c: c.offset)
        contiguous = (
            nbytes > 0
            and i not in remote_arrays
            and all(c.codec is None for c in chunks)
            and all(c.offset == k * cs and c.at == chunks[0].at + k * cs for k, c in enumerate(chunks))
        )
        if contiguous:
            arrays.append(_borrow(view, chunks[0].at, kind, dt, shape, nbytes, seen))
            dests.append(None)
            continue
        arr = torch.empty(shape, dtype=dt) if kind == "torch" else np.empty(shape, dtype=dt)
        dest = _dest_view(arr)
        for c in chunks:
            piece = view[c.at : c.at + c.stored]
            if c.codec is None:
                dest[c.offset : c.offset + c.length] = piece
            else:
                decompress(piece, c.codec, c.length, dest[c.offset : c.offset + c.length])
        arrays.append(arr)
        dests.append(dest)
    if remote:
        _resolve_remote(remote, dests, resolver)
    if on_header is not None:
        on_header(header)
    return _Decoder(arrays, CHUNKED_FORMAT_VERSION).node(header["tree"], 0)


def detach(tree: Any, borrowed: set[int]) -> Any:
    """``tree`` with every tensor whose storage is in ``borrowed`` (views into a shard buffer,
    :func:`decode_borrowed`) moved onto a storage of its own (one copy per storage, so views
    of one array stay views of one copy), and every numpy array that views a buffer copied: for
    state an object keeps as given (an optimizer's), which would otherwise keep a whole shard
    buffer alive."""
    if not borrowed:
        return tree
    copies: dict[int, Any] = {}

    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            storage = v.untyped_storage()
            key = storage.data_ptr()
            if key not in borrowed:
                return v
            own = copies.get(key)
            if own is None:
                own = copies[key] = storage.clone()  # type: ignore[no-untyped-call]
            out = torch.empty(0, dtype=v.dtype).set_(own, v.storage_offset(), v.size(), v.stride())
            return torch.nn.Parameter(out, v.requires_grad) if isinstance(v, torch.nn.Parameter) else out
        if np is not None and isinstance(v, np.ndarray) and v.base is not None:
            return v.copy()
        return v

    return map_tree(tree, leaf)
