"""``ls ROOT``: every committed checkpoint, as a tree of timelines.

Reads metadata only (``data/`` is never listed): one LIST of ``manifests/`` and one GET per
checkpoint, the timeline claims, one LIST of ``quarantine/`` (a GET per marker, for its
reason), and "latest" as everywhere (:func:`~objckpt.cli._latest.resolve_latest`, which
HEAD-checks the shards from the head down to the newest valid checkpoint).

Human output, one line per checkpoint, grouped by timeline and indented under the timeline it
branched from (a root with timeline 0 alone prints no tree)::

    file:///mnt/ckpt/eta
    step     attempt           ranks  shards      size     age
    timeline 0
      10     3f9c0a1b2c3d4e5f      2       4  11.7 KiB  2h ago  base of timeline 1
      20     0a1b2c3d4e5f6a7b      2       4  11.7 KiB  2h ago  (abandoned 1h ago)
      └─ timeline 1 (head): rollback from 10, 2026-05-04T10:00:00Z (1h ago)
           t1:20  5e6f7a8b9c0d1e2f      2       4  11.7 KiB  5m ago  <- LATEST

Marks: ``<- LATEST`` (the newest valid checkpoint of the head's line), ``(LATEST pointer)``
(the pointer names it but it is not the newest valid one), ``DAMAGED: why`` (passed over while
resolving latest), ``INVALID: why`` (the manifest does not validate), ``QUARANTINED[: reason]``,
``(abandoned AGE ago)`` (off the head's line), ``base of timeline N``, ``(+SIZE reused)`` (a
deduplicated step: ``size`` is what it wrote itself, SIZE what it references of its ancestors'
objects, from the manifest: an upper bound; ``show`` gives the exact figure).
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from typing import Any

from ._common import EXIT_OK, display_uri, label, open_root, ref_dict, run_root
from ._latest import Resolution, resolve_latest
from ._output import Out, age, emit_json, human_bytes, note, outputs, warn
from ._view import RootView

Ref = tuple[int, int]


def checkpoint_rows(reader: Any, view: RootView, res: Resolution, now: datetime) -> dict[Ref, dict[str, Any]]:
    """One JSON row per committed checkpoint (every timeline), by ref, oldest first."""
    from ..errors import ManifestError, NotFoundError

    damaged = {s.ref: s.reason for s in res.skipped if not s.invalid_manifest}
    bases: dict[Ref, list[int]] = {}
    for n, timeline_claim in sorted(view.claims.items()):
        bases.setdefault(timeline_claim.base_ref, []).append(n)
    rows: dict[Ref, dict[str, Any]] = {}
    for ref, key in sorted(view.keys.items()):
        by = view.abandoned_by(ref)
        claim = view.claims.get(by) if by is not None else None
        row: dict[str, Any] = {
            "step": ref[1],
            "timeline": ref[0],
            "label": label(ref),
            "manifest": key,
            "valid": True,
            "error": None,
            "on_line": view.on_line(ref),
            "abandoned": not view.on_line(ref),
            "abandoned_at": None if claim is None else claim.created_at,
            "abandoned_by": by,
            "quarantined": ref in view.quarantined,
            "quarantine_reason": view.quarantined.get(ref) or None,
            "base_of": bases.get(ref, []),
            "head": ref == view.head.ref,
            "pointer": ref == view.pointer_target,
            "latest": ref == res.ref,
            "damaged": damaged.get(ref),
        }
        try:
            m = reader.fetch(key)
        except NotFoundError:
            continue  # collected meanwhile
        except ManifestError as exc:
            row.update(valid=False, error=str(exc))
            rows[ref] = row
            continue
        parent = m.parent_ref
        row.update(
            attempt=m.attempt,
            world_size=m.world_size,
            shards=len(m.shards),
            bytes=m.total_size,  # what this step wrote (its own shards)
            reused_bytes=m.referenced_size,  # ancestors' objects it references (upper bound)
            logical_bytes=m.total_size + m.referenced_size,
            created_at=m.created_at,
            age_seconds=age(m.created_at, now)[0],
            parent=m.parent,
            parent_timeline=None if parent is None else parent[0],
            parent_label=None if parent is None else label(parent),
        )
        rows[ref] = row
    return rows


def timeline_docs(view: RootView, rows: dict[Ref, dict[str, Any]]) -> list[dict[str, Any]]:
    """One JSON entry per timeline: its base, why and when it was claimed, its checkpoints."""
    docs = []
    for n in view.timelines():
        claim = view.claims.get(n)
        docs.append(
            {
                "timeline": n,
                "base": None if claim is None else ref_dict(claim.base_ref),
                "reason": None if claim is None else claim.reason,
                "created_at": None if claim is None else claim.created_at,
                "claimed": claim is not None,
                "head": n == view.head.timeline,
                "on_line": n in view.line.timelines,
                "children": view.children(n),
                "checkpoints": [r for ref, r in rows.items() if ref[0] == n],
            }
        )
    return docs


def cmd_ls(args: argparse.Namespace) -> int:
    from ..reader import Reader

    uri = run_root(args.uri, "ls", " (use 'objckpt show URI@STEP')")
    store = open_root(uri, args.store_options)
    reader = Reader(store)
    now = datetime.now(timezone.utc)
    res = resolve_latest(reader)
    view = RootView.read(reader, head=res.head, reasons=True)
    rows = checkpoint_rows(reader, view, res, now)
    pointer = res.pointer
    where = display_uri(uri)
    roots: list[dict[str, Any]] | None = None
    if not rows and pointer is None:
        from ._runs import describe_roots, find_run_roots

        found = [p for p in find_run_roots(store, depth=2) if p]
        roots = describe_roots(uri, found, args.store_options, check_shards=False, now=now) if found else []
    if args.json:
        doc: dict[str, Any] = {
            "root": where,
            "pointer": None
            if pointer is None
            else {
                "step": pointer.step,
                "timeline": pointer.timeline,
                "attempt": pointer.attempt,
                "manifest": pointer.manifest_key,
            },
            "head": {"timeline": view.head.timeline, "checkpoint": ref_dict(view.head.ref)},
            "latest": res.step,
            "latest_ref": ref_dict(res.ref),
            "skipped": [s.to_dict() for s in res.skipped],
            "skipped_quarantined": [s.to_dict() for s in res.quarantined],
            "checkpoints": list(rows.values()),
            "timelines": timeline_docs(view, rows),
        }
        if roots:
            doc["run_roots"] = roots
        emit_json(doc)
        return EXIT_OK
    out, _ = outputs()
    if not rows:
        out.line(f"no committed checkpoints under {where}")
        if roots:
            from ._runs import render_roots

            out.line(f"run roots below it ({len(roots)}; details: objckpt runs {where}):")
            render_roots(out, roots)
        return EXIT_OK
    out.line(where)
    render_tree(out, view, rows, now)
    if view.pointer_target is not None and view.pointer_target not in rows:
        warn(f"LATEST names step {label(view.pointer_target)}, which has no manifest")
    if res.manifest is None:
        warn(f"no valid checkpoint under {where}")
    elif pointer is None:
        note("no LATEST pointer; '<- LATEST' (the newest valid checkpoint) resolved from manifests/")
    return EXIT_OK


# ---------------------------------------------------------------------------------- rendering

_HEADER = ("step", "attempt", "ranks", "shards", "size", "age", "")
_RIGHT = {2, 3, 4, 5}


def _marks(r: dict[str, Any], now: datetime) -> str:
    marks = []
    if not r["valid"]:
        marks.append(f"INVALID: {r['error']}")
    if r["damaged"]:
        marks.append(f"DAMAGED: {r['damaged']}")
    if r["quarantined"]:
        marks.append("QUARANTINED" + (f": {r['quarantine_reason']}" if r["quarantine_reason"] else ""))
    if r["abandoned"]:
        when = age(r["abandoned_at"], now)[1] if r["abandoned_at"] else "-"
        marks.append("(abandoned)" if when == "-" else f"(abandoned {when})")
    if r["base_of"]:
        marks.append(f"base of timeline {', '.join(map(str, r['base_of']))}")
    if r.get("reused_bytes"):  # a deduplicated step: "size" is what it added
        marks.append(f"(+{human_bytes(r['reused_bytes'])} reused)")
    if r["latest"]:
        marks.append("<- LATEST")
    elif r["pointer"]:
        marks.append("(LATEST pointer)")
    return "  ".join(marks)


def _cells(r: dict[str, Any], prefix: str, now: datetime) -> list[str]:
    name = prefix + r["label"]
    if not r["valid"]:
        return [name, "-", "-", "-", "-", "-", _marks(r, now)]
    return [
        name,
        r["attempt"],
        str(r["world_size"]),
        str(r["shards"]),
        human_bytes(r["bytes"]),
        age(r["created_at"], now)[1],
        _marks(r, now),
    ]


def _heading(view: RootView, n: int, has_rows: bool, now: datetime) -> str:
    tags = []
    if n == view.head.timeline:
        tags.append("head")
    elif n not in view.line.timelines:
        tags.append("abandoned")
    text = f"timeline {n}" + (f" ({', '.join(tags)})" if tags else "")
    claim = view.claims.get(n)
    if claim is not None:
        text += f": {view.branch_from(n)}, {claim.created_at} ({age(claim.created_at, now)[1]})"
    elif n:
        text += f": {view.branch_from(n)}"
    if not has_rows and n == view.head.timeline and claim is not None:
        text += "; no checkpoints yet: the next save continues from its base"
    return text


def render_tree(out: Out, view: RootView, rows: dict[Ref, dict[str, Any]], now: datetime) -> None:
    """The tree (see the module doc); columns aligned across every timeline."""
    lines: list[str | list[str]] = []  # a heading, or one checkpoint's cells
    tree = len(view.timelines()) > 1

    def walk(n: int, at: str, connector: str, body: str) -> None:
        mine = [r for ref, r in rows.items() if ref[0] == n]
        lines.append(at + connector + _heading(view, n, bool(mine), now))
        lines.extend(_cells(r, body, now) for r in mine)
        kids = view.children(n)
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            walk(child, body, "└─ " if last else "├─ ", body + ("     " if last else "│    "))

    if tree:
        for root in view.roots():
            walk(root, "", "", "  ")
    else:
        lines.extend(_cells(r, "", now) for r in rows.values())
    table = [list(_HEADER)] + [ln for ln in lines if isinstance(ln, list)]
    widths = [max(len(c[i]) for c in table) for i in range(len(_HEADER))]

    def fmt(cells: list[str]) -> str:
        parts = [
            c.rjust(w) if i in _RIGHT else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    out.line(fmt(list(_HEADER)))
    for ln in lines:
        out.line(ln if isinstance(ln, str) else fmt(ln))
