"""The scale fixes the simulator can switch on, and which of them exist yet.

Each scenario option named here (:class:`~objckpt.testing.scale.scenario.ScaleOptions`) stands for
one fix of the scale issue. A fix is *built* when its :attr:`Fix.enable` is set: a context
manager factory that turns the library's feature on for the duration of a scenario (for example by
passing an option to the sessions, or choosing a layout), given the scenario's options. The
report (``python -m benchmarks.scale``) runs every size once with every option off ("before")
and once with every built fix on ("after"); a fix whose ``enable`` is ``None`` is listed as not
built yet, and asking a scenario for it raises :class:`FixNotBuilt` (never a silent no-op).

To wire a fix in, its author sets ``enable`` below and, when the fix changes what a rank writes or
reads, the matching branch of :mod:`.adapter` (the simulator's mirror of ``CheckpointManager``'s
shard layout). Nothing else in the simulator needs to change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FIXES", "Fix", "FixNotBuilt", "built", "fix", "not_built"]


class FixNotBuilt(RuntimeError):
    """A scenario asked for a fix that does not exist in the library yet."""


@dataclass(frozen=True)
class Fix:
    """One fix of the scale issue.

    Attributes:
        option: the :class:`ScaleOptions` field that asks for it.
        title: what it changes.
        goal: the goal of the issue it serves (as shown in ``SCALE.md``).
        enable: ``enable(options)`` returns a context manager that switches the library's fix
            on; ``None`` until the fix is built.
    """

    option: str
    title: str
    goal: str
    enable: Callable[[Any], contextlib.AbstractContextManager[Any]] | None = None


FIXES: tuple[Fix, ...] = (
    Fix(
        option="key_spreading",
        title=(
            "shard keys carry a spreading component (invariant 16's `data/<spread>/...`) so a "
            "save's writes and a restore's reads fall on many key-range partitions"
        ),
        goal="0 SlowDowns surfaced; hottest partition below its limit",
    ),
    Fix(
        option="replicated_read_once",
        title=(
            "replicated state is read from the store about once per job (each rank reads its own "
            "1/N part and the parts are shared over the training network)"
        ),
        goal="restore reads <= 1.1x the unique bytes",
    ),
)


def fix(option: str) -> Fix:
    for f in FIXES:
        if f.option == option:
            return f
    raise KeyError(option)


def built() -> list[Fix]:
    return [f for f in FIXES if f.enable is not None]


def not_built() -> list[Fix]:
    return [f for f in FIXES if f.enable is None]
