"""Restoring a format 1/2 shard by ranged reads straight into its staged arrays' memory.

The streaming path (:func:`.serialization.decode_stream` over ``Reader.open_shard``) copies
every byte out of the chunks the store delivers; on S3 those are part-sized ranges read ahead
in parallel, so a restore held ``read_concurrency + 1`` parts on top of the staged state (1.43x
the state at 512 MiB on LocalStack, BENCHMARKS.md section 5). Here, for one shard:

1. **Probe**: one ranged GET of the first :data:`PROBE_BYTES` (the prefix and, usually, the
   whole header). A longer header is read by one more GET of exactly its declared length,
   which :func:`._parse_prefix` checked against the receipt's size first.
2. **Allocate**: the header is parsed and every size it declares is checked against the
   receipt before the arrays are allocated (:func:`._state_decode.allocate_for`, the streaming
   decoder's own check): invariant 11.
3. **Read**: the rest of the shard in ranges of at most ``part_size``, at most ``window`` at a
   time, each by one ``Store.get_into`` straight into the arrays' memory; only the alignment
   padding between arrays lands in a (per-range, < 64 bytes an array) scratch buffer. Each
   destination is handed to the store in slices of at most :data:`SLICE_BYTES`: the S3 client
   receives every buffer through a temporary of that buffer's size (urllib3's ``readinto``),
   so the slices, not the ranges, bound what it allocates.
4. **Verify**: every byte's CRC32C is computed exactly once (the probe, the rest of the
   header, each range on the thread that read it), the pieces are combined in order
   (:func:`objckpt._crc.crc32c_combine`, no byte read again) and the result is compared with
   the receipt. Only then is the tree built.

Extra memory: the probe (and a header longer than it) and the tail, plus per range in flight
its padding scratch and what the store needs to receive it. Where the backend receives into
memory that is at most one slice's temporaries (``S3Store``: urllib3's ``readinto``;
``LocalStore``'s ``preadv``: none); where ``get_into`` falls back to the default
``Store._read_into`` over ``_open`` it is the whole range, up to ``part_size`` (a backend or
wrapper without its own ``_read_into``; ``PrefixStore``, which every s3:// run root with a
prefix is, ``CountingStore`` and ``FaultInjectingStore`` forward it). Never more than ``window x part_size``, whatever the shard's size.

Format 3 (:mod:`._chunked`, what a deduplicating save writes): the probe holds the stub, the
header and footer at the end are read by :func:`._chunked.read_header` (checked against the
footer's CRC32C), planned and checked by :func:`._chunked_decode._plan_chunked` before
allocation, the shard's own chunks are read by ranges into place as above, and the ranges it
references in ancestors' objects follow (:func:`._chunked_decode._resolve_remote`, each
chunk checked against its own CRC32C). The header's bytes are checksummed twice (its footer's
CRC32C and the object's); every other byte once.

Which path (:func:`ranged_applies`, one rule): a shard larger than one part is read by ranges;
a smaller one streams (one GET either way, and the probe would be a second). A format-3 shard
with compressed local chunks (decompressed from the stream) returns ``None`` after its header
was read: the caller streams it (two small GETs more).

Atomicity: the arrays are freshly allocated and reachable only from the returned tree; a
failure leaves them unreferenced, nothing live is touched.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _crc, layout
from ..errors import ChecksumMismatchError
from ..manifest import ShardReceipt
from ..reader import SLICE_BYTES, read_ranges_into
from ..store.base import Store
from ._chunked import Resolver, read_header
from ._chunked_decode import _plan_chunked, _resolve_remote
from ._state_decode import allocate_for
from .serialization import (
    _PREFIX,
    CHUNKED_FORMAT_VERSION,
    _Decoder,
    _dest_view,
    _fail,
    _parse_header,
    _parse_prefix,
)

try:  # numpy is optional: without it numpy arrays simply cannot appear in a state
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = ["PROBE_BYTES", "SLICE_BYTES", "decode_ranged", "ranged_applies"]

#: the first read of a shard: its prefix and, for all but very large trees, its whole header
PROBE_BYTES = 64 * 1024


def ranged_applies(store: Store, receipt: ShardReceipt) -> bool:
    """Whether ``receipt``'s shard is read by ranges (:func:`decode_ranged`): it is larger than
    one of the store's parts, so the stream would be several parts read ahead."""
    return receipt.size > store.part_size


