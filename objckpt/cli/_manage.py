"""``gc`` (apply a retention policy) and ``rm ROOT@STEP`` (delete one committed checkpoint).

Both go through the retention machinery (:func:`objckpt.gc.plan_gc` then
:func:`objckpt.gc.run_gc`), so a manifest is always deleted before its shards: no surviving
manifest ever names missing data.

Timelines: ``gc --keep-abandoned DURATION`` (default 7d; ``never`` keeps them forever) is how
long a checkpoint off the head's line (steps after a rollback's base, a stale coordinator's late
commits) survives after it was abandoned; the plan lists each abandoned checkpoint, since when
and what happens to it. ``rm`` refuses the base of any timeline that still holds checkpoints
(one of the rules of :func:`rm_refusals`), and names checkpoints as ``@STEP`` or ``@tN:STEP``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
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
    run_root,
    split_target,
)
from ._latest import resolve_latest
from ._output import age, emit_json, outputs
from ._view import RootView


def parse_keep_abandoned(text: str) -> timedelta | None:
    """``--keep-abandoned``: a duration (``7d``, ``12h``, ``0``) or ``never`` (keep forever)."""
    from ..planner import parse_duration

    if text.strip().lower() in ("never", "forever", "none"):
        return None
    return timedelta(seconds=parse_duration(text))


def parse_pin(text: str) -> int | tuple[int, int]:
    """``--pin``: ``STEP`` (that step on every timeline) or ``tN:STEP`` (exactly that one)."""
    m = re.match(r"^(?:[tT](\d+):)?(\d+)$", text.strip())
    if m is None:
        raise CliError(f"bad --pin {text!r}: use STEP or tN:STEP", EXIT_USAGE)
    return int(m.group(2)) if m.group(1) is None else (int(m.group(1)), int(m.group(2)))


def abandoned_report(view: RootView, plan: Any, now: datetime) -> list[dict[str, Any]]:
    """Every abandoned checkpoint, since when, by which timeline, and what the plan does."""
    deleted = {(d.timeline, d.step) for d in plan.manifests}
    out = []
    for ref in sorted(view.keys):
        if view.on_line(ref):
            continue
        by = view.abandoned_by(ref)
        claim = view.claims.get(by) if by is not None else None
        since = None if claim is None else claim.created_at
        out.append(
            {
                **(ref_dict(ref) or {}),
                "abandoned_at": since,
                "age_seconds": None if since is None else age(since, now)[0],
                "abandoned_by": by,
                "branch": None if by is None else view.branch_from(by),
                "action": "delete" if ref in deleted else "keep",
                "why_kept": plan.kept.get(ref),
            }
        )
    return out


def cmd_gc(args: argparse.Namespace) -> int:
    from .. import gc as gcmod
    from ..planner import parse_duration
    from ..reader import Reader

    uri = run_root(args.uri, "gc", " (use --pin STEP to keep a step)")
    if args.keep_last < 0:
        raise CliError("--keep-last must be >= 0 (the latest checkpoint is always kept)", EXIT_USAGE)
    if args.keep_every is not None and args.keep_every < 1:
        raise CliError("--keep-every must be a positive number of steps", EXIT_USAGE)
    grace = timedelta(seconds=parse_duration(args.grace))
    keep_abandoned = parse_keep_abandoned(args.keep_abandoned)
    pins = frozenset(parse_pin(p) for p in args.pin or ())
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    policy = gcmod.RetentionPolicy(
        keep_last=args.keep_last, keep_every=args.keep_every, pinned=pins, keep_abandoned=keep_abandoned
    )
    now = datetime.now(timezone.utc)
    reader = Reader(store)
    # plan_gc keeps the newest checkpoint that verifies (quarantined ones skipped): what restores use
    res = resolve_latest(reader)
    plan = gcmod.plan_gc(store, policy, grace_period=grace, now=now)
    abandoned = abandoned_report(RootView.read(reader, head=res.head), plan, now)
    result = None if args.dry_run else gcmod.run_gc(store, plan)
    if args.json:
        payload: dict[str, Any] = {
            "root": where,
            "dry_run": bool(args.dry_run),
            "keep_abandoned_seconds": None if keep_abandoned is None else keep_abandoned.total_seconds(),
            "plan": {**gc_plan_dict(plan), "abandoned": abandoned},
        }
        if result is not None:
            payload["result"] = _result_dict(result)
        emit_json(payload)
        return EXIT_OK
    out, _ = outputs()
    horizon = "never collected" if keep_abandoned is None else f"kept {format_duration(keep_abandoned)}"
    out.line(f"{'gc plan (dry run: nothing deleted)' if args.dry_run else 'gc'} for {where}:")
    for line in plan.describe():
        out.line(f"  {line}")
    if abandoned:
        out.line(f"abandoned checkpoints (off the head's line; {horizon} after they were abandoned):")
        for a in abandoned:
            when = "at an unknown time" if a["abandoned_at"] is None else a["abandoned_at"]
            ago = "" if a["age_seconds"] is None else f" ({age(a['abandoned_at'], now)[1]})"
            by = "" if a["abandoned_by"] is None else f" by timeline {a['abandoned_by']} ({a['branch']})"
            out.line(f"  {a['label']}: abandoned {when}{ago}{by}: {a['action']}")
    if result is not None:
        _print_result(out, result)
    return EXIT_OK


def format_duration(d: timedelta) -> str:
    from ..planner import format_duration as fmt

    return fmt(d.total_seconds())


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
        "kept": {label(ref): why for ref, why in sorted(plan.kept.items())},
        "delete": [
            {
                "step": d.step,
                "timeline": d.timeline,
                "label": d.label,
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


Target = int | tuple[int, int] | None  # a step (timeline 0) or a (timeline, step)


@dataclass(frozen=True)
class RmFacts:
    """What the refusal rules look at (one place to add more).

    ``head``, ``pointer_step`` and ``newest_valid`` name a checkpoint either by step (timeline
    0) or as ``(timeline, step)``; ``step`` and ``timeline`` are the checkpoint to delete.
    """

    step: int
    head: Target  # the head: the newest checkpoint of the newest timeline
    pointer_step: Target  # the target of LATEST
    newest_valid: Target  # what "latest" resolves to
    retention: str | None  # why plan_gc keeps the step anyway (None: it would delete it)
    timeline: int = 0
    base_of: tuple[int, ...] = ()  # timelines continuing from it that still hold checkpoints

    @property
    def ref(self) -> tuple[int, int]:
        return (self.timeline, self.step)

    def names(self, target: Target) -> bool:
        """Whether ``target`` names the checkpoint to delete."""
        if target is None:
            return False
        return self.ref == (target if isinstance(target, tuple) else (0, target))


def _rule_head(f: RmFacts) -> str | None:
    return "it is the newest committed step (the head)" if f.names(f.head) else None


def _rule_pointer(f: RmFacts) -> str | None:
    return "it is the target of LATEST" if f.names(f.pointer_step) else None


def _rule_newest_valid(f: RmFacts) -> str | None:
    return "it is the newest valid checkpoint (what a restore uses)" if f.names(f.newest_valid) else None


def _rule_base(f: RmFacts) -> str | None:
    if not f.base_of:
        return None
    which = ", ".join(map(str, f.base_of))
    return f"it is the base of timeline {which}, which still holds checkpoints (their line runs through it)"


def _rule_retention(f: RmFacts) -> str | None:
    return f"retention keeps it: {f.retention}" if f.retention else None


#: each rule says why a step must not be deleted without --force, or None
RM_RULES: tuple[Callable[[RmFacts], str | None], ...] = (
    _rule_head,
    _rule_pointer,
    _rule_newest_valid,
    _rule_base,
    _rule_retention,
)


def rm_refusals(facts: RmFacts) -> list[str]:
    """Every reason to refuse deleting ``facts.ref`` (empty: it may go)."""
    reasons: list[str] = []
    for rule in RM_RULES:
        why = rule(facts)
        if why and why not in reasons:
            reasons.append(why)
    return reasons


#: what plan_gc says for the checkpoints the rules above already refuse (not repeated)
_SAFETY = (
    "the head",
    "newest committed step",
    "target of LATEST",
    "newest checkpoint that verifies",
    "base of timeline",
)


def cmd_rm(args: argparse.Namespace) -> int:
    from .. import gc as gcmod
    from ..errors import ManifestError, NoCheckpointError
    from ..reader import Reader

    uri, step, timeline = split_target(args.target)
    if step is None:
        raise CliError(
            "rm needs ROOT@STEP or ROOT@tN:STEP: the checkpoint to delete (see 'objckpt ls ROOT')", EXIT_USAGE
        )
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    key = reader.locate(step, timeline)
    res = resolve_latest(reader)
    view = RootView.read(reader, head=res.head)
    refs = {k: r for r, k in view.keys.items()}
    if key not in refs:
        raise NoCheckpointError(
            f"no committed checkpoint for step {label((timeline or 0, step))} ({key}) under {where}"
        )
    ref = refs[key]
    manifest = None
    try:
        manifest = reader.fetch(key)
    except ManifestError:
        pass  # plan_gc leaves it for a human; --force deletes the manifest alone
    policy = gcmod.RetentionPolicy(
        keep_last=0,
        pinned=frozenset(r for r in view.keys if r != ref),
        keep_abandoned=timedelta(0),  # an abandoned checkpoint named here may go
    )
    full = gcmod.plan_gc(store, policy)
    planned = [d for d in full.manifests if (d.timeline, d.step) == ref]
    kept = full.why_kept(ref[1], ref[0])
    facts = RmFacts(
        step=ref[1],
        timeline=ref[0],
        head=view.head.ref,
        pointer_step=view.pointer_target,
        newest_valid=res.ref,
        # the rules above already name the safety reasons plan_gc gives; keep the others
        retention=None if kept is None or any(s in kept for s in _SAFETY) else kept,
        base_of=tuple(view.bases().get(ref, ())),
    )
    refusals = rm_refusals(facts)
    name = label(ref)
    if refusals and not args.force:
        raise CliError(
            f"refusing to delete step {name} under {where}: {'; '.join(refusals)} (--force deletes it anyway)",
            EXIT_FAILED,
        )
    if planned:
        deletion = planned[0]
    elif manifest is not None:
        deletion = gcmod.ManifestDeletion(
            ref[1],
            manifest.key,
            manifest.attempt,
            tuple(s.key for s in manifest.shards),
            manifest.total_size,
            ref[0],
        )
    else:  # forced, unreadable manifest: its shards become orphans for a later gc
        deletion = gcmod.ManifestDeletion(ref[1], key, "?", (), 0, ref[0])
    # Only this checkpoint: orphans and stale uploads are gc's business.
    plan = gcmod.GcPlan(manifests=[deletion], grace_period=full.grace_period, now=full.now)
    result = None
    if not args.dry_run:
        result = gcmod.run_gc(store, plan)
        if not result.deleted_manifests and args.force:
            # run_gc never deletes the target of LATEST; --force does, in the same safe order
            # (manifest first, then its shards). Readers then fall back past the dangling pointer.
            store.delete([deletion.key])
            live = gcmod.live_keys(reader)  # objects another checkpoint references stay
            doomed = [k for k in deletion.shard_keys if k not in live]
            store.delete(doomed)
            result = gcmod.GcResult(deleted_manifests=[deletion.key], deleted_objects=len(doomed))
    if args.json:
        doc: dict[str, Any] = {
            "root": where,
            "step": ref[1],
            "timeline": ref[0],
            "label": name,
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
