"""objckpt.training.export / ``objckpt export``: checkpoint weights as one safetensors (or
torch.save) file, streamed with bounded memory, verified on the way.

Fast tests run one process; the slow ones export a 2-rank CheckpointManager checkpoint and a
4-rank FSDP2 (DCP) checkpoint written by gloo worlds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from objckpt import CheckpointManager, Reader, open_store  # noqa: E402
from objckpt.cli import main as cli_main  # noqa: E402
from objckpt.errors import ChecksumMismatchError, ConfigError, NoCheckpointError  # noqa: E402
from objckpt.training.export import export_safetensors, export_torch  # noqa: E402

from .export_workers import Net  # noqa: E402
from .mp import run_world  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randint(0, 9, (4, 3))).pow(2).sum().backward()
    opt.step()
    return model, opt


def assert_same(loaded: dict, reference: dict) -> None:
    assert sorted(loaded) == sorted(reference)
    for k, v in reference.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
        assert torch.equal(loaded[k], v), k


def no_temporaries(directory: Path) -> None:
    assert not [p.name for p in directory.iterdir() if ".objckpt-" in p.name]


def flip_byte(path: Path, offset: int = -1) -> None:
    """Bit rot: one byte changed in place, the file's times kept (a HEAD check still passes)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset if offset >= 0 else st.st_size + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ------------------------------------------------------------------ CheckpointManager, 1 process


def test_manager_checkpoint_round_trips_through_safetensors(tmp_path: Path) -> None:
    model, opt = trained()
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(5, {"model": model, "optimizer": opt})
    out = tmp_path / "model.safetensors"
    result = export_safetensors(root, out)
    reference = model.state_dict()
    assert_same(safetensors_torch.load_file(out), reference)
    # the tied weight is one tensor in the checkpoint and two keys in the file
    assert model.state_dict()["head.weight"].data_ptr() == model.state_dict()["embed.weight"].data_ptr()
    assert result.step == 5 and result.layout == "CheckpointManager" and result.entry == "model"
    assert result.tensors == len(reference)
    assert result.data_bytes == sum(v.numel() * v.element_size() for v in reference.values())
    manifest = Reader(open_store(root)).latest()
    # the whole replicated shard is read (its CRC32C covers the object), the optimizer's too
    assert result.read_bytes == sum(s.size for s in manifest.shards if s.name == "replicated.bin")
    no_temporaries(tmp_path)


def test_dtype_cast_prefixes_and_torch_format(tmp_path: Path) -> None:
    model, opt = trained()
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(1, {"model": model, "optimizer": opt})
    reference = model.state_dict()

    out = tmp_path / "bf16.safetensors"
    export_safetensors(root, out, step=1, dtype="bfloat16", strip_prefix="layers.", add_prefix="net.")
    loaded = safetensors_torch.load_file(out)
    expected = {}
    for k, v in reference.items():
        name = "net." + (k[len("layers.") :] if k.startswith("layers.") else k)
        expected[name] = v.to(torch.bfloat16) if v.is_floating_point() else v
    assert_same(loaded, expected)
    assert loaded["net.count"].dtype == torch.int64  # integers are never cast

    pt = tmp_path / "model.pt"
    result = export_torch(root, pt, step=1)
    assert result.format == "torch"
    assert_same(torch.load(pt, weights_only=True), reference)
    no_temporaries(tmp_path)


def test_views_and_shared_storage_in_a_per_rank_entry(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "weights": {
            "base": base,
            "rows": base[1:3],  # a contiguous view: streamed from the base's bytes
            "cols": base[:, 2],  # strided: gathered from the base
            "t": base.t(),  # transposed: gathered
            "alias": base.view(torch.int32),  # another dtype over the same bytes
            "note": "not a tensor",
            "nested": {"bias": torch.ones(3, dtype=torch.float16)},
        }
    }
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root, replicated=()) as ckpt:
        ckpt.save(3, state)
    out = tmp_path / "w.safetensors"
    result = export_safetensors(root, out, entry="weights")
    w = state["weights"]
    expected = {k: v.contiguous() for k, v in w.items() if isinstance(v, torch.Tensor)}
    expected["nested.bias"] = w["nested"]["bias"]
    assert_same(safetensors_torch.load_file(out), expected)
    assert result.skipped == ["note"]


