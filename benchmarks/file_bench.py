"""Save/load of one state on local disk: objckpt ``file://`` vs DCP ``FileSystemWriter``/``Reader``.

One process, same directory tree (same disk), interleaved runs with the order alternating:

* ``objckpt``: ``CheckpointManager("file:///...").save`` / ``.restore`` (fsync'd, CRC32C on every
  part and on read, commit protocol included);
* ``dcp_fs``: ``dcp.save(model.state_dict(), storage_writer=FileSystemWriter(dir, thread_count=N))``
  (``sync_files=True``, its default) / ``dcp.load`` with ``FileSystemReader``;
* ``dcp_objckpt``: the same ``dcp.save``/``dcp.load`` with ``ObjckptStorageWriter``/``Reader`` on
  ``file://`` (``dedup=False``): same planner as ``dcp_fs``, only the storage layer differs.

Loads read what the same run just wrote, so both come from the page cache: this compares the
software paths, not the disk. Results as JSON (``--out``) and printed.

    python -m benchmarks.file_bench --mib 256 --runs 3
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    MiB,
    Series,
    fingerprint,
    make_model,
    paired_ratios,
    state_bytes,
    timed,
    write_json,
    zero,
)


def bench(total: int, n_tensors: int, runs: int, dcp_threads: int, root: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from objckpt.training.manager import CheckpointManager

    model = make_model(total, n_tensors)
    fp = fingerprint(model)
    times: dict[str, dict[str, list[list[float]]]] = {
        c: {"save": [], "load": []} for c in ("objckpt", "dcp_fs", "dcp_objckpt")
    }

    def objckpt(op: str, run: int, d: Path) -> None:
        with CheckpointManager(f"file://{d}", keep_last=None) as mgr:
            if op == "save":
                times["objckpt"]["save"].append(list(timed(lambda: mgr.save(run + 1, {"model": model}))))
            else:
                zero(model)
                times["objckpt"]["load"].append(list(timed(lambda: mgr.restore({"model": model}))))
                assert fingerprint(model) == fp, "objckpt file:// load returned other content"

    def dcp_fs(op: str, run: int, d: Path) -> None:
        if op == "save":
            w = FileSystemWriter(str(d), thread_count=dcp_threads)
            times["dcp_fs"]["save"].append(
                list(timed(lambda: dcp.save(model.state_dict(), storage_writer=w)))
            )
        else:
            zero(model)
            r = FileSystemReader(str(d))
            times["dcp_fs"]["load"].append(
                list(timed(lambda: dcp.load(model.state_dict(), storage_reader=r)))
            )
            assert fingerprint(model) == fp, "DCP file load returned other content"

    def dcp_objckpt(op: str, run: int, d: Path) -> None:
        from objckpt.training.dcp import ObjckptStorageReader, ObjckptStorageWriter

        if op == "save":
            w = ObjckptStorageWriter(f"file://{d}", step=run + 2, dedup=False)
            times["dcp_objckpt"]["save"].append(
                list(timed(lambda: dcp.save(model.state_dict(), storage_writer=w)))
            )
            w.close()
        else:
            zero(model)
            r = ObjckptStorageReader(f"file://{d}")
            times["dcp_objckpt"]["load"].append(
                list(timed(lambda: dcp.load(model.state_dict(), storage_reader=r)))
            )
            r.close()
            assert fingerprint(model) == fp, "objckpt DCP file:// load returned other content"

    cases = {"objckpt": objckpt, "dcp_fs": dcp_fs, "dcp_objckpt": dcp_objckpt}
    for run in range(-1, runs):  # run -1: warm-up, untimed
        # DCP's writer in the middle, next to both cases compared with it, in alternating
        # order (A B C, then C B A); until 2026-12-06 the order rotated, and a pair was two apart
        # in one run out of three
        names = list(cases)
        order = names if run % 2 == 0 else names[::-1]
        dirs = {c: root / f"{c}-{run + 1}" for c in cases}
        keep = {c: {"save": list(times[c]["save"]), "load": list(times[c]["load"])} for c in cases}
        for op in ("save", "load"):
            for c in order:
                cases[c](op, run, dirs[c])
        if run < 0:  # forget the warm-up
            for c in cases:
                times[c] = keep[c]
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)
    return {
        "state_bytes": state_bytes(model),
        "n_tensors": n_tensors,
        "times": times,
        "dcp_threads": dcp_threads,
        "dir": str(root),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dcp-threads", type=int, default=8)
    ap.add_argument("--dir", help="parent directory (default: the system temp dir)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    root = Path(tempfile.mkdtemp(prefix="objckpt-file-bench-", dir=args.dir))
    try:
        res = bench(args.mib * MiB, args.tensors, args.runs, args.dcp_threads, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        write_json(args.out, res)
    t = res["times"]
    for op in ("save", "load"):
        base = [w for w, _ in t["dcp_fs"][op]]
        for case in ("objckpt", "dcp_objckpt"):
            ours = [w for w, _ in t[case][op]]
            print(
                f"{op}: {case} {Series(ours).fmt(2, 's')}  dcp {Series(base).fmt(2, 's')}  "
                f"speed ratio {paired_ratios(base, ours).fmt(2, 'x')}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
