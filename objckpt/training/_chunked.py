"""Format version 3 of a shard: content-addressed chunks (deduplication, codecs).

What :mod:`.serialization`'s docstring describes as "Version 3", encoded and decoded: the header
is a trailer read through the footer (:func:`read_header`, one ranged GET), every array is a list
of chunks either stored here or referenced in an ancestor's object (:class:`ChunkTarget`,
:class:`Resolver`), and :func:`encode_chunked` decides per chunk, while streaming, whether to
hash, reuse or compress it (:class:`ChunkOptions`).

Separate from :mod:`.serialization` because it is a second encoder and decoder with its own
framing, planning and concurrency (a hashing pool on write, coalesced ranged reads on restore),
while versions 1 and 2 stay a plain prefix-header stream; both share the tree encoding (from
:mod:`._state_encode`), the dtype allow-list and the header checks (from :mod:`.serialization`).
Every name here is also importable from :mod:`.serialization` (its ``__getattr__``), the module
callers use; :func:`.serialization.decode_stream` hands a version-3 stream to
:func:`._chunked_decode._decode_chunked` (the decoder, in a module of its own for length).
"""

from __future__ import annotations

import json
import math
import re
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .._crc import crc32c_b64, crc32c_of
from ..errors import ChecksumMismatchError, SerializationError
from ._state_encode import _Array, _bytes_view, _Encoder
from .serialization import (
    _PREFIX,
    CHUNKED_FORMAT_VERSION,
    FORMAT_NAME,
    MAGIC,
    MAX_HEADER_BYTES,
    _fail,
    _is_int,
    _parse_header,
)

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "FOOTER_MAGIC",
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "TAIL_READ",
    "ChunkOptions",
    "ChunkTarget",
    "ChunkedState",
    "Identity",
    "IndexEntry",
    "Resolver",
    "encode_chunked",
    "index_entries",
    "read_header",
]

# ---------------------------------------------------------------------------------- encoding

_STUB = json.dumps(
    {"format": FORMAT_NAME, "version": CHUNKED_FORMAT_VERSION, "header": "trailer"}, separators=(",", ":")
).encode("utf-8")
#: header offset, header length, CRC32C of the header, 4 zero bytes, magic
_FOOTER = struct.Struct("<QQI4x8s")
FOOTER_MAGIC = b"OBJCKPT\x03"
#: a restore's (and the next save's) first read of a version-3 shard: its last bytes
TAIL_READ = 64 * 1024
MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 256 * 1024 * 1024
_HASH_RE = re.compile(r"^[0-9a-f]{16,128}$")
Identity = tuple[int, int, int, str]


@dataclass(frozen=True)
class ChunkTarget:
    """Where an ancestor holds a chunk's bytes: ``[offset, offset+stored)`` of object
    ``identity`` (``(timeline, step, rank, name)``), under ``codec`` (None: raw), CRC32C ``crc``
    of the uncompressed bytes when its header recorded one."""

    identity: Identity
    offset: int
    stored: int
    codec: str | None
    crc: str | None


@dataclass
class ChunkOptions:
    """How :func:`encode_chunked` cuts, hashes, reuses and compresses array bytes.

    ``lookup(digest, length)``: a :class:`ChunkTarget` holding exactly these bytes, or None.
    ``codec(dtype, itemsize, nbytes)``: the codec to try for a chunk, or None; ``compress(view,
    codec)``: the stored bytes, or None to keep the chunk raw. ``part_size``: the upload's part
    size; the stream is cut at part boundaries so parts are zero-copy slices of tensor memory.
    """

    chunk_size: int
    hash_name: str
    hash_fn: Callable[[Any], bytes]
    min_bytes: int
    lookup: Callable[[bytes, int], ChunkTarget | None] | None = None
    #: the cheap sample of a chunk, and whether the parent has a chunk with that sample (None:
    #: hash every chunk in full, e.g. when there is no parent to compare with)
    sample_fn: Callable[[Any], bytes] | None = None
    candidate: Callable[[bytes, int], bool] | None = None
    codec: Callable[[str, int, int], str | None] | None = None
    compress: Callable[[memoryview, str], bytes | None] | None = None
    part_size: int = 16 * 1024 * 1024
    workers: int = 2
    lookahead: int = 8


