"""``objckpt``: inspect, verify, garbage-collect and copy checkpoints; plan the save interval.

Commands::

    objckpt ls         URI               committed checkpoints as a tree of timelines, damage
    objckpt runs       PREFIX            run roots under a prefix, each with its head step
    objckpt show       URI[@STEP]        one manifest: step, timeline, state, run identity, shards
    objckpt latest     URI               the step a restore would use
    objckpt verify     URI[@STEP]        download every shard and check its CRC32C (--all)
    objckpt gc         URI --keep-last N apply a retention policy (--dry-run prints the plan)
    objckpt rm         URI@STEP          delete one committed checkpoint (--dry-run, --force)
    objckpt rollback   URI@STEP          make an older checkpoint the head (a new timeline)
    objckpt quarantine URI@STEP          set a checkpoint aside (--undo; also unquarantine)
    objckpt cp         SRC[@STEP] DST    replicate a committed checkpoint to another run root
    objckpt plan       --save 12s        Young/Daly checkpoint interval and its cost
    objckpt demo       ...               the end-to-end demo (needs objckpt[torch] and objckpt[dev])

A run root is ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///abs/path`` or
``memory://name``. A suffix names one checkpoint: ``@STEP`` is step STEP on the head's line
(else on the newest timeline holding it), ``@tN:STEP`` is step STEP of timeline N (as ``ls``
prints it: ``20``, ``t1:20``), ``@latest`` (or none) the latest. "Latest" means the same in
every command: the newest *valid* checkpoint of the head's line (its manifest validates, it is
not quarantined and every shard passes a HEAD check); damaged newer ones are shown as such and
skipped, and an abandoned branch (after a rollback) is never latest. Store options come as URI
query parameters (``s3://b/run?endpoint_url=http://127.0.0.1:9000``) or repeated
``-o key=value``; credentials are never printed (secret-looking option values are masked).

Exit codes:
    0  success
    1  verification or commit failure (a bad shard, an invalid manifest, a commit conflict, a
       refused ``rm`` or ``rollback``); also an unexpected internal error. A quarantined
       checkpoint is not a failure (``verify`` reports it and exits 0 when its bytes are good)
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
    split_target,
)

# reached through objckpt.cli by tests and by the commands (``_open`` is the seam tests wrap)
from ._common import _accepted_options as _accepted_options
from ._common import _open as _open
from ._output import emit_error, error_line, reset_json
from ._parser import EPILOG as EPILOG
from ._parser import _UsageError, build_parser
from ._plan import cmd_demo

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
    "split_target",
]


#: the JSON error ``type`` of the CLI's own errors, by exit code
_CLI_ERROR_KINDS = {
    EXIT_FAILED: "Refused",
    EXIT_USAGE: "UsageError",
    EXIT_NOT_FOUND: "NotFound",
    EXIT_STORE: "StoreError",
}


# ---------------------------------------------------------------------------------- entry point


def _said_by_the_cli(record: logging.LogRecord) -> bool:
    message = str(record.msg)
    return (record.name == "objckpt.reader" and "it is quarantined" in message) or (
        record.name == "objckpt.timelines" and message.startswith("quarantined checkpoint")
    )


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
            # The commands report quarantined checkpoints themselves (a note per checkpoint
            # passed over, the quarantine command's own line): the library's warnings about
            # them would only repeat it (--debug keeps them).
            return debug or not _said_by_the_cli(record)

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