def decode_ranged(
    store: Store,
    receipt: ShardReceipt,
    *,
    resolver: Resolver | None = None,
    on_header: Callable[[dict[str, Any]], None] | None = None,
) -> Any | None:
    """Decode the shard of ``receipt`` by ranged reads into its arrays (module doc). ``None``
    when it is a format-3 shard this path does not read (compressed local chunks, or so small
    that the probe and the tail read overlap): the caller streams it instead. ``resolver`` and ``on_header`` as
    for :func:`.serialization.decode_stream`. Reads only.

    Raises:
        ChecksumMismatchError: the bytes read differ from the receipt (CRC32C), or the object is
            shorter than it.
        SerializationError: a malformed or hostile header (refused before any allocation).
        NotFoundError: the shard is gone.
    """
    layout.validate_key_in_root(receipt.key)
    key, total = receipt.key, receipt.size
    probe = _read_exact(store, key, 0, min(total, PROBE_BYTES))
    if len(probe) < _PREFIX.size:
        raise _fail(f"truncated: the shard has {len(probe)} bytes, fewer than its prefix")
    header_len = _parse_prefix(probe[: _PREFIX.size], total)
    header_end = _PREFIX.size + header_len
    if header_end > len(probe):  # the size was checked against the receipt just above
        rest = _read_exact(store, key, len(probe), header_end)
        head, raw = probe + rest, probe[_PREFIX.size :] + rest
    else:
        head, raw = probe, probe[_PREFIX.size : header_end]
    header = _parse_header(raw)
    if header.get("version") == CHUNKED_FORMAT_VERSION:
        return _decode_chunked(store, receipt, probe, header_end, resolver, on_header)
    arrays, targets, _ = allocate_for(header, header_end, total)
    spans = [(start, nbytes) for start, nbytes, _ in targets]
    dests = [_dest_view(arr) for _, _, arr in targets]
    _fill(store, receipt, head, total, b"", spans, dests)
    # the tree last: numpy scalars are read out of their (now verified) arrays
    return _Decoder(arrays, header["version"]).node(header["tree"], 0)


def _decode_chunked(
    store: Store,
    receipt: ShardReceipt,
    probe: bytes,
    data_start: int,
    resolver: Resolver | None,
    on_header: Callable[[dict[str, Any]], None] | None,
) -> Any | None:
    """A format-3 shard: its header (at its end, checked against its footer's CRC32C) planned
    and checked against the receipts before allocation, its own chunks read by ranges into
    place, then the ranges it references in ancestors' objects (:func:`._resolve_remote`)."""
    key, total = receipt.key, receipt.size
    tails: dict[int, bytes] = {}  # start -> bytes of each read_header made

    def read_range(start: int, end: int) -> bytes:
        tails[start] = _read_exact(store, key, start, end)
        return tails[start]

    got = read_header(read_range, total)
    if got is None:
        raise _fail("version-3 shard without a footer")
    header, header_at = got
    specs, local, remote = _plan_chunked(header, data_start, header_at, resolver)
    if any(c.codec is not None for c in local):
        return None  # compressed chunks are decompressed from the stream
    # what read_header read: one tail read (the header, the footer and the data before them), or
    # the header's own read and the tail's for the footer; its data bytes are copied from it
    tail_at = max(tails)
    if header_at >= tail_at:
        tail_start, tail = tail_at, tails[tail_at]
    else:
        own = tails[header_at]
        tail_start, tail = header_at, own + tails[tail_at][header_at + len(own) - tail_at :]
    if tail_start < len(probe):
        return None  # the probe and the tail overlap: a shard this small streams
    arrays = [
        torch.empty(shape, dtype=dt) if kind == "torch" else np.empty(shape, dtype=dt)
        for kind, dt, shape in specs
    ]
    views = [_dest_view(arr) for arr in arrays]
    spans = [(c.at, c.stored) for c in local]
    dests = [views[c.array][c.offset : c.offset + c.length] for c in local]
    _fill(store, receipt, probe, tail_start, tail, spans, dests)
    if remote:
        _resolve_remote(remote, views, resolver)
    if on_header is not None:
        on_header(header)
    return _Decoder(arrays, CHUNKED_FORMAT_VERSION).node(header["tree"], 0)


