"""The ``objckpt`` command line: every command, its options and its ``--help``."""

from __future__ import annotations

import argparse

from ._copy import cmd_cp
from ._export import add_export_parser
from ._inspect import cmd_latest, cmd_show
from ._ls import cmd_ls
from ._manage import cmd_gc, cmd_rm
from ._plan import cmd_demo, cmd_plan
from ._rollback import cmd_quarantine, cmd_rollback
from ._runs import cmd_runs
from ._verify import cmd_verify

EPILOG = """\
exit codes:
  0  success
  1  verification or commit failure (bad shard, invalid manifest, commit conflict, refused rm
     or rollback); a quarantined checkpoint is not a failure
  2  usage or configuration error (bad arguments or URI, unknown option, missing extra)
  3  not found (no committed checkpoint, no such step, no such bucket)
  4  store or permission error (access denied, server unreachable or errors after retries)

run roots: s3://bucket/prefix  gs://bucket/prefix  file:///abs/path  memory://name
  name one checkpoint with a suffix:
    @STEP     step STEP on the head's line (else on the newest timeline holding it)
    @tN:STEP  step STEP of timeline N exactly (as 'ls' prints it: 20, t1:20)
    @latest   the newest valid checkpoint (the default): manifest and shards check out, not
              quarantined, on the head's line (an abandoned branch is never latest)
  Store options as URI query parameters or -o key=value
  (e.g. -o endpoint_url=http://127.0.0.1:9000). Secrets are never printed.

examples:
  objckpt ls s3://bucket/runs/eta
  objckpt runs s3://bucket/runs
  objckpt verify gs://bucket/runs/eta@2000
  objckpt gc s3://bucket/runs/eta --keep-last 3 --keep-every 1000 --dry-run
  objckpt rm s3://bucket/runs/eta@1500 --dry-run
  objckpt show s3://bucket/runs/eta@t1:2000
  objckpt rollback s3://bucket/runs/eta@1000
  objckpt quarantine s3://bucket/runs/eta@2000 --reason "loss spike"
  objckpt cp s3://bucket/runs/eta gs://other/runs/eta
  objckpt plan --save 12s --mtbf 24h --restart 2m
"""


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
        "List committed checkpoints from manifests/ (data/ is never listed): attempt, ranks, "
        "shards, size, age; as a tree of timelines when there is more than one (each indented "
        "under the timeline it branched from, with its base, reason and time). '<- LATEST' marks "
        "the newest valid checkpoint of the head's line (shards HEAD-checked from the head down "
        "to it); marks: DAMAGED (passed over), INVALID, QUARANTINED, (abandoned AGE ago): off the "
        "head's line, 'base of timeline N'. On a prefix that holds run roots rather than "
        "checkpoints, lists the run roots.",
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
        "Summarise a manifest: step, timeline (its base), state (on the head's line or "
        "abandoned, quarantined, base of), attempt, world size, run identity, progress, parent, "
        "shards. URI@STEP: the step on the head's line, else the newest timeline holding it; "
        "URI@tN:STEP: that step of timeline N. Default: the latest (newest valid) checkpoint.",
    )
    p.add_argument("target", metavar="URI[@STEP|@tN:STEP]")
    p.add_argument("--shards", action="store_true", help="list every shard")
    _with_common(p)
    p.set_defaults(func=cmd_show)

    p = add(
        "latest",
        "print the latest (newest valid) step",
        "Print the step a restore would use: the newest committed checkpoint of the head's line "
        "whose manifest validates, that is not quarantined, and whose shards are all present with "
        "the recorded size and version. The bare step is printed (URI@STEP names it); --json "
        "adds its timeline.",
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
        "checkpoint; damaged newer ones passed over are reported as failures too. Quarantined "
        "checkpoints are reported as QUARANTINED, never as failures (quarantine is a decision, "
        "not damage): passed over, they are not downloaded; named or under --all, their bytes "
        "are verified and only bad bytes exit 1.",
    )
    p.add_argument("target", metavar="URI[@STEP|@tN:STEP]")
    p.add_argument(
        "--all", action="store_true", help="verify every committed checkpoint (abandoned ones too)"
    )
    _with_common(p, progress=True)
    p.set_defaults(func=cmd_verify)

    p = add(
        "gc",
        "delete checkpoints a retention policy does not keep",
        "Decide retention from manifests only, along the head's line; the head, the LATEST "
        "target, the bases of live timelines and saves in progress are never collected; "
        "manifests are deleted before their shards; unreferenced attempts and incomplete "
        "uploads only after the grace period; abandoned checkpoints (off the head's line) only "
        "--keep-abandoned after they were abandoned. The plan lists every abandoned checkpoint, "
        "since when, and whether it goes.",
    )
    p.add_argument("uri", metavar="URI")
    p.add_argument(
        "--keep-last", type=int, required=True, metavar="N", help="keep the newest N steps of the line"
    )
    p.add_argument("--keep-every", type=int, metavar="K", help="also keep every step divisible by K")
    p.add_argument(
        "--pin",
        action="append",
        metavar="STEP",
        help="also keep STEP (every timeline's) or tN:STEP (repeatable)",
    )
    p.add_argument(
        "--keep-abandoned",
        default="7d",
        metavar="DURATION",
        help="how long checkpoints off the head's line survive after they were abandoned "
        "(default 7d; 'never' keeps them forever)",
    )
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
        "Delete one checkpoint through the retention machinery (every other one pinned; its "
        "manifest before its shards). Refused (exit 1) for the head, the target of LATEST, the "
        "newest valid checkpoint, the base of a timeline that still holds checkpoints and "
        "anything retention must keep, unless --force.",
    )
    p.add_argument("target", metavar="URI@STEP|URI@tN:STEP")
    p.add_argument("--force", action="store_true", help="delete even a step the safety rules keep")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    _with_common(p)
    p.set_defaults(func=cmd_rm)

    p = add(
        "rollback",
        "make an older checkpoint the head again (metadata only)",
        "Claim a new timeline whose base is the checkpoint named and move LATEST to it: it is "
        "the head and 'latest' at once, and the next save continues from it on the new "
        "timeline. Nothing is copied or deleted; the steps after it on the old line are "
        "abandoned (kept for gc --keep-abandoned). Refused (exit 1) when the base is damaged "
        "(HEAD check) or quarantined. Prints the new timeline, the base and what was abandoned.",
    )
    p.add_argument("target", metavar="URI@STEP|URI@tN:STEP")
    p.add_argument("--dry-run", action="store_true", help="say what would be abandoned, write nothing")
    _with_common(p)
    p.set_defaults(func=cmd_rollback)

    quarantine_help = (
        "Set a checkpoint aside without deleting it: restores and every 'latest' skip it (falling "
        "back along the line), 'ls' marks it QUARANTINED, 'verify' reports it (not as a failure). "
        "Idempotent. --undo (or 'objckpt unquarantine') takes it back."
    )
    p = add("quarantine", "set a checkpoint aside (restores skip it)", quarantine_help)
    p.add_argument("target", metavar="URI@STEP|URI@tN:STEP")
    p.add_argument("--reason", metavar="TEXT", help="why (shown by ls and verify)")
    p.add_argument("--undo", action="store_true", help="take the checkpoint back (remove the marker)")
    _with_common(p)
    p.set_defaults(func=cmd_quarantine)

    p = add("unquarantine", "take a quarantined checkpoint back", "Same as 'quarantine --undo'.")
    p.add_argument("target", metavar="URI@STEP|URI@tN:STEP")
    _with_common(p)
    p.set_defaults(func=cmd_quarantine, undo=True, reason=None)

    p = add(
        "cp",
        "replicate a committed checkpoint to another run root",
        "Stream every shard from SRC (CRC32C verified) to DST under a fresh attempt, then "
        "commit it on DST by the same protocol (manifest create-if-absent, pointer CAS). "
        "Idempotent when DST already has the same checkpoint at that step. -o options apply "
        "to each side whose scheme accepts them.",
    )
    p.add_argument(
        "src", metavar="SRC[@STEP|@tN:STEP]", help="source run root (default: the newest valid step)"
    )
    p.add_argument("dst", metavar="DST", help="destination run root")
    p.add_argument(
        "--all", action="store_true", help="copy every committed step of the head's line, oldest first"
    )
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
