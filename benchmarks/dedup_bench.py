"""Write only what changed: bytes per checkpoint with deduplication, its cost on a fully changing
save, the hash, the chunk size, and optional compression per tensor class of a trained model.

    .venv/bin/python -m benchmarks.dedup_bench            # full (~20-30 min on 2 busy cores)
    .venv/bin/python -m benchmarks.dedup_bench --quick    # smoke (a few minutes)
    .venv/bin/python -m benchmarks.dedup_bench --skip moto --legs full,compress

Legs:

* ``train``: a small transformer language model (byte-level, on this repository's own source
  text) trained for a few hundred AdamW steps, so weights and moments have real statistics;
* ``compress``: ratio and throughput of the lossless codecs on its fp32 and bf16 weights and its
  Adam moments (byte-plane split + zstd as objckpt does it, plain zstd, zipnn when installed);
* ``hash``: throughput of the candidate chunk hashes (xxh3-128, blake3, blake2b-128) and CRC32C;
* ``chunk``: bytes written and header size by chunk size when a sparse part of a tensor changes;
* ``lora``: a frozen base and a small LoRA adapter trained between saves: bytes written per
  checkpoint after the first vs the full state (goal <= 1%);
* ``embed``: pretraining with frozen embeddings: bytes written vs the changed fraction (goal <=
  changed fraction + 2%);
* ``full``: a fully changing state saved with dedup on and off, interleaved, on file:// and
  moto: median and min-max save time (goal: no slowdown > 3%).

Bytes are exact counts; times are medians of interleaved runs in one process (drift on a shared
machine hits both sides alike). Writes ``benchmarks/DEDUP.md`` (a section for BENCHMARKS.md) and
``build/dedup.json`` (the raw results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # python benchmarks/dedup_bench.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, Series, machine_info  # noqa: E402

MiB = 1024 * 1024
OUT_MD = REPO / "benchmarks" / "DEDUP.md"
OUT_JSON = REPO / "build" / "dedup.json"  # the raw results (not committed); legs not re-run keep theirs


# ------------------------------------------------------------------------------ the model


def corpus() -> bytes:
    """This repository's Python sources: real text, deterministic."""
    files = sorted((REPO / "objckpt").rglob("*.py"))
    return b"\n".join(p.read_bytes() for p in files)


def tiny_lm(d: int = 256, layers: int = 4, ff: int = 1024, ctx: int = 64) -> Any:
    import torch

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(256, d)
            self.pos = torch.nn.Parameter(torch.zeros(ctx, d))
            layer = torch.nn.TransformerEncoderLayer(d, 4, ff, dropout=0.0, batch_first=True)
            self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, 256, bias=False)

        def forward(self, x: Any) -> Any:
            n = x.shape[1]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
            h = self.body(self.embed(x) + self.pos[:n], mask=mask, is_causal=True)
            return self.head(self.norm(h))

    return LM()


def train(steps: int, *, batch: int = 16, ctx: int = 64, seed: int = 0) -> tuple[Any, Any, list[float]]:
    """The LM trained for ``steps`` AdamW steps; returns (model, optimizer, losses)."""
    import torch

    torch.manual_seed(seed)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    model = tiny_lm(ctx=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
        x = torch.stack([data[i : i + ctx] for i in idx])
        y = torch.stack([data[i + 1 : i + ctx + 1] for i in idx])
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return model, opt, losses


# ------------------------------------------------------------------------------ compression


def _flat(tensors: list[Any]) -> memoryview:
    import torch

    return memoryview(torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors]).numpy())


Codec = tuple[Callable[[], list[bytes]], Callable[[list[bytes]], None]]


def _bp_codec(pieces: list[memoryview], level: int, name: str) -> Codec:
    """objckpt's codec (byte planes + zstd) at a zstd ``level``."""
    import torch
    import zstandard

    from objckpt.training import codec

    comp = zstandard.ZstdCompressor(level=level)
    k = int(name[2])

    def enc() -> list[bytes]:
        return [
            comp.compress(torch.frombuffer(p, dtype=torch.uint8).view(-1, k).t().contiguous().numpy())
            for p in pieces
        ]

    def dec(blobs: list[bytes]) -> None:
        for b, p in zip(blobs, pieces, strict=True):
            codec.decompress(b, name, p.nbytes, memoryview(bytearray(p.nbytes)))

    return enc, dec