@dataclass
class ChunkedState:
    """A state being written as format version 3. Iterate :meth:`buffers` once (the decisions
    are made while streaming); afterwards ``header``, ``size``, ``used`` (identities of the
    ancestors' objects read from), ``local_bytes`` and ``reused_bytes`` are known."""

    tree: Any
    arrays: list[_Array]
    options: ChunkOptions
    header: dict[str, Any] | None = None
    size: int = 0
    used: set[Identity] = field(default_factory=set)
    local_bytes: int = 0
    reused_bytes: int = 0
    compressed_from: int = 0
    compressed_to: int = 0

    def __iter__(self) -> Iterator[memoryview]:
        return self.buffers()

    def buffers(self) -> Iterator[memoryview]:
        opts = self.options
        part = max(1, opts.part_size)
        head = _PREFIX.pack(MAGIC, len(_STUB)) + _STUB
        yield memoryview(head)
        pos = len(head)
        self.used, self.local_bytes, self.reused_bytes = set(), 0, 0
        self.compressed_from = self.compressed_to = 0
        entries: list[dict[str, Any]] = []
        # every piece in stream order: (array index, chunk index, start, length)
        pieces: list[tuple[int, int, int, int]] = []
        for ai, arr in enumerate(self.arrays):
            n = arr.nbytes
            entries.append(
                {"kind": arr.kind, "dtype": arr.dtype, "shape": arr.shape, "nbytes": n, "chunks": []}
            )
            for ci, start in enumerate(range(0, n, opts.chunk_size)):
                pieces.append((ai, ci, start, min(opts.chunk_size, n - start)))
        views: dict[int, memoryview] = {}
        views_lock = threading.Lock()

        def view_of(ai: int) -> memoryview:
            with views_lock:  # workers run ahead: one (maybe copied) view per array
                v = views.get(ai)
                if v is None:
                    v = views[ai] = _bytes_view(self.arrays[ai])
                return v

        def light(ai: int, start: int, length: int) -> Any:
            """The main thread's part of a chunk's decision: its sample, and whether it needs the
            pool (a full hash, compression) at all; a changed chunk needs neither."""
            arr = self.arrays[ai]
            if arr.nbytes < opts.min_bytes:
                return _Ready((None, None, None, None, None))  # small: always local, unhashed
            chunk = view_of(ai)[start : start + length]
            sample = opts.sample_fn(chunk) if opts.sample_fn is not None else None
            full = opts.candidate is None or (sample is not None and opts.candidate(sample, length))
            codec = None
            if opts.codec is not None and opts.compress is not None:
                itemsize = arr.nbytes // max(1, math.prod(arr.shape))
                codec = opts.codec(arr.dtype, itemsize, length)
            if not full and codec is None:
                return _Ready((None, sample, None, None, None))
            return pool().submit(heavy, chunk, sample, full, codec)

        def heavy(chunk: memoryview, sample: bytes | None, full: bool, codec: str | None) -> Any:
            digest = target = None
            if full:
                digest = opts.hash_fn(chunk)
                target = opts.lookup(digest, chunk.nbytes) if opts.lookup is not None else None
            if target is not None:
                return digest, sample, target, target.crc or crc32c_b64(chunk), None
            packed = None
            if codec is not None:
                out = opts.compress(chunk, codec)  # type: ignore[misc]
                if out is not None:
                    packed = (codec, out)
            return digest, sample, None, None, packed

        executor: list[ThreadPoolExecutor] = []

        def pool() -> ThreadPoolExecutor:
            if not executor:
                executor.append(ThreadPoolExecutor(max(1, opts.workers), thread_name_prefix="objckpt-hash"))
            return executor[0]

        # run: contiguous local raw bytes of one array not yet yielded: [array, start, length)
        run: list[Any] = [None, 0, 0]

        def flush(upto_boundary: bool) -> Iterator[memoryview]:
            nonlocal pos
            ai, start, length = run
            while length:
                take = length
                if upto_boundary:
                    boundary = (pos // part + 1) * part
                    if pos + length < boundary:
                        break
                    take = boundary - pos
                yield view_of(ai)[start : start + take]
                pos, start, length = pos + take, start + take, length - take
            run[1], run[2] = start, length
            if not length:
                run[0] = None

        futures: list[Any] = []
        try:
            submitted = 0
            last = -1
            for i, (ai, _, start, length) in enumerate(pieces):
                if ai != last:
                    yield from flush(False)  # the run, if any, is the previous array's
                    with views_lock:
                        views.pop(last, None)  # done with it: drop its (maybe copied) view
                    last = ai
                while submitted < len(pieces) and submitted <= i + opts.lookahead:
                    a, _, st, ln = pieces[submitted]
                    futures.append(light(a, st, ln))
                    submitted += 1
                digest, sample, target, crc, packed = futures[i].result()
                futures[i] = None  # free a compressed chunk early
                chunk: dict[str, Any]
                if target is not None:
                    yield from flush(False)
                    t, st_, r, name = target.identity
                    chunk = {
                        "ref": {"from": [t, st_], "rank": r, "name": name, "offset": target.offset},
                        "n": target.stored,
                        "crc": crc,
                    }
                    if target.codec is not None:
                        chunk["z"] = target.codec
                    self.used.add(target.identity)
                    self.reused_bytes += length
                elif packed is not None:
                    yield from flush(False)
                    codec, out = packed
                    chunk = {"at": pos, "n": len(out), "z": codec}
                    yield memoryview(out)
                    pos += len(out)
                    self.local_bytes += len(out)
                    self.compressed_from += length
                    self.compressed_to += len(out)
                else:
                    if run[0] is not None and (run[0] != ai or run[1] + run[2] != start):
                        yield from flush(False)
                    if run[0] is None:
                        run[0], run[1], run[2] = ai, start, 0
                    chunk = {"at": pos + run[2], "n": length}
                    run[2] += length
                    self.local_bytes += length
                    yield from flush(True)
                if sample is not None:
                    chunk["s"] = sample.hex()
                if digest is not None:
                    chunk["h"] = digest.hex()
                entries[ai]["chunks"].append(chunk)
            yield from flush(False)
        finally:
            for f in futures:
                if f is not None:
                    f.cancel()
            for ex in executor:
                ex.shutdown(wait=True)
            views.clear()
        data_size = pos - len(head)
        header = {
            "format": FORMAT_NAME,
            "version": CHUNKED_FORMAT_VERSION,
            "tree": self.tree,
            "arrays": entries,
            "data_size": data_size,
            "chunk_size": opts.chunk_size,
            "hash": opts.hash_name,
        }
        raw = json.dumps(header, separators=(",", ":"), allow_nan=True).encode("utf-8")
        footer = _FOOTER.pack(pos, len(raw), crc32c_of(raw), FOOTER_MAGIC)
        yield memoryview(raw + footer)
        self.header = header
        self.size = pos + len(raw) + len(footer)


class _Ready:
    """A decision made without the pool (what a future would hold)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value

    def cancel(self) -> bool:
        return False


def encode_chunked(
    obj: Any, options: ChunkOptions, *, path_root: str = "state", strip: int = 0
) -> ChunkedState:
    """Describe ``obj`` for streaming as format version 3; nothing is hashed or copied until
    :meth:`ChunkedState.buffers` is iterated.

    Raises:
        UnsupportedStateError: as :func:`encode`.
    """
    if not MIN_CHUNK_SIZE <= options.chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size must be in [{MIN_CHUNK_SIZE}, {MAX_CHUNK_SIZE}], got {options.chunk_size}"
        )
    enc = _Encoder(path_root, strip)
    tree = enc.node(obj, (), 0)
    return ChunkedState(tree, enc.arrays, options)


def _parse_footer(tail: bytes, total_size: int) -> tuple[int, int, int] | None:
    if len(tail) < _FOOTER.size:
        return None
    offset, length, crc, magic = _FOOTER.unpack(tail[-_FOOTER.size :])
    if magic != FOOTER_MAGIC:
        return None
    if (
        offset < _PREFIX.size + len(_STUB)
        or length > MAX_HEADER_BYTES
        or offset + length + _FOOTER.size != total_size
    ):
        raise _fail(f"footer places a {length}-byte header at {offset} in a {total_size}-byte shard")
    return offset, length, crc


def read_header(
    read_range: Callable[[int, int], bytes], total_size: int
) -> tuple[dict[str, Any], int] | None:
    """The version-3 header of a shard of ``total_size`` bytes, read through ``read_range(start,
    end)`` (one ranged GET of the tail; a second when the header is larger), checked against the
    footer's CRC32C; ``(header, header_offset)``. None when the shard is not version 3.

    Raises:
        SerializationError: a version-3 footer whose header is malformed or fails its CRC32C.
    """
    if total_size < _FOOTER.size:
        return None
    start = max(0, total_size - TAIL_READ)
    tail = bytes(read_range(start, total_size))
    if len(tail) != total_size - start:
        raise ChecksumMismatchError(f"ranged read returned {len(tail)} bytes, expected {total_size - start}")
    parsed = _parse_footer(tail, total_size)
    if parsed is None:
        return None
    offset, length, crc = parsed
    if offset >= start:
        raw = tail[offset - start : offset - start + length]
    else:
        raw = bytes(read_range(offset, offset + length))
    if len(raw) != length or crc32c_of(raw) != crc:
        raise ChecksumMismatchError(
            f"the header of this shard fails its CRC32C (read {len(raw)} of {length} bytes)"
        )
    header = _parse_header(raw, trailer=True)
    if header.get("version") != CHUNKED_FORMAT_VERSION or header.get("header") is not None:
        raise _fail(f"a version-3 footer holds a version {header.get('version')!r} header")
    return header, offset


IndexEntry = tuple[bytes | None, bytes | None, int, Identity | None, int, int, str | None, str | None]


def index_entries(header: Mapping[str, Any]) -> list[IndexEntry]:
    """Every sampled or hashed chunk of a version-3 header: ``(digest or None, sample or None,
    length, ref identity or None for a local chunk, offset, stored, codec, crc32c)``. Malformed
    entries are left out (the index is an optimisation: a chunk not found is written again)."""
    out: list[IndexEntry] = []
    cs = header.get("chunk_size")
    arrays = header.get("arrays")
    if not _is_int(cs) or not isinstance(arrays, list):
        return out
    for a in arrays:
        if not isinstance(a, dict) or not _is_int(a.get("nbytes")) or not isinstance(a.get("chunks"), list):
            continue
        nbytes = a["nbytes"]
        for k, c in enumerate(a["chunks"]):
            if not isinstance(c, dict):
                continue
            h, smp = c.get("h"), c.get("s")
            digest = bytes.fromhex(h) if isinstance(h, str) and _HASH_RE.match(h) else None
            sample = bytes.fromhex(smp) if isinstance(smp, str) and _HASH_RE.match(smp) else None
            if digest is None and sample is None:
                continue
            length = min(cs, nbytes - k * cs)
            stored, codec, crc = c.get("n"), c.get("z"), c.get("crc")
            if not _is_int(stored) or length <= 0 or (codec is not None and not isinstance(codec, str)):
                continue
            crc = crc if isinstance(crc, str) else None
            ref = c.get("ref")
            if ref is None and _is_int(c.get("at")):
                out.append((digest, sample, length, None, c["at"], stored, codec, crc))
            elif isinstance(ref, dict):
                try:
                    ident = _identity(ref)
                except SerializationError:
                    continue
                out.append((digest, sample, length, ident, ref["offset"], stored, codec, crc))
    return out


def _identity(ref: Any) -> Identity:
    if not isinstance(ref, dict) or set(ref) != {"from", "rank", "name", "offset"}:
        raise _fail(f"bad chunk reference {str(ref)[:120]!r}")
    origin, rank, name, offset = ref["from"], ref["rank"], ref["name"], ref["offset"]
    if not (
        isinstance(origin, list)
        and len(origin) == 2
        and all(_is_int(x) and x >= 0 for x in origin)
        and _is_int(rank)
        and rank >= 0
        and isinstance(name, str)
        and _is_int(offset)
        and offset >= 0
    ):
        raise _fail(f"bad chunk reference {str(ref)[:120]!r}")
    return (origin[0], origin[1], rank, name)


class Resolver:
    """How a restore reads the ranges a version-3 shard references: ``sizes`` maps each
    identity the checkpoint references (its manifest's ``references``) to its object's size;
    ``read(identity, start, end)`` returns those bytes (a ranged GET). Concurrency and the
    coalescing of adjacent chunks are the decoder's."""

    def __init__(
        self,
        sizes: Mapping[Identity, int],
        read: Callable[[Identity, int, int], bytes],
        *,
        workers: int = 4,
        max_range: int = 32 * 1024 * 1024,
    ) -> None:
        self.sizes = dict(sizes)
        self.read = read
        self.workers = workers
        self.max_range = max_range
        #: bytes and requests of the referenced ranges read (for tests and metrics)
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()
        #: ranges held at once, across every shard a restore decodes in parallel with this
        #: resolver: peak memory of the referenced reads is ``workers x max_range``
        self.slots = threading.BoundedSemaphore(max(1, workers))

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += 1
