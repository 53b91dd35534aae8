"""What "latest" means in every command: the newest **valid** checkpoint.

Valid as the reader's :meth:`~objckpt.reader.Reader.candidates` defines it: the manifest
validates and every shard passes the HEAD check (present, same size and version), walking newest
first and then along the parent chain. Checkpoints rejected on the way are *damaged* and are
reported (step, manifest key, reason) so that ``ls``, ``show``, ``latest``, ``verify`` and ``cp``
can say what they skipped. Damage is what :func:`objckpt.errors.is_damage` says it is, nothing
else: an outage, a permission or a configuration error propagates (exit 4 or 2) and is never
mistaken for a damaged checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import layout
from ..errors import NoCheckpointError, describe, is_damage
from ..manifest import Manifest, Pointer
from ..reader import Problem, Reader


@dataclass(frozen=True)
class Skipped:
    """A damaged checkpoint passed over while resolving the latest one."""

    step: int
    key: str
    reason: str
    problems: tuple[Problem, ...] = ()
    invalid_manifest: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "manifest": self.key,
            "reason": self.reason,
            "invalid_manifest": self.invalid_manifest,
            "problems": [{"key": p.key, "rank": p.rank, "reason": p.reason} for p in self.problems],
        }


@dataclass
class Resolution:
    """The newest valid checkpoint (None: there is none), the pointer, and what was skipped."""

    manifest: Manifest | None
    pointer: Pointer | None
    skipped: list[Skipped] = field(default_factory=list)
    shards_checked: bool = True

    @property
    def step(self) -> int | None:
        return None if self.manifest is None else self.manifest.step

    def require(self, where: str) -> Manifest:
        """The manifest, or NoCheckpointError naming ``where`` and what was damaged."""
        if self.manifest is not None:
            return self.manifest
        if not self.skipped:
            raise NoCheckpointError(f"no committed checkpoint under {where}")
        damaged = "; ".join(f"step {s.step}: {s.reason}" for s in self.skipped)
        raise NoCheckpointError(f"no valid committed checkpoint under {where} (damaged: {damaged})")


def summarize(problems: list[Problem] | tuple[Problem, ...]) -> str:
    first = problems[0]
    rank = f" (rank {first.rank})" if first.rank is not None else ""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{first.key}{rank}: {first.reason}{more}"


def iter_valid(reader: Reader, skipped: list[Skipped], *, check_shards: bool = True) -> Iterator[Manifest]:
    """Validated manifests in the reader's fallback order; with ``check_shards`` only those whose
    shards pass the HEAD check (exactly :meth:`Reader.candidates`), each rejected one appended to
    ``skipped``. Errors that are not damage propagate from :meth:`Reader.check`."""
    for m in reader.manifests():
        if check_shards:
            problems = reader.check(m)
            if problems:
                skipped.append(Skipped(m.step, m.key, summarize(problems), tuple(problems)))
                continue
        yield m


def _invalid_newer(reader: Reader, found: Manifest | None, seen: set[int]) -> list[Skipped]:
    """Manifests newer than ``found`` that do not validate (the walk passes over them with only
    a log line): one LIST of ``manifests/`` after ``found``'s key, one GET per newer step."""
    start = None if found is None else layout.manifest_key(found.step)
    out = []
    for meta in reader.store.list(layout.MANIFEST_PREFIX, start_after=start):
        step = layout.step_of_manifest_key(meta.key)
        if step is None or step in seen:
            continue
        try:
            reader.load(step)
        except NoCheckpointError:
            continue  # deleted meanwhile
        except Exception as exc:
            if not is_damage(exc):
                raise
            why = describe(exc, with_key=False)
            out.append(Skipped(step, meta.key, f"manifest does not validate: {why}", invalid_manifest=True))
    return out


def resolve_latest(reader: Reader, *, check_shards: bool = True) -> Resolution:
    """THE resolution of "latest" for every command (see the module docstring).

    ``check_shards=False`` is the manifest-only view (``latest --no-check-shards``).
    """
    pointer = reader.pointer()
    skipped: list[Skipped] = []
    found = next(iter_valid(reader, skipped, check_shards=check_shards), None)
    skipped += _invalid_newer(reader, found, {s.step for s in skipped})
    skipped.sort(key=lambda s: s.step, reverse=True)
    return Resolution(found, pointer, skipped, check_shards)


def note_skipped(resolution: Resolution) -> None:
    """One stderr note per damaged checkpoint passed over."""
    from ._output import note

    using = "" if resolution.step is None else f"; using step {resolution.step}"
    for s in resolution.skipped:
        note(f"skipped damaged checkpoint step {s.step} ({s.key}): {s.reason}{using}")
