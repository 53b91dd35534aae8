"""State dicts <-> shard bytes, without pickle (invariant 12).

A shard is a small self-describing container::

    b"OBJCKPT\\x00"                 8-byte magic
    <u64 little-endian>             length of the JSON header
    <JSON header, UTF-8>            {"format": "objckpt-state", "version": 1,
                                     "tree": <node>, "arrays": [<entry>, ...], "data_size": N}
    <zero padding to 64 bytes>
    <raw array bytes>               each array's bytes, C order, at its 64-byte aligned offset

``tree`` mirrors the nested structure. JSON ``null``/booleans/numbers/strings stand for
themselves (floats keep their exact value, NaN and infinities included) and a JSON array is a
Python ``list``; every other node is a one-key object whose key says what it is::

    {"T": [...]}          tuple               {"D": {...}, "meta": {...}}  dict with str keys
    {"M": [[k, v], ...]}  dict, any keys      {"t": i}  torch tensor i     {"a": i}  numpy array i
    {"s": i}              numpy scalar i      {"b": "<base64>"}  bytes     {"dt": "bfloat16"}
    {"dev": "cuda:0"}     torch.device        {"r": i}  TensorRef(i), a tensor stored elsewhere
    {"w": [i, dtype, shape, stride, offset]}  ViewRef: a view into tensor i of a table (version 2)

An array entry is ``{"kind": "torch"|"numpy", "dtype": name, "shape": [...], "offset": o,
"nbytes": n}``; the bytes are the tensor's memory in C order, so every dtype (bfloat16, float8,
complex, bool, NaN payloads) round-trips bit for bit.

Storage sharing: :func:`encode` writes a tensor object reachable twice once (identity). Tensors
that are *different objects over one storage* (tied weights in ``nn.Module.state_dict()``, whose
every entry is a fresh ``detach()``; views into one buffer) are found by
:func:`objckpt.training.replicated.split_tensors`, which puts one tensor per storage in a table
and writes the others as :class:`ViewRef` s into it; :func:`make_view` rebuilds them as views of
the decoded tensor, so the sharing survives the round trip. A shard holding a ``ViewRef`` is
written as format version 2 (an older objckpt refuses it by version rather than by an unknown
node); every other shard stays version 1.

Version 3 (content-addressed chunks, written when deduplication or compression is on; see
:mod:`.dedup`): the header moves to the END of the object so that the bytes can be streamed while
they are hashed, and every array's data is a list of chunks (``chunk_size`` bytes each, the last
shorter), each either *local* or a *reference* to a byte range of an ancestor's object::

    b"OBJCKPT\\x00" <u64 stub length> {"format": "objckpt-state", "version": 3, "header": "trailer"}
    <local chunk bytes, back to back>
    <JSON header>                   {"format", "version": 3, "tree", "arrays", "data_size",
                                     "chunk_size", "hash": "xxh3-128"}
    <u64 header offset> <u64 header length> <u32 header CRC32C> <4 zero bytes> b"OBJCKPT\\x03"

An array entry is ``{"kind", "dtype", "shape", "nbytes", "chunks": [...]}``; a chunk is
``{"at": <absolute offset in this object>, "n": <stored bytes>, "s": <sample>, "h": <content
hash>}`` (local) or ``{"ref": {"from": [timeline, step], "rank": r, "name": n, "offset": o},
"n": ..., "s": ..., "h": ..., "crc": <CRC32C>}`` (bytes ``[o, o+n)`` of shard ``n`` of rank
``r`` of checkpoint ``(timeline, step)``: named by identity, never by key, so a copy to another
run root only rewrites the manifest's references). ``"z": <codec>`` marks a compressed chunk
(:mod:`.codec`); hashes and CRC32Cs are always of the uncompressed bytes. ``"s"`` is a 64-bit
digest of 65 words sampled across the chunk (:func:`.dedup.chunk_sample`): a chunk is hashed in
full (``"h"``) only when its sample equals a parent chunk's (or when there is no parent to
compare with), so a save where everything changed hashes nothing. Chunks of arrays smaller than
``dedup.MIN_BYTES`` carry neither. The footer's CRC32C covers the header, so the next save can read the header
alone with one ranged GET and trust it; a restore reads the footer first (one small ranged GET),
then streams the object (whose full CRC32C covers everything again), then fetches the referenced
ranges, each checked against its chunk's CRC32C before use.

Writing streams straight from tensor memory: :func:`encode` returns the header and an iterator of
``memoryview`` s over the tensors (zero-copy for contiguous CPU tensors; a non-contiguous or
device tensor is copied to contiguous CPU memory one at a time, while it is being sent), so the
serialized state never exists twice in memory. Reading fills preallocated tensors from a byte
stream chunk by chunk. Decoding only ever builds containers, numbers, strings, tensors and arrays
of allow-listed dtypes: nothing from the store can run code. Malformed or hostile input raises
:class:`SerializationError`.

This module holds what every version shares (the format's constants, the dtype allow-list,
:class:`TensorRef` / :class:`ViewRef`, the header checks); the encoder of versions 1 and 2 is in
:mod:`._state_encode` and their decoder in :mod:`._state_decode`, version 3's encoder in
:mod:`._chunked` and its decoder in :mod:`._chunked_decode`. Every name stays importable from
here (resolved on first use: those modules import this one).
"""

