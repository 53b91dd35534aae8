"""``objckpt``: inspect, verify, garbage-collect and copy checkpoints; plan the save interval.

Commands::

    objckpt ls      URI                 committed steps (from manifests only), sizes, ages
    objckpt show    URI[@STEP]          one manifest: step, attempt, run identity, shards
    objckpt latest  URI                 the step a restore would use
    objckpt verify  URI[@STEP]          download every shard and check its CRC32C (--all)
    objckpt gc      URI --keep-last N   apply a retention policy (--dry-run prints the plan)
    objckpt cp      SRC[@STEP] DST      replicate a committed checkpoint to another run root
    objckpt plan    --save 12s          Young/Daly checkpoint interval and its cost
    objckpt demo    ...                 the end-to-end demo (needs objckpt[torch])

A run root is ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///abs/path`` or
``memory://name``; append ``@STEP`` (or ``@latest``) to name one checkpoint. Store options come
as URI query parameters (``s3://b/run?endpoint_url=http://127.0.0.1:9000``) or repeated
``-o key=value``; credentials are never printed (secret-looking option values are masked).

Exit codes:
    0  success
    1  verification or commit failure (a bad shard, an invalid manifest, a commit conflict);
       also an unexpected internal error
    2  usage or configuration error (bad arguments, bad URI, unknown option, missing extra)
    3  not found (no committed checkpoint, no such step, no such bucket)
    4  store or permission error (access denied, server errors after retries)

Errors print one line naming the URI or key (never a traceback unless ``--debug``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .errors import (
    CommitError,
    ConfigError,
    IntegrityError,
    NoCheckpointError,
    NotFoundError,
    ObjckptError,
    StoreError,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_STORE",
    "EXIT_USAGE",
    "exit_code_for",
    "main",
    "redact",
    "split_step",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE = 4

EPILOG = """\
exit codes:
  0  success
  1  verification or commit failure (bad shard, invalid manifest, commit conflict)
  2  usage or configuration error (bad arguments or URI, unknown option, missing extra)
  3  not found (no committed checkpoint, no such step, no such bucket)
  4  store or permission error (access denied, server errors after retries)

