"""Lossless compression of tensor bytes: byte-plane split + zstd (optional, off by default).

Floating-point weights and optimizer moments compress badly as they are (the mantissa bytes are
close to random) but their sign/exponent bytes are highly redundant. Splitting each element's
bytes into planes (all first bytes, then all second bytes, ...) puts the redundant bytes next to
each other, and zstd then finds them (the scheme zipnn and "byte grouping" papers use; measured
in ``benchmarks/DEDUP.md``).

A codec is named by a short string stored with each chunk in the shard header, so a reader
never guesses: ``bp2+zstd`` (2-byte planes: bf16/fp16), ``bp4+zstd`` (fp32), ``bp8+zstd``,
``zstd`` (no split). Decompression is bounded: the output must be exactly the chunk's declared
length, nothing larger is ever allocated (invariant 11).

:class:`CompressionPolicy` decides per tensor class (dtype) whether compressing pays:
``"zstd"`` always compresses large float chunks, ``"auto"`` only when the measured ratio and
throughput make the save shorter at the measured upload bandwidth (the previous save's), and
``None`` never. CRC32C and content hashes are always over the uncompressed bytes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, SerializationError

__all__ = [
    "CODECS",
    "CompressionPolicy",
    "available",
    "codec_for",
    "compress",
    "decompress",
]

try:  # optional: the ``compression=`` option needs it
    import zstandard as _zstd
except ImportError:  # pragma: no cover - exercised where zstandard is not installed
    _zstd = None  # type: ignore[assignment]

#: names a header may carry (an allow-list; anything else is damage)
CODECS = ("zstd", "bp2+zstd", "bp4+zstd", "bp8+zstd")
MODES = (None, "zstd", "auto")
#: zstd level: 1 is the fastest; higher levels gain ~1-2% on float planes at 2-4x the CPU
LEVEL = 1
#: compress only chunks at least this large (small tensors: the header costs more than it saves)
MIN_BYTES = 64 * 1024
#: a chunk is kept compressed only when it shrinks by at least this fraction
MIN_GAIN = 0.03

_local = threading.local()


def available() -> bool:
    return _zstd is not None


def _compressor() -> Any:
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = _zstd.ZstdCompressor(level=LEVEL, write_content_size=True)
    return c


def _decompressor() -> Any:
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = _zstd.ZstdDecompressor()
    return d


def codec_for(dtype_name: str, itemsize: int) -> str | None:
    """The codec for a tensor class, or None where compression is pointless (integers, bool,
    8-bit floats: their bytes are already packed or are indices)."""
    if dtype_name in ("float16", "bfloat16", "complex32", "<f2", "<c4"):
        return "bp2+zstd"
    if dtype_name in ("float32", "complex64", "<f4", "<c8"):
        return "bp4+zstd"
    if dtype_name in ("float64", "complex128", "<f8", "<c16"):
        return "bp8+zstd"
    return None


def _planes(codec: str) -> int:
    return int(codec[2]) if codec.startswith("bp") else 1


def compress(view: memoryview, codec: str) -> bytes:
    """``view``'s bytes under ``codec``."""
    import torch

    k = _planes(codec)
    if k > 1 and view.nbytes % k == 0:
        flat = torch.frombuffer(view, dtype=torch.uint8)
        data: Any = flat.view(-1, k).t().contiguous().numpy().data
    else:
        data = view
    return bytes(_compressor().compress(data))


def decompress(stored: memoryview | bytes | bytearray, codec: str, length: int, out: memoryview) -> None:
    """Decode ``stored`` into ``out`` (exactly ``length`` bytes).

    Raises:
        SerializationError: unknown codec, or the stored bytes do not decode to ``length``
            bytes (damage; nothing larger than ``length`` is allocated).
    """
    import torch

    if codec not in CODECS:
        raise SerializationError(f"invalid objckpt state shard: unknown codec {codec!r}")
    if _zstd is None:
        raise ConfigError("this checkpoint is compressed: install zstandard (pip install zstandard)")
    try:
        raw = _decompressor().decompress(bytes(stored), max_output_size=length)
    except _zstd.ZstdError as exc:
        raise SerializationError(
            f"invalid objckpt state shard: compressed chunk does not decode ({exc})"
        ) from None
    if len(raw) != length:
        raise SerializationError(
            f"invalid objckpt state shard: compressed chunk decodes to {len(raw)} bytes, not {length}"
        )
    k = _planes(codec)
    if k > 1 and length % k == 0:
        planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(k, -1)
        dest = torch.frombuffer(out, dtype=torch.uint8).view(-1, k)
        dest.copy_(planes.t())
    else:
        out[:length] = raw


@dataclass
class _ClassStats:
    raw: int = 0
    stored: int = 0
    seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.stored / self.raw if self.raw else 1.0

    @property
    def throughput(self) -> float:
        return self.raw / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class CompressionPolicy:
    """Whether to compress a chunk of a tensor class; learns from what it compressed.

    ``mode``: ``None`` (never), ``"zstd"`` (every float chunk that shrinks by ``MIN_GAIN``), or
    ``"auto"``: compress a class only when ``max(raw/throughput, ratio*raw/bandwidth)`` (the
    codec runs ahead of the upload, so the slower of the two sets the pace) is shorter than
    ``raw/bandwidth``, with ``bandwidth`` the previous save's measured upload rate. Before any
    save has been measured, auto compresses a probe (the first chunks of each class) to learn
    ratio and throughput, and keeps them only if they help at the bandwidth it then assumes
    (``assumed_bandwidth``, default 1 GB/s: a fast link, where compression rarely pays).
    """

    mode: str | None = None
    assumed_bandwidth: float = 1e9
    #: measured upload bandwidth of the last save (bytes/s); set by the manager after each save
    bandwidth: float | None = None
    stats: dict[str, _ClassStats] = field(default_factory=dict)
    probe_chunks: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"compression must be one of {MODES}, got {self.mode!r}")
        if self.mode is not None and _zstd is None:
            raise ConfigError("compression needs zstandard: pip install zstandard")

    @property
    def enabled(self) -> bool:
        return self.mode is not None

    def codec(self, dtype_name: str, itemsize: int, nbytes: int) -> str | None:
        """The codec to try for a chunk of ``nbytes`` of this class, or None."""
        if self.mode is None or nbytes < MIN_BYTES:
            return None
        codec = codec_for(dtype_name, itemsize)
        if codec is None or self.mode == "zstd":
            return codec
        with self._lock:
            s = self.stats.get(codec)
            if s is None or s.raw < self.probe_chunks * nbytes:
                return codec  # still probing this class
            return codec if self._pays(s) else None

    def _pays(self, s: _ClassStats) -> bool:
        bw = self.bandwidth or self.assumed_bandwidth
        plain = 1.0 / bw
        packed = max(1.0 / s.throughput, s.ratio / bw)
        return packed < plain

    def record(self, codec: str, raw: int, stored: int, seconds: float) -> None:
        with self._lock:
            s = self.stats.setdefault(codec, _ClassStats())
            s.raw += raw
            s.stored += stored
            s.seconds += seconds

    def try_compress(self, view: memoryview, codec: str) -> bytes | None:
        """``view`` compressed, or None when it does not shrink enough (kept raw)."""
        t = time.perf_counter()
        out = compress(view, codec)
        self.record(codec, view.nbytes, len(out), time.perf_counter() - t)
        return out if len(out) <= view.nbytes * (1 - MIN_GAIN) else None

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {
                c: {"ratio": round(s.ratio, 4), "throughput_MBps": round(s.throughput / 1e6, 1)}
                for c, s in self.stats.items()
            }
