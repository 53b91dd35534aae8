"""``verify``: download every shard of a checkpoint and check its size and CRC32C.

Without ``@STEP`` it verifies the latest checkpoint as every command means it (the newest
valid one) and reports the damaged newer ones it passed over as failures too. ``--all``
verifies every committed checkpoint, abandoned ones included. Only damage
(:func:`objckpt.errors.is_damage`) is a failed verification (exit 1); an outage or a permission
error means the checkpoint could not be verified, and exits 4 with the store's error.

Quarantine is a decision, not damage: a quarantined checkpoint is reported as ``QUARANTINED``
and never makes ``verify`` fail. Passed over on the way to the latest one it is listed but not
downloaded; named (``@STEP``) or under ``--all`` its bytes are verified like any other, and
only bad bytes fail (exit 1).
"""

from __future__ import annotations

import argparse
from typing import Any

from .. import layout
from ..errors import NotFoundError
from ._common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    display_uri,
    label,
    object_url,
    open_root,
    split_target,
)
from ._latest import resolve_latest
from ._output import emit_json, error_dict, error_line, human_bytes, outputs, progress
from ._view import RootView


def _entry(ref: tuple[int, int], view: RootView | None, **fields: Any) -> dict[str, Any]:
    reason = None if view is None else view.quarantined.get(ref)
    return {
        "step": ref[1],
        "timeline": ref[0],
        "label": label(ref),
        "ok": False,
        "verified": False,
        "shards": None,
        "bytes": None,
        "problems": [],
        "skipped": False,
        "quarantined": reason is not None,
        "quarantine_reason": reason or None,
        "abandoned": False if view is None else not view.on_line(ref),
        **fields,
    }


def cmd_verify(args: argparse.Namespace) -> int:
    from ..errors import ManifestError, NoCheckpointError
    from ..reader import Problem, Reader

    uri, step, timeline = split_target(args.target)
    if args.all and step is not None:
        raise CliError("give either URI@STEP or --all, not both", EXIT_USAGE)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    results: list[dict[str, Any]] = []
    if args.all:
        view = RootView.read(reader, reasons=True)
        keys = sorted(view.keys.items())  # every checkpoint, abandoned ones too
        if not keys:
            raise NoCheckpointError(f"no committed checkpoint under {where}")
    elif step is not None:
        key = reader.locate(step, timeline)
        ref = layout.parse_manifest_key(key) or (timeline or 0, step)
        view = RootView.read(reader, reasons=True)
        if ref not in view.keys:
            raise NoCheckpointError(f"no committed checkpoint for step {label(ref)} ({key}) under {where}")
        keys = [(ref, key)]
    else:
        res = resolve_latest(reader)
        if res.manifest is None and not res.skipped and not res.quarantined:
            res.require(where)
        view = RootView.read(reader, head=res.head, reasons=True)
        for s in res.skipped:  # damaged checkpoints newer than the latest valid one
            problems = list(s.problems) or [Problem(s.step, s.key, s.reason)]
            results.append(_entry(s.ref, view, problems=problems, skipped=True))
        for s in res.quarantined:  # set aside: reported, not verified, not a failure
            results.append(_entry(s.ref, view, ok=True, skipped=True))
        results.sort(key=lambda r: (r["timeline"], r["step"]), reverse=True)
        keys = [] if res.manifest is None else [(res.manifest.ref, res.manifest.key)]
    for ref, key in keys:
        try:
            m = reader.fetch(key)
        except ManifestError as exc:
            results.append(_entry(ref, view, problems=[Problem(ref[1], key, str(exc))]))
            continue
        except NotFoundError:
            continue  # collected meanwhile
        with progress(args, m.total_size, f"verify step {m.label}") as advance:
            problems = reader.verify(m, progress=advance)
        results.append(
            _entry(
                ref,
                view,
                ok=not problems,
                verified=True,
                shards=len(m.shards),
                bytes=m.total_size,
                problems=problems,
            )
        )
    bad = [r for r in results if not r["ok"]]
    quarantined = [r for r in results if r["quarantined"]]
    message = ""
    if bad:
        n = sum(len(r["problems"]) for r in bad)
        message = (
            f"verification failed: {n} bad object(s) in step(s) "
            f"{', '.join(r['label'] for r in bad)} under {where}"
        )
    if args.json:
        doc: dict[str, Any] = {
            "root": where,
            "ok": not bad,
            "quarantined": [r["label"] for r in quarantined],
            "steps": [
                {
                    **{k: v for k, v in r.items() if k != "problems"},
                    "problems": [
                        {"key": p.key, "url": object_url(store, p.key), "rank": p.rank, "reason": p.reason}
                        for p in r["problems"]
                    ],
                }
                for r in results
            ],
        }
        if bad:
            doc["error"] = error_dict("VerificationFailed", message, EXIT_FAILED, "verify")
        emit_json(doc)
    else:
        out, _ = outputs()
        for r in results:
            out.line(_describe(r))
            for p in r["problems"]:
                rank = f" (rank {p.rank})" if p.rank is not None else ""
                out.line(f"  {object_url(store, p.key)}{rank}: {p.reason}")
    if bad:
        error_line(message)
        return EXIT_FAILED
    return EXIT_OK


def _describe(r: dict[str, Any]) -> str:
    why = f": {r['quarantine_reason']}" if r["quarantine_reason"] else ""
    if r["quarantined"] and not r["verified"]:
        return f"step {r['label']}: QUARANTINED{why}, skipped: set aside, not verified (restores skip it)"
    if r["ok"]:
        text = f"step {r['label']}: OK ({r['shards']} shards, {human_bytes(r['bytes'])} verified)"
    else:
        what = "DAMAGED, skipped: not the latest valid checkpoint" if r["skipped"] else "FAILED"
        text = f"step {r['label']}: {what} ({len(r['problems'])} bad object(s))"
    if r["quarantined"]:
        text += f"; QUARANTINED{why} (restores skip it)"
    if r["abandoned"]:
        text += "; abandoned (off the head's line)"
    return text
