"""CRC32C helpers (Castagnoli), the checksum S3 and GCS both verify server-side.

Values travel as base64 of the 4-byte big-endian digest, which is the wire format of both
S3's ``x-amz-checksum-crc32c`` and GCS's ``crc32c`` metadata.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterable
from typing import Any, Union

import google_crc32c  # hardware-accelerated C implementation; pure-Python fallback built in

Buffer = Union[bytes, bytearray, memoryview]


_buffer_crc32c: Any
try:  # ICRAR's crc32c reads any buffer in place; google-crc32c's C API takes only bytes
    import crc32c as _buffer_crc32c
except ImportError:  # pragma: no cover - optional speed-up
    _buffer_crc32c = None

_COPY_CHUNK = 1 << 20


def crc32c_update(crc: int, data: Buffer) -> int:
    """Extend a running CRC32C value with ``data`` (bytes, bytearray or memoryview).

    Never copies more than 1 MiB at a time, so checksumming a tensor's memory stays within
    the memory bound of a streamed upload.
    """
    if isinstance(data, bytes):
        return int(google_crc32c.extend(crc, data))
    if _buffer_crc32c is not None:
        return int(_buffer_crc32c.crc32c(data, crc))
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, _COPY_CHUNK):
        crc = int(google_crc32c.extend(crc, view[start : start + _COPY_CHUNK].tobytes()))
    return crc


def crc32c_of(data: Buffer) -> int:
    return crc32c_update(0, data)


def encode_crc32c(crc: int) -> str:
    return base64.b64encode(struct.pack(">I", crc & 0xFFFFFFFF)).decode("ascii")


def decode_crc32c(value: str) -> int:
    raw = base64.b64decode(value, validate=True)
    if len(raw) != 4:
        raise ValueError(f"not a CRC32C digest: {value!r}")
    return int(struct.unpack(">I", raw)[0])


def crc32c_b64(data: Buffer) -> str:
    """The base64 CRC32C of ``data``: what S3/GCS expect in a checksum header."""
    return encode_crc32c(crc32c_of(data))


class Crc32c:
    """Incremental CRC32C of a stream, fed chunk by chunk."""

    __slots__ = ("value", "size")

    def __init__(self) -> None:
        self.value = 0
        self.size = 0

    def update(self, data: Buffer) -> None:
        self.value = crc32c_update(self.value, data)
        self.size += memoryview(data).nbytes

    @property
    def b64(self) -> str:
        return encode_crc32c(self.value)


# --------------------------------------------------------------------------- combine
#
# crc(A || B) from crc(A), crc(B) and len(B), without reading A or B again: the algorithm of
# zlib's crc32_combine (1.2.12+), over the reflected Castagnoli polynomial. Appending len(B)
# zero bytes to A multiplies its CRC by x^(8 len(B)) modulo P; the powers x^(2^k) mod P are
# tabulated once, so a combine costs O(log len) carry-less products of 32-bit values.

_POLY = 0x82F63B78  # CRC32C, reflected


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo P(x), both reflected."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _power_table() -> list[int]:
    table, p = [], 1 << 30  # x^1
    for _ in range(64):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _power_table()  # _X2N[k] = x^(2^k) mod P


def _x8nmodp(n: int) -> int:
    """x^(8n) mod P: the factor that shifts a CRC past n zero bytes."""
    p, k = 1 << 31, 3  # x^0; start at x^(2^3) = one byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``A || B`` given ``crc(A)``, ``crc(B)`` and ``len(B)``; no byte is read."""
    if len_b < 0:
        raise ValueError(f"negative length {len_b}")
    if len_b == 0:
        return crc_a
    return _multmodp(_x8nmodp(len_b), crc_a) ^ crc_b


def crc32c_concat(pieces: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """``(crc, size)`` of the concatenation of pieces given as ``(crc, size)``, in order."""
    crc = size = 0
    for piece_crc, piece_size in pieces:
        crc = crc32c_combine(crc, piece_crc, piece_size)
        size += piece_size
    return crc, size