def _plain_codec(pieces: list[memoryview], level: int) -> Codec:
    import zstandard

    comp, de = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()

    def dec(blobs: list[bytes]) -> None:
        for b in blobs:
            de.decompress(b)

    return (lambda: [comp.compress(p) for p in pieces]), dec


def _zipnn_codec(pieces: list[memoryview], zn: Any) -> Codec:
    def dec(blobs: list[bytes]) -> None:
        for b in blobs:
            zn.decompress(b)

    return (lambda: [zn.compress(bytes(p)) for p in pieces]), dec


def compression_rows(model: Any, opt: Any, runs: int) -> list[dict[str, Any]]:
    import torch

    from objckpt.training import codec

    params = [p for p in model.parameters() if p.numel() >= 4096]
    moments = [opt.state[p] for p in params if p in opt.state]
    classes = {
        "fp32 weights": [p.detach() for p in params],
        "bf16 weights": [p.detach().bfloat16() for p in params],
        "Adam exp_avg (fp32)": [m["exp_avg"] for m in moments],
        "Adam exp_avg_sq (fp32)": [m["exp_avg_sq"] for m in moments],
    }
    try:
        import zipnn  # type: ignore[import-not-found]
    except ImportError:  # pragma: no cover
        zipnn = None
    rows = []
    chunk = 4 * MiB
    for name, tensors in classes.items():
        view = _flat(tensors)
        dtype = "bfloat16" if tensors[0].dtype == torch.bfloat16 else "float32"
        ours = codec.codec_for(dtype, tensors[0].element_size())
        assert ours is not None
        pieces = [view[i : i + chunk] for i in range(0, view.nbytes, chunk)]
        candidates: dict[str, Codec] = {
            f"byte planes + zstd-1 (objckpt `{ours}`)": _bp_codec(pieces, 1, ours),
            "byte planes + zstd-3": _bp_codec(pieces, 3, ours),
            "zstd-1 (no split)": _plain_codec(pieces, 1),
        }
        if zipnn is not None:
            zn = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
            candidates["zipnn 0.5 (1 thread)"] = _zipnn_codec(pieces, zn)
        for label, (enc, dec) in candidates.items():
            ct, dt, size = Series(), Series(), 0
            for _ in range(runs):
                t = time.perf_counter()
                blobs = enc()
                ct.values.append(view.nbytes / (time.perf_counter() - t) / 1e6)
                size = sum(len(b) for b in blobs)
                t = time.perf_counter()
                dec(blobs)
                dt.values.append(view.nbytes / (time.perf_counter() - t) / 1e6)
            rows.append(
                {
                    "class": name,
                    "MiB": round(view.nbytes / MiB, 1),
                    "codec": label,
                    "ratio": round(size / view.nbytes, 4),
                    "compress_MBps": round(ct.median, 1),
                    "decompress_MBps": round(dt.median, 1),
                }
            )
    return rows


# ------------------------------------------------------------------------------ hash, chunk