run roots: s3://bucket/prefix  gs://bucket/prefix  file:///abs/path  memory://name
  append @STEP (or @latest) to name one checkpoint; store options as URI query parameters
  or -o key=value (e.g. -o endpoint_url=http://127.0.0.1:9000). Secrets are never printed.

examples:
  objckpt ls s3://bucket/runs/eta
  objckpt verify gs://bucket/runs/eta@2000
  objckpt gc s3://bucket/runs/eta --keep-last 3 --keep-every 1000 --dry-run
  objckpt cp s3://bucket/runs/eta gs://other/runs/eta
  objckpt plan --save 12s --mtbf 24h --restart 2m
"""

# Option names whose values are secrets: masked wherever a URI or message is printed.
_SECRET_NAME = re.compile(
    r"(secret|token|password|passwd|credential|private|access_key|key_id|api_key|auth)",
    re.IGNORECASE,
)
_SECRET_ASSIGNMENT = re.compile(
    r"((?:[A-Za-z0-9_]*(?:secret|token|password|passwd|credential|private|access_key|key_id"
    r"|api_key|auth)[A-Za-z0-9_]*)=)([^&\s'\"]+)",
    re.IGNORECASE,
)


class CliError(Exception):
    """A failure the CLI reports as one line with a given exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------- helpers


class _Secrets:
    """Values to mask in anything printed (collected from -o and URI query strings)."""

    values: set[str] = set()

    @classmethod
    def add_options(cls, options: dict[str, str]) -> None:
        for k, v in options.items():
            if _SECRET_NAME.search(k) and v and len(v) >= 3:
                cls.values.add(v)


def redact(text: str) -> str:
    """Mask secret-looking ``name=value`` pairs and every known secret value in ``text``."""
    text = _SECRET_ASSIGNMENT.sub(r"\1***", text)
    for value in sorted(_Secrets.values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text


def split_step(target: str) -> tuple[str, int | None]:
    """``"s3://b/run@20?x=y"`` -> (``"s3://b/run?x=y"``, 20); ``@latest`` or none -> None.

    The ``@STEP`` suffix belongs to the path; it may come before or after a query string.

    Raises:
        CliError: a malformed ``@STEP``.
    """
    parts = urlsplit(target)
    path, query = parts.path, parts.query
    step: int | None = None
    m = re.search(r"@([^/@?]*)$", path)
    if m is None and query:
        qm = re.search(r"@([^/@&=]*)$", query)  # tolerate run?opts@20
        if qm is not None:
            m, query = qm, query[: qm.start()]
    elif m is not None:
        path = path[: m.start()]
    if m is not None:
        token = m.group(1)
        if token.lower() != "latest":
            if not token.isdigit():
                raise CliError(
                    f"bad step {token!r} in {redact(target)!r}: use URI@STEP with a "
                    "non-negative integer step, or URI@latest",
                    EXIT_USAGE,
                )
            step = int(token)
    if not parts.scheme and not path and parts.netloc:
        path = ""
    return urlunsplit((parts.scheme, parts.netloc, path, query, parts.fragment)), step


def _parse_options(pairs: Sequence[str] | None) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"bad store option {redact(pair)!r}: use -o key=value", EXIT_USAGE)
        options[key.strip()] = value
    _Secrets.add_options(options)
    return options


def _display_uri(uri: str) -> str:
    """The URI as printed in headings and JSON: without its query string (store options may
    hold credentials, and endpoints are noise next to the run root)."""
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _open(uri: str, options: dict[str, str]) -> Any:
    """Open the store for ``uri`` (query options + ``-o`` options; ``-o`` wins)."""
    from .store import open_store, parse_uri

    parsed = parse_uri(uri)  # ConfigError -> exit 2
    _Secrets.add_options(dict(parsed.options))
    return open_store(uri, **options)


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code for an exception."""
    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, ConfigError):
        return EXIT_USAGE
    if isinstance(exc, (NoCheckpointError, NotFoundError)):
        return EXIT_NOT_FOUND
    if isinstance(exc, (IntegrityError, CommitError)):
        return EXIT_FAILED
    if isinstance(exc, (StoreError, PermissionError)):
        return EXIT_STORE
    if isinstance(exc, ValueError):
        return EXIT_USAGE
    return EXIT_FAILED


def _human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None


def _age(created_at: str, now: datetime) -> tuple[float | None, str]:
    t = _parse_time(created_at)
    if t is None:
        return None, "-"
    seconds = max(0.0, (now - t).total_seconds())
    from .planner import format_duration

    return seconds, f"{format_duration(seconds)} ago"


def _consoles(args: argparse.Namespace) -> tuple[Any, Any]:
    from rich.console import Console

    out_tty = sys.stdout.isatty()
    # Piped output keeps full lines (rich would otherwise wrap tables at 80 columns).
    out = Console(highlight=False, width=None if out_tty else 200, soft_wrap=not out_tty)
    err = Console(stderr=True, highlight=False)
    return out, err


@contextmanager
def _progress(
    args: argparse.Namespace, err: Any, total: int, description: str
) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr; ``--progress`` forces it, default only on a terminal."""
    enabled = args.progress if args.progress is not None else err.is_terminal
    if not enabled or getattr(args, "json", False) and args.progress is None:
        yield lambda n: None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,
    ) as bar:
        task = bar.add_task(redact(description), total=total)
        yield lambda n: bar.update(task, advance=n)


def _emit_json(obj: Any) -> None:
    sys.stdout.write(redact(json.dumps(obj, indent=2, sort_keys=True, default=str)) + "\n")


def _object_url(store: Any, key: str) -> str:
    return f"{store.location.rstrip('/')}/{key}"


# ---------------------------------------------------------------------------------- commands


def _run_root(value: str, command: str, hint: str = "") -> str:
    """The run root of a command that takes no ``@STEP`` (usage error otherwise)."""
    uri, step = split_step(value)
    if step is not None:
        raise CliError(f"{command} takes a run root, not URI@STEP{hint}", EXIT_USAGE)
    return uri


