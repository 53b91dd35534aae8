"""The optional codec (byte planes + zstd) and the ``auto`` policy: bounded, lossless, measured."""

from __future__ import annotations

import pytest
import torch

zstandard = pytest.importorskip("zstandard")

from objckpt.errors import SerializationError  # noqa: E402
from objckpt.training import codec  # noqa: E402

MiB = 1024 * 1024


def weights(n: int = 1 << 20, dtype: torch.dtype = torch.bfloat16) -> memoryview:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(n, generator=g) * 0.02).to(dtype)
    return memoryview(t.view(torch.uint8).numpy())


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bp2+zstd"), (torch.float32, "bp4+zstd")])
def test_lossless_and_smaller_on_float_weights(dtype: torch.dtype, name: str) -> None:
    view = weights(dtype=dtype)
    assert codec.codec_for(str(dtype).removeprefix("torch."), dtype.itemsize) == name
    packed = codec.compress(view, name)
    assert len(packed) < view.nbytes * 0.95
    out = memoryview(bytearray(view.nbytes))
    codec.decompress(packed, name, view.nbytes, out)
    assert bytes(out) == bytes(view)


def test_decompression_is_bounded_by_the_declared_length() -> None:
    zeros = codec.compress(memoryview(bytes(4 * MiB)), "zstd")  # a tiny frame of 4 MiB
    with pytest.raises(SerializationError):
        codec.decompress(zeros, "zstd", 1024, memoryview(bytearray(1024)))  # never 4 MiB
    with pytest.raises(SerializationError, match="unknown codec"):
        codec.decompress(zeros, "gzip", 1024, memoryview(bytearray(1024)))
    with pytest.raises(SerializationError):
        codec.decompress(b"not zstd", "zstd", 1024, memoryview(bytearray(1024)))


def test_integers_and_small_chunks_are_never_compressed() -> None:
    policy = codec.CompressionPolicy("zstd")
    assert policy.codec("int64", 8, 4 * MiB) is None and policy.codec("bool", 1, 4 * MiB) is None
    assert policy.codec("float32", 4, 1024) is None
    assert codec.CompressionPolicy(None).codec("float32", 4, 4 * MiB) is None


def test_auto_compresses_a_class_only_when_it_shortens_the_save() -> None:
    view = weights(n=2 << 20)  # 4 MiB of bf16
    fast = codec.CompressionPolicy("auto", bandwidth=1e13)  # a link far faster than the codec
    slow = codec.CompressionPolicy("auto", bandwidth=1e6)  # 1 MB/s: every saved byte counts
    for policy in (fast, slow):
        for _ in range(policy.probe_chunks):  # the probe: the first chunks of a class are tried
            name = policy.codec("bfloat16", 2, view.nbytes)
            assert name == "bp2+zstd"
            policy.try_compress(view, name)
    assert fast.codec("bfloat16", 2, view.nbytes) is None
    assert slow.codec("bfloat16", 2, view.nbytes) == "bp2+zstd"
    assert 0 < slow.describe()["bp2+zstd"]["ratio"] < 1
