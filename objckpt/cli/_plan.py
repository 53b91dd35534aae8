"""``plan`` (the Young/Daly checkpoint interval and its cost) and ``demo``."""

from __future__ import annotations

import argparse

from ._common import EXIT_OK, EXIT_USAGE, CliError
from ._output import FOLD_COLUMNS, emit_json, outputs, warn


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planner import format_duration, make_plan, parse_duration

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
    if plan.infeasible:
        raise CliError(
            f"no useful checkpoint interval: a {format_duration(save)} save against a "
            f"{format_duration(mtbf)} MTBF gives an optimum of {format_duration(plan.optimum.interval_s)}, "
            "shorter than the save itself (Young/Daly assume save << MTBF); make saves cheaper "
            "(e.g. asynchronous) or check --mtbf / --failures-per-day",
            EXIT_USAGE,
        )
    for w in plan.warnings:
        warn(w)
    if args.json:
        emit_json(plan.to_dict())
        return EXIT_OK
    out, _ = outputs()
    from rich.table import Table

    out.line(
        f"save cost {format_duration(save)}, restart cost {format_duration(restart)}, "
        f"MTBF {format_duration(mtbf)}" + (f", step time {format_duration(step_s)}" if step_s else "")
    )
    out.line(
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
        table.add_column(col, justify=justify, no_wrap=col not in FOLD_COLUMNS, overflow="fold")  # type: ignore[arg-type]
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
    out.render(table)
    best = plan.optimum
    steps = f" ({best.every_steps} steps)" if best.every_steps else ""
    out.line(
        f"recommended: checkpoint every {format_duration(best.interval_s)}{steps}: "
        f"{best.overhead:.1%} overhead, ~{format_duration(best.expected_loss_s)} lost per failure"
    )
    out.line(
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