def _fill(
    store: Store,
    receipt: ShardReceipt,
    head: bytes,
    tail_start: int,
    tail: bytes,
    spans: list[tuple[int, int]],
    dests: list[memoryview],
) -> None:
    """Put the bytes of ``spans`` (absolute ``(start, nbytes)``, sorted, disjoint) into ``dests``:
    those that ``head`` (bytes ``[0, len(head))``) and ``tail`` (bytes ``[tail_start, size)``),
    both already read, hold are copied from them; ``[len(head), tail_start)`` is read by ranges
    straight into place. Then the CRC32C of ``head``, the ranges and ``tail``, combined, must be
    the receipt's.

    Raises:
        ChecksumMismatchError: a short read, or the combined CRC32C differs from the receipt's.
    """
    key = receipt.key
    starts = [start for start, _ in spans]
    for base, held in ((0, head), (tail_start, tail)):
        for pos, n, si, offset in _segments(spans, starts, base, base + len(held)):
            if si is not None:
                dests[si][offset : offset + n] = held[pos - base : pos - base + n]
    crc = _crc.crc32c_of(head)
    for range_crc, size in _read_ranges(store, key, spans, starts, dests, len(head), tail_start):
        crc = _crc.crc32c_combine(crc, range_crc, size)
    crc = _crc.crc32c_combine(crc, _crc.crc32c_of(tail), len(tail))
    got = _crc.encode_crc32c(crc)
    if got != receipt.crc32c:
        raise ChecksumMismatchError(
            f"CRC32C mismatch: read {got}, receipt says {receipt.crc32c}", key=key, location=store.location
        )


def _read_exact(store: Store, key: str, start: int, end: int) -> bytes:
    data = store.get(key, byte_range=(start, end))
    if len(data) != end - start:
        raise ChecksumMismatchError(
            f"ranged read [{start}, {end}) returned {len(data)} bytes (shard truncated?)",
            key=key,
            location=store.location,
        )
    return data


def _segments(
    spans: list[tuple[int, int]], starts: list[int], begin: int, end: int
) -> Iterator[tuple[int, int, int | None, int]]:
    """Bytes ``[begin, end)`` of the shard as ``(position, size, span index or None for bytes
    outside every span, offset in that span)``, in order."""
    ti = max(0, bisect_right(starts, begin) - 1)
    pos = begin
    while pos < end:
        if ti < len(spans):
            start, nbytes = spans[ti]
            if pos >= start + nbytes:
                ti += 1
                continue
            if pos < start:
                stop = min(start, end)
                yield pos, stop - pos, None, 0
                pos = stop
                continue
            stop = min(start + nbytes, end)
            yield pos, stop - pos, ti, pos - start
            pos = stop
        else:
            yield pos, end - pos, None, 0
            pos = end


def _read_ranges(
    store: Store,
    key: str,
    spans: list[tuple[int, int]],
    starts: list[int],
    dests: list[memoryview],
    begin: int,
    end: int,
) -> Iterator[tuple[int, int]]:
    """``(crc, size)`` of each range of ``[begin, end)``, in order (:func:`reader.read_ranges_into`),
    each received straight into the tensors it covers (gaps between arrays into scratch)."""

    def views_of(start: int, stop: int) -> list[memoryview]:
        views: list[memoryview] = []
        for _, n, ti, offset in _segments(spans, starts, start, stop):
            whole = dests[ti][offset : offset + n] if ti is not None else memoryview(bytearray(n))
            views.extend(whole[i : i + SLICE_BYTES] for i in range(0, n, SLICE_BYTES))
        return views

    yield from read_ranges_into(store, key, begin, end, views_of, name="objckpt-restore-range")