def _resolve(reader: Any, step: int | None, where: str) -> Any:
    if step is not None:
        return reader.load(step)
    m = reader.latest()
    if m is None:
        raise NoCheckpointError(f"no committed checkpoint under {where}")
    return m


def cmd_ls(args: argparse.Namespace) -> int:
    from . import layout
    from .errors import ManifestError
    from .reader import Reader

    uri = _run_root(args.uri, "ls", " (use 'objckpt show URI@STEP')")
    store = _open(uri, args.store_options)
    reader = Reader(store)
    pointer = reader.pointer()
    now = datetime.now(timezone.utc)
    rows: list[dict[str, Any]] = []
    # Manifests only: one LIST of manifests/ and one GET per committed step; data/ is never listed.
    for meta in store.list(layout.MANIFEST_PREFIX):
        s = layout.step_of_manifest_key(meta.key)
        if s is None:
            continue
        row: dict[str, Any] = {
            "step": s,
            "manifest": meta.key,
            "valid": True,
            "error": None,
            "pointer": pointer is not None and pointer.step == s,
        }
        try:
            m = reader.load(s)
        except (ManifestError, NoCheckpointError) as exc:
            row.update(valid=False, error=str(exc))
            rows.append(row)
            continue
        age_s, _ = _age(m.created_at, now)
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
    valid = [r["step"] for r in rows if r["valid"]]
    latest = max(valid) if valid else None  # what Reader.latest() resolves to (rolls forward)
    for r in rows:
        r["latest"] = r["step"] == latest
    where = _display_uri(uri)
    if args.json:
        _emit_json(
            {
                "root": where,
                "pointer": None if pointer is None else {"step": pointer.step, "attempt": pointer.attempt},
                "latest": latest,
                "checkpoints": rows,
            }
        )
        return EXIT_OK
    out, err = _consoles(args)
    if not rows:
        out.print(f"no committed checkpoints under {where}")
        return EXIT_OK
    from rich.table import Table

    table = Table(title=f"{where}", title_justify="left", box=None, pad_edge=False)
    for col, justify in (
        ("step", "right"),
        ("attempt", "left"),
        ("ranks", "right"),
        ("shards", "right"),
        ("size", "right"),
        ("age", "right"),
        ("", "left"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        marks = []
        if r["pointer"]:
            marks.append("<- LATEST")
        if r["latest"] and not r["pointer"]:
            marks.append("<- latest (pointer lags)" if pointer is not None else "<- latest (no pointer)")
        if not r["valid"]:
            table.add_row(
                str(r["step"]),
                "-",
                "-",
                "-",
                "-",
                "-",
                f"INVALID: {r['error']}" + (" " + " ".join(marks) if marks else ""),
            )
            continue
        table.add_row(
            str(r["step"]),
            r["attempt"],
            str(r["world_size"]),
            str(r["shards"]),
            _human_bytes(r["bytes"]),
            _age(r["created_at"], now)[1],
            " ".join(marks),
        )
    out.print(table)
    if pointer is not None and pointer.step not in {r["step"] for r in rows}:
        err.print(f"warning: LATEST names step {pointer.step}, which has no manifest")
    return EXIT_OK


def _manifest_json(m: Any, store: Any, where: str, *, shards: bool) -> dict[str, Any]:
    d = m.to_dict()
    if not shards:
        d.pop("shards")
    d.update(root=where, manifest_key=m.key, shard_count=len(m.shards), total_size=m.total_size)
    return d


def cmd_show(args: argparse.Namespace) -> int:
    from .reader import Reader

    uri, step = split_step(args.target)
    store = _open(uri, args.store_options)
    where = _display_uri(uri)
    m = _resolve(Reader(store), step, where)
    if args.json:
        _emit_json(_manifest_json(m, store, where, shards=args.shards))
        return EXIT_OK
    out, _ = _consoles(args)
    from rich.table import Table

    now = datetime.now(timezone.utc)
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column()
    run = dict(m.run)
    software = run.pop("software", {})
    rows = [
        ("root", where),
        ("manifest", _object_url(store, m.key)),
        ("step", str(m.step)),
        ("attempt", m.attempt),
        ("committed", f"{m.created_at} ({_age(m.created_at, now)[1]})"),
        ("parent", "-" if m.parent is None else str(m.parent)),
        ("world size", str(m.world_size)),
        ("topology", json.dumps(m.topology, sort_keys=True)),
        ("run", json.dumps(run, sort_keys=True) if run else "-"),
        ("software", ", ".join(f"{k} {v}" for k, v in sorted(software.items())) or "-"),
        ("progress", json.dumps(m.progress, sort_keys=True) if m.progress else "-"),
        ("shards", f"{len(m.shards)} ({_human_bytes(m.total_size)}, {m.total_size} bytes)"),
        ("checksum", f"sha256:{m.checksum}"),
    ]
    if m.metadata:
        rows.append(("metadata", json.dumps(m.metadata, sort_keys=True)))
    for k, v in rows:
        summary.add_row(k, redact(v))
    out.print(summary)
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
            table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        for s in sorted(m.shards, key=lambda s: (s.rank, s.name)):
            table.add_row(str(s.rank), s.name, str(s.size), s.crc32c, str(s.parts), s.key)
        out.print()
        out.print(table)
    return EXIT_OK


def cmd_latest(args: argparse.Namespace) -> int:
    from .reader import Reader

    uri = _run_root(args.uri, "latest")
    store = _open(uri, args.store_options)
    where = _display_uri(uri)
    reader = Reader(store)
    # Default: what a restore would pick (manifest validated AND every shard HEAD-checked,
    # falling back along the parent chain); --no-check-shards validates the manifest only.
    m = reader.latest_valid() if args.check_shards else reader.latest()
    if m is None:
        raise NoCheckpointError(f"no committed (valid) checkpoint under {where}")
    pointer = reader.pointer()
    if args.json:
        _emit_json(
            {
                "root": where,
                "step": m.step,
                "attempt": m.attempt,
                "manifest_key": m.key,
                "created_at": m.created_at,
                "pointer_step": None if pointer is None else pointer.step,
                "shards_checked": bool(args.check_shards),
            }
        )
    else:
        print(m.step)
        if pointer is None or pointer.step != m.step:
            _, err = _consoles(args)
            note = "no LATEST pointer" if pointer is None else f"LATEST points at step {pointer.step}"
            err.print(f"note: {note}; resolved step {m.step} from manifests/")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .errors import ManifestError
    from .reader import Problem, Reader

    uri, step = split_step(args.target)
    if args.all and step is not None:
        raise CliError("give either URI@STEP or --all, not both", EXIT_USAGE)
    store = _open(uri, args.store_options)
    where = _display_uri(uri)
    reader = Reader(store)
    out, err = _consoles(args)
    if args.all:
        steps = reader.steps()
        if not steps:
            raise NoCheckpointError(f"no committed checkpoint under {where}")
    else:
        steps = [_resolve(reader, step, where).step]
    results: list[dict[str, Any]] = []
    for s in steps:
        try:
            m = reader.load(s)
        except ManifestError as exc:
            problems = [Problem(s, getattr(exc, "key", "") or f"manifests/{s:020d}.json", str(exc))]
            results.append({"step": s, "ok": False, "shards": None, "bytes": None, "problems": problems})
            continue
        with _progress(args, err, m.total_size, f"verify step {s}") as advance:
            problems = reader.verify(m, progress=advance)
        results.append(
            {
                "step": s,
                "ok": not problems,
                "shards": len(m.shards),
                "bytes": m.total_size,
                "problems": problems,
            }
        )
    bad = [r for r in results if not r["ok"]]
    if args.json:
        _emit_json(
            {
                "root": where,
                "ok": not bad,
                "steps": [
                    {
                        **{k: v for k, v in r.items() if k != "problems"},
                        "problems": [
                            {
                                "key": p.key,
                                "url": _object_url(store, p.key),
                                "rank": p.rank,
                                "reason": p.reason,
                            }
                            for p in r["problems"]
                        ],
                    }
                    for r in results
                ],
            }
        )
    else:
        for r in results:
            if r["ok"]:
                out.print(f"step {r['step']}: OK ({r['shards']} shards, {_human_bytes(r['bytes'])} verified)")
            else:
                out.print(f"step {r['step']}: FAILED ({len(r['problems'])} bad object(s))")
                for p in r["problems"]:
                    rank = f" (rank {p.rank})" if p.rank is not None else ""
                    out.print(f"  {redact(_object_url(store, p.key))}{rank}: {redact(p.reason)}")
    if bad:
        n = sum(len(r["problems"]) for r in bad)
        _error_line(
            f"verification failed: {n} bad object(s) in step(s) "
            f"{', '.join(str(r['step']) for r in bad)} under {where}"
        )
        return EXIT_FAILED
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from . import gc as gcmod
    from .planner import parse_duration

    uri = _run_root(args.uri, "gc", " (use --pin STEP to keep a step)")
    if args.keep_last < 0:
        raise CliError("--keep-last must be >= 0 (the latest checkpoint is always kept)", EXIT_USAGE)
    if args.keep_every is not None and args.keep_every < 1:
        raise CliError("--keep-every must be a positive number of steps", EXIT_USAGE)
    grace = timedelta(seconds=parse_duration(args.grace))
    store = _open(uri, args.store_options)
    where = _display_uri(uri)
    policy = gcmod.RetentionPolicy(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        pinned=frozenset(args.pin or ()),
    )
    plan = gcmod.plan_gc(store, policy, grace_period=grace)
    result = None if args.dry_run else gcmod.run_gc(store, plan)
    if args.json:
        payload: dict[str, Any] = {"root": where, "dry_run": bool(args.dry_run), "plan": _gc_plan_dict(plan)}
        if result is not None:
            payload["result"] = {
                "deleted_manifests": list(result.deleted_manifests),
                "deleted_objects": result.deleted_objects,
                "aborted_uploads": result.aborted_uploads,
                "skipped": list(result.skipped),
            }
        _emit_json(payload)
        return EXIT_OK
    out, _ = _consoles(args)
    out.print(f"{'gc plan (dry run: nothing deleted)' if args.dry_run else 'gc'} for {where}:")
    for line in plan.describe():
        out.print(f"  {redact(line)}")
    if result is not None:
        out.print(
            f"deleted {len(result.deleted_manifests)} manifest(s) and {result.deleted_objects} "
            f"object(s); aborted {result.aborted_uploads} upload(s)"
        )
        for why in result.skipped:
            out.print(f"  skipped: {redact(why)}")
    return EXIT_OK


def _gc_plan_dict(plan: Any) -> dict[str, Any]:
    return {
        "kept": {str(s): why for s, why in sorted(plan.kept.items())},
        "delete": [
            {
                "step": d.step,
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


def cmd_cp(args: argparse.Namespace) -> int:
    from .reader import Reader
    from .replicate import replicate

    src_uri, step = split_step(args.src)
    dst_uri, dst_step = split_step(args.dst)
    if dst_step is not None:
        raise CliError("the destination is a run root: the step is kept (drop @STEP from DST)", EXIT_USAGE)
    if args.all and step is not None:
        raise CliError("give either SRC@STEP or --all, not both", EXIT_USAGE)
    src = _open(src_uri, {**args.store_options, **_parse_options(args.src_option)})
    dst = _open(dst_uri, {**args.store_options, **_parse_options(args.dst_option)})
    src_where, dst_where = _display_uri(src_uri), _display_uri(dst_uri)
    out, err = _consoles(args)
    reader = Reader(src)
    results: list[dict[str, Any]] = []

    def report(step: int, source: Any, m: Any, copied: bool) -> None:
        results.append(
            {
                "step": step,
                "copied": copied,
                "source_attempt": source.attempt,
                "attempt": m.attempt,
                "shards": len(m.shards),
                "bytes": m.total_size,
            }
        )
        if not args.json:
            if copied:
                out.print(
                    f"copied step {step} ({len(m.shards)} shards, {_human_bytes(m.total_size)}) "
                    f"{src_where} -> {dst_where} as attempt {m.attempt}"
                )
            else:
                out.print(f"step {step} already at {dst_where} (attempt {m.attempt}); nothing to do")

    steps = reader.steps() if args.all else [_resolve(reader, step, src_where).step]
    if not steps:
        raise NoCheckpointError(f"no committed checkpoint under {src_where}")
    # Oldest first (steps() is ascending) so the destination pointer only moves forward; one
    # step at a time (like replicate_all) so each gets its own progress bar.
    for s in steps:
        _copy_one(args, err, reader, src, dst, s, report, replicate)
    if args.json:
        _emit_json({"src": src_where, "dst": dst_where, "steps": results})
    return EXIT_OK


def _copy_one(
    args: argparse.Namespace,
    err: Any,
    reader: Any,
    src: Any,
    dst: Any,
    step: int,
    report: Callable[..., None],
    replicate: Callable[..., Any],
) -> None:
    source = reader.load(step)
    existed: list[Any] = []
    with _progress(args, err, source.total_size, f"copy step {step}") as advance:
        m = replicate(src, dst, step, advance, on_exists=existed.append)
    report(step, source, m, copied=not existed)


def cmd_plan(args: argparse.Namespace) -> int:
    from .planner import format_duration, make_plan, parse_duration

    if args.save is None:
        raise CliError("plan needs --save DURATION (how long one save blocks training, e.g. 12s)", EXIT_USAGE)
    save = parse_duration(args.save)
    if args.failures_per_day is not None:
        if args.failures_per_day <= 0:
            raise CliError("--failures-per-day must be positive", EXIT_USAGE)
        mtbf = 86400.0 / args.failures_per_day
    else:
        mtbf = parse_duration(args.mtbf)
    restart = parse_duration(args.restart)
    step_s = parse_duration(args.step_time) if args.step_time is not None else None
    candidates = [parse_duration(c) for c in args.interval] if args.interval else None
    plan = make_plan(
        save,
        mtbf,
        restart_seconds=restart,
        step_seconds=step_s,
        **({"candidates": candidates} if candidates else {}),
    )
    if args.json:
        _emit_json(plan.to_dict())
        return EXIT_OK
    out, _ = _consoles(args)
    from rich.table import Table

    out.print(
        f"save cost {format_duration(save)}, restart cost {format_duration(restart)}, "
        f"MTBF {format_duration(mtbf)}" + (f", step time {format_duration(step_s)}" if step_s else "")
    )
    out.print(
        f"Young's optimum sqrt(2 x save x MTBF) = {format_duration(plan.young_s)}; "
        f"Daly's refinement = {format_duration(plan.daly_s)}"
    )
    table = Table(box=None, pad_edge=False)
    cols = [("every", "right")]
    if step_s:
        cols.append(("steps", "right"))
    cols += [
        ("overhead", "right"),
        ("expected loss / failure", "right"),
        ("expected waste", "right"),
        ("", "left"),
    ]
    for col, justify in cols:
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in plan.rows:
        cells = [format_duration(r.interval_s)]
        if step_s:
            cells.append(str(r.every_steps))
        note = {"young": "Young optimum", "daly": "<- Daly optimum (recommended)"}.get(r.label, "")
        cells += [
            f"{r.overhead:.1%}",
            f"~{format_duration(r.expected_loss_s)}",
            f"{r.expected_waste:.2%}",
            note,
        ]
        table.add_row(*cells)
    out.print(table)
    best = plan.optimum
    steps = f" ({best.every_steps} steps)" if best.every_steps else ""
    out.print(
        f"recommended: checkpoint every {format_duration(best.interval_s)}{steps}: "
        f"{best.overhead:.1%} overhead, ~{format_duration(best.expected_loss_s)} lost per failure"
    )
    out.print(
        "(overhead = save / interval; expected loss = interval / 2 + restart; "
        "waste = both, as a fraction of wall time)"
    )
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import importlib

    try:
        # Lazily: the demo needs torch; every other command works without it.
        demo = importlib.import_module("objckpt.demo")
    except ImportError as exc:
        if getattr(exc, "name", None) == "objckpt.demo":
            raise CliError(
                "the demo is not part of this installation (objckpt.demo is missing)", EXIT_USAGE
            ) from exc
        raise CliError(
            f"the demo needs extra packages ({exc}); install them with pip install 'objckpt[torch]'",
            EXIT_USAGE,
        ) from exc
    rc = demo.main(list(args.demo_args))
    return int(rc or 0)


# ---------------------------------------------------------------------------------- parser


def _with_common(
    p: argparse.ArgumentParser, *, json_flag: bool = True, store: bool = True, progress: bool = False
) -> None:
    if store:
        p.add_argument(
            "-o",
            "--option",
            dest="options",
            action="append",
            metavar="KEY=VALUE",
            help="store option (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000",
        )
    if json_flag:
        p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    if progress:
        p.add_argument(
            "--progress",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="byte progress bar on stderr (default: only on a terminal)",
        )
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs"
    )


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="objckpt",
        description="Complete, coordinated, immutable-until-committed checkpoints on object "
        "storage (S3, GCS, local files): inspect, verify, collect, copy, plan.",
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    from ._version import __version__

    parser.add_argument("--version", action="version", version=f"objckpt {__version__}")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks and debug logs")
    parser.add_argument(
        "-o",
        "--option",
        dest="global_options",
        action="append",
        metavar="KEY=VALUE",
        help="store option applied to every URI (repeatable)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def add(name: str, help_: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help_, description=description, epilog=EPILOG, formatter_class=_Formatter
        )

    p = add(
        "ls",
        "list committed checkpoints",
        "List committed steps from manifests/ only (data/ is never listed): attempt, ranks, "
        "shards, size, age, and which step LATEST points at.",
    )
    p.add_argument("uri", metavar="URI", help="run root")
    _with_common(p)
    p.set_defaults(func=cmd_ls)

    p = add(
        "show",
        "show one checkpoint's manifest",
        "Summarise a manifest: step, attempt, world size, run identity, progress, parent, "
        "shards. Default: the latest committed step.",
    )
    p.add_argument("target", metavar="URI[@STEP]")
    p.add_argument("--shards", action="store_true", help="list every shard")
    _with_common(p)
    p.set_defaults(func=cmd_show)

    p = add(
        "latest",
        "print the latest committed step",
        "Print the step a restore would use: the newest committed checkpoint whose manifest "
        "validates and whose shards are all present with the recorded size and version.",
    )
    p.add_argument("uri", metavar="URI")
    p.add_argument(
        "--check-shards",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="HEAD every shard and fall back past broken checkpoints (default: on)",
    )
    _with_common(p)
    p.set_defaults(func=cmd_latest)

    p = add(
        "verify",
        "download and checksum every shard",
        "Download every shard of a checkpoint and verify its size and CRC32C against the "
        "manifest. Exit 1 naming every bad object. Default: the latest committed step.",
    )
    p.add_argument("target", metavar="URI[@STEP]")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    _with_common(p, progress=True)
    p.set_defaults(func=cmd_verify)

    p = add(
        "gc",
        "delete checkpoints a retention policy does not keep",
        "Decide retention from manifests only; the LATEST target and saves in progress are "
        "never collected; manifests are deleted before their shards; unreferenced attempts "
        "and incomplete uploads only after the grace period.",
    )
    p.add_argument("uri", metavar="URI")
    p.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the newest N steps")
    p.add_argument("--keep-every", type=int, metavar="K", help="also keep every step divisible by K")
    p.add_argument("--pin", type=int, action="append", metavar="STEP", help="also keep STEP (repeatable)")
    p.add_argument(
        "--grace",
        default="6h",
        metavar="DURATION",
        help="age before unreferenced attempts / uploads are removed (default 6h; "
        "must exceed the longest save)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    _with_common(p)
    p.set_defaults(func=cmd_gc)

    p = add(
        "cp",
        "replicate a committed checkpoint to another run root",
        "Stream every shard from SRC (CRC32C verified) to DST under a fresh attempt, then "
        "commit it on DST by the same protocol (manifest create-if-absent, pointer CAS). "
        "Idempotent when DST already has the same checkpoint at that step.",
    )
    p.add_argument("src", metavar="SRC[@STEP]", help="source run root (default step: latest)")
    p.add_argument("dst", metavar="DST", help="destination run root")
    p.add_argument("--all", action="store_true", help="copy every committed step, oldest first")
    p.add_argument(
        "--src-option", action="append", metavar="KEY=VALUE", help="store option for SRC only (repeatable)"
    )
    p.add_argument(
        "--dst-option", action="append", metavar="KEY=VALUE", help="store option for DST only (repeatable)"
    )
    _with_common(p, progress=True)
    p.set_defaults(func=cmd_cp)

    p = add(
        "plan",
        "choose a checkpoint interval (Young/Daly)",
        "Young's sqrt(2 x save x MTBF) and Daly's refinement, and the overhead "
        "(save / interval) and expected lost work (interval / 2 + restart) of candidate "
        "intervals. Durations: 12s, 20m, 6h, 1.5d or seconds.",
    )
    p.add_argument("--save", metavar="DURATION", help="how long one save blocks training (required)")
    p.add_argument(
        "--mtbf",
        default="24h",
        metavar="DURATION",
        help="mean time between failures of the whole job (default 24h)",
    )
    p.add_argument("--failures-per-day", type=float, metavar="RATE", help="instead of --mtbf")
    p.add_argument(
        "--restart",
        default="0s",
        metavar="DURATION",
        help="time from a failure until training runs again (default 0)",
    )
    p.add_argument("--step-time", metavar="DURATION", help="one optimizer step; shows intervals in steps")
    p.add_argument(
        "--interval",
        action="append",
        metavar="DURATION",
        help="candidate interval (repeatable; default 5m 10m 20m 30m 60m)",
    )
    _with_common(p, store=False)
    p.set_defaults(func=cmd_plan)

    p = add(
        "demo",
        "run the end-to-end demo (needs objckpt[torch])",
        "Delegates to objckpt.demo; arguments after 'demo' are passed through.",
    )
    p.add_argument("demo_args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=cmd_demo)
    return parser


# ---------------------------------------------------------------------------------- entry point


def _error_line(message: str) -> None:
    sys.stderr.write(f"objckpt: error: {redact(message)}\n")


def _setup_logging(debug: bool) -> Callable[[], None]:
    """Route objckpt's log records to stderr as ``objckpt: LEVEL: message`` (redacted).

    Returns a function that restores the previous logger state, so calling :func:`main` in
    process (tests, embedding) leaves logging as it found it.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("objckpt: %(levelname)s: %(message)s"))

    class _Redact(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg, record.args = redact(record.getMessage()), None
            return True

    handler.addFilter(_Redact())
    root = logging.getLogger("objckpt")
    saved = (list(root.handlers), root.level, root.propagate)
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
    root.propagate = False

    def restore() -> None:
        root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]

    return restore


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        # Everything after "demo" belongs to the demo (argparse would take "demo --help" itself).
        args = argparse.Namespace(
            command="demo", func=cmd_demo, demo_args=argv[1:], global_options=None, debug=False
        )
    else:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # argparse: --help/--version (0) or usage errors (2)
            return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    restore_logging = _setup_logging(debug)
    try:
        args.store_options = {
            **_parse_options(args.global_options),
            **_parse_options(getattr(args, "options", None)),
        }
        if not hasattr(args, "progress"):
            args.progress = None
        return int(args.func(args))
    except KeyboardInterrupt:
        _error_line("interrupted")
        return 130
    except BrokenPipeError:
        return EXIT_OK  # e.g. `objckpt ls ... | head`
    except Exception as exc:  # noqa: BLE001 - every error becomes one line and an exit code
        code = exit_code_for(exc)
        if debug:
            import traceback

            sys.stderr.write(redact("".join(traceback.format_exception(exc))))
        what = f"{args.command}: " if args.command else ""
        if isinstance(exc, (CliError, ObjckptError)):
            _error_line(f"{what}{exc}")
        else:
            _error_line(
                f"{what}{type(exc).__name__}: {exc}"
                + ("" if debug else " (rerun with --debug for a traceback)")
            )
        return code
    finally:
        restore_logging()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
