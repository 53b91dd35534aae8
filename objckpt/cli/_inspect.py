"""``show`` and ``latest``: read-only views of one checkpoint of a run root (``ls``: ``_ls``)."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import Any

from ._common import (
    EXIT_OK,
    display_uri,
    label,
    object_url,
    open_root,
    redact,
    ref_dict,
    run_root,
    split_target,
)
from ._latest import note_skipped, resolve_latest
from ._output import FOLD_COLUMNS, age, emit_json, human_bytes, note, outputs
from ._view import RootView


def _manifest_json(m: Any, where: str, *, shards: bool) -> dict[str, Any]:
    d: dict[str, Any] = m.to_dict()
    if not shards:
        d.pop("shards")
    d.update(root=where, manifest_key=m.key, shard_count=len(m.shards), total_size=m.total_size)
    return d


def checkpoint_state(view: RootView, m: Any) -> dict[str, Any]:
    """Where ``m`` stands on the run root's timelines (for ``show`` and ``verify``)."""
    claim = view.claims.get(m.timeline)
    by = view.abandoned_by(m.ref)
    left = view.claims.get(by) if by is not None else None
    return {
        "label": m.label,
        "parent_label": None if m.parent_ref is None else label(m.parent_ref),
        "timeline_base": None if claim is None else ref_dict(claim.base_ref),
        "timeline_reason": None if claim is None else claim.reason,
        "timeline_created_at": None if claim is None else claim.created_at,
        "head": m.ref == view.head.ref,
        "on_line": view.on_line(m.ref),
        "abandoned": not view.on_line(m.ref),
        "abandoned_at": None if left is None else left.created_at,
        "abandoned_by": by,
        "quarantined": m.ref in view.quarantined,
        "quarantine_reason": view.quarantined.get(m.ref) or None,
        "base_of": sorted(n for n, c in view.claims.items() if c.base_ref == m.ref),
    }


def _state_line(state: dict[str, Any], now: datetime) -> str:
    parts = []
    if state["head"]:
        parts.append("the head")
    if state["abandoned"]:
        since = f" {age(state['abandoned_at'], now)[1]}" if state["abandoned_at"] else ""
        by = f" (by timeline {state['abandoned_by']})" if state["abandoned_by"] is not None else ""
        parts.append(f"abandoned{since}{by}: off the head's line, restores never resume it")
    else:
        parts.append("on the head's line")
    if state["quarantined"]:
        why = f": {state['quarantine_reason']}" if state["quarantine_reason"] else ""
        parts.append(f"QUARANTINED{why} (restores skip it)")
    if state["base_of"]:
        parts.append(f"base of timeline {', '.join(map(str, state['base_of']))}")
    return "; ".join(parts)


def _usage_line(usage: Any) -> str:
    line = f"{human_bytes(usage.written_bytes)} written, {human_bytes(usage.logical_bytes)} logical"
    if usage.referenced_objects:
        bound = "" if usage.exact else " at most"
        line += (
            f" ({human_bytes(usage.referenced_bytes)}{bound} reused from {usage.referenced_objects} "
            f"object(s) of earlier checkpoints, {usage.written_fraction:.1%} of it written by this save)"
        )
    return line