from __future__ import annotations

import importlib
import json
import math
import re
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from ..errors import SerializationError, UnsupportedStateError

if TYPE_CHECKING:  # at run time these come through __getattr__ below (no import cycle)
    # one import, kept whole: "X as X" marks each name an explicit re-export for mypy
    # isort: off
    from ._chunked import (
        _FOOTER as _FOOTER,
        FOOTER_MAGIC as FOOTER_MAGIC,
        MAX_CHUNK_SIZE as MAX_CHUNK_SIZE,
        MIN_CHUNK_SIZE as MIN_CHUNK_SIZE,
        TAIL_READ as TAIL_READ,
        ChunkedState as ChunkedState,
        ChunkOptions as ChunkOptions,
        ChunkTarget as ChunkTarget,
        Identity as Identity,
        IndexEntry as IndexEntry,
        Resolver as Resolver,
        encode_chunked as encode_chunked,
        index_entries as index_entries,
        read_header as read_header,
    )
    from ._state_decode import (
        _alloc_arrays as _alloc_arrays,
        _Decoder as _Decoder,
        _dest_view as _dest_view,
        _view_ref as _view_ref,
        decode as decode,
        decode_stream as decode_stream,
        loads as loads,
    )
    from ._chunked_decode import (
        _check_entry as _check_entry,
        _Local as _Local,
        _plan_chunked as _plan_chunked,
        _Remote as _Remote,
    )
    from ._state_encode import (
        _Array as _Array,
        _bytes_view as _bytes_view,
        _Encoder as _Encoder,
        EncodedState as EncodedState,
        dumps as dumps,
        encode as encode,
        validate as validate,
    )
    # isort: on

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "EncodedState",
    "MAGIC",
    "SerializationError",
    "TensorRef",
    "UnsupportedStateError",
    "ViewRef",
    "decode",
    "decode_stream",
    "encode_chunked",
    "read_header",
    "dumps",
    "encode",
    "loads",
    "make_view",
    "validate",
]

MAGIC = b"OBJCKPT\x00"
FORMAT_NAME = "objckpt-state"
FORMAT_VERSION = 1
#: the version of a shard that holds a ViewRef (readers accept both)
VIEWS_FORMAT_VERSION = 2
#: the version whose header is a trailer and whose arrays are lists of chunks (dedup, codecs)
CHUNKED_FORMAT_VERSION = 3
_READABLE_VERSIONS = (FORMAT_VERSION, VIEWS_FORMAT_VERSION, CHUNKED_FORMAT_VERSION)
ALIGN = 64
#: a header larger than this is refused before it is parsed (hostile input)
MAX_HEADER_BYTES = 256 * 1024 * 1024
#: nesting deeper than this is refused (hostile input; real state dicts are a few levels deep)
MAX_DEPTH = 100

_PREFIX = struct.Struct("<8sQ")

# Only these dtypes may be named by a header: an allow-list, never getattr(torch, <header text>).
_TORCH_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex128",
    "complex64",
    "complex32",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)
_TORCH_DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _TORCH_DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {d: n for n, d in _TORCH_DTYPES.items()}
# numpy: plain numeric/bool dtypes with explicit byte order, e.g. "<f4", "|b1", "<u8", "<c16"
_NUMPY_DTYPE_RE = re.compile(r"^[<>|][biufc](1|2|4|8|16)$")


@dataclass(frozen=True)
class TensorRef:
    """A placeholder for a tensor stored in another shard (index ``i`` of a table the caller
    keeps); written as ``{"r": i}`` and decoded back to a ``TensorRef``."""

    index: int


