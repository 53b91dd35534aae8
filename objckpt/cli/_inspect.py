"""``ls``, ``show`` and ``latest``: read-only views of one run root."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import Any

from ._common import EXIT_OK, display_uri, object_url, open_root, redact, run_root, split_step
from ._latest import note_skipped, resolve_latest
from ._output import FOLD_COLUMNS, age, emit_json, human_bytes, outputs, warn


def cmd_ls(args: argparse.Namespace) -> int:
    from .. import layout
    from ..errors import ManifestError, NoCheckpointError
    from ..reader import Reader

    uri = run_root(args.uri, "ls", " (use 'objckpt show URI@STEP')")
    store = open_root(uri, args.store_options)
    reader = Reader(store)
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    # Manifests: one LIST of manifests/ and one GET per committed step; data/ is never listed.
    for meta in store.list(layout.MANIFEST_PREFIX):
        s = layout.step_of_manifest_key(meta.key)
        if s is None:
            continue
        row: dict[str, Any] = {"step": s, "manifest": meta.key, "valid": True, "error": None}
        try:
            m = reader.load(s)
        except (ManifestError, NoCheckpointError) as exc:
            row.update(valid=False, error=str(exc))
            rows.append(row)
            continue
        age_s, _ = age(m.created_at, now)
        row.update(
            attempt=m.attempt,
            world_size=m.world_size,
            shards=len(m.shards),
            bytes=m.total_size,
            created_at=m.created_at,
            age_seconds=age_s,
            parent=m.parent,
        )
        rows.append(row)
    # "latest" as everywhere: the newest valid checkpoint (HEAD-checks shards from the newest
    # down to it); the damaged ones passed over are marked.
    res = resolve_latest(reader)
    pointer = res.pointer
    damaged = {s.step: s for s in res.skipped if not s.invalid_manifest}
    for r in rows:
        r["pointer"] = pointer is not None and pointer.step == r["step"]
        r["latest"] = r["step"] == res.step
        r["damaged"] = damaged[r["step"]].reason if r["step"] in damaged else None
    where = display_uri(uri)
    roots: list[dict[str, Any]] | None = None
    if not rows and pointer is None:
        from ._runs import describe_roots, find_run_roots

        found = [p for p in find_run_roots(store, depth=2) if p]
        roots = describe_roots(uri, found, args.store_options, check_shards=False, now=now) if found else []
    if args.json:
        doc: dict[str, Any] = {
            "root": where,
            "pointer": None if pointer is None else {"step": pointer.step, "attempt": pointer.attempt},
            "latest": res.step,
            "skipped": [s.to_dict() for s in res.skipped],
            "checkpoints": rows,
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
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(where), title_justify="left", box=None, pad_edge=False)
    for col, justify in (
        ("step", "right"),
        ("attempt", "left"),
        ("ranks", "right"),
        ("shards", "right"),
        ("size", "right"),
        ("age", "right"),
        ("", "left"),
    ):
        table.add_column(col, justify=justify, no_wrap=col not in FOLD_COLUMNS, overflow="fold")  # type: ignore[arg-type]
    for r in rows:
        marks = []
        if r["latest"]:
            marks.append("<- LATEST")
        if r["pointer"] and not r["latest"]:
            marks.append("(LATEST pointer)")
        if not r["valid"]:
            table.add_row(
                str(r["step"]), "-", "-", "-", "-", "-", Text(" ".join([f"INVALID: {r['error']}", *marks]))
            )
            continue
        if r["damaged"]:
            marks.insert(0, f"DAMAGED: {r['damaged']}")
        table.add_row(
            str(r["step"]),
            r["attempt"],
            str(r["world_size"]),
            str(r["shards"]),
            human_bytes(r["bytes"]),
            age(r["created_at"], now)[1],
            Text(" ".join(marks)),
        )
    out.render(table)
    if pointer is not None and pointer.step not in {r["step"] for r in rows}:
        warn(f"LATEST names step {pointer.step}, which has no manifest")
    if res.step is None:
        warn(f"no valid checkpoint under {where}")
    elif pointer is None:
        from ._output import note

        note("no LATEST pointer; '<- LATEST' (the newest valid checkpoint) resolved from manifests/")
    return EXIT_OK


def _manifest_json(m: Any, where: str, *, shards: bool) -> dict[str, Any]:
    d = m.to_dict()
    if not shards:
        d.pop("shards")
    d.update(root=where, manifest_key=m.key, shard_count=len(m.shards), total_size=m.total_size)
    return d


def cmd_show(args: argparse.Namespace) -> int:
    from ..reader import Reader

    uri, step = split_step(args.target)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    skipped: list[Any] = []
    if step is not None:
        m = reader.load(step)
    else:
        res = resolve_latest(reader)
        m = res.require(where)
        skipped = res.skipped
        if not args.json:
            note_skipped(res)
    if args.json:
        doc = _manifest_json(m, where, shards=args.shards)
        if step is None:
            doc["skipped"] = [s.to_dict() for s in skipped]
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
    rows = [
        ("root", where),
        ("manifest", object_url(store, m.key)),
        ("step", str(m.step)),
        ("attempt", m.attempt),
        ("committed", f"{m.created_at} ({age(m.created_at, now)[1]})"),
        ("parent", "-" if m.parent is None else str(m.parent)),
        ("world size", str(m.world_size)),
        ("topology", json.dumps(m.topology, sort_keys=True)),
        ("run", json.dumps(run, sort_keys=True) if run else "-"),
        ("software", ", ".join(f"{k} {v}" for k, v in sorted(software.items())) or "-"),
        ("progress", json.dumps(m.progress, sort_keys=True) if m.progress else "-"),
        ("shards", f"{len(m.shards)} ({human_bytes(m.total_size)}, {m.total_size} bytes)"),
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
    from ..reader import Reader

    uri = run_root(args.uri, "latest")
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    # Default: what a restore would pick (manifest validated AND every shard HEAD-checked,
    # falling back along the parent chain); --no-check-shards validates the manifest only.
    res = resolve_latest(Reader(store), check_shards=args.check_shards)
    m = res.require(where)
    pointer = res.pointer
    if args.json:
        emit_json(
            {
                "root": where,
                "step": m.step,
                "attempt": m.attempt,
                "manifest_key": m.key,
                "created_at": m.created_at,
                "pointer_step": None if pointer is None else pointer.step,
                "shards_checked": bool(args.check_shards),
                "skipped": [s.to_dict() for s in res.skipped],
            }
        )
        return EXIT_OK
    out, _ = outputs()
    out.line(str(m.step))
    note_skipped(res)
    if pointer is None or pointer.step != m.step:
        from ._output import note

        what = "no LATEST pointer" if pointer is None else f"LATEST points at step {pointer.step}"
        note(f"{what}; resolved step {m.step} from manifests/")
    return EXIT_OK
