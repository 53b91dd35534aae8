"""Store options: declared once, with their types, defaults and which are secret; converted and
rejected in one place (:func:`parse_options`).

Every backend declares its own options as a tuple of :class:`Option` in ``Store.OPTIONS``; the
options every backend shares (:data:`COMMON_OPTIONS`) are declared here, once. A value comes from
a URI query string (always a string) or from an ``open_store`` keyword (any type); the option's
converter accepts both and raises ``ValueError``/``TypeError`` for a bad value, which
:func:`parse_options` turns into a :class:`ConfigError` naming the option and the value, or only
the option when it is a secret. Secret values never appear in a message or a ``repr``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._retry import RetryPolicy
from ..errors import ConfigError


@dataclass(frozen=True)
class Option:
    """One store option.

    Attributes:
        name: as written in a URI query (``?name=value``) or as an ``open_store`` keyword.
        convert: raw value (a string from a URI, anything from a keyword) -> the value the
            backend receives; raises ``ValueError`` or ``TypeError`` when it is not valid.
        default: what the backend uses when the option is not given (documentation: the
            backend's constructor applies it).
        doc: one line for ``--help`` listings and the docs.
        secret: a credential: its value is never shown in messages or ``repr``.
        keyword_only: an object that cannot be written in a URI (a client, a policy).
    """

    name: str
    convert: Callable[[Any], Any]
    default: Any = None
    doc: str = ""
    secret: bool = False
    keyword_only: bool = False

    def __repr__(self) -> str:  # the converter's repr is noise; the default is not a secret
        flags = "".join([", secret" if self.secret else "", ", keyword only" if self.keyword_only else ""])
        return f"Option({self.name!r}, default={self.default!r}{flags})"

    def parse(self, raw: Any, *, scheme: str, from_uri: bool) -> Any:
        """The converted value of ``raw``. Raises :class:`ConfigError` naming the option (and the
        value, unless the option is secret)."""
        if from_uri and self.keyword_only:
            raise ConfigError(
                f"option {self.name} of {scheme}:// stores cannot be given in a URI; pass it as an "
                "open_store keyword"
            )
        try:
            return self.convert(raw)
        except (TypeError, ValueError) as exc:
            shown = "<secret, not shown>" if self.secret else repr(raw)
            why = "" if self.secret else f": {exc}"
            raise ConfigError(f"bad value {shown} for option {self.name} of {scheme}:// stores{why}") from (
                None if self.secret else exc
            )


# ---------------------------------------------------------------------------- converters
# Each takes a string (from a URI) or a typed keyword value and raises ValueError/TypeError.

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 10**6,
    "mb": 10**6,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 10**9,
    "gb": 10**9,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 10**12,
    "tb": 10**12,
    "tib": 1024**4,
}


def parse_size(value: str | int) -> int:
    """``"16MiB"`` -> 16777216; ints pass through. Raises :class:`ConfigError` (a ValueError)."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r} (e.g. 16MiB, 8388608)")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"not a size: {value!r} (e.g. 16MiB, 8388608)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


def size(value: Any) -> int:
    """A positive byte count: ``16MiB``, ``8388608``."""
    n = parse_size(value)
    if n < 1:
        raise ValueError("must be positive")
    return n


def integer(minimum: int = 1) -> Callable[[Any], int]:
    """An int >= ``minimum`` (``"8"`` or ``8``; not a bool, not ``"8.5"``)."""

    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        n = int(value)
        if n < minimum:
            raise ValueError(f"must be >= {minimum}")
        return n

    convert.__name__ = f"integer>={minimum}"
    return convert


