"""What every command shares: exit codes, the one-line error, secret masking, ``URI@STEP``,
store options (and which side of a copy they belong to), opening a store.

Naming a checkpoint: ``URI@STEP`` is step STEP on the head's line (else on the newest timeline
holding it), ``URI@tN:STEP`` is step STEP of timeline N exactly, ``URI@latest`` (or no suffix)
the newest valid checkpoint. Checkpoints are printed the same way (:func:`label`): ``20`` on
timeline 0, ``t1:20`` on timeline 1.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import (
    CommitError,
    ConfigError,
    IntegrityError,
    NoCheckpointError,
    NotFoundError,
    StoreError,
)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE = 4

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


class _Secrets:
    """Values to mask in anything printed (collected from -o and URI query strings)."""

    values: set[str] = set()

    @classmethod
    def add_options(cls, options: Mapping[str, str]) -> None:
        for k, v in options.items():
            if _SECRET_NAME.search(k) and v and len(v) >= 3:
                cls.values.add(v)


def redact(text: str) -> str:
    """Mask secret-looking ``name=value`` pairs and every known secret value in ``text``."""
    text = _SECRET_ASSIGNMENT.sub(r"\1***", text)
    for value in sorted(_Secrets.values, key=len, reverse=True):
        text = text.replace(value, "***")
    return text


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


# ---------------------------------------------------------------------------------- URIs


_STEP_TOKEN = re.compile(r"^(?:[tT](\d+):)?(\d+)$")

#: the ``@STEP`` syntax, as ``--help`` and error messages spell it
TARGET_SYNTAX = (
    "URI@STEP (the step on the head's line, else the newest timeline holding it), "
    "URI@tN:STEP (that step on timeline N) or URI@latest"
)


def split_target(target: str) -> tuple[str, int | None, int | None]:
    """``"s3://b/run@t1:20?x=y"`` -> (``"s3://b/run?x=y"``, 20, 1).

    The suffix names one checkpoint:

    * ``@STEP``: that step on the head's line, else on the newest timeline holding it (an
      abandoned one): timeline ``None``, resolved by :meth:`objckpt.reader.Reader.locate`;
    * ``@tN:STEP``: that step on timeline ``N`` (``@t0:20`` is timeline 0's step 20);
    * ``@latest`` or no suffix: step and timeline ``None`` (the newest valid checkpoint).

    The suffix belongs to the path; it may come before or after a query string.

    Raises:
        CliError: a malformed suffix (exit 2).
    """
    parts = urlsplit(target)
    path, query = parts.path, parts.query
    step: int | None = None
    timeline: int | None = None
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
            tm = _STEP_TOKEN.match(token)
            if tm is None:
                raise CliError(
                    f"bad step {token!r} in {redact(target)!r}: use URI@STEP with a non-negative "
                    "integer step, URI@tN:STEP for step STEP of timeline N, or URI@latest",
                    EXIT_USAGE,
                )
            step = int(tm.group(2))
            timeline = None if tm.group(1) is None else int(tm.group(1))
            from .. import layout

            if step > layout.MAX_STEP or (timeline is not None and timeline > layout.MAX_TIMELINE):
                raise CliError(f"step {token!r} in {redact(target)!r} is out of range", EXIT_USAGE)
    if not parts.scheme and not path and parts.netloc:
        path = ""
    return urlunsplit((parts.scheme, parts.netloc, path, query, parts.fragment)), step, timeline


def split_step(target: str) -> tuple[str, int | None]:
    """``"s3://b/run@20?x=y"`` -> (``"s3://b/run?x=y"``, 20); ``@latest`` or none -> None.

    The two-value form of :func:`split_target`, for callers that take no timeline: a
    ``@tN:STEP`` suffix is refused (exit 2) rather than silently read as ``@STEP``.

    Raises:
        CliError: a malformed ``@STEP``, or one naming a timeline.
    """
    uri, step, timeline = split_target(target)
    if timeline is not None:
        raise CliError(f"{redact(target)!r}: a timeline (@tN:STEP) is not accepted here", EXIT_USAGE)
    return uri, step


def label(ref: tuple[int, int]) -> str:
    """How the CLI names checkpoint ``(timeline, step)``: ``20`` on timeline 0, else ``t1:20``
    (the ``@`` suffix that names exactly it)."""
    return str(ref[1]) if ref[0] == 0 else f"t{ref[0]}:{ref[1]}"


def ref_dict(ref: tuple[int, int] | None) -> dict[str, Any] | None:
    """``{"timeline", "step", "label"}`` for JSON (None stays None)."""
    return None if ref is None else {"timeline": ref[0], "step": ref[1], "label": label(ref)}


def run_root(value: str, command: str, hint: str = "") -> str:
    """The run root of a command that takes no ``@STEP`` (usage error otherwise)."""
    uri, step, _ = split_target(value)
    if step is not None:
        raise CliError(f"{command} takes a run root, not URI@STEP{hint}", EXIT_USAGE)
    return uri


def display_uri(uri: str) -> str:
    """The URI as printed in headings and JSON: without its query string (store options may
    hold credentials, and endpoints are noise next to the run root)."""
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def child_uri(uri: str, prefix: str) -> str:
    """The run root ``prefix`` (relative, e.g. ``"eta/"``) below ``uri``, keeping its query."""
    parts = urlsplit(uri)
    path, sub = parts.path.rstrip("/"), prefix.strip("/")
    if sub:
        path = f"{path}/{sub}"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def object_url(store: Any, key: str) -> str:
    return f"{store.location.rstrip('/')}/{key}"


# ---------------------------------------------------------------------------------- options


def parse_options(pairs: Sequence[str] | None) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise CliError(f"bad store option {redact(pair)!r}: use -o key=value", EXIT_USAGE)
        options[key.strip()] = value
    _Secrets.add_options(options)
    return options


def _accepted_options(scheme: str) -> set[str]:
    """The store options a ``scheme://`` run root accepts: the names of
    ``objckpt.store.options_for(scheme)`` (looked up at call time, so tests can replace it).

    Raises:
        ConfigError: an unknown scheme, or the backend's extra is not installed.
    """
    from .. import store as store_pkg

    return {spec.name for spec in store_pkg.options_for(scheme)}


def scope_options(
    shared: Mapping[str, str], sides: Sequence[tuple[str, str]], flags: str
) -> list[dict[str, str]]:
    """Split options given for every URI (``-o``) among ``sides`` (``(label, uri)`` pairs): each
    option goes to every side whose scheme accepts it.

    Raises:
        CliError: an option no side accepts (exit 2), naming ``flags`` (the per-side flags).
    """
    from ..store import parse_uri

    schemes = [parse_uri(uri).scheme for _, uri in sides]
    accepted = [_accepted_options(s) for s in schemes]
    unused = sorted(k for k in shared if not any(k in acc for acc in accepted))
    if unused:
        where = " and ".join(f"{label} ({s}://)" for (label, _), s in zip(sides, schemes, strict=True))
        raise CliError(
            f"unknown store option(s) {unused} for {where}; -o options apply to each side that "
            f"accepts them; to set one for a single side use {flags}",
            EXIT_USAGE,
        )
    return [{k: v for k, v in shared.items() if k in acc} for acc in accepted]


# ---------------------------------------------------------------------------------- stores


def _open(uri: str, options: dict[str, str]) -> Any:
    """Open the store for ``uri`` (query options + ``-o`` options; ``-o`` wins)."""
    from ..store import open_store, parse_uri

    parsed = parse_uri(uri)  # ConfigError -> exit 2
    _Secrets.add_options(dict(parsed.options))
    return open_store(uri, **options)


def open_root(uri: str, options: dict[str, str]) -> Any:
    """Open a store through ``objckpt.cli._open`` (the one seam tests wrap)."""
    pkg = importlib.import_module("objckpt.cli")
    return pkg._open(uri, options)
