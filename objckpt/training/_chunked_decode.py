"""Format version 3 of a shard, decoding: a version-3 stream checked against its receipts before
anything is allocated (invariant 11), filled from this object's own chunks as they stream, then
from the byte ranges it references in ancestors' objects (coalesced ranged reads, each chunk
checked against its CRC32C).

The encoder, the footer and header reader, the chunk index and :class:`~._chunked.Resolver` are
in :mod:`._chunked`; this module holds only the decoder, so that each reads in one sitting.
Every name is also importable from :mod:`.serialization` (its ``__getattr__``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .._crc import Buffer, Crc32c, crc32c_b64, crc32c_of, encode_crc32c
from ..errors import ChecksumMismatchError, SerializationError
from ._chunked import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, Identity, Resolver, _identity, read_header
from .serialization import (
    _NUMPY_DTYPE_RE,
    _TORCH_DTYPES,
    CHUNKED_FORMAT_VERSION,
    _Decoder,
    _dest_view,
    _fail,
    _is_int,
)

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def _chain_views(first: memoryview, rest: Iterator[Buffer]) -> Iterator[memoryview]:
    if first.nbytes:
        yield first
    for chunk in rest:
        yield memoryview(chunk).cast("B")


@dataclass
class _Local:
    at: int
    stored: int
    array: int
    offset: int  # in the array's bytes
    length: int
    codec: str | None


@dataclass
class _Remote:
    identity: Identity
    offset: int  # in the referenced object
    stored: int
    array: int
    at: int  # in the array's bytes
    length: int
    codec: str | None
    crc: str


#: the most elements an array may span, its zero dimensions aside (as if they were 1), times
#: its item size: torch and numpy refuse a zero-size array whose other dimensions overflow
#: int64 (TypeError/ValueError/RuntimeError, not a SerializationError), so a hostile header
#: declaring ``[0, 10**30]`` is refused here first
MAX_EXTENT_BYTES = 2**62


def _check_entry(i: int, e: Any) -> tuple[str, Any, list[int], int]:
    """Validate one array entry (kind, dtype, shape, nbytes); nothing is allocated. The one
    check of an array-table entry, for every format's decoder and for export's planner.

    Raises:
        SerializationError: naming the entry and what is wrong with it.
    """
    if not isinstance(e, dict):
        raise _fail(f"array {i}: entry is not an object")
    kind, dtype, shape, nbytes = e.get("kind"), e.get("dtype"), e.get("shape"), e.get("nbytes")
    if not _is_int(nbytes) or nbytes < 0:
        raise _fail(f"array {i}: bad nbytes {nbytes!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape) or len(shape) > 64:
        raise _fail(f"array {i}: bad shape {shape!r}")
    numel = math.prod(shape)
    if kind == "torch":
        if not isinstance(dtype, str) or dtype not in _TORCH_DTYPES:
            raise _fail(f"array {i}: dtype {dtype!r} is not allowed")
        dt: Any = _TORCH_DTYPES[dtype]
        itemsize = torch.empty((), dtype=dt).element_size()
    elif kind == "numpy":
        if np is None:
            raise _fail(f"array {i}: numpy arrays need numpy installed")
        if not isinstance(dtype, str) or not _NUMPY_DTYPE_RE.match(dtype):
            raise _fail(f"array {i}: numpy dtype {dtype!r} is not allowed")
        dt = np.dtype(dtype)
        itemsize = dt.itemsize
    else:
        raise _fail(f"array {i}: unknown kind {kind!r}")
    if numel * itemsize != nbytes:
        raise _fail(f"array {i}: {nbytes} bytes do not fit shape {shape} of {dtype}")
    if math.prod(max(d, 1) for d in shape) * itemsize > MAX_EXTENT_BYTES:
        raise _fail(f"array {i}: shape {shape} of {dtype} is beyond any array's extent")
    return kind, dt, shape, nbytes


_CHUNK_KEYS = frozenset(("at", "n", "s", "h", "z", "ref", "crc"))


def _plan_chunked(
    header: dict[str, Any], data_start: int, data_end: int, resolver: Resolver | None
) -> tuple[list[tuple[str, Any, list[int]]], list[_Local], list[_Remote]]:
    """Check every array and chunk of a version-3 header against what the verified receipts
    allow (local chunks inside this object's data, referenced ranges inside the referenced
    objects' sizes) BEFORE anything is allocated (invariant 11)."""
    from .codec import CODECS

    cs, entries, data_size = header.get("chunk_size"), header.get("arrays"), header.get("data_size")
    if not _is_int(cs) or not MIN_CHUNK_SIZE <= cs <= MAX_CHUNK_SIZE:
        raise _fail(f"bad chunk size {cs!r}")
    if not isinstance(entries, list):
        raise _fail("bad array table")
    if data_size != data_end - data_start:
        raise _fail(f"header says {data_size!r} data bytes, the shard holds {data_end - data_start}")
    specs: list[tuple[str, Any, list[int]]] = []
    local: list[_Local] = []
    remote: list[_Remote] = []
    for i, e in enumerate(entries):
        kind, dt, shape, nbytes = _check_entry(i, e)
        chunks = e.get("chunks")
        if not isinstance(chunks, list) or len(chunks) != -(-nbytes // cs):
            raise _fail(f"array {i}: {nbytes} bytes need {-(-nbytes // cs)} chunks of {cs}")
        for k, c in enumerate(chunks):
            length = min(cs, nbytes - k * cs)
            if not isinstance(c, dict) or not set(c) <= _CHUNK_KEYS or ("ref" in c) == ("at" in c):
                raise _fail(f"array {i} chunk {k}: malformed {str(c)[:120]!r}")
            stored, codec = c.get("n"), c.get("z")
            if codec is not None and codec not in CODECS:
                raise _fail(f"array {i} chunk {k}: unknown codec {codec!r}")
            if not _is_int(stored) or stored <= 0 or (codec is None and stored != length):
                raise _fail(f"array {i} chunk {k}: stored size {stored!r} does not fit {length} bytes")
            if "ref" in c:
                ident = _identity(c["ref"])
                crc = c.get("crc")
                if not isinstance(crc, str):
                    raise _fail(f"array {i} chunk {k}: a referenced chunk needs its CRC32C")
                if resolver is None:
                    raise _fail(
                        f"array {i} chunk {k} references {ident}, and nothing was given to resolve it"
                    )
                size = resolver.sizes.get(ident)
                if size is None:
                    raise _fail(
                        f"array {i} chunk {k} references {ident}, which the manifest does not reference"
                    )
                off = c["ref"]["offset"]
                if off + stored > size:
                    raise _fail(
                        f"array {i} chunk {k}: bytes [{off}, {off + stored}) lie beyond {ident} ({size} bytes)"
                    )
                remote.append(_Remote(ident, int(off), int(stored), i, k * int(cs), length, codec, crc))
            else:
                at = c.get("at")
                if not _is_int(at) or at < data_start or at + stored > data_end:
                    raise _fail(f"array {i} chunk {k}: bytes at {at!r} (+{stored}) lie outside the data")
                local.append(_Local(int(at), int(stored), i, k * int(cs), length, codec))
        specs.append((kind, dt, shape))
    local.sort(key=lambda c: c.at)
    for a, b in zip(local, local[1:], strict=False):
        if b.at < a.at + a.stored:
            raise _fail(f"chunks at {a.at} and {b.at} overlap")
    return specs, local, remote


def _decode_chunked(
    stream: Iterator[memoryview],
    data_start: int,
    total_size: int | None,
    read_range: Callable[[int, int], bytes] | None,
    resolver: Resolver | None,
    on_header: Callable[[dict[str, Any]], None] | None,
) -> Any:
    from .codec import decompress

    if total_size is None or read_range is None:
        raise _fail(
            "a version-3 shard is read with its size and ranged reads (decode_stream(read_range=...))"
        )
    try:
        got = read_header(read_range, total_size)
        if got is None:
            raise _fail("version-3 shard without a footer")
        header, header_offset = got
        specs, local, remote = _plan_chunked(header, data_start, header_offset, resolver)
    except (SerializationError, ChecksumMismatchError):
        # Say what is really wrong: bytes that fail the object's CRC32C (read to its end), or,
        # when they pass it, the malformed header itself.
        for _ in stream:
            pass
        raise
    arrays: list[Any] = []
    for kind, dt, shape in specs:  # allocation only after every size was checked
        arrays.append(torch.empty(shape, dtype=dt) if kind == "torch" else np.empty(shape, dtype=dt))
    dests = [_dest_view(a) for a in arrays]

    # 1. this object's own bytes, streamed (verified whole at the end of the stream)
    pos, li = data_start, 0
    staged: bytearray | None = None
    trailer = Crc32c()
    for view in stream:
        while view.nbytes:
            if li < len(local):
                c = local[li]
                if pos < c.at:
                    skip = min(c.at - pos, view.nbytes)
                    view, pos = view[skip:], pos + skip
                    continue
                n = min(c.at + c.stored - pos, view.nbytes)
                if c.codec is None:
                    d = c.offset + pos - c.at
                    dests[c.array][d : d + n] = view[:n]
                else:
                    if staged is None:
                        staged = bytearray()
                    staged += view[:n]
                view, pos = view[n:], pos + n
                if pos == c.at + c.stored:
                    if c.codec is not None:
                        assert staged is not None
                        decompress(staged, c.codec, c.length, dests[c.array][c.offset : c.offset + c.length])
                        staged = None
                    li += 1
            else:
                if pos < header_offset:
                    skip = min(header_offset - pos, view.nbytes)
                    view, pos = view[skip:], pos + skip
                    continue
                if pos + view.nbytes > total_size:
                    raise _fail(f"{pos + view.nbytes - total_size} unexpected trailing bytes")
                trailer.update(view)
                pos += view.nbytes
                view = view[view.nbytes :]
    if li < len(local) or pos != total_size:
        raise _fail(f"truncated: ended at byte {pos} of {total_size}")
    tail = bytes(read_range(header_offset, total_size))
    if trailer.b64 != crc32c_b64(tail):
        raise ChecksumMismatchError("the header read first differs from the one streamed")

    # 2. the ranges it references, coalesced, each chunk checked against its CRC32C
    if remote:
        _resolve_remote(remote, dests, resolver)
    if on_header is not None:
        on_header(header)
    return _Decoder(arrays, CHUNKED_FORMAT_VERSION).node(header["tree"], 0)


_COALESCE_GAP = 256 * 1024


def _resolve_remote(remote: list[_Remote], dests: list[memoryview], resolver: Resolver | None) -> None:
    from .codec import decompress

    assert resolver is not None
    ranges: list[tuple[Identity, int, int, list[_Remote]]] = []
    for ident in sorted({r.identity for r in remote}):
        members = sorted((r for r in remote if r.identity == ident), key=lambda r: r.offset)
        cur: list[Any] | None = None
        for r in members:
            end = r.offset + r.stored
            if (
                cur is not None
                and r.offset - cur[2] <= _COALESCE_GAP
                and max(cur[2], end) - cur[1] <= resolver.max_range
            ):
                cur[2] = max(cur[2], end)
                cur[3].append(r)
                continue
            if cur is not None:
                ranges.append((cur[0], cur[1], cur[2], cur[3]))
            cur = [ident, r.offset, end, [r]]
        if cur is not None:
            ranges.append((cur[0], cur[1], cur[2], cur[3]))

    def fetch(job: tuple[Identity, int, int, list[_Remote]]) -> None:
        with resolver.slots:
            place(job)

    def place(job: tuple[Identity, int, int, list[_Remote]]) -> None:
        ident, start, end, members = job
        data = memoryview(resolver.read(ident, start, end))
        if data.nbytes != end - start:
            raise ChecksumMismatchError(
                f"ranged read [{start}, {end}) of {ident} returned {data.nbytes} bytes (object truncated?)"
            )
        resolver._count(data.nbytes)
        for r in members:
            piece = data[r.offset - start : r.offset - start + r.stored]
            out = dests[r.array][r.at : r.at + r.length]
            if r.codec is None:
                if encode_crc32c(crc32c_of(piece)) != r.crc:
                    raise ChecksumMismatchError(
                        f"referenced bytes [{r.offset}, {r.offset + r.stored}) of {ident} fail their CRC32C"
                    )
                out[:] = piece
            else:
                decompress(piece, r.codec, r.length, out)
                if encode_crc32c(crc32c_of(out)) != r.crc:
                    raise ChecksumMismatchError(
                        f"referenced chunk [{r.offset}, {r.offset + r.stored}) of {ident} fails its CRC32C"
                    )

    workers = max(1, min(resolver.workers, len(ranges)))
    if workers == 1:
        for job in ranges:
            fetch(job)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="objckpt-refs") as pool:
        pending: list[Future[None]] = []
        try:
            for job in ranges:  # at most `workers` ranges held in memory at once
                if len(pending) >= workers:
                    pending.pop(0).result()
                pending.append(pool.submit(fetch, job))
            for f in pending:
                f.result()
        finally:
            for f in pending:
                f.cancel()
