"""What S3 requests and answers carry besides the bytes: request bodies sent without copying,
and the ETag and checksum values of answers.

Bodies: small ones as bytes, larger ones through a seekable reader over the caller's buffers
(one memoryview, or several for a part that spans tensors), so a part is never assembled or
copied. Answers: ETags compared in one quoted form, a CRC32C reported only when it is the
full-object value (never a composite), and the ETag S3 gives a multipart object (to recognise a
completion whose answer was lost). No SDK is imported here.
"""

from __future__ import annotations

import hashlib
import io
import re

from ._util import BuffersReader, ViewReader
from .base import MiB

_MULTIPART_ETAG = re.compile(r"-\d+\"?$")


#: bodies up to this size are sent as bytes (one small copy); larger ones through ViewReader.
#: botocore adds ``Expect: 100-continue`` to file-like bodies, which costs a round trip that
#: small writes (pointer, manifests) should not pay, and saves re-sending large ones when the
#: server rejects the request up front.
_SMALL_BODY = 1 * MiB


def _body(data: memoryview) -> bytes | ViewReader:
    return data.tobytes() if data.nbytes <= _SMALL_BODY else ViewReader(data)


def _body_of(buffers: list[memoryview], size: int) -> bytes | io.RawIOBase:
    if len(buffers) == 1:
        return _body(buffers[0])
    if size <= _SMALL_BODY:
        return b"".join(buffers)
    return BuffersReader(buffers)


def _quoted(etag: str | None) -> str:
    """ETags are compared as the server sends them: one canonical quoted form."""
    if not etag:
        return ""
    return etag if etag.startswith(('"', "W/")) else f'"{etag}"'


def _full_crc(value: str | None, checksum_type: str | None, etag: str | None = None) -> str | None:
    """The full-object CRC32C, or ``None`` when it may be a composite (checksum-of-checksums).

    A multipart object's checksum is only trusted when the server says FULL_OBJECT: some
    servers (moto 5.2.5) send a composite value without its ``-N`` suffix or a type.
    """
    kind = (checksum_type or "").upper()
    if not value or "-" in value or kind == "COMPOSITE":
        return None
    if _MULTIPART_ETAG.search(etag or "") and kind != "FULL_OBJECT":
        return None
    return value


def multipart_etag(part_etags: list[str]) -> str:
    """The ETag S3 gives a multipart object: MD5 of the parts' binary MD5s, ``-<count>``."""
    digest = hashlib.md5(usedforsecurity=False)
    for etag in part_etags:
        digest.update(bytes.fromhex(etag.strip('"')))
    return f'"{digest.hexdigest()}-{len(part_etags)}"'


__all__ = ["multipart_etag"]