def test_entry_and_prefix_errors_name_the_problem(tmp_path: Path) -> None:
    model, opt = trained()
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(2, {"net": model, "optimizer": opt})
    out = tmp_path / "x.safetensors"
    with pytest.raises(ConfigError, match=r"no 'model' entry.*\['net', 'optimizer'\]"):
        export_safetensors(root, out)
    with pytest.raises(ConfigError, match="no state entry 'nope'"):
        export_safetensors(root, out, entry="nope")
    with pytest.raises(ConfigError, match="cannot cast"):
        export_safetensors(root, out, entry="net", dtype="int8")
    with pytest.raises(NoCheckpointError):
        export_safetensors(root, out, step=99)
    assert not out.exists()

    other = f"file://{tmp_path}/other"
    with CheckpointManager(other, replicated=()) as ckpt:
        ckpt.save(1, {"model": {"x": torch.zeros(2), "orig.x": torch.ones(2)}})
    with pytest.raises(ConfigError, match="'orig.x' both become 'x'"):
        export_safetensors(other, out, strip_prefix="orig.")
    assert not out.exists()


def test_a_damaged_shard_fails_the_export_and_leaves_no_file(tmp_path: Path) -> None:
    model, opt = trained()
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(4, {"model": model, "optimizer": opt})
    shard = next((tmp_path / "run").rglob("replicated.bin"))
    flip_byte(shard)  # the last tensor byte: only the whole-object CRC32C can tell
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"previous export")
    with pytest.raises(ChecksumMismatchError, match="replicated.bin"):
        export_safetensors(root, out, step=4)
    assert out.read_bytes() == b"previous export"  # replaced only by a verified export
    no_temporaries(tmp_path)


def test_a_header_that_differs_from_the_verified_stream_is_refused(tmp_path: Path) -> None:
    from objckpt.training.export import plan_export

    model, opt = trained()
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(4, {"model": model, "optimizer": opt})
    store = open_store(root)
    plan = plan_export(store, 4)
    # the layout was planned from ranged reads of the header; the verified stream must agree
    source = plan.sources[0]
    changed = bytearray(source.header)
    changed[-2] ^= 0x01
    source.header = bytes(changed)
    out = tmp_path / "m.safetensors"
    with pytest.raises(ChecksumMismatchError, match="header changed"):
        plan.write_safetensors(out)
    assert not out.exists()
    no_temporaries(tmp_path)


