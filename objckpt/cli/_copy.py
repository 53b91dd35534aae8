"""``cp SRC[@STEP] DST``: replicate committed checkpoints to another run root.

``SRC@STEP`` names a step as everywhere (the head's line, else the newest timeline holding it);
``SRC@tN:STEP`` is accepted when it is that same checkpoint (:func:`objckpt.replicate.replicate`
takes a step, not a timeline, so another checkpoint of the step cannot be copied). ``--all``
copies the head's line, oldest first. The destination commits them on its own timeline 0. Without ``@STEP`` it copies the latest checkpoint as every command means it (the newest valid
one), saying which damaged ones it passed over. Store options given with ``-o`` apply to each
side whose scheme accepts them; ``--src-option`` / ``--dst-option`` set one side only.
"""

from __future__ import annotations

import argparse
from typing import Any

from .. import layout
from ._common import (
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    display_uri,
    label,
    open_root,
    parse_options,
    scope_options,
    split_target,
)
from ._latest import note_skipped, resolve_latest
from ._output import emit_json, human_bytes, outputs, progress


def cmd_cp(args: argparse.Namespace) -> int:
    from ..errors import NoCheckpointError
    from ..reader import Reader
    from ..replicate import replicate

    src_uri, step, timeline = split_target(args.src)
    dst_uri, dst_step, _ = split_target(args.dst)
    if dst_step is not None:
        raise CliError("the destination is a run root: the step is kept (drop @STEP from DST)", EXIT_USAGE)
    if args.all and step is not None:
        raise CliError("give either SRC@STEP or --all, not both", EXIT_USAGE)
    shared_src, shared_dst = scope_options(
        args.store_options, [("SRC", src_uri), ("DST", dst_uri)], "--src-option/--dst-option"
    )
    src = open_root(src_uri, {**shared_src, **parse_options(args.src_option)})
    dst = open_root(dst_uri, {**shared_dst, **parse_options(args.dst_option)})
    src_where, dst_where = display_uri(src_uri), display_uri(dst_uri)
    out, _ = outputs()
    reader = Reader(src)
    results: list[dict[str, Any]] = []
    skipped: list[Any] = []

    if args.all:
        steps = reader.steps()
    elif step is not None:
        if timeline is not None and reader.locate(step) != reader.locate(step, timeline):
            # objckpt.replicate takes a step and resolves it as SRC@STEP does (the line's,
            # else the newest timeline's): another checkpoint of that step cannot be named to it
            named = layout.parse_manifest_key(reader.locate(step))
            raise CliError(
                f"cannot copy t{timeline}:{step} from {src_where}: cp copies a step as @{step} names "
                f"it, and @{step} names {label(named or (0, step))} (roll back to t{timeline}:{step} "
                "first to make it the line's)",
                EXIT_USAGE,
            )
        steps = [reader.load(step, timeline).step]
    else:
        res = resolve_latest(reader)
        steps = [res.require(src_where).step]
        skipped = res.skipped
        if not args.json:
            note_skipped(res)
    if not steps:
        raise NoCheckpointError(f"no committed checkpoint under {src_where}")
    # Oldest first (steps() is ascending) so the destination pointer only moves forward; one
    # step at a time so each gets its own progress bar.
    for s in steps:
        source = reader.load(s)
        existed: list[Any] = []
        with progress(args, source.total_size, f"copy step {s}") as advance:
            m = replicate(src, dst, s, advance, on_exists=existed.append)
        copied = not existed
        results.append(
            {
                "step": s,
                "copied": copied,
                "source_attempt": source.attempt,
                "attempt": m.attempt,
                "shards": len(m.shards),
                "bytes": m.total_size,
            }
        )
        if args.json:
            continue
        if copied:
            out.line(
                f"copied step {s} ({len(m.shards)} shards, {human_bytes(m.total_size)}) "
                f"{src_where} -> {dst_where} as attempt {m.attempt}"
            )
        else:
            out.line(f"step {s} already at {dst_where} (attempt {m.attempt}); nothing to do")
    if args.json:
        emit_json(
            {
                "src": src_where,
                "dst": dst_where,
                "steps": results,
                "skipped": [x.to_dict() for x in skipped],
            }
        )
    return EXIT_OK
