"""``verify``: download every shard of a checkpoint and check its size and CRC32C.

Without ``@STEP`` it verifies the latest checkpoint as every command means it (the newest
valid one) and reports the damaged newer ones it passed over as failures too. Only damage
(:func:`objckpt.errors.is_damage`) is a failed verification (exit 1); an outage or a permission
error means the checkpoint could not be verified, and exits 4 with the store's error.
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
    object_url,
    open_root,
    split_step,
)
from ._latest import resolve_latest
from ._output import emit_json, error_dict, error_line, human_bytes, outputs, progress


def _failed(step: int, problems: list[Any], *, skipped: bool = False) -> dict[str, Any]:
    return {
        "step": step,
        "ok": False,
        "shards": None,
        "bytes": None,
        "problems": problems,
        "skipped": skipped,
    }


def cmd_verify(args: argparse.Namespace) -> int:
    from .. import layout
    from ..errors import ManifestError, NoCheckpointError
    from ..reader import Problem, Reader

    uri, step = split_step(args.target)
    if args.all and step is not None:
        raise CliError("give either URI@STEP or --all, not both", EXIT_USAGE)
    store = open_root(uri, args.store_options)
    where = display_uri(uri)
    reader = Reader(store)
    results: list[dict[str, Any]] = []
    if args.all:
        steps = reader.steps()
        if not steps:
            raise NoCheckpointError(f"no committed checkpoint under {where}")
    elif step is not None:
        steps = [reader.load(step).step]
    else:
        res = resolve_latest(reader)
        if res.manifest is None and not res.skipped:
            res.require(where)
        for s in res.skipped:  # damaged checkpoints newer than the latest valid one
            problems = list(s.problems) or [Problem(s.step, s.key, s.reason)]
            results.append(_failed(s.step, problems, skipped=True))
        steps = [] if res.step is None else [res.step]
    for s in steps:
        try:
            m = reader.load(s)
        except ManifestError as exc:
            key = getattr(exc, "key", "") or layout.manifest_key(s)
            results.append(_failed(s, [Problem(s, key, str(exc))]))
            continue
        with progress(args, m.total_size, f"verify step {s}") as advance:
            problems = reader.verify(m, progress=advance)
        results.append(
            {
                "step": s,
                "ok": not problems,
                "shards": len(m.shards),
                "bytes": m.total_size,
                "problems": problems,
                "skipped": False,
            }
        )
    bad = [r for r in results if not r["ok"]]
    message = ""
    if bad:
        n = sum(len(r["problems"]) for r in bad)
        message = (
            f"verification failed: {n} bad object(s) in step(s) "
            f"{', '.join(str(r['step']) for r in bad)} under {where}"
        )
    if args.json:
        doc: dict[str, Any] = {
            "root": where,
            "ok": not bad,
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
            if r["ok"]:
                out.line(f"step {r['step']}: OK ({r['shards']} shards, {human_bytes(r['bytes'])} verified)")
                continue
            why = "DAMAGED, skipped: not the latest valid checkpoint" if r["skipped"] else "FAILED"
            out.line(f"step {r['step']}: {why} ({len(r['problems'])} bad object(s))")
            for p in r["problems"]:
                rank = f" (rank {p.rank})" if p.rank is not None else ""
                out.line(f"  {object_url(store, p.key)}{rank}: {p.reason}")
    if bad:
        error_line(message)
        return EXIT_FAILED
    return EXIT_OK
