"""CRC32C helpers (Castagnoli), the checksum S3 and GCS both verify server-side.

Values travel as base64 of the 4-byte big-endian digest, which is the wire format of both
S3's ``x-amz-checksum-crc32c`` and GCS's ``crc32c`` metadata.
"""

from __future__ import annotations

import base64
import struct
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
