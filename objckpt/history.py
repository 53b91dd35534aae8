"""What a run root's metadata says happened: the pointer, the timeline claims, the committed
checkpoints, the head and its line (invariants 10, T1-T3). Reads only metadata, never ``data/``.

* A **timeline** is a numbered line of checkpoints; timeline 0 is implicit, every later one is
  claimed (``timelines/<n>.json``) with a **base**: the checkpoint it continues from.
* The **head** is the newest committed checkpoint of the newest timeline. A newly claimed
  timeline without commits of its own has its base as head (a rollback takes effect at once).
* The head's **line** is its ancestry: the head's timeline, then the part of its base's timeline
  up to the base, and so on down to timeline 0. Checkpoints off the line are **abandoned**
  (a stale coordinator's late commits, steps after a rollback's base). Fallback, retention and
  step names all follow the line, so an abandoned branch is never resumed.

Resolution (:meth:`History.resolve`) costs a constant number of requests whatever the number of
shards, checkpoints and timelines: GET the pointer, LIST ``manifests/`` after the pointer's key
(rolls forward over a commit whose pointer update was lost, onto a newer timeline too), LIST
``timelines/`` after the pointer's timeline (rolls forward onto a claim whose pointer update was
lost), and GET one claim when the head is a base. With no pointer, or a corrupt one, both
prefixes are listed whole.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import layout
from .errors import ManifestError, NotFoundError
from .pointer import Pointer, TimelineClaim
from .store.base import Store

__all__ = ["Head", "History", "Line"]

log = logging.getLogger("objckpt.reader")

Ref = tuple[int, int]  # (timeline, step)


@dataclass(frozen=True)
class Line:
    """The ancestry of a timeline: ``segments`` = ``[(timeline, last step or None), ...]`` from
    the newest timeline down to timeline 0; a checkpoint ``(t, s)`` is on the line when some
    segment has timeline ``t`` and ``s`` is at most its last step."""

    segments: tuple[tuple[int, int | None], ...]

    def position(self, ref: Ref) -> int | None:
        """Where ``ref`` lies on the line (0: the newest segment), or None when it is off it."""
        for i, (timeline, last) in enumerate(self.segments):
            if ref[0] == timeline and (last is None or ref[1] <= last):
                return i
        return None

    def contains(self, ref: Ref) -> bool:
        return self.position(ref) is not None

    def order(self, refs: Iterable[Ref]) -> list[Ref]:
        """The refs on the line, newest first (fallback order)."""
        on = [(self.position(r), r) for r in refs]
        return [
            r for pos, r in sorted(((p, r) for p, r in on if p is not None), key=lambda x: (x[0], -x[1][1]))
        ]

    @property
    def timelines(self) -> list[int]:
        return [t for t, _ in self.segments]


@dataclass
class Head:
    """The resolved head: its timeline, the key of its manifest (``None`` when nothing is
    committed), and what resolution saw (for rolling forward without more requests)."""

    timeline: int
    key: str | None
    pointer: Pointer | None
    claims: dict[int, TimelineClaim] = field(default_factory=dict)

    @property
    def ref(self) -> Ref | None:
        parsed = layout.parse_manifest_key(self.key) if self.key else None
        return None if parsed is None else parsed


class History:
    """Reads the run root's metadata (thread-safe; holds nothing but the store)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # ------------------------------------------------------------------ primitives

    def pointer(self) -> Pointer | None:
        """The decoded ``LATEST`` pointer (1 GET); None when absent or corrupt (logged)."""
        try:
            data = self.store.get(layout.POINTER_KEY)
        except NotFoundError:
            return None
        try:
            return Pointer.decode(data, key=layout.POINTER_KEY)
        except ManifestError as exc:
            log.warning(
                "ignoring corrupt pointer %s in %s (falling back to listing manifests/): %s",
                layout.POINTER_KEY,
                self.store.location,
                exc,
            )
            return None

    def manifest_keys(self, start_after: str | None = None) -> dict[Ref, str]:
        """Committed checkpoints listed under ``manifests/`` (after ``start_after``), by ref."""
        found: dict[Ref, str] = {}
        for meta in self.store.list(layout.MANIFEST_PREFIX, start_after=start_after):
            ref = layout.parse_manifest_key(meta.key)
            if ref is None:
                log.debug("ignoring non-manifest object %s under manifests/", meta.key)
                continue
            found[ref] = meta.key
        return found

    def claim_numbers(self, after: int | None = None) -> list[int]:
        """Claimed timeline numbers (LIST of ``timelines/``), ascending, greater than ``after``."""
        start = layout.timeline_key(after) if after else None
        numbers = []
        for meta in self.store.list(layout.TIMELINE_PREFIX, start_after=start):
            n = layout.parse_timeline_key(meta.key)
            if n is not None and (after is None or n > after):
                numbers.append(n)
        return sorted(numbers)

    def claim(self, timeline: int) -> TimelineClaim | None:
        """The claim of ``timeline`` (None for timeline 0 and for a missing claim).

        Raises:
            ManifestError: the claim exists but fails validation.
        """
        if timeline == 0:
            return None
        key = layout.timeline_key(timeline)
        try:
            data = self.store.get(key)
        except NotFoundError:
            return None
        return TimelineClaim.decode(data, key=key)

    def claims(self) -> dict[int, TimelineClaim]:
        """Every valid claim (an invalid one is logged and left out: its timeline has no base)."""
        out: dict[int, TimelineClaim] = {}
        for n in self.claim_numbers():
            try:
                claim = self.claim(n)
            except ManifestError as exc:
                log.warning("ignoring invalid timeline claim %s: %s", layout.timeline_key(n), exc)
                continue
            if claim is not None:
                out[n] = claim
        return out

    def line(self, timeline: int, claims: dict[int, TimelineClaim] | None = None) -> Line:
        """The ancestry of ``timeline`` (GETs the claims it needs unless given)."""
        segments: list[tuple[int, int | None]] = []
        t: int | None = timeline
        last: int | None = None
        seen: set[int] = set()
        while t is not None and t not in seen:
            seen.add(t)
            segments.append((t, last))
            if t == 0:
                break
            claim = claims.get(t) if claims is not None else self._claim_or_none(t)
            if claim is None:
                log.warning(
                    "timeline %d under %s has no valid claim: its line ends there", t, self.store.location
                )
                break
            t, last = claim.base_timeline, claim.base_step
        return Line(tuple(segments))

    def _claim_or_none(self, timeline: int) -> TimelineClaim | None:
        try:
            return self.claim(timeline)
        except ManifestError as exc:
            log.warning("ignoring invalid timeline claim %s: %s", layout.timeline_key(timeline), exc)
            return None

    # ------------------------------------------------------------------ resolution

    def resolve(self) -> Head:
        """The head, in O(1) requests (see the module doc). ``Head.key`` is None when nothing is
        committed (a claimed timeline whose base is gone counts as nothing)."""
        pointer = self.pointer()
        if pointer is not None:
            after_key = layout.manifest_key(pointer.step, pointer.timeline)
            listed = self.manifest_keys(start_after=after_key)
            newer_claims = self.claim_numbers(after=pointer.timeline or None)
            floor = pointer.timeline
        else:
            listed = self.manifest_keys()
            newer_claims = self.claim_numbers()
            floor = 0
        newest = max([floor, *newer_claims, *(t for t, _ in listed)])
        on_newest = [ref for ref in listed if ref[0] == newest]
        claims: dict[int, TimelineClaim] = {}
        if on_newest:
            return Head(newest, listed[max(on_newest)], pointer, claims)
        if pointer is not None and newest == pointer.timeline:
            return Head(newest, pointer.manifest_key, pointer, claims)
        if newest == 0:
            return Head(0, None, pointer, claims)
        # The newest timeline has no commit of its own: its base is the head.
        claim = self._claim_or_none(newest)
        if claim is None:
            # Not a usable claim: resolve among what is committed instead.
            rest = {ref: key for ref, key in (listed if pointer is None else self.manifest_keys()).items()}
            if not rest:
                return Head(0, None, pointer, claims)
            top = max(t for t, _ in rest)
            return Head(top, rest[max(r for r in rest if r[0] == top)], pointer, claims)
        claims[newest] = claim
        return Head(newest, claim.base_key, pointer, claims)
