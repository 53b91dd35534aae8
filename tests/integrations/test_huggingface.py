"""objckpt.integrations.huggingface: ObjckptCallback and download_checkpoint (unit tests in one
process; one slow 2-process Trainer test)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers not installed")

from objckpt.errors import CommitError, NoCheckpointError  # noqa: E402
from objckpt.integrations import _common  # noqa: E402
from objckpt.integrations.huggingface import ObjckptCallback, default_owner, download_checkpoint  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402

from .launch import logs_of, run_ranks  # noqa: E402
from .util import bitrot, truncate  # noqa: E402

FILES = {
    "model.safetensors": b"weights" * 100,
    "optimizer.pt": b"opt" * 50,
    "scheduler.pt": b"sched",
    "trainer_state.json": b'{"global_step": 0}',
    "rng_state_0.pth": b"rng0",
    "rng_state_1.pth": b"rng1",
    "training_args.bin": b"args",
}


def write_folder(output_dir: Path, step: int, files: dict[str, bytes] = FILES) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data + str(step).encode())
    return folder


def on_save(cb: ObjckptCallback, output_dir: Path, step: int) -> None:
    args = SimpleNamespace(output_dir=str(output_dir))
    state = SimpleNamespace(global_step=step, epoch=step / 10)
    cb.on_train_begin(args, state, None)
    cb.on_save(args, state, None)


def test_default_owner() -> None:
    assert default_owner("rng_state_1.pth", 2) == 1
    assert default_owner("rng_state_0.pth", 2) == 0
    assert default_owner("rng_state_5.pth", 2) == 0  # no such rank: the main process uploads it
    assert default_owner("model.safetensors", 2) == 0
    assert default_owner("rng_state.pth", 1) == 0


def test_on_save_commits_the_folder_and_download_restores_it(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    out = tmp_path / "out"
    cb = ObjckptCallback(root)
    for step in (3, 6):
        write_folder(out, step)
        on_save(cb, out, step)
    assert cb.last_manifest is not None and cb.last_manifest.step == 6
    m = Reader(open_store(root)).latest()
    assert m is not None and m.step == 6 and m.world_size == 1
    assert m.metadata["huggingface"] == {"folder": "checkpoint-6"} and m.progress["global_step"] == 6
    assert sorted(s.name for s in m.shards) == sorted(FILES)

    path = download_checkpoint(root, tmp_path / "resume")
    assert path == str(tmp_path / "resume" / "checkpoint-6")
    for name in FILES:
        assert (Path(path) / name).read_bytes() == (out / "checkpoint-6" / name).read_bytes()
    assert sorted(p.name for p in Path(path).iterdir()) == sorted(FILES)  # no temporary leftovers
    older = download_checkpoint(root, tmp_path / "resume", step=3)
    assert older == str(tmp_path / "resume" / "checkpoint-3")


def test_nothing_committed_means_a_fresh_start(tmp_path: Path) -> None:
    assert download_checkpoint(f"file://{tmp_path}/run", tmp_path / "resume") is None


def test_damaged_checkpoints(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = f"file://{tmp_path}/run"
    out = tmp_path / "out"
    cb = ObjckptCallback(root)
    for step in (3, 6, 9):
        write_folder(out, step)
        on_save(cb, out, step)
    reader = Reader(open_store(root))
    shard9 = next(s for s in reader.load(9).shards if s.name == "optimizer.pt")
    truncate(tmp_path / "run", shard9.key)  # HEAD sees it: falls back to 6, loudly
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        assert download_checkpoint(root, tmp_path / "a").endswith("checkpoint-6")
    assert any("rejecting checkpoint step 9" in r.message for r in caplog.records)
    with pytest.raises(NoCheckpointError, match="step 9 is damaged"):
        download_checkpoint(root, tmp_path / "a", step=9)

    shard6 = next(s for s in reader.load(6).shards if s.name == "model.safetensors")
    bitrot(tmp_path / "run", shard6.key)  # only the CRC32C check while downloading sees it
    # an explicit step never falls back: refused, naming the damage (one restore protocol)
    with pytest.raises(NoCheckpointError, match="step 6 is damaged.*CRC32C"):
        download_checkpoint(root, tmp_path / "b", step=6)
    assert not (tmp_path / "b" / "checkpoint-6" / "model.safetensors").exists()  # never placed
    assert [p.name for p in (tmp_path / "b" / "checkpoint-6").iterdir() if ".objckpt-" in p.name] == []


def test_a_rank_failing_to_upload_fails_the_commit(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    out = tmp_path / "out"
    write_folder(out, 3, {**FILES, "bad name.json": b"{}"})  # not a portable shard name
    with pytest.raises(CommitError, match=r"rank 0"):
        on_save(ObjckptCallback(root), out, 3)
    assert Reader(open_store(root)).steps() == []
    with pytest.raises(CommitError, match="does not exist"):
        on_save(ObjckptCallback(root), out, 4)  # Trainer's folder is missing on this rank


def test_a_file_no_rank_uploads_fails_the_commit(tmp_path: Path) -> None:
    """Node-local disks with an owner_of that does not match who wrote a file: loud, not lost."""
    root = f"file://{tmp_path}/run"
    write_folder(tmp_path / "out", 3)
    cb = ObjckptCallback(root, owner_of=lambda rel, world: 1 if rel == "optimizer.pt" else 0)
    with pytest.raises(
        CommitError, match="'optimizer.pt' is in its checkpoint folder but no rank uploaded it"
    ):
        on_save(cb, tmp_path / "out", 3)
    assert Reader(open_store(root)).steps() == []


def test_not_a_trainer_checkpoint(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    _common.commit_single_writer(open_store(root), 5, [("x.bin", b"x")])
    with pytest.raises(NoCheckpointError, match="not a Hugging Face Trainer checkpoint"):
        download_checkpoint(root, tmp_path / "r")


def test_retention_keeps_the_last_n(tmp_path: Path) -> None:
    root = f"file://{tmp_path}/run"
    out = tmp_path / "out"
    cb = ObjckptCallback(root, keep_last=2)
    for step in (1, 2, 3):
        write_folder(out, step)
        on_save(cb, out, step)
    assert Reader(open_store(root)).steps() == [2, 3]


def test_on_s3_moto(backend_s3_moto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    uri, store = backend_s3_moto.new_root()
    write_folder(tmp_path / "out", 2)
    on_save(ObjckptCallback(uri), tmp_path / "out", 2)
    assert Reader(store).steps() == [2]
    path = download_checkpoint(uri, tmp_path / "resume")
    assert path is not None and (Path(path) / "rng_state_1.pth").read_bytes() == b"rng12"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trainer_on_two_gloo_ranks_resumes_bitwise(tmp_path: Path) -> None:
    """2 CPU ranks (gloo DDP) with a tiny model built from code: the uninterrupted 6-step run and
    a run cut after step 3, then resumed on fresh processes from the store into an empty local
    folder, end with bitwise identical parameters."""
    module = "tests.integrations.hf_worker"
    full, cut = f"file://{tmp_path}/full", f"file://{tmp_path}/cut"
    started = time.monotonic()
    for mode in ("first", "resume"):
        codes = run_ranks(
            module, [full, cut, str(tmp_path), mode], log_dir=tmp_path / "logs" / mode, timeout=180
        )
        assert codes == [0, 0], logs_of(module, tmp_path / "logs" / mode)
        if mode == "first":
            assert Reader(open_store(full)).steps() == [3, 6]
            assert Reader(open_store(cut)).steps() == [3]
            m = Reader(open_store(cut)).load(3)
            assert {s.name: s.rank for s in m.shards}["rng_state_1.pth"] == 1  # each rank uploads its own
            assert m.world_size == 2
    assert Reader(open_store(cut)).steps() == [3, 6]
    full_run = torch.load(tmp_path / "full.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert resumed["global_step"] == full_run["global_step"] == 6
    assert resumed["resumed_from"].endswith("checkpoint-3")
    for k, v in full_run["params"].items():
        assert torch.equal(v, resumed["params"][k]), k
    print(f"hf trainer 2-rank save + resume: {time.monotonic() - started:.1f}s")