def test_export_from_every_backend(store) -> None:  # type: ignore[no-untyped-def]
    """Through each backend's own streams (S3: multipart upload, parallel ranged reads; GCS), both
    layouts: a CheckpointManager step and a DCP step under one run root."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from objckpt import save_sharded

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1600), torch.nn.Linear(1600, 3))  # > 5 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointManager(store, keep_last=None) as ckpt:
        ckpt.save(3, {"model": model, "optimizer": opt})
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_sharded({"model": msd, "optim": osd}, store, step=4)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for step, layout_name in ((3, "CheckpointManager"), (4, "DCP")):
            out = Path(d) / f"{step}.safetensors"
            result = export_safetensors(store, out, step=step, chunk_size=2 * 2**20)
            assert result.layout == layout_name
            assert_same(safetensors_torch.load_file(out), model.state_dict())


# ------------------------------------------------------------------------------ DCP, 1 process


def _dcp_checkpoint(root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from objckpt import save_sharded

    model, opt = trained()
    model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())  # DCP unties anyway
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        save_sharded({"model": msd, "optim": osd}, root, step=12)
    return model.state_dict()


def test_dcp_checkpoint_exports_only_the_model_items(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/dcp"
    reference = _dcp_checkpoint(root)
    out = tmp_path / "model.safetensors"
    result = export_safetensors(root, out)
    assert_same(safetensors_torch.load_file(out), reference)
    assert result.layout == "DCP" and result.step == 12
    # ranged reads of the model's items only (the optimizer's moments are not read)
    assert result.read_bytes == result.data_bytes


def test_dcp_item_checksums_are_verified(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/dcp"
    _dcp_checkpoint(root)
    manifest = Reader(open_store(root)).latest()
    from objckpt.training.dcp import decode_metadata

    store = open_store(root)
    meta_receipt = next(s for s in manifest.shards if s.name == "dcp-metadata.json")
    _, locations = decode_metadata(Reader(store).read_shard(meta_receipt))
    loc = next(loc for idx, loc in locations.items() if idx.fqn == "model.layers.1.weight")
    data = next(s for s in manifest.shards if s.name == loc.shard)
    flip_byte(tmp_path / "dcp" / data.key, loc.start + 3)
    out = tmp_path / "model.safetensors"
    with pytest.raises(ChecksumMismatchError, match=r"model\.layers\.1\.weight.*CRC32C"):
        export_safetensors(root, out)
    assert not out.exists()
    no_temporaries(tmp_path)


# ------------------------------------------------------------------------------------ Lightning


def test_lightning_checkpoint_state_dict(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from objckpt.integrations.lightning import ObjckptCheckpointIO

    sd = OrderedDict(w=torch.randn(4, 3), b=torch.randn(4))
    io = ObjckptCheckpointIO(f"file://{tmp_path}/pl")
    io.save_checkpoint(
        {"global_step": 6, "epoch": 0, "state_dict": sd, "hyper_parameters": {"lr": 0.1}},
        "epoch=0-step=6.ckpt",
    )
    out = tmp_path / "pl.safetensors"
    result = export_safetensors(f"file://{tmp_path}/pl", out)
    assert result.layout == "Lightning" and result.entry == "state_dict"
    assert_same(safetensors_torch.load_file(out), dict(sd))


# ------------------------------------------------------------------------------ bounded memory

_MEASURE = textwrap.dedent(
    """
    import json, sys, tracemalloc
    import torch
    from objckpt.training.export import export_safetensors

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(field)

    root, out, dtype = sys.argv[1], sys.argv[2], sys.argv[3] or None
    before = status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
    except OSError:
        pass
    tracemalloc.start()
    result = export_safetensors(root, out, dtype=dtype)
    print(json.dumps({"rss_before": before, "rss_peak": status("VmHWM"),
                      "traced_peak": tracemalloc.get_traced_memory()[1],
                      "data_bytes": result.data_bytes, "read_bytes": result.read_bytes}))
    """
)


@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_peak_memory_is_bounded_whatever_the_model_size(tmp_path: Path, dtype: str) -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("needs /proc (Linux) to read the process's peak RSS")
    model = torch.nn.ModuleDict({f"w{i}": torch.nn.Linear(1024, 4096) for i in range(8)})
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    assert model_bytes > 128 * 2**20
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(1, {"model": model})
    del model
    out = tmp_path / "big.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, root, str(out), dtype],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    assert m["data_bytes"] == (model_bytes // 2 if dtype else model_bytes)
    assert m["read_bytes"] >= model_bytes
    growth = m["rss_peak"] - m["rss_before"]
    # bytes, not time: the process grew by a fraction of the model (reads are 4 MiB chunks)
    assert growth < model_bytes // 4, (growth, model_bytes)
    assert m["traced_peak"] < 32 * 2**20, m
    assert out.stat().st_size > m["data_bytes"]


# --------------------------------------------------------------------------- Hugging Face Hub


def test_transformers_from_pretrained_reads_the_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 5))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    root = f"file://{tmp_path}/hf-run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(100, {"model": model, "optimizer": opt})
    export_dir = tmp_path / "export"
    export_dir.mkdir()
    export_safetensors(root, export_dir / "model.safetensors")
    config.save_pretrained(export_dir)  # config.json next to the weights
    loaded = transformers.LlamaForCausalLM.from_pretrained(export_dir)
    ours = model.state_dict()
    theirs = loaded.state_dict()
    assert sorted(theirs) == sorted(ours)
    for k in ours:
        assert torch.equal(theirs[k], ours[k]), k
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


# ------------------------------------------------------------------------------------------ CLI


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli_main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_export_and_its_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = trained()
    root = f"file://{tmp_path}/run"
    with CheckpointManager(root) as ckpt:
        ckpt.save(7, {"model": model, "optimizer": opt})
    out = tmp_path / "m.safetensors"

    code, stdout, _ = _cli(["export", f"{root}@7", str(out), "--json"], capsys)
    assert code == 0
    doc = json.loads(stdout)
    assert doc["step"] == 7 and doc["tensors"] == len(model.state_dict()) and doc["out"] == str(out)
    assert_same(safetensors_torch.load_file(out), model.state_dict())

    code, stdout, _ = _cli(
        ["export", root, str(tmp_path / "m.pt"), "--format", "torch", "--dtype", "bf16"], capsys
    )
    assert code == 0 and "exported step 7" in stdout
    assert torch.load(tmp_path / "m.pt", weights_only=True)["layers.0.weight"].dtype == torch.bfloat16

    code, _, err = _cli(["export", f"{root}@8", str(out)], capsys)
    assert code == 3 and "step 8" in err
    code, _, err = _cli(["export", root, str(out), "--entry", "nope"], capsys)
    assert code == 2 and "nope" in err
    code, _, err = _cli(["export", root, str(tmp_path / "missing" / "m.safetensors")], capsys)
    assert code == 2 and "missing" in err
    code, _, err = _cli(["export", root, str(out), "--dtype", "int3"], capsys)
    assert code == 2 and "int3" in err
    flip_byte(next((tmp_path / "run").rglob("replicated.bin")))
    code, _, err = _cli(["export", f"{root}@7", str(out)], capsys)
    assert code == 1 and "replicated.bin" in err and "CRC32C" in err
    code, _, err = _cli(["export", "file:///nonexistent-objckpt-root", str(out)], capsys)
    assert code == 3


def test_cli_export_is_listed_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = _cli(["--help"], capsys)
    assert code == 0
    code = cli_main(["export", "--help"])
    text = capsys.readouterr().out
    assert code == 0 and "--strip-prefix" in text and "--dtype" in text and "--entry" in text


# ------------------------------------------------------------------------- multi-process (slow)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_rank_manager_checkpoint_exports_whole(tmp_path: Path) -> None:
    from . import export_workers

    root = f"file://{tmp_path}/run"
    out = tmp_path / "out"
    out.mkdir()
    assert run_world(export_workers.manager_save, 2, root, str(out)) == [0, 0]
    manifest = Reader(open_store(root)).latest()
    assert manifest.world_size == 2
    assert len([s for s in manifest.shards if s.name == "replicated.bin"]) == 2  # split across ranks
    target = tmp_path / "model.safetensors"
    result = export_safetensors(root, target)
    assert result.world_size == 2
    assert_same(safetensors_torch.load_file(target), torch.load(out / "reference.pt", weights_only=True))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_rank_fsdp2_checkpoint_exports_at_global_shapes(tmp_path: Path) -> None:
    from . import export_workers

    root = f"file://{tmp_path}/dcp"
    out = tmp_path / "out"
    out.mkdir()
    assert run_world(export_workers.fsdp_save, 4, root, str(out), timeout=600) == [0, 0, 0, 0]
    reference = torch.load(out / "reference.pt", weights_only=True)
    manifest = Reader(open_store(root)).latest()
    assert manifest.world_size == 4

    target = tmp_path / "model.safetensors"
    result = export_safetensors(root, target)
    assert result.layout == "DCP" and result.world_size == 4
    assert_same(safetensors_torch.load_file(target), reference["model"])

    # chunks sharded along later dimensions: one run per row, assembled in place
    extra = tmp_path / "extra.safetensors"
    export_safetensors(root, extra, entry="extra", dtype="float16")
    assert_same(
        safetensors_torch.load_file(extra), {k: v.to(torch.float16) for k, v in reference["extra"].items()}
    )


# ----------------------------------------------------------- the byte router, property-based


def test_chunks_reassemble_bit_for_bit_however_the_stream_is_cut() -> None:
    """Any tensor (up to 3 dimensions, any dtype pair), split into DCP-style chunks along any
    dimension, read in chunks of any size (partial elements included), with or without a cast:
    the bytes written are exactly the cast global tensor's."""
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")
    from objckpt.manifest import ShardReceipt
    from objckpt.training import export as ex

    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8]

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(
        shape=st.lists(st.integers(1, 5), min_size=0, max_size=3),
        split_dim=st.integers(0, 2),
        parts=st.integers(1, 4),
        read=st.integers(1, 37),
        src=st.sampled_from(dtypes),
        cast=st.sampled_from([None, torch.bfloat16, torch.float16, torch.float64]),
    )
    def check(shape, split_dim, parts, read, src, cast):  # type: ignore[no-untyped-def]
        shape = tuple(shape)
        full = (torch.arange(max(1, int(torch.tensor(shape).prod())) if shape else 1) * 3 + 1).to(src)
        full = full.reshape(shape)
        out_dtype = ex._out_dtype("t", src, cast)
        tensor = ex._Tensor("t", src, out_dtype, shape)
        d = split_dim % len(shape) if shape else 0
        bounds = torch.linspace(0, shape[d], parts + 1).round().int().tolist() if shape else [0, 1]
        stream = bytearray()
        pieces = []
        strides = [
            int(torch.tensor(shape[j + 1 :]).prod()) if j + 1 < len(shape) else 1 for j in range(len(shape))
        ]
        for a, b in zip(bounds, bounds[1:], strict=False):
            if shape and a == b:
                continue
            if shape:
                chunk = full.narrow(d, a, b - a).contiguous()
                sizes, offsets = tuple(chunk.shape), tuple(a if j == d else 0 for j in range(len(shape)))
            else:
                chunk, sizes, offsets = full, (), ()
            raw = chunk.reshape(-1).view(torch.uint8).numpy().tobytes()
            k = max(len(sizes) - 1, 0)
            while k > 0 and sizes[k] == shape[k]:
                k -= 1
            run = int(torch.tensor(sizes[k:]).prod()) if sizes else 1
            pieces.append(
                ex._Piece(
                    len(stream),
                    len(raw),
                    tensor,
                    run=run,
                    base=sum(o * s for o, s in zip(offsets, strides, strict=True)),
                    outer=tuple(sizes[:k]),
                    strides=tuple(strides[:k]),
                    what="chunk",
                )
            )
            stream += raw
        receipt = ShardReceipt(
            key="data/1-a/0/x", size=len(stream), version="v", crc32c="AAAAAA==", rank=0, name="x"
        )
        out = bytearray(tensor.nbytes)

        def write(pos: int, data: memoryview) -> None:
            assert 0 <= pos and pos + data.nbytes <= len(out)
            out[pos : pos + data.nbytes] = data

        router = ex._Router(ex._Source(receipt, whole=True, pieces=pieces), write, "memory://t")
        for pos in range(0, len(stream), read):
            router.feed(pos, memoryview(bytes(stream[pos : pos + read])))
        router.finish()
        expected = full.to(out_dtype).reshape(-1).view(torch.uint8).numpy().tobytes()
        assert bytes(out) == expected

    check()
