"""``runs PREFIX``: the run roots under a prefix, each with its head step and that step's age.

Run roots are found by their ``manifests/`` prefix, with one delimiter listing
(``Store.list_prefixes``) per level down to ``--depth``; a run root's own prefixes (``data/``,
``manifests/``, ``timelines/``, ``quarantine/``) are never descended into. Each root found is then resolved like any run root: one GET of its
``LATEST`` and the reader's bounded LIST of ``manifests/`` after the pointer's key.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from typing import Any

from .. import layout
from ._common import EXIT_OK, EXIT_USAGE, CliError, child_uri, display_uri, open_root, run_root
from ._latest import resolve_latest
from ._output import FOLD_COLUMNS, Out, age, emit_json, outputs

#: the two things a head step can come from, as printed
FROM_VALID = "newest valid"
FROM_POINTER = "LATEST pointer"
FROM_MANIFEST = "newest manifest"

#: a run root's own prefixes: never searched for run roots below them
_NEVER_DESCEND = {
    layout.DATA_PREFIX,
    layout.MANIFEST_PREFIX,
    layout.TIMELINE_PREFIX,
    layout.QUARANTINE_PREFIX,
}


def find_run_roots(store: Any, depth: int) -> list[str]:
    """Prefixes (relative to ``store``'s root, ``""`` for the root itself, else ending in
    ``/``) holding a ``manifests/`` prefix, at most ``depth`` levels down. A run root is not
    searched further."""
    roots: list[str] = []
    level = [""]
    for d in range(depth + 1):
        below: list[str] = []
        for prefix in level:
            subs = store.list_prefixes(prefix)
            if prefix + layout.MANIFEST_PREFIX in subs:
                roots.append(prefix)
                continue
            if d < depth:
                below.extend(s for s in subs if s[len(prefix) :] not in _NEVER_DESCEND)
        level = below
    return sorted(roots)


def describe_roots(
    uri: str, prefixes: list[str], options: dict[str, str], *, check_shards: bool, now: datetime
) -> list[dict[str, Any]]:
    """One row per run root: its head step, where that came from, and its age."""
    from ..errors import NotFoundError
    from ..reader import Reader

    rows = []
    for prefix in prefixes:
        sub = child_uri(uri, prefix)
        store = open_root(sub, options)
        try:
            reader = Reader(store)
            row: dict[str, Any] = {"root": display_uri(sub), "skipped": []}
            if check_shards:
                res = resolve_latest(reader)
                m, source, pointer = res.manifest, FROM_VALID, res.pointer
                row["skipped"] = [s.step for s in res.skipped]
                row["skipped_labels"] = [s.label for s in res.skipped]
            else:
                pointer = reader.pointer()
                m, source = None, FROM_POINTER
                if pointer is not None:
                    try:
                        m = reader.fetch(pointer.manifest_key)
                    except NotFoundError:
                        m = None
                if m is None:
                    m, source = reader.latest(), FROM_MANIFEST
            row.update(
                head_step=None if m is None else m.step,
                head_timeline=None if m is None else m.timeline,
                head_label=None if m is None else m.label,
                source=None if m is None else source,
                pointer_step=None if pointer is None else pointer.step,
                created_at=None if m is None else m.created_at,
                age_seconds=None if m is None else age(m.created_at, now)[0],
            )
            rows.append(row)
        finally:
            store.close()
    return rows


def render_roots(out: Out, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table
    from rich.text import Text

    now = datetime.now(timezone.utc)
    table = Table(box=None, pad_edge=False)
    for col, justify in (
        ("root", "left"),
        ("head", "right"),
        ("from", "left"),
        ("age", "right"),
        ("", "left"),
    ):
        table.add_column(col, justify=justify, no_wrap=col not in FOLD_COLUMNS, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        if r["head_step"] is None:
            table.add_row(Text(r["root"]), "-", "-", "-", "no valid checkpoint")
            continue
        skipped = r.get("skipped_labels") or [str(s) for s in r["skipped"]]
        extra = f"skipped damaged step(s) {', '.join(skipped)}" if skipped else ""
        table.add_row(
            Text(r["root"]),
            r.get("head_label") or str(r["head_step"]),
            r["source"],
            age(r["created_at"], now)[1],
            Text(extra),
        )
    out.render(table)


def cmd_runs(args: argparse.Namespace) -> int:
    uri = run_root(args.prefix, "runs")
    if args.depth < 0:
        raise CliError("--depth must be >= 0", EXIT_USAGE)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    try:
        prefixes = find_run_roots(store, args.depth)
    finally:
        store.close()
    now = datetime.now(timezone.utc)
    rows = describe_roots(uri, prefixes, args.store_options, check_shards=args.check_shards, now=now)
    if args.json:
        emit_json({"prefix": where, "depth": args.depth, "shards_checked": args.check_shards, "runs": rows})
        return EXIT_OK
    out, _ = outputs()
    if not rows:
        out.line(f"no run roots under {where} (searched {args.depth} level(s) down)")
        return EXIT_OK
    out.line(f"{len(rows)} run root(s) under {where}:")
    render_roots(out, rows)
    return EXIT_OK
