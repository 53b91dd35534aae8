"""``export ROOT[@STEP] OUT``: a checkpoint's model weights as one safetensors (or torch.save)
file (:mod:`objckpt.training.export`: streamed with bounded memory, verified on the way).

Without ``@STEP`` it exports the latest checkpoint as every command means it (the newest valid
one). Needs the torch extra (``pip install 'objckpt[torch]'``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from ._common import EXIT_OK, EXIT_USAGE, CliError, display_uri, open_root, split_step
from ._output import emit_json, human_bytes, outputs, progress


def add_export_parser(
    add: Callable[[str, str, str], argparse.ArgumentParser],
    with_common: Callable[..., None],
) -> argparse.ArgumentParser:
    """Register ``objckpt export`` (``add`` and ``with_common`` are the parser's own helpers)."""
    p = add(
        "export",
        "write a checkpoint's model weights as one safetensors file",
        "Write one state entry (default 'model') of a committed checkpoint -- CheckpointManager at "
        "any world size, DCP/FSDP at any world size, or Lightning -- as one file that "
        "safetensors.torch.load_file and Hugging Face from_pretrained read (--format torch: a "
        "torch.save file). Streamed chunk by chunk with bounded memory; every byte read is "
        "checked against its CRC32C, and OUT is replaced only once the export is complete. "
        "Default: the latest (newest valid) checkpoint.",
    )
    p.add_argument("target", metavar="ROOT[@STEP]", help="run root, optionally @STEP")
    p.add_argument("out", metavar="OUT", help="file to write, e.g. model.safetensors")
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="safetensors (default) or torch (a torch.save file of the flat state dict)",
    )
    p.add_argument(
        "--entry",
        metavar="NAME",
        help="the state entry holding the model (default: model; Lightning: state_dict)",
    )
    p.add_argument("--strip-prefix", metavar="PREFIX", help="remove PREFIX from keys that start with it")
    p.add_argument(
        "--add-prefix", metavar="PREFIX", help="put PREFIX before every key (after --strip-prefix)"
    )
    p.add_argument(
        "--dtype", metavar="DTYPE", help="cast floating-point tensors: bfloat16, float16, float32 or float64"
    )
    p.add_argument("--timeline", type=int, metavar="N", help="the step on timeline N (an abandoned one)")
    p.add_argument(
        "--rank",
        type=int,
        default=0,
        metavar="R",
        help="whose per-rank shard holds a per-rank entry (default 0)",
    )
    with_common(p, progress=True)
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    uri, step = split_step(args.target)
    if args.timeline is not None and step is None:
        raise CliError("--timeline needs ROOT@STEP", EXIT_USAGE)
    out = os.path.abspath(args.out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise CliError(f"cannot write {args.out}: directory {parent} does not exist", EXIT_USAGE)
    if os.path.isdir(out):
        raise CliError(f"cannot write {args.out}: it is a directory", EXIT_USAGE)
    try:
        from ..training import export as exporter
    except ImportError as exc:
        raise CliError(
            f"objckpt export needs torch ({exc}); install it with pip install 'objckpt[torch]'", EXIT_USAGE
        ) from exc
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    try:
        plan = exporter.plan_export(
            store,
            step,
            args.timeline,
            entry=args.entry,
            strip_prefix=args.strip_prefix,
            add_prefix=args.add_prefix,
            dtype=args.dtype,
            rank=args.rank,
        )
        with progress(args, plan.read_bytes, f"export step {plan.manifest.label}") as advance:
            if args.format == "torch":
                result = plan.write_torch(out, progress=advance)
            else:
                result = plan.write_safetensors(out, progress=advance)
    finally:
        store.close()
    doc: dict[str, Any] = {"source": where, **result.to_dict(), "out": args.out, "path": result.path}
    if args.json:
        emit_json(doc)
        return EXIT_OK
    stdout, _ = outputs()
    skipped = f"; left out (not tensors): {', '.join(result.skipped)}" if result.skipped else ""
    stdout.line(
        f"exported step {plan.manifest.label} of {where} ({result.layout}, {result.world_size} rank(s), "
        f"entry {result.entry!r}): {result.tensors} tensors, {human_bytes(result.data_bytes)} -> "
        f"{args.out} ({result.format}){skipped}"
    )
    return EXIT_OK