def cmd_show(args: argparse.Namespace) -> int:
    from ..reader import Reader

    uri, step, timeline = split_target(args.target)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    res = None
    if step is not None:
        m = reader.load(step, timeline)
    else:
        res = resolve_latest(reader)
        m = res.require(where)
        if not args.json:
            note_skipped(res)
    view = RootView.read(reader, head=None if res is None else res.head, reasons=True)
    state = checkpoint_state(view, m)
    from ..usage import checkpoint_usage

    usage = checkpoint_usage(store, m)  # written vs logical bytes (deduplicated checkpoints)
    if args.json:
        doc = {**_manifest_json(m, where, shards=args.shards), **state}
        doc["usage"] = {
            "written_bytes": usage.written_bytes,
            "referenced_bytes": usage.referenced_bytes,
            "logical_bytes": usage.logical_bytes,
            "referenced_objects": usage.referenced_objects,
            "exact": usage.exact,
        }
        if res is not None:
            doc["skipped"] = [s.to_dict() for s in res.skipped]
            doc["skipped_quarantined"] = [s.to_dict() for s in res.quarantined]
        emit_json(doc)
        return EXIT_OK
    out, _ = outputs()
    from rich.table import Table

    now = datetime.now(timezone.utc)
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column(overflow="fold")
    run = dict(m.run)
    software = run.pop("software", {})
    claim = view.claims.get(m.timeline)
    branch = "" if claim is None else f" ({view.branch_from(m.timeline)}, {claim.created_at})"
    rows = [
        ("root", where),
        ("manifest", object_url(store, m.key)),
        ("step", str(m.step)),
        ("timeline", f"{m.timeline}{branch}"),
        ("state", _state_line(state, now)),
        ("attempt", m.attempt),
        ("committed", f"{m.created_at} ({age(m.created_at, now)[1]})"),
        ("parent", state["parent_label"] or "-"),
        ("world size", str(m.world_size)),
        ("topology", json.dumps(m.topology, sort_keys=True)),
        ("run", json.dumps(run, sort_keys=True) if run else "-"),
        ("software", ", ".join(f"{k} {v}" for k, v in sorted(software.items())) or "-"),
        ("progress", json.dumps(m.progress, sort_keys=True) if m.progress else "-"),
        ("shards", f"{len(m.shards)} ({human_bytes(m.total_size)}, {m.total_size} bytes)"),
        ("bytes", _usage_line(usage)),
        ("checksum", f"sha256:{m.checksum}"),
    ]
    if m.metadata:
        rows.append(("metadata", json.dumps(m.metadata, sort_keys=True)))
    from rich.text import Text

    for k, v in rows:
        summary.add_row(k, Text(redact(v)))
    out.render(summary)
    if args.shards:
        table = Table(box=None, pad_edge=False)
        for col, justify in (
            ("rank", "right"),
            ("name", "left"),
            ("size", "right"),
            ("crc32c", "left"),
            ("parts", "right"),
            ("key", "left"),
        ):
            table.add_column(col, justify=justify, no_wrap=col not in FOLD_COLUMNS, overflow="fold")  # type: ignore[arg-type]
        for s in sorted(m.shards, key=lambda s: (s.rank, s.name)):
            table.add_row(str(s.rank), Text(s.name), str(s.size), s.crc32c, str(s.parts), Text(s.key))
        out.line()
        out.render(table)
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    from .. import layout
    from ..reader import Reader

    uri = run_root(args.uri, "latest")
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    # Default: what a restore would pick (manifest validated, not quarantined, every shard
    # HEAD-checked, falling back along the head's line); --no-check-shards validates the
    # manifest only.
    res = resolve_latest(Reader(store), check_shards=args.check_shards)
    m = res.require(where)
    pointer = res.pointer
    target = None if pointer is None else layout.parse_manifest_key(pointer.manifest_key)
    if args.json:
        emit_json(
            {
                "root": where,
                "step": m.step,
                "timeline": m.timeline,
                "label": m.label,
                "attempt": m.attempt,
                "manifest_key": m.key,
                "created_at": m.created_at,
                "pointer_step": None if pointer is None else pointer.step,
                "pointer_timeline": None if pointer is None else pointer.timeline,
                "head_timeline": None if res.head is None else res.head.timeline,
                "shards_checked": bool(args.check_shards),
                "skipped": [s.to_dict() for s in res.skipped],
                "skipped_quarantined": [s.to_dict() for s in res.quarantined],
            }
        )
        return EXIT_OK
    out, _ = outputs()
    # The bare step: unambiguous, since URI@STEP names the step on the head's line (where the
    # latest checkpoint always is), and what scripts expect.
    out.line(str(m.step))
    note_skipped(res)
    if m.timeline:
        note(f"step {m.step} is on timeline {m.timeline} ({m.label})")
    if target != m.ref and not res.skipped and not res.quarantined:  # else the notes above say why
        what = "no LATEST pointer" if pointer is None else f"LATEST points at step {label(target or (0, 0))}"
        note(f"{what}; resolved step {m.label} from manifests/")
    return EXIT_OK
