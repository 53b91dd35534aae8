"""``objckpt``: inspect, verify, garbage-collect and copy checkpoints; plan the save interval.

Commands::

    objckpt ls      URI                 committed steps (from manifests), sizes, ages, damage
    objckpt runs    PREFIX              run roots under a prefix, each with its head step
    objckpt show    URI[@STEP]          one manifest: step, attempt, run identity, shards
    objckpt latest  URI                 the step a restore would use
    objckpt verify  URI[@STEP]          download every shard and check its CRC32C (--all)
    objckpt gc      URI --keep-last N   apply a retention policy (--dry-run prints the plan)
    objckpt rm      URI@STEP            delete one committed checkpoint (--dry-run, --force)
    objckpt cp      SRC[@STEP] DST      replicate a committed checkpoint to another run root
    objckpt plan    --save 12s          Young/Daly checkpoint interval and its cost
    objckpt demo    ...                 the end-to-end demo (needs objckpt[torch] and objckpt[dev])

A run root is ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///abs/path`` or
``memory://name``; append ``@STEP`` (or ``@latest``) to name one checkpoint. "Latest" means the
same in every command: the newest *valid* checkpoint (its manifest validates and every shard
passes a HEAD check); damaged newer ones are shown as such and skipped. Store options come as URI
query parameters (``s3://b/run?endpoint_url=http://127.0.0.1:9000``) or repeated
``-o key=value``; credentials are never printed (secret-looking option values are masked).

Exit codes:
    0  success
    1  verification or commit failure (a bad shard, an invalid manifest, a commit conflict, a
       refused ``rm``); also an unexpected internal error
    2  usage or configuration error (bad arguments, bad URI, unknown option, missing extra)
    3  not found (no committed checkpoint, no such step, no such bucket)
    4  store or permission error (access denied, server unreachable or errors after retries)

Errors print one line naming the URI or key (never a traceback unless ``--debug``); with
``--json`` stdout also gets exactly one JSON object, ``{"error": {"type", "message",
"exit_code", "command"}}``.

The package: ``_common`` (exit codes, URIs, options, secrets), ``_output`` (printing, JSON,
units, progress), ``_latest`` (what "latest" means), and one module per command group.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from ..errors import ObjckptError
from ._common import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    CliError,
    exit_code_for,
    redact,
    split_step,
)

# reached through objckpt.cli by tests and by the commands (``_open`` is the seam tests wrap)
from ._common import _accepted_options as _accepted_options
from ._common import _open as _open
from ._copy import cmd_cp
from ._export import add_export_parser
from ._inspect import cmd_latest, cmd_ls, cmd_show
from ._manage import cmd_gc, cmd_rm
from ._output import emit_error, error_line, reset_json
from ._plan import cmd_demo, cmd_plan
from ._runs import cmd_runs
from ._verify import cmd_verify

__all__ = [
    "EXIT_FAILED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_STORE",
    "EXIT_USAGE",
    "CliError",
    "build_parser",
    "exit_code_for",
    "main",
    "redact",
    "split_step",
]


EPILOG = """\
exit codes:
  0  success
  1  verification or commit failure (bad shard, invalid manifest, commit conflict, refused rm)
  2  usage or configuration error (bad arguments or URI, unknown option, missing extra)
  3  not found (no committed checkpoint, no such step, no such bucket)
  4  store or permission error (access denied, server unreachable or errors after retries)

