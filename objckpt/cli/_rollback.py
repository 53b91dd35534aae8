"""``rollback ROOT@STEP`` and ``quarantine ROOT@STEP`` (``--undo`` / ``unquarantine``): metadata
only, through :mod:`objckpt.timelines`; no shard is ever copied, rewritten or deleted.

* ``rollback`` claims a new timeline whose base is the named checkpoint and moves ``LATEST`` to
  it: from then on it is the head, "latest" and restores resolve it, and the next save continues
  from it on the new timeline. The steps after it on the old line are **abandoned** (kept for
  ``gc --keep-abandoned``, 7 days by default). A damaged or quarantined base is refused (exit 1)
  before anything is written; rolling back to the head itself changes nothing.
* ``quarantine`` sets a checkpoint aside with a marker (``quarantine/<t>-<s>.json``): restores,
  ``latest`` and every "latest" of the CLI skip it, ``verify`` and ``ls`` show it; ``--undo``
  (or ``unquarantine``) removes the marker. Both are idempotent.

Both need an explicit ``@STEP`` or ``@tN:STEP`` (never ``@latest``: run twice, that would set
aside or roll back a different checkpoint each time).
"""

from __future__ import annotations

import argparse
from typing import Any

from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    display_uri,
    label,
    open_root,
    ref_dict,
    split_target,
)
from ._output import emit_json, outputs


def _target(args: argparse.Namespace, command: str) -> tuple[str, int, int | None]:
    uri, step, timeline = split_target(args.target)
    if step is None:
        raise CliError(
            f"{command} needs ROOT@STEP or ROOT@tN:STEP naming the checkpoint (not @latest; "
            "see 'objckpt ls ROOT')",
            EXIT_USAGE,
        )
    return uri, step, timeline


def cmd_rollback(args: argparse.Namespace) -> int:
    from .. import timelines
    from ..reader import Reader
    from ._latest import summarize

    uri, step, timeline = _target(args, "rollback")
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    base = reader.load(step, timeline)  # exit 3 when absent, 1 when its manifest is invalid
    problems = reader.check(base)
    if problems:
        raise CliError(
            f"refusing to roll back {where} to step {base.label}: it is damaged ({summarize(problems)}); "
            "pick an older checkpoint ('objckpt verify' says which are good)",
            EXIT_FAILED,
        )
    if reader.is_quarantined(base):
        raise CliError(
            f"refusing to roll back {where} to step {base.label}: it is quarantined "
            f"(undo with 'objckpt quarantine {where}@{base.label} --undo')",
            EXIT_FAILED,
        )
    head = reader.head()
    # what the rollback leaves behind: the line's checkpoints newer than the base (the same
    # rule as objckpt.timelines.rollback)
    abandoned = [ref for ref in reader.line() if ref > base.ref and ref[0] >= base.timeline]
    noop = head.ref == base.ref and not abandoned
    claim = None
    if not noop and not args.dry_run:
        claim = timelines.rollback(store, base.step, timeline=base.timeline)
    new_timeline = None if claim is None else claim.timeline
    if args.json:
        emit_json(
            {
                "root": where,
                "dry_run": bool(args.dry_run),
                "changed": claim is not None,
                "timeline": new_timeline,
                "claim": None if claim is None else claim.key,
                "created_at": None if claim is None else claim.created_at,
                "reason": None if claim is None else claim.reason,
                "base": {**(ref_dict(base.ref) or {}), "manifest": base.key, "attempt": base.attempt},
                "abandoned": [ref_dict(r) for r in sorted(abandoned)],
            }
        )
        return EXIT_OK
    out, _ = outputs()
    left = ", ".join(label(r) for r in sorted(abandoned)) or "nothing"
    if noop:
        out.line(f"step {base.label} is already the head of {where}: nothing to roll back")
        return EXIT_OK
    if claim is None:
        out.line(f"rollback plan (dry run: nothing written) for {where}:")
        out.line(f"  a new timeline would continue from step {base.label}")
        out.line(f"  abandoned: {left}")
        return EXIT_OK
    out.line(f"rolled back {where} to step {base.label}: timeline {claim.timeline} continues from it")
    out.line(f"  claim: {claim.key} ({claim.created_at})")
    out.line(f"  abandoned: {left} (kept for gc --keep-abandoned, 7d by default)")
    out.line(f"  latest is now step {base.label}; the next save continues on timeline {claim.timeline}")
    return EXIT_OK


def cmd_quarantine(args: argparse.Namespace) -> int:
    from .. import layout, timelines
    from ..reader import Reader
    from ._latest import resolve_latest
    from ._view import read_reason

    undo = bool(args.undo)
    command = "unquarantine" if args.command == "unquarantine" else "quarantine"
    uri, step, timeline = _target(args, command)
    if undo and args.reason:
        raise CliError("--reason is for setting a checkpoint aside, not for --undo", EXIT_USAGE)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    m = reader.load(step, timeline)
    marker = layout.quarantine_key(m.timeline, m.step)
    was = reader.is_quarantined(m)
    reason = read_reason(store, marker) if was else ""
    if undo:
        if was:
            timelines.unquarantine(store, m.step, timeline=m.timeline)
        changed, now_quarantined = was, False
    else:
        if not was:
            reason = args.reason or ""
            timelines.quarantine(store, m.step, timeline=m.timeline, reason=reason)
        changed, now_quarantined = not was, True
    latest = resolve_latest(reader)
    doc: dict[str, Any] = {
        "root": where,
        **(ref_dict(m.ref) or {}),
        "manifest": m.key,
        "marker": marker,
        "quarantined": now_quarantined,
        "changed": changed,
        "reason": reason or None,
        "latest": ref_dict(latest.ref),
    }
    if args.json:
        emit_json(doc)
        return EXIT_OK
    out, _ = outputs()
    why = f" ({reason})" if reason else ""
    if undo:
        what = "is no longer quarantined" if changed else "was not quarantined: nothing to undo"
        out.line(f"step {m.label} under {where} {what}")
    elif changed:
        out.line(f"quarantined step {m.label} under {where}{why}: restores skip it; nothing deleted")
        out.line(f"  undo: objckpt quarantine {where}@{m.label} --undo")
    else:
        out.line(f"step {m.label} under {where} is already quarantined{why}")
    out.line(f"  latest is {'-' if latest.label is None else 'step ' + latest.label}")
    return EXIT_OK
