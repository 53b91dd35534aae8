"""What "latest" means in every command: the newest **valid** checkpoint of the head's line.

Valid as the reader's :meth:`~objckpt.reader.Reader.candidates` defines it: the manifest
validates, it is not quarantined, and every shard passes the HEAD check (present, same size and
version), walking from the head along its line (the parent chain, across timeline bases). An
abandoned branch (steps after a rollback's base, a stale coordinator's late commits) is never
"latest". Checkpoints rejected on the way are *damaged* and are reported (step, manifest key,
reason); quarantined ones passed over are reported apart (a decision, not damage), so that
``ls``, ``show``, ``latest``, ``verify`` and ``cp`` can say what they skipped. Damage is what
:func:`objckpt.errors.is_damage` says it is, nothing else: an outage, a permission or a
configuration error propagates (exit 4 or 2) and is never mistaken for a damaged checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import layout
from ..errors import NoCheckpointError, NotFoundError, describe, is_damage
from ..history import Head
from ..manifest import Manifest, Pointer
from ..reader import Problem, Reader
from ._common import label


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over while resolving the latest one: damaged (shards), an invalid
    manifest, or quarantined (set aside by a human: not damage)."""

    step: int
    key: str
    reason: str
    problems: tuple[Problem, ...] = ()
    invalid_manifest: bool = False
    timeline: int = 0
    quarantined: bool = False

    @property
    def ref(self) -> tuple[int, int]:
        return (self.timeline, self.step)

    @property
    def label(self) -> str:
        return label(self.ref)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "timeline": self.timeline,
            "label": self.label,
            "manifest": self.key,
            "reason": self.reason,
            "invalid_manifest": self.invalid_manifest,
            "quarantined": self.quarantined,
            "problems": [{"key": p.key, "rank": p.rank, "reason": p.reason} for p in self.problems],
        }


@dataclass
class Resolution:
    """The newest valid checkpoint (None: there is none), the pointer, the head, what was
    skipped as damaged and what was passed over as quarantined."""

    manifest: Manifest | None
    pointer: Pointer | None
    skipped: list[Skipped] = field(default_factory=list)
    shards_checked: bool = True
    head: Head | None = None
    quarantined: list[Skipped] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        return None if self.manifest is None else self.manifest.step

    @property
    def ref(self) -> tuple[int, int] | None:
        return None if self.manifest is None else self.manifest.ref

    @property
    def label(self) -> str | None:
        return None if self.manifest is None else self.manifest.label

    def require(self, where: str) -> Manifest:
        """The manifest, or NoCheckpointError naming ``where`` and what was passed over."""
        if self.manifest is not None:
            return self.manifest
        if not self.skipped and not self.quarantined:
            raise NoCheckpointError(f"no committed checkpoint under {where}")
        why = [f"step {s.label}: {s.reason}" for s in self.skipped]
        why += [f"step {s.label}: quarantined{': ' + s.reason if s.reason else ''}" for s in self.quarantined]
        what = "damaged" if not self.quarantined else "passed over"
        raise NoCheckpointError(f"no valid committed checkpoint under {where} ({what}: {'; '.join(why)})")


def summarize(problems: list[Problem] | tuple[Problem, ...]) -> str:
    first = problems[0]
    rank = f" (rank {first.rank})" if first.rank is not None else ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{first.key}{rank}: {first.reason}{more}"


def iter_valid(
    reader: Reader, skipped: list[Skipped], *, check_shards: bool = True, head: Head | None = None
) -> Iterator[Manifest]:
    """Validated manifests in the reader's fallback order (the head's line; quarantined ones
    left out); with ``check_shards`` only those whose shards pass the HEAD check (exactly
    :meth:`Reader.candidates`), each rejected one appended to ``skipped``. Errors that are not
    damage propagate from :meth:`Reader.check`."""
    for m in reader.manifests(head):
        if check_shards:
            problems = reader.check(m)
            if problems:
                skipped.append(
                    Skipped(m.step, m.key, summarize(problems), tuple(problems), timeline=m.timeline)
                )
                continue
        yield m


def _newer_on_line(reader: Reader, head: Head, found: Manifest | None) -> list[tuple[tuple[int, int], str]]:
    """Checkpoints of the head's line newer than ``found`` (all of the line when None), newest
    first: one LIST of ``manifests/`` after ``found``'s key (keys sort by (timeline, step), and
    everything newer on the line sorts after it), plus the claims of the line when needed."""
    listed = reader.history.manifest_keys(start_after=None if found is None else found.key)
    if found is not None:
        listed.pop(found.ref, None)
    if not listed:
        return []
    line = reader.history.line(head.timeline)

    def rank(ref: tuple[int, int]) -> tuple[int, int]:
        position = line.position(ref)
        return (len(line.segments) if position is None else position, -ref[1])

    order = line.order(listed)
    if found is not None:
        order = [r for r in order if rank(r) < rank(found.ref)]
    return [(r, listed[r]) for r in order]


def _passed_over(
    reader: Reader, head: Head, found: Manifest | None, seen: set[tuple[int, int]]
) -> tuple[list[Skipped], list[Skipped]]:
    """Checkpoints newer than ``found`` on the line that the walk passed over with only a log
    line: invalid manifests (one GET each) and quarantined ones (one LIST of ``quarantine/``)."""
    newer = [(r, k) for r, k in _newer_on_line(reader, head, found) if r not in seen]
    if not newer:
        return [], []
    from ._view import list_quarantined

    marked = list_quarantined(reader.store, dict(newer))
    invalid: list[Skipped] = []
    quarantined: list[Skipped] = []
    for ref, key in newer:
        try:
            m = reader.fetch(key)
        except NotFoundError:
            continue  # deleted meanwhile
        except Exception as exc:
            if not is_damage(exc):
                raise
            why = describe(exc, with_key=False)
            invalid.append(
                Skipped(
                    ref[1], key, f"manifest does not validate: {why}", invalid_manifest=True, timeline=ref[0]
                )
            )
            continue
        if ref in marked:
            from ._view import read_reason

            reason = read_reason(reader.store, layout.quarantine_key(*ref))
            quarantined.append(Skipped(m.step, key, reason, timeline=m.timeline, quarantined=True))
    return invalid, quarantined


def resolve_latest(reader: Reader, *, check_shards: bool = True) -> Resolution:
    """THE resolution of "latest" for every command (see the module docstring): the newest
    valid checkpoint of the head's line. It never resumes an abandoned branch: the walk, the
    damage reported and the quarantined checkpoints passed over all follow the line.

    ``check_shards=False`` is the manifest-only view (``latest --no-check-shards``).
    """
    head = reader.head()
    skipped: list[Skipped] = []
    found = next(iter_valid(reader, skipped, check_shards=check_shards, head=head), None)
    invalid, quarantined = _passed_over(reader, head, found, {s.ref for s in skipped})
    skipped += invalid
    skipped.sort(key=lambda s: s.ref, reverse=True)
    quarantined.sort(key=lambda s: s.ref, reverse=True)
    return Resolution(found, head.pointer, skipped, check_shards, head, quarantined)


def note_skipped(resolution: Resolution) -> None:
    """One stderr note per checkpoint passed over (damaged or quarantined)."""
    from ._output import note

    using = "" if resolution.label is None else f"; using step {resolution.label}"
    for s in resolution.skipped:
        note(f"skipped damaged checkpoint step {s.label} ({s.key}): {s.reason}{using}")
    for s in resolution.quarantined:
        why = f": {s.reason}" if s.reason else ""
        note(f"skipped quarantined checkpoint step {s.label} ({s.key}){why}{using}")
