"""``gc`` (apply a retention policy) and ``rm ROOT@STEP`` (delete one committed checkpoint).

Both go through the retention machinery (:func:`objckpt.gc.plan_gc` then
:func:`objckpt.gc.run_gc`), so a manifest is always deleted before its shards: no surviving
manifest ever names missing data.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, display_uri, open_root, run_root, split_step
from ._output import emit_json, outputs


def cmd_gc(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from .. import gc as gcmod
    from ..planner import parse_duration

    uri = run_root(args.uri, "gc", " (use --pin STEP to keep a step)")
    if args.keep_last < 0:
        raise CliError("--keep-last must be >= 0 (the latest checkpoint is always kept)", EXIT_USAGE)
    if args.keep_every is not None and args.keep_every < 1:
        raise CliError("--keep-every must be a positive number of steps", EXIT_USAGE)
    grace = timedelta(seconds=parse_duration(args.grace))
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    policy = gcmod.RetentionPolicy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        pinned=frozenset(args.pin or ()),
    )
    plan = gcmod.plan_gc(store, policy, grace_period=grace)
    result = None if args.dry_run else gcmod.run_gc(store, plan)
    if args.json:
        payload: dict[str, Any] = {"root": where, "dry_run": bool(args.dry_run), "plan": gc_plan_dict(plan)}
        if result is not None:
            payload["result"] = _result_dict(result)
        emit_json(payload)
        return EXIT_OK
    out, _ = outputs()
    out.line(f"{'gc plan (dry run: nothing deleted)' if args.dry_run else 'gc'} for {where}:")
    for line in plan.describe():
        out.line(f"  {line}")
    if result is not None:
        _print_result(out, result)
    return EXIT_OK


def _result_dict(result: Any) -> dict[str, Any]:
    return {
        "deleted_manifests": list(result.deleted_manifests),
        "deleted_objects": result.deleted_objects,
        "aborted_uploads": result.aborted_uploads,
        "skipped": list(result.skipped),
    }


def _print_result(out: Any, result: Any) -> None:
    out.line(
        f"deleted {len(result.deleted_manifests)} manifest(s) and {result.deleted_objects} "
        f"object(s); aborted {result.aborted_uploads} upload(s)"
    )
    for why in result.skipped:
        out.line(f"  skipped: {why}")


def gc_plan_dict(plan: Any) -> dict[str, Any]:
    return {
        "kept": {(str(s) if t == 0 else f"t{t}:{s}"): why for (t, s), why in sorted(plan.kept.items())},
        "delete": [
            {
                "step": d.step,
                "timeline": d.timeline,
                "manifest": d.key,
                "attempt": d.attempt,
                "shards": len(d.shard_keys),
                "bytes": d.size,
            }
            for d in plan.manifests
        ],
        "orphans": [
            {
                "prefix": o.prefix,
                "step": o.step,
                "attempt": o.attempt,
                "objects": len(o.keys),
                "bytes": o.size,
                "newest": o.newest.isoformat(),
            }
            for o in plan.orphans
        ],
        "uploads": [
            {"key": u.key, "initiated": u.initiated.isoformat() if u.initiated else None}
            for u in plan.uploads
        ],
        "notes": list(plan.notes),
        "grace_seconds": plan.grace_period.total_seconds(),
        "empty": plan.empty,
    }


# ---------------------------------------------------------------------------------- rm


@dataclass(frozen=True)
class RmFacts:
    """What the refusal rules look at (one place to add more: timelines, bases, ...)."""

    step: int
    head: int | None  # the newest committed step
    pointer_step: int | None  # the target of LATEST
    newest_valid: int | None  # what "latest" resolves to
    retention: str | None  # why plan_gc keeps the step anyway (None: it would delete it)


def _rule_head(f: RmFacts) -> str | None:
    return "it is the newest committed step (the head)" if f.step == f.head else None


def _rule_pointer(f: RmFacts) -> str | None:
    return "it is the target of LATEST" if f.step == f.pointer_step else None


def _rule_newest_valid(f: RmFacts) -> str | None:
    return "it is the newest valid checkpoint (what a restore uses)" if f.step == f.newest_valid else None


def _rule_retention(f: RmFacts) -> str | None:
    return f"retention keeps it: {f.retention}" if f.retention else None


#: each rule says why a step must not be deleted without --force, or None
RM_RULES: tuple[Callable[[RmFacts], str | None], ...] = (
    _rule_head,
    _rule_pointer,
    _rule_newest_valid,
    _rule_retention,
)


def rm_refusals(facts: RmFacts) -> list[str]:
    """Every reason to refuse deleting ``facts.step`` (empty: it may go)."""
    reasons: list[str] = []
    for rule in RM_RULES:
        why = rule(facts)
        if why and why not in reasons:
            reasons.append(why)
    return reasons


_SAFETY = ("newest committed step", "target of LATEST", "newest checkpoint that verifies")


def cmd_rm(args: argparse.Namespace) -> int:
    from .. import gc as gcmod
    from ..errors import ManifestError, NoCheckpointError
    from ..reader import Reader
    from ._latest import resolve_latest

    uri, step = split_step(args.target)
    if step is None:
        raise CliError("rm needs ROOT@STEP: the step to delete (see 'objckpt ls ROOT')", EXIT_USAGE)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    steps = reader.steps()
    if step not in steps:
        raise NoCheckpointError(f"no committed checkpoint for step {step} under {where}")
    manifest = None
    try:
        manifest = reader.load(step)
    except ManifestError:
        pass  # plan_gc leaves it for a human; --force deletes the manifest alone
    res = resolve_latest(reader)
    policy = gcmod.RetentionPolicy(keep_last=0, pinned=frozenset(s for s in steps if s != step))
    full = gcmod.plan_gc(store, policy)
    planned = [d for d in full.manifests if d.step == step]
    kept = full.why_kept(step)
    facts = RmFacts(
        step=step,
        head=max(steps),
        pointer_step=None if res.pointer is None else res.pointer.step,
        newest_valid=res.step,
        # the rules above already name the safety reasons plan_gc gives; keep the others
        retention=None if kept is None or any(s in kept for s in _SAFETY) else kept,
    )
    refusals = rm_refusals(facts)
    if refusals and not args.force:
        raise CliError(
            f"refusing to delete step {step} under {where}: {'; '.join(refusals)} (--force deletes it anyway)",
            EXIT_FAILED,
        )
    if planned:
        deletion = planned[0]
    elif manifest is not None:
        deletion = gcmod.ManifestDeletion(
            step, manifest.key, manifest.attempt, tuple(s.key for s in manifest.shards), manifest.total_size
        )
    else:  # forced, unreadable manifest: its shards become orphans for a later gc
        from .. import layout

        deletion = gcmod.ManifestDeletion(step, layout.manifest_key(step), "?", (), 0)
    # Only this checkpoint: orphans and stale uploads are gc's business.
    plan = gcmod.GcPlan(manifests=[deletion], grace_period=full.grace_period, now=full.now)
    result = None
    if not args.dry_run:
        result = gcmod.run_gc(store, plan)
        if not result.deleted_manifests and args.force:
            # run_gc never deletes the target of LATEST; --force does, in the same safe order
            # (manifest first, then its shards). Readers then fall back past the dangling pointer.
            store.delete([deletion.key])
            store.delete(deletion.shard_keys)
            result = gcmod.GcResult(
                deleted_manifests=[deletion.key], deleted_objects=len(deletion.shard_keys)
            )
    if args.json:
        doc: dict[str, Any] = {
            "root": where,
            "step": step,
            "dry_run": bool(args.dry_run),
            "forced": bool(args.force),
            "overridden": refusals,
            "plan": gc_plan_dict(plan),
        }
        if result is not None:
            doc["result"] = _result_dict(result)
        emit_json(doc)
        return EXIT_OK
    out, _ = outputs()
    out.line(f"{'rm plan (dry run: nothing deleted)' if args.dry_run else 'rm'} for {where}:")
    for why in refusals:
        out.line(f"  forced: {why}")
    for line in plan.describe():
        out.line(f"  {line}")
    if manifest is None:
        out.line("  its manifest does not validate: its shards are left for gc as orphans")
    if result is not None:
        _print_result(out, result)
    return EXIT_OK
