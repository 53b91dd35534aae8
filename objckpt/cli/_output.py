"""Output: plain lines and rich tables, JSON documents, byte sizes and ages, progress bars.

* On a terminal, tables are rendered by rich at the terminal's width. Anywhere else (a pipe, a
  file, a test capturing stdout) they are laid out at their natural width, never wrapped or
  cropped, and every line is written without trailing spaces.
* One unit family everywhere: binary (B, KiB, MiB, GiB, ...), in summaries and progress bars.
* With ``--json`` exactly one JSON object goes to stdout, whatever happens: a command's result,
  or ``{"error": {...}}`` when it fails (:func:`emit_error`).
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import IO, Any

from ._common import redact

#: layout width off a terminal: wide enough that no table is ever wrapped or cropped; lines are
#: stripped of the padding afterwards, so it never shows
_UNBOUNDED_WIDTH = 4000


#: table columns that may wrap on a narrow terminal (notes, keys, roots) so the others keep
#: their width; off a terminal nothing wraps
FOLD_COLUMNS = frozenset({"", "key", "root"})


class Out:
    """One output stream (stdout or stderr)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        try:
            self.tty = bool(stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False

    def line(self, text: str = "") -> None:
        """One plain line (no markup interpretation), secrets masked."""
        self.stream.write(redact(text) + "\n")

    def render(self, renderable: Any) -> None:
        """A rich renderable (a table): terminal width on a tty, else natural width, unpadded."""
        from rich.console import Console

        if self.tty:
            Console(file=self.stream, highlight=False).print(renderable)
            return
        buf = io.StringIO()
        Console(file=buf, width=_UNBOUNDED_WIDTH, highlight=False, color_system=None).print(renderable)
        text = "\n".join(ln.rstrip() for ln in buf.getvalue().splitlines())
        self.stream.write(redact(text) + "\n")


def outputs() -> tuple[Out, Out]:
    """(stdout, stderr)."""
    return Out(sys.stdout), Out(sys.stderr)


def error_line(message: str) -> None:
    sys.stderr.write(f"objckpt: error: {redact(message)}\n")


def warn(message: str) -> None:
    sys.stderr.write(f"objckpt: warning: {redact(message)}\n")


def note(message: str) -> None:
    sys.stderr.write(f"note: {redact(message)}\n")


# ---------------------------------------------------------------------------------- JSON


class _Emitted:
    """Whether this invocation already wrote its JSON document (so an error adds none)."""

    done = False


def reset_json() -> None:
    _Emitted.done = False


def emit_json(obj: Any) -> None:
    sys.stdout.write(redact(json.dumps(obj, indent=2, sort_keys=True, default=str)) + "\n")
    _Emitted.done = True


def emit_error(kind: str, message: str, code: int, command: str | None) -> None:
    """``{"error": {"type", "message", "exit_code", "command"}}`` unless a document was written."""
    if _Emitted.done:
        return
    emit_json({"error": error_dict(kind, message, code, command)})


def error_dict(kind: str, message: str, code: int, command: str | None) -> dict[str, Any]:
    return {"type": kind, "message": redact(message), "exit_code": code, "command": command}


# ---------------------------------------------------------------------------------- units


def human_bytes(n: float | None) -> str:
    """Binary units: ``512 B``, ``11.7 KiB``, ``3.0 GiB``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (AttributeError, TypeError, ValueError):
        return None


def age(created_at: str, now: datetime) -> tuple[float | None, str]:
    """(seconds, ``"2.5h ago"``) since an ISO timestamp; (None, ``"-"``) if unparsable."""
    t = parse_time(created_at)
    if t is None:
        return None, "-"
    seconds = max(0.0, (now - t).total_seconds())
    from ..planner import format_duration

    return seconds, f"{format_duration(seconds)} ago"


# ---------------------------------------------------------------------------------- progress


def _columns() -> tuple[Any, Any]:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class BytesColumn(ProgressColumn):
        """``1.2 MiB/11.7 MiB`` (rich's DownloadColumn would say MB)."""

        def render(self, task: Any) -> Text:
            total = "?" if task.total is None else human_bytes(task.total)
            return Text(f"{human_bytes(task.completed)}/{total}", style="progress.download")

    class SpeedColumn(ProgressColumn):
        """``48.0 MiB/s`` (rich's TransferSpeedColumn would say MB/s)."""

        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    return BytesColumn(), SpeedColumn()


@contextmanager
def progress(args: Any, total: int, description: str) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr; ``--progress`` forces it, default only on a terminal
    (and never with ``--json`` unless asked)."""
    from rich.console import Console

    err = Console(stderr=True, highlight=False)
    enabled = args.progress if args.progress is not None else err.is_terminal
    if not enabled or getattr(args, "json", False) and args.progress is None:
        yield lambda n: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    size, speed = _columns()
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        size,
        speed,
        TimeRemainingColumn(),
        console=err,
        transient=False,
    ) as bar:
        task = bar.add_task(redact(description), total=total)
        yield lambda n: bar.update(task, advance=n)
