"""The scale fixes (issue 13) the simulator can switch on, and how each maps to the library.

Each :class:`Fix` is one :class:`~objckpt.testing.scale.scenario.ScaleOptions` flag. The
library's own switch for it (``docs/DESIGN.md``, "Scale") is set on a :class:`Switches`: with
every flag off the switches are today's design *before* the fixes (old key layout, coordinator
LIST verification, every rank reading every replicated shard, no pacing), whatever the library's
defaults are; each built fix's :attr:`Fix.enable` turns its switch on. The scenario passes the
switches to the real code: ``SaveSession(key_spreading=, verify=)``, ``ShardWriter(key_spreading=)``
for ranks hosted on another rank's thread, and for ``replicated_read="once"`` the adapter calls
the library's :func:`objckpt.coordination.exchange.read_shared` (see :mod:`.adapter`).

A fix whose ``enable`` is ``None`` is listed as not built / not modelled (``note`` says why), and
asking a scenario for it raises :class:`FixNotBuilt` (never a silent no-op).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ... import layout

__all__ = [
    "FIXES",
    "Fix",
    "FixNotBuilt",
    "Switches",
    "built",
    "fix",
    "not_built",
    "spread_boundaries",
    "switches_for",
]


class FixNotBuilt(RuntimeError):
    """A scenario asked for a fix that does not exist in the library (or in the simulator)."""


@dataclass
class Switches:
    """The library's scale switches for one scenario; the defaults are *before* the fixes."""

    key_spreading: bool = False
    verify: str = "coordinator"
    replicated_read: str = "every"
    pacing: bool = False


@dataclass(frozen=True)
class Fix:
    """One fix of the scale issue.

    Attributes:
        option: the :class:`ScaleOptions` field that asks for it.
        title: what it changes.
        goal: the goal of the issue it serves (as shown in ``SCALE.md``).
        switch: the library's switch (``docs/DESIGN.md``, "Scale").
        enable: sets the switch on a :class:`Switches`; ``None``: not built, or not modelled.
        note: why ``enable`` is ``None``.
    """

    option: str
    title: str
    goal: str
    switch: str
    enable: Callable[[Switches], None] | None = None
    note: str = ""


def _spread(s: Switches) -> None:
    s.key_spreading = True


def _read_once(s: Switches) -> None:
    s.replicated_read = "once"


def _verify_ranks(s: Switches) -> None:
    s.verify = "ranks"


def _pacing(s: Switches) -> None:
    s.pacing = True


FIXES: tuple[Fix, ...] = (
    Fix(
        option="key_spreading",
        title=(
            "shard keys carry a spreading component (`data/<hh>/<step>-<attempt>/<rank>/...`, 256 "
            "prefixes that stay the same across saves) so a save's writes and a restore's reads "
            "fall on many key-range partitions"
        ),
        goal="0 SlowDowns surfaced; hottest partition below its limit",
        switch="SaveSession(key_spreading=True), ShardWriter(key_spreading=True)",
        enable=_spread,
    ),
    Fix(
        option="replicated_read_once",
        title=(
            "replicated state is read from the store once per job: each rank downloads ~1/W of "
            "the `replicated.bin` shards and the ranks exchange them over the process group in one "
            "all-gather "
            "(`coordination.exchange.read_shared`), CRC32C checked on every receiving rank"
        ),
        goal="restore reads <= 1.1x the unique bytes",
        switch='shards.stage(comm=, replicated_read="once")',
        enable=_read_once,
    ),
    Fix(
        option="verify_ranks",
        title=(
            "commit verification spread over ranks: once every rank has written, ranks "
            "0..min(W, 256)-1 each LIST one spread attempt prefix (`layout.verification_slices`: "
            "every key of the attempt, strays included) and send it to the coordinator, which "
            "checks every receipt against them and LISTs nothing itself"
        ),
        goal="commit verification <= 1 LIST per 1,000 shards, or the equivalent spread over ranks",
        switch='SaveSession(verify="ranks")',
        enable=_verify_ranks,
    ),
    Fix(
        option="auto_part_size",
        title="part size chosen from the shard size (S3's 10,000-part limit, >= 32 MiB parts above 1 GiB)",
        goal="fewer requests per big shard",
        switch="Store.auto_part_size = True",
        note=(
            "built in the library; no effect at the modelled sizes (16 MiB shards are one PUT "
            "either way: `part_size_for` changes nothing below 1 GiB)"
        ),
    ),
    Fix(
        option="aimd_pacing",
        title="adaptive concurrency on SlowDown (AIMD limit on a rank's requests in flight)",
        goal="0 SlowDowns surfaced",
        switch="Store.pacing = store.pacing.Pacer()",
        enable=_pacing,
        note=(
            "modelled per simulated rank: the library's Pacer, one per rank, told the rank's "
            "virtual requests in flight (`Pacer.feedback`); a try waits on the virtual clock "
            "until fewer of its rank's lanes are in flight than the limit. The store object's own "
            "`pacing` stays off (one object serves every simulated rank). Lanes: a restore's 8 "
            "reads; writes are one at a time (as `shards.write` for a replicated share under two "
            "parts; a larger one is written as pieces at once), and retention's pool of 16 "
            "HEADs counts as 1 in flight"
        ),
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


def switches_for(options: object) -> Switches:
    """The switches of a scenario's ``options`` (a fix flag that is set but not built raises
    :class:`FixNotBuilt`)."""
    switches = Switches()
    for f in FIXES:
        if getattr(options, f.option, False):
            if f.enable is None:
                raise FixNotBuilt(f"{f.option}: not built or not modelled ({f.note or f.title})")
            f.enable(switches)
    return switches


def spread_boundaries() -> tuple[str, ...]:
    """The key-range boundaries of a bucket whose ``data/`` is partitioned at the 256 spreading
    prefixes (``data/00/`` ... ``data/ff/``, :func:`objckpt.layout.spread_prefix`): what S3
    learns from saves with ``key_spreading`` (their prefixes are the same every save, unlike
    ``data/<step>-<attempt>/``) or sets up on request. Keys of the old layout
    (``data/<step:020d>-...``) all sort into one of these ranges (``[data/00/, data/01/)``)."""
    n = 16**layout.SPREAD_DIGITS
    return tuple(layout.spread_prefix(f"{i:0{layout.SPREAD_DIGITS}x}") for i in range(n))