def hash_rows(runs: int) -> list[dict[str, Any]]:
    import hashlib

    import numpy as np
    import xxhash

    from objckpt._crc import crc32c_of

    buf = memoryview(np.random.default_rng(0).standard_normal(64 * MiB // 4).astype(np.float32)).cast("B")
    pieces = [buf[i : i + 4 * MiB] for i in range(0, buf.nbytes, 4 * MiB)]
    fns: dict[str, Callable[[memoryview], Any]] = {
        "xxh3-128 (chosen)": xxhash.xxh3_128_digest,
        "blake2b-128 (stdlib fallback)": lambda b: hashlib.blake2b(b, digest_size=16).digest(),
        "CRC32C (what every part costs already)": crc32c_of,
    }
    try:
        import blake3

        fns["blake3 (1 thread)"] = lambda b: blake3.blake3(b).digest()
    except ImportError:  # pragma: no cover
        pass
    rows = []
    for name, fn in fns.items():
        s = Series()
        for _ in range(runs):
            t = time.perf_counter()
            for p in pieces:
                fn(p)
            s.values.append(buf.nbytes / (time.perf_counter() - t) / 1e9)
        rows.append(
            {"function": name, "GBps": round(s.median, 2), "lo": round(s.lo, 2), "hi": round(s.hi, 2)}
        )
    return rows


def chunk_rows(tensor_mib: int = 64) -> list[dict[str, Any]]:
    """An embedding table of ``tensor_mib`` MiB where part of its rows change between saves, at
    several chunk sizes: bytes written by the second save, its header, its save time. Two
    patterns: a contiguous block of 5% of the rows (new or fine-tuned tokens), and 0.1% of the
    rows at random (sparse updates: no chunk size helps much there)."""
    import torch

    from objckpt.store.memory import MemoryStore
    from objckpt.training import dedup
    from objckpt.training.manager import CheckpointManager

    rows = []
    saved = dedup.CHUNK_SIZE
    width = 1024
    n = tensor_mib * MiB // 4 // width
    patterns = {
        "contiguous 5% of rows": torch.arange(n // 2, n // 2 + n // 20),
        "random 0.1% of rows": torch.randperm(n, generator=torch.Generator().manual_seed(1))[: n // 1000],
    }
    try:
        for pattern, changed in patterns.items():
            for cs in (1 * MiB, 4 * MiB, 16 * MiB):
                dedup.CHUNK_SIZE = cs
                torch.manual_seed(0)
                table = torch.nn.Embedding(n, width)
                state = {"model": table}
                store = MemoryStore()
                with CheckpointManager(store, keep_last=None) as mgr:
                    mgr.save(1, state)
                    with torch.no_grad():
                        table.weight[changed] += 1.0
                    t = time.perf_counter()
                    second = mgr.save(2, state)
                    seconds = time.perf_counter() - t
                blob = store.get(second.shard(0, "replicated.bin").key)
                header_len = int.from_bytes(blob[-24:-16], "little")
                rows.append(
                    {
                        "pattern": pattern,
                        "chunk_MiB": cs // MiB,
                        "changed_fraction": round(len(changed) / n, 4),
                        "written_MiB": round(second.total_size / MiB, 2),
                        "written_fraction": round(second.total_size / (tensor_mib * MiB), 4),
                        "header_KiB": round(header_len / 1024, 1),
                        "save_s": round(seconds, 3),
                    }
                )
    finally:
        dedup.CHUNK_SIZE = saved
    return rows


# ------------------------------------------------------------------------------ scenarios


def state_size(manifest: Any) -> int:
    return manifest.total_size + manifest.referenced_size


def lora_leg(blocks: int, saves: int, steps_between: int, d: int = 1024, r: int = 8) -> dict[str, Any]:
    """A frozen base of transformer-sized blocks (q, k, v, o: d x d; MLP: d x 4d and 4d x d) with
    rank-``r`` LoRA adapters on q and v (as the LoRA paper), trained by AdamW between saves."""
    import torch

    from objckpt.store.memory import MemoryStore
    from objckpt.store.wrappers import CountingStore
    from objckpt.training.manager import CheckpointManager
    from objckpt.usage import run_usage

    torch.manual_seed(0)

    def block() -> Any:
        return torch.nn.ModuleDict(
            {
                "q": torch.nn.Linear(d, d),
                "k": torch.nn.Linear(d, d),
                "v": torch.nn.Linear(d, d),
                "o": torch.nn.Linear(d, d),
                "up": torch.nn.Linear(d, 4 * d),
                "down": torch.nn.Linear(4 * d, d),
            }
        )

    base = torch.nn.ModuleList(block() for _ in range(blocks))
    for p in base.parameters():
        p.requires_grad_(False)
    lora = torch.nn.ParameterDict()
    for i in range(blocks):
        for m in ("q", "v"):
            lora[f"{i}_{m}_a"] = torch.nn.Parameter(torch.randn(d, r) * 0.01)
            lora[f"{i}_{m}_b"] = torch.nn.Parameter(torch.zeros(r, d))
    opt = torch.optim.AdamW(lora.parameters(), lr=1e-3)
    state = {"base": base, "lora": lora, "optimizer": opt}
    trainable = sum(p.numel() for p in lora.parameters()) * 4 * 3  # params + two Adam moments

    def step() -> None:
        x = torch.randn(8, d)
        for i, blk in enumerate(base):
            q = blk["q"](x) + x @ lora[f"{i}_q_a"] @ lora[f"{i}_q_b"]
            v = blk["v"](x) + x @ lora[f"{i}_v_a"] @ lora[f"{i}_v_b"]
            x = torch.tanh(blk["o"](torch.tanh(q) * v))
        x.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    store = MemoryStore()
    counted = CountingStore(store, close_inner=False)
    out: dict[str, Any] = {
        "base_MiB": round(sum(p.numel() for p in base.parameters()) * 4 / MiB, 1),
        "blocks": blocks,
        "rank": r,
        "saves": saves,
    }
    with CheckpointManager(counted, keep_last=None) as mgr:
        manifests = []
        for s in range(1, saves + 1):
            for _ in range(steps_between):
                step()
            counted.reset()
            manifests.append(mgr.save(s * steps_between, state))
            if s == 2:
                out["second_save_requests"] = dict(counted.counts)
    full = state_size(manifests[0])
    later = [m.total_size for m in manifests[1:]]
    out.update(
        {
            "full_state_bytes": full,
            "changed_fraction": round(trainable / full, 5),
            "first_save_bytes": manifests[0].total_size,
            "later_save_bytes_median": int(statistics.median(later)),
            "later_fraction_median": round(statistics.median(later) / full, 5),
            "later_fraction_max": round(max(later) / full, 5),
            "usage": [r.__dict__ for r in run_usage(store)][:3],
        }
    )
    fresh = {k: v for k, v in state.items()}
    with CheckpointManager(store, keep_last=None) as mgr:
        t = time.perf_counter()
        assert mgr.restore(fresh) == manifests[-1].step
        out["restore_s"] = round(time.perf_counter() - t, 3)
    return out


def embed_leg(saves: int, steps_between: int) -> dict[str, Any]:
    """The trained LM's shape, but with a large frozen embedding table (pretraining a new body on
    frozen embeddings): everything else and its Adam moments change every step."""
    import torch

    from objckpt.store.memory import MemoryStore
    from objckpt.training.manager import CheckpointManager

    torch.manual_seed(0)
    model = tiny_lm()
    model.embed = torch.nn.Embedding(32768, 256)  # 32 MiB: a large vocabulary, frozen
    model.head = torch.nn.Linear(256, 256, bias=False)
    model.embed.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    state = {"model": model, "optimizer": opt}

    def step() -> None:
        idx = torch.randint(0, data.numel() - 65, (8,), generator=gen)
        x = torch.stack([data[i : i + 64] for i in idx])
        y = torch.stack([data[i + 1 : i + 65] for i in idx])
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()

    frozen = model.embed.weight.numel() * 4
    store = MemoryStore()
    with CheckpointManager(store, keep_last=None) as mgr:
        manifests = []
        for s in range(1, saves + 1):
            for _ in range(steps_between):
                step()
            manifests.append(mgr.save(s * steps_between, state))
    full = state_size(manifests[0])
    changed = (full - frozen) / full
    later = [m.total_size / full for m in manifests[1:]]
    return {
        "full_state_bytes": full,
        "frozen_bytes": frozen,
        "changed_fraction": round(changed, 4),
        "written_fraction_median": round(statistics.median(later), 4),
        "written_fraction_max": round(max(later), 4),
        "excess_over_changed": round(max(later) - changed, 4),
    }


@contextlib.contextmanager
def _roots(kind: str) -> Iterator[Callable[[str], Any]]:
    from objckpt.store import open_store

    if kind == "file":
        with tempfile.TemporaryDirectory(prefix="dedup-bench-", dir="/tmp") as d:
            yield lambda name: open_store(f"file://{d}/{name}")
        return
    from benchmarks.common import BUCKET, start_server

    with start_server(kind) as srv:
        stamp = time.time_ns()
        yield lambda name: open_store(f"s3://{BUCKET}/dedup-{stamp}/{name}", **srv.store_options)


def full_change_leg(kind: str, mib: int, runs: int) -> dict[str, Any]:
    """Save time of a fully changing state with dedup on and off: two run roots, saves
    interleaved (order alternating), every byte of the state changed before each pair."""
    import torch

    from benchmarks.common import make_model
    from objckpt.training.manager import CheckpointManager

    model = make_model(mib * MiB, 16)
    state = {"model": model}
    times: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    written: dict[str, list[int]] = {"on": [], "off": []}
    with _roots(kind) as root:
        mgrs = {
            "on": CheckpointManager(root("on"), keep_last=2),
            "off": CheckpointManager(root("off"), keep_last=2, dedup=False),
        }
        try:
            for mode in ("on", "off"):  # warm-up: the first save (no parent) is not timed
                mgrs[mode].save(1, state)
            for i in range(runs):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p))  # every byte changes
                order = ("on", "off") if i % 2 == 0 else ("off", "on")
                for mode in order:
                    t, c = time.perf_counter(), time.process_time()
                    m = mgrs[mode].save(i + 2, state)
                    times[mode].append(time.perf_counter() - t)
                    cpu[mode].append(time.process_time() - c)
                    written[mode].append(m.total_size)
        finally:
            for m in mgrs.values():
                m.close()
    on, off = Series(times["on"]), Series(times["off"])
    ratios = Series([a / b for a, b in zip(times["on"], times["off"], strict=True)])
    cpu_ratios = Series([a / b for a, b in zip(cpu["on"], cpu["off"], strict=True)])
    return {
        "backend": kind,
        "state_MiB": mib,
        "runs": runs,
        "on_s": on.fmt(3),
        "off_s": off.fmt(3),
        "on_median": on.median,
        "off_median": off.median,
        "slowdown_median": round(on.median / off.median - 1, 4),
        "paired_ratio": ratios.fmt(3),
        "paired_ratio_median": ratios.median,
        "cpu_on_s": Series(cpu["on"]).fmt(3),
        "cpu_off_s": Series(cpu["off"]).fmt(3),
        "cpu_ratio": cpu_ratios.fmt(3),
        "cpu_ratio_median": cpu_ratios.median,
        "bytes_on_over_off": round(statistics.median(written["on"]) / statistics.median(written["off"]), 5),
    }


def stream_cost_leg(mib: int, runs: int) -> dict[str, Any]:
    """What dedup adds to producing a shard, without I/O: the CPU time of encoding a fully
    changed state of ``mib`` MiB and streaming it through the writer's part splitting and CRC32C,
    format 3 with the parent's index in place vs format 1, interleaved."""
    import torch

    from benchmarks.common import make_model
    from objckpt._crc import crc32c_of
    from objckpt.store.base import iter_parts
    from objckpt.store.memory import MemoryStore
    from objckpt.training import _state_write, dedup, serialization, shards
    from objckpt.training.manager import CheckpointManager

    model = make_model(mib * MiB, 16)
    state = {"model": model}
    store = MemoryStore()
    with CheckpointManager(store, keep_last=1) as mgr:
        mgr.save(1, state)  # the parent, in format 3, its headers kept in-process
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    cap = shards.capture(2, state, rank=0, world_size=1, replicated_names=None)
    cap.dedup = True
    parent = dedup.parent_for(store, 2)
    assert parent is not None
    names = [s.name for s in parent.shards if s.rank == 0]  # the replicated pieces and rank.bin
    index = dedup.build_index(store, parent, rank=0, names=names, layouts=shards.STATE_LAYOUTS)

    class _W:
        part_size = None

    _W.store = store  # type: ignore[attr-defined]
    opts = _state_write._chunk_options(_W, cap, index)  # type: ignore[arg-type]
    first = _state_write._chunk_options(_W, cap, None)  # type: ignore[arg-type]  # no parent: hash all

    def once(mode: str) -> tuple[float, float]:
        c, t = time.process_time(), time.perf_counter()
        tree = cap.replicated_tree
        enc: Any = (
            serialization.encode(tree)
            if mode == "v1"
            else serialization.encode_chunked(tree, opts if mode == "v3" else first)
        )
        for part in iter_parts(enc.buffers(), 16 * MiB):
            crc32c_of(part)
        return time.process_time() - c, time.perf_counter() - t

    cpu: dict[str, list[float]] = {"v3": [], "v1": [], "first": []}
    wall: dict[str, list[float]] = {"v3": [], "v1": [], "first": []}
    for i in range(runs):
        modes = ("v3", "v1", "first") if i % 2 else ("first", "v1", "v3")
        for mode in modes:
            c, w = once(mode)
            cpu[mode].append(c)
            wall[mode].append(w)
    on, off, fst = Series(cpu["v3"]), Series(cpu["v1"]), Series(cpu["first"])
    return {
        "first_cpu_ms": round(fst.median * 1000, 1),
        "first_wall_ms": round(Series(wall["first"]).median * 1000, 1),
        "format1_wall_ms": round(Series(wall["v1"]).median * 1000, 1),
        "state_MiB": mib,
        "runs": runs,
        "format3_cpu_ms": round(on.median * 1000, 1),
        "format1_cpu_ms": round(off.median * 1000, 1),
        "format3_min_ms": round(on.lo * 1000, 1),
        "format1_min_ms": round(off.lo * 1000, 1),
        "extra_ms_median": round((on.median - off.median) * 1000, 1),
        "extra_ms_min": round((on.lo - off.lo) * 1000, 1),
    }


# ------------------------------------------------------------------------------ report


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def write_md(res: dict[str, Any]) -> str:
    lines = [
        "## Deduplication and compression (`benchmarks/dedup_bench.py`)",
        "",
        f"Run {res['when']} ({'quick' if res['quick'] else 'full'}), {res['machine'].get('nproc')} cores "
        f"({res['machine'].get('cpu')}), load average at start {res['machine'].get('load average at start')}. "
        "Bytes are exact; times are medians [min-max] of interleaved runs.",
        "",
        "How it works (`objckpt/training/dedup.py`, shard format 3 in `serialization.py`): every array "
        "of 4 KiB or more is cut into 4 MiB chunks; a chunk whose 128-bit content hash (xxh3-128) equals "
        "one the *parent* checkpoint (the one restored or last committed) holds itself or references is "
        "written as a reference to that byte range, by identity (origin checkpoint, rank, shard name, "
        "offset), with the CRC32C the restore checks it against; the rank reports the `Reference` of "
        "every object it reads from and the coordinator verifies them. The header is a trailer (the "
        "decisions are made while the bytes stream) whose own CRC32C is in the footer, so the next save "
        "can read it with one ranged GET; normally it needs none, keeping the headers of its last commit "
        "or restore in-process. A restore reads the footer (one small ranged GET per shard), streams the "
        "shard, then the referenced ranges (coalesced, at most 4 x 32 MiB held at once).",
        "",
        "Two deviations from the agreed design, both for the cost of a save where everything changed "
        "(measured below): (1) a chunk is hashed in full only when its 64-bit *sample* (65 words spread "
        "over it) equals one of the parent's, or when there is no parent; a changed chunk is never hashed, "
        "and a chunk that stops changing is written once more before it is reused (its parent has no "
        "full hash to confirm it by); (2) a chunk's CRC32C is recorded on references only (computed from "
        "the live bytes when reused; a local chunk is covered by its object's CRC32C). A full xxh3 pass "
        "plus a CRC32C pass over every chunk would cost two more passes over the state: on this machine "
        "xxh3-128 runs at the rate in the hash table and a file:// save at ~0.3-0.6 GB/s, i.e. roughly "
        "10-20% of a fully changing save.",
        "",
    ]
    if "lora" in res:
        lo = res["lora"]
        ok = lo["later_fraction_max"] <= 0.01
        lines += [
            "### LoRA-style frozen base + small adapter",
            "",
            f"Frozen base {lo['base_MiB']} MiB ({lo.get('blocks')} transformer-sized blocks, d=1024), rank-"
            f"{lo.get('rank')} LoRA on q and v trained with AdamW between {lo['saves']} saves (adapters and their "
            f"moments: {lo.get('changed_fraction', 0):.2%} of the state). "
            f"Full state {lo['full_state_bytes'] / MiB:.1f} MiB; first save wrote {lo['first_save_bytes'] / MiB:.1f} MiB; "
            f"every later save wrote {lo['later_save_bytes_median'] / 1024:.0f} KiB (median) = "
            f"**{lo['later_fraction_median']:.3%}** of the full state (max {lo['later_fraction_max']:.3%}). "
            f"Goal <= 1%: **{'met' if ok else 'MISSED'}**. Requests of the second save: "
            f"{lo.get('second_save_requests')} (the parent's index comes from this process's last "
            f"commit: no shard is read). Restore of the newest (base read from the first save's "
            f"object): {lo['restore_s']} s.",
            "",
        ]
    if "embed" in res:
        e = res["embed"]
        ok = e["excess_over_changed"] <= 0.02
        lines += [
            "### Pretraining with frozen embeddings",
            "",
            f"The LM with a 32 MiB frozen embedding table; everything else and its Adam moments change "
            f"every step. Changed fraction of the state {e['changed_fraction']:.2%}; bytes written per save "
            f"after the first {e['written_fraction_median']:.2%} (max {e['written_fraction_max']:.2%}), i.e. "
            f"{e['excess_over_changed']:+.2%} over the changed fraction. Goal <= changed + 2%: "
            f"**{'met' if ok else 'MISSED'}**.",
            "",
        ]
    if res.get("full"):
        lines += [
            "### Cost on a fully changing save (dedup on vs off)",
            "",
            "Every byte changes before each save, so nothing is reused: what dedup costs is a 65-word "
            "sample of every chunk, the index lookups and the trailer header (no chunk is hashed in "
            "full: no sample matches the parent's). Two run roots, saves interleaved in alternating "
            "order, the parent's index in-process; `paired_ratio` is on/off per pair, `cpu_ratio` the "
            "same in process CPU time.",
            "",
            _table(
                res["full"],
                [
                    "backend",
                    "state_MiB",
                    "runs",
                    "on_s",
                    "off_s",
                    "paired_ratio",
                    "cpu_ratio",
                    "bytes_on_over_off",
                ],
            ),
            "",
        ]
        worst = max(r["paired_ratio_median"] - 1 for r in res["full"])
        lines += [
            f"Goal: no slowdown > 3% (median of the paired on/off ratios): worst {worst:+.1%}: "
            f"**{'met' if worst <= 0.03 else 'MISSED'}**. Caveat: on this shared machine (2 cores, other "
            "jobs running) a single pair varies by far more than 3% (see min-max), so what the wall-clock "
            "runs show is no slowdown beyond their noise; the deterministic cost is the one below.",
            "",
        ]
    if "stream" in res:
        st = res["stream"]
        lines += [
            f"Deterministic part of that cost, without I/O ({st['state_MiB']} MiB fully changed, encode + "
            f"part split + CRC32C as the writer does, {st['runs']} interleaved runs, CPU time): format 3 with "
            f"the parent's index {st['format3_cpu_ms']} ms (min {st['format3_min_ms']}), format 1 "
            f"{st['format1_cpu_ms']} ms (min {st['format1_min_ms']}): {st['extra_ms_median']:+} ms median, "
            f"{st['extra_ms_min']:+} ms between the minima. A first save (no parent: every chunk hashed in "
            f"full, in two threads ahead of the stream) costs {st.get('first_cpu_ms')} ms of CPU and "
            f"{st.get('first_wall_ms')} ms of wall time against {st.get('format1_wall_ms')} ms for format 1.",
            "",
        ]
    if "hash" in res:
        lines += [
            "### Chunk hash (4 MiB chunks, one thread)",
            "",
            _table(res["hash"], ["function", "GBps", "lo", "hi"]),
            "",
        ]
    if "chunk" in res:
        lines += [
            "4 MiB is the chunk size: it reuses a contiguous change as well as 1 MiB does, with a quarter "
            "of the per-chunk costs (a ~110-byte header entry; ~30 us of sampling and lookup in the "
            "writer's thread, which is what the fully changing save pays). Smaller chunks only help "
            "scattered row updates, which plain Adam/AdamW never produce (weight decay and the moments' "
            "decay touch every row); 16 MiB loses most contiguous reuse. `dedup.CHUNK_SIZE` is one constant.",
            "",
            "### Chunk size (a 64 MiB embedding table, part of its rows changed between saves)",
            "",
            _table(
                res["chunk"],
                [
                    "pattern",
                    "chunk_MiB",
                    "changed_fraction",
                    "written_MiB",
                    "written_fraction",
                    "header_KiB",
                    "save_s",
                ],
            ),
            "",
        ]
    if "compress" in res:
        tr = res["train"]
        lines += [
            "### Compression per tensor class",
            "",
            f"Model: byte-level transformer LM ({tr['params']:,} parameters, 4 layers, d=256) trained "
            f"{tr['steps']} AdamW steps on this repository's source (loss {tr['loss_first']:.2f} -> "
            f"{tr['loss_last']:.2f}). Ratio = compressed/raw (lower is better); single thread, 4 MiB chunks.",
            "",
            _table(res["compress"], ["class", "MiB", "codec", "ratio", "compress_MBps", "decompress_MBps"]),
            "",
            'objckpt implements byte planes + zstd-1 (`compression="zstd"` or `"auto"`, off by '
            "default; needs `zstandard`). zipnn (byte grouping + Huffman of the exponent) gets a few points "
            "better on bf16 and decodes faster, the same on fp32 and moments; it is not used: another "
            "native dependency whose decoder has not been shown to be safe on hostile input (a restore "
            "decodes what the store holds; zstd's decoder is fuzzed and bounded by the declared size). "
            "At ~15-25% smaller float state, compression shortens a save only where the upload is slower "
            "than the codec (single-thread rates above; two threads compress ahead of the upload): "
            "`auto` measures both per tensor class and compresses only then.",
            "",
        ]
    text = "\n".join(lines) + "\n"
    OUT_MD.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=None)
    p.add_argument("--legs", default="train,compress,hash,chunk,lora,embed,stream,full")
    p.add_argument("--skip", default="", help="comma list: moto, file")
    p.add_argument("--full-mib", type=int, default=None)
    args = p.parse_args(argv)
    legs = set(args.legs.split(","))
    skip = set(filter(None, args.skip.split(",")))
    runs = args.runs or (3 if args.quick else 7)
    res: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
        "machine": machine_info(),
    }
    if OUT_JSON.exists():  # legs not run this time keep their last results
        with contextlib.suppress(ValueError):
            old = json.loads(OUT_JSON.read_text())
            res.update({k: v for k, v in old.items() if k not in ("when", "quick", "machine")})
    if "train" in legs or "compress" in legs:
        steps = 60 if args.quick else 300
        t = time.perf_counter()
        model, opt, losses = train(steps)
        res["train"] = {
            "steps": steps,
            "params": sum(p.numel() for p in model.parameters()),
            "loss_first": losses[0],
            "loss_last": statistics.mean(losses[-20:]),
            "seconds": round(time.perf_counter() - t, 1),
        }
        print("train", res["train"], flush=True)
        if "compress" in legs:
            res["compress"] = compression_rows(model, opt, runs=min(runs, 3))
            print(json.dumps(res["compress"], indent=1), flush=True)
    if "hash" in legs:
        res["hash"] = hash_rows(runs)
        print(res["hash"], flush=True)
    if "chunk" in legs:
        res["chunk"] = chunk_rows(32 if args.quick else 64)
        print(res["chunk"], flush=True)
    if "lora" in legs:
        res["lora"] = lora_leg(1 if args.quick else 3, saves=3 if args.quick else 6, steps_between=5)
        print(res["lora"], flush=True)
    if "embed" in legs:
        res["embed"] = embed_leg(saves=3 if args.quick else 5, steps_between=5)
        print(res["embed"], flush=True)
    if "stream" in legs:
        res["stream"] = stream_cost_leg(64 if args.quick else 256, 2 * runs + 1)
        print(res["stream"], flush=True)
    if "full" in legs:
        res["full"] = []
        for kind in ("file", "moto"):
            if kind in skip:
                continue
            mib = args.full_mib or (64 if args.quick else (256 if kind == "file" else 128))
            row = full_change_leg(kind, mib, runs)
            res["full"].append(row)
            print(row, flush=True)
    OUT_JSON.write_text(json.dumps(res, indent=1, default=str))
    print(write_md(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
