#!/usr/bin/env python3
"""The README's store-options table, generated from ``objckpt.store.options_for(scheme)``.

    python scripts/readme_options.py            # print the table
    python scripts/readme_options.py --write    # replace the table in README.md
    python scripts/readme_options.py --check    # exit 1 if README.md's table is stale

The table lies between ``<!-- store-options:begin -->`` and ``<!-- store-options:end -->``;
``tests/test_readme.py`` fails when it differs from what this script generates, so every option
a backend declares is documented, with its default and its one-line doc.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
BEGIN = "<!-- store-options:begin -->"
END = "<!-- store-options:end -->"
SCHEMES = ("memory", "file", "s3", "gs")


def _default(value: object) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def table() -> str:
    """The markdown table: one row per option (schemes merged where name and doc agree)."""
    sys.path.insert(0, str(REPO))
    from objckpt.store import options_for

    rows: dict[tuple[str, str], dict[str, object]] = {}
    for scheme in SCHEMES:
        for opt in options_for(scheme):
            key = (opt.name, opt.doc)
            row = rows.setdefault(key, {"option": opt, "schemes": []})
            row["schemes"].append(scheme)  # type: ignore[union-attr]
    lines = ["| option | schemes | default | meaning |", "|---|---|---|---|"]
    for row in rows.values():
        opt = row["option"]
        schemes = row["schemes"]
        where = "all" if list(schemes) == list(SCHEMES) else ", ".join(schemes)  # type: ignore[arg-type]
        notes = []
        if opt.secret:  # type: ignore[attr-defined]
            notes.append("secret: never printed")
        if opt.keyword_only:  # type: ignore[attr-defined]
            notes.append("keyword only, not in a URI")
        doc = opt.doc.replace("|", "\\|")  # type: ignore[attr-defined]
        if notes:
            doc += f" ({'; '.join(notes)})"
        lines.append(f"| `{opt.name}` | {where} | {_default(opt.default)} | {doc} |")  # type: ignore[attr-defined]
    return "\n".join(lines)


def current(text: str) -> str:
    """The table now in ``text`` (README.md)."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} section")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's table is stale")
    args = parser.parse_args(argv)
    generated = table()
    if not (args.write or args.check):
        print(generated)
        return 0
    text = README.read_text()
    if args.check:
        if current(text) != generated:
            print("README.md's store-options table is stale: run scripts/readme_options.py --write")
            return 1
        return 0
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{BEGIN}\n{generated}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