run roots: s3://bucket/prefix  gs://bucket/prefix  file:///abs/path  memory://name
  append @STEP (or @latest) to name one checkpoint; "latest" is the newest valid checkpoint
  (manifest and shards check out). Store options as URI query parameters or -o key=value
  (e.g. -o endpoint_url=http://127.0.0.1:9000). Secrets are never printed.

examples:
  objckpt ls s3://bucket/runs/eta
  objckpt runs s3://bucket/runs
  objckpt verify gs://bucket/runs/eta@2000
  objckpt gc s3://bucket/runs/eta --keep-last 3 --keep-every 1000 --dry-run
  objckpt rm s3://bucket/runs/eta@1500 --dry-run
  objckpt cp s3://bucket/runs/eta gs://other/runs/eta
  objckpt plan --save 12s --mtbf 24h --restart 2m
"""


#: the JSON error ``type`` of the CLI's own errors, by exit code
_CLI_ERROR_KINDS = {
    EXIT_FAILED: "Refused",
    EXIT_USAGE: "UsageError",
    EXIT_NOT_FOUND: "NotFound",
    EXIT_STORE: "StoreError",
}


class _UsageError(Exception):
    """argparse rejected the command line (exit 2)."""

    def __init__(self, message: str, usage: str, prog: str) -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors come back to :func:`main` (for ``--json``)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message, self.format_usage(), self.prog)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


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


def _check_shards_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--check-shards",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"HEAD every shard and fall back past damaged checkpoints {what}(default: on)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="objckpt",
        description="Complete, coordinated, immutable-until-committed checkpoints on object "
        "storage (S3, GCS, local files): inspect, verify, collect, copy, plan.",
        epilog=EPILOG,
        formatter_class=_Formatter,
    )
    from .._version import __version__

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
        "List committed steps from manifests/ (data/ is never listed): attempt, ranks, shards, "
        "size, age. '<- LATEST' marks the newest valid checkpoint (shards HEAD-checked from the "
        "newest down to it); damaged ones passed over are marked DAMAGED. On a prefix that holds "
        "run roots rather than checkpoints, lists the run roots.",
    )
    p.add_argument("uri", metavar="URI", help="run root")
    _with_common(p)
    p.set_defaults(func=cmd_ls)

    p = add(
        "runs",
        "list the run roots under a prefix",
        "Find run roots (by their manifests/ prefix, never listing data/) up to --depth levels "
        "below PREFIX and show each one's head step (the newest valid checkpoint, or with "
        "--no-check-shards the LATEST pointer's step) and its age.",
    )
    p.add_argument("prefix", metavar="PREFIX", help="e.g. s3://bucket/runs")
    p.add_argument(
        "--depth", type=int, default=2, metavar="N", help="levels to search below PREFIX (default 2)"
    )
    _check_shards_flag(p, "for each root; off: use the LATEST pointer ")
    _with_common(p)
    p.set_defaults(func=cmd_runs)

    p = add(
        "show",
        "show one checkpoint's manifest",
        "Summarise a manifest: step, attempt, world size, run identity, progress, parent, "
        "shards. Default: the latest (newest valid) checkpoint.",
    )
    p.add_argument("target", metavar="URI[@STEP]")
    p.add_argument("--shards", action="store_true", help="list every shard")
    _with_common(p)
    p.set_defaults(func=cmd_show)

    p = add(
        "latest",
        "print the latest (newest valid) step",
        "Print the step a restore would use: the newest committed checkpoint whose manifest "
        "validates and whose shards are all present with the recorded size and version.",
    )
    p.add_argument("uri", metavar="URI")
    _check_shards_flag(p, "")
    _with_common(p)
    p.set_defaults(func=cmd_latest)

    p = add(
        "verify",
        "download and checksum every shard",
        "Download every shard of a checkpoint and verify its size and CRC32C against the "
        "manifest. Exit 1 naming every bad object. Default: the latest (newest valid) "
        "checkpoint; damaged newer ones passed over are reported as failures too.",
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
        "rm",
        "delete one committed checkpoint",
        "Delete STEP through the retention machinery (every other step pinned; its manifest "
        "before its shards). Refused (exit 1) for the newest committed step, the target of "
        "LATEST, the newest valid checkpoint and anything retention must keep, unless --force.",
    )
    p.add_argument("target", metavar="URI@STEP")
    p.add_argument("--force", action="store_true", help="delete even a step the safety rules keep")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    _with_common(p)
    p.set_defaults(func=cmd_rm)

    p = add(
        "cp",
        "replicate a committed checkpoint to another run root",
        "Stream every shard from SRC (CRC32C verified) to DST under a fresh attempt, then "
        "commit it on DST by the same protocol (manifest create-if-absent, pointer CAS). "
        "Idempotent when DST already has the same checkpoint at that step. -o options apply "
        "to each side whose scheme accepts them.",
    )
    p.add_argument("src", metavar="SRC[@STEP]", help="source run root (default: the newest valid step)")
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
        "intervals. Durations: 12s, 20m, 6h, 1.5d or seconds. Warns when the save is over a "
        "tenth of the MTBF; refuses (exit 2) when the optimum would be shorter than the save.",
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

    add_export_parser(add, _with_common)

    p = add(
        "demo",
        "run the end-to-end demo (needs objckpt[torch] and objckpt[dev])",
        "Delegates to objckpt.demo; arguments after 'demo' are passed through.",
    )
    p.add_argument("demo_args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(func=cmd_demo)
    return parser


# ---------------------------------------------------------------------------------- entry point


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


def _wants_json(argv: Sequence[str]) -> bool:
    """``--json`` on the command line (before any ``--``), for errors argparse itself raises."""
    head = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    return "--json" in head and head[:1] != ["demo"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    reset_json()
    if argv[:1] == ["demo"]:
        # Everything after "demo" belongs to the demo (argparse would take "demo --help" itself).
        args = argparse.Namespace(
            command="demo", func=cmd_demo, demo_args=argv[1:], global_options=None, debug=False
        )
    else:
        try:
            args = parser.parse_args(argv)
        except _UsageError as exc:
            sys.stderr.write(f"{exc.usage}{exc.prog}: error: {redact(str(exc))}\n")
            if _wants_json(argv):
                emit_error("UsageError", str(exc), EXIT_USAGE, exc.prog.partition(" ")[2] or None)
            return EXIT_USAGE
        except SystemExit as exc:  # argparse: --help / --version
            return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    json_mode = bool(getattr(args, "json", False))
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    restore_logging = _setup_logging(debug)
    try:
        from ._common import parse_options

        args.store_options = {
            **parse_options(args.global_options),
            **parse_options(getattr(args, "options", None)),
        }
        if not hasattr(args, "progress"):
            args.progress = None
        return int(args.func(args))
    except KeyboardInterrupt:
        error_line("interrupted")
        if json_mode:
            emit_error("KeyboardInterrupt", "interrupted", 130, args.command)
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
            message = str(exc)
            error_line(f"{what}{message}")
        else:
            message = f"{type(exc).__name__}: {exc}"
            error_line(f"{what}{message}" + ("" if debug else " (rerun with --debug for a traceback)"))
        if json_mode:
            kind = _CLI_ERROR_KINDS.get(code, "Error") if isinstance(exc, CliError) else type(exc).__name__
            emit_error(kind, message, code, args.command)
        return code
    finally:
        restore_logging()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