@dataclass(frozen=True)
class ViewRef:
    """A tensor that is a view into tensor ``index`` of a table the caller keeps (another tensor
    over the same storage): ``dtype``, ``shape`` and ``stride`` (in elements) of the view, which
    starts ``offset`` bytes after the first byte of that tensor. Written as ``{"w": [...]}``;
    :func:`make_view` turns it back into a view."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def make_view(base: Any, ref: ViewRef) -> torch.Tensor:
    """The view ``ref`` describes, into the storage of the (contiguous) tensor ``base``.

    Raises:
        SerializationError: the view would reach outside ``base`` or is misaligned (a damaged or
            hostile shard: nothing outside ``base`` is ever read).
    """
    if not isinstance(base, torch.Tensor) or not base.is_contiguous():
        raise _fail(f"view {ref.index} refers to a {type(base).__name__} that is not a contiguous tensor")
    item = _itemsize(ref.dtype)
    start = base.storage_offset() * base.element_size() + ref.offset
    if start % item:
        raise _fail(f"view of tensor {ref.index} starts at byte {start}, not a multiple of {item}")
    if math.prod(ref.shape):
        end = ref.offset + (sum((n - 1) * st for n, st in zip(ref.shape, ref.stride, strict=True)) + 1) * item
        if end > base.numel() * base.element_size():
            raise _fail(
                f"view of tensor {ref.index} reaches byte {end}, past its {base.numel() * base.element_size()}"
            )
    out = torch.empty(0, dtype=ref.dtype, device=base.device)
    return out.set_(base.untyped_storage(), start // item, ref.shape, ref.stride)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ------------------------------------------------------------------ header checks (every decoder)


def _fail(msg: str) -> SerializationError:
    return SerializationError(f"invalid objckpt state shard: {msg}")


def _parse_prefix(prefix: bytes, total_size: int | None) -> int:
    magic: bytes
    header_len: int
    magic, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        hint = (
            " (looks like a pickle / torch.save file, which objckpt never loads)"
            if (magic[:1] == b"\x80" or magic[:2] == b"PK")
            else ""
        )
        raise _fail(f"bad magic {magic!r}{hint}")
    if header_len > MAX_HEADER_BYTES or (total_size is not None and _PREFIX.size + header_len > total_size):
        raise _fail(f"header length {header_len} exceeds the shard")
    return header_len


def _parse_header(raw: bytes, *, trailer: bool = False) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _fail("header is not a JSON object")
    if header.get("format") != FORMAT_NAME:
        raise _fail(f"unknown format {header.get('format')!r}")
    if header.get("version") not in _READABLE_VERSIONS:
        raise _fail(
            f"unsupported format version {header.get('version')!r} (this objckpt reads "
            f"{', '.join(map(str, _READABLE_VERSIONS))})"
        )
    if header.get("version") == CHUNKED_FORMAT_VERSION and header.get("header") == "trailer":
        return header  # the stub at the start of a version-3 shard: the header is at the end
    if header.get("version") == CHUNKED_FORMAT_VERSION and not trailer:
        raise _fail("a version-3 shard starts with a stub naming its trailer header")
    for name in ("tree", "arrays", "data_size"):
        if name not in header:
            raise _fail(f"header lacks {name!r}")
    if header.get("version") == CHUNKED_FORMAT_VERSION:
        for name in ("chunk_size", "hash"):
            if name not in header:
                raise _fail(f"header lacks {name!r}")
    return header


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


# Format version 3 lives in ._chunked / ._chunked_decode, formats 1-2 in ._state_encode /
# ._state_decode (each imports this module's primitives); their names stay importable from here,
# where callers have always found them, resolved on first use so that any of these modules can
# be imported first. Home module -> the names found here.
_REEXPORTED: dict[str, tuple[str, ...]] = {
    "_chunked": (
        "FOOTER_MAGIC", "MAX_CHUNK_SIZE", "MIN_CHUNK_SIZE", "TAIL_READ", "ChunkOptions", "ChunkTarget",
        "ChunkedState", "Identity", "IndexEntry", "Resolver", "encode_chunked", "index_entries",
        "read_header", "_FOOTER",
    ),
    "_chunked_decode": ("_Local", "_Remote", "_check_entry", "_plan_chunked"),
    "_state_encode": ("EncodedState", "_Array", "_bytes_view", "_Encoder", "dumps", "encode", "validate"),
    "_state_decode": ("_alloc_arrays", "_Decoder", "_dest_view", "_view_ref", "decode", "decode_stream", "loads"),
}  # fmt: skip
_HOME_OF = {name: home for home, names in _REEXPORTED.items() for name in names}


def __getattr__(name: str) -> Any:
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __package__), name)
        globals()[name] = value  # later lookups are plain module attributes
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