def seconds(value: Any) -> float:
    """A positive number of seconds (``"2.5"`` or ``2.5``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
    n = float(value)
    if not n > 0:  # also rejects NaN
        raise ValueError("must be a positive number of seconds")
    return n


def boolean(value: Any) -> bool:
    """``true/false``, ``1/0``, ``yes/no``, ``on/off`` (or a bool)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def text(value: Any) -> str | None:
    """A string; empty means unset (``None``)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value or None


def choice(*allowed: str) -> Callable[[Any], str]:
    """One of ``allowed`` (case-insensitive)."""

    def convert(value: Any) -> str:
        if not isinstance(value, str):
            raise TypeError(f"expected one of {', '.join(allowed)}")
        picked = value.strip().lower()
        if picked not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return picked

    convert.__name__ = "|".join(allowed)
    return convert


def instance_of(cls: type) -> Callable[[Any], Any]:
    """A ready object of type ``cls`` (keyword-only options)."""

    def convert(value: Any) -> Any:
        if not isinstance(value, cls):
            raise TypeError(f"expected a {cls.__name__}, got {type(value).__name__}")
        return value

    return convert


def anything(value: Any) -> Any:
    """Passed through unchecked (an SDK object the backend checks itself)."""
    return value


# ---------------------------------------------------------------------------- the common ones

COMMON_OPTIONS: tuple[Option, ...] = (
    Option("part_size", size, "16MiB", "bytes per multipart part and per parallel ranged read"),
    Option("max_in_flight", integer(1), 8, "parts uploaded (and ranges read) at once by one stream"),
    Option(
        "deadline",
        seconds,
        120.0,
        "the retry time budget: seconds after a request's first try when no new try starts",
    ),
    Option(
        "max_attempts",
        integer(1),
        1000,
        "a safety cap on the tries of one request (never ends the time budget early by default)",
    ),
    Option(
        "retry",
        instance_of(RetryPolicy),
        "RetryPolicy()",
        "a RetryPolicy (deadline/max_attempts override its fields)",
        keyword_only=True,
    ),
)


def store_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """Pop the converted common options out of ``values`` as ``Store.__init__`` keywords
    (``part_size``, ``max_in_flight``, ``retry``); ``deadline``/``max_attempts`` refine
    ``retry`` (or the default policy)."""
    kwargs: dict[str, Any] = {}
    for name in ("part_size", "max_in_flight"):
        if name in values:
            kwargs[name] = values.pop(name)
    retry: RetryPolicy | None = values.pop("retry", None)
    deadline = values.pop("deadline", None)
    attempts = values.pop("max_attempts", None)
    if deadline is not None or attempts is not None:
        base = retry or RetryPolicy()
        retry = RetryPolicy(
            deadline=deadline if deadline is not None else base.deadline,
            max_attempts=attempts if attempts is not None else base.max_attempts,
            initial_backoff=base.initial_backoff,
            max_backoff=base.max_backoff,
        )
    if retry is not None:
        kwargs["retry"] = retry
    return kwargs


def parse_options(
    scheme: str,
    specs: Iterable[Option],
    uri_options: Mapping[str, str],
    keywords: Mapping[str, Any],
    *,
    elsewhere: Callable[[str], list[str]] | None = None,
) -> dict[str, Any]:
    """THE conversion of a store's options: ``uri_options`` (from the query string) overlaid by
    ``keywords``, checked against ``specs``, each converted by its :class:`Option`.

    Returns the converted values of the options given (absent ones are left to the backend's
    defaults).

    Raises:
        ConfigError: an unknown option (the message lists the known ones and, through
            ``elsewhere(name) -> [schemes]``, which other schemes take it), a value of the wrong
            type, or a keyword-only option written in a URI. Secret values are never shown.
    """
    by_name = {spec.name: spec for spec in specs}
    given = {**uri_options, **keywords}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        hints = []
        for name in unknown:
            others = [s for s in (elsewhere(name) if elsewhere else []) if s != scheme]
            if others:
                hints.append(f"{name} is an option of {', '.join(o + '://' for o in others)} stores")
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise ConfigError(
            f"unknown option(s) {', '.join(unknown)} for {scheme}:// stores{hint}; "
            f"known: {', '.join(sorted(by_name))}"
        )
    return {
        name: by_name[name].parse(raw, scheme=scheme, from_uri=name not in keywords)
        for name, raw in given.items()
    }


__all__ = [
    "COMMON_OPTIONS",
    "Option",
    "anything",
    "boolean",
    "choice",
    "instance_of",
    "integer",
    "parse_options",
    "parse_size",
    "seconds",
    "size",
    "store_kwargs",
    "text",
]
