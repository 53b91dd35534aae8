"""Timelines: claiming one, rolling back, setting a checkpoint aside (invariants T1-T3).

Everything here is metadata only: no shard is ever copied or rewritten.

* :func:`claim_timeline` -- a new timeline continuing from a committed base, claimed by one
  create-if-absent write of ``timelines/<n>.json`` (two claims of one number cannot both
  succeed; the loser takes the next number), then ``LATEST`` moves to it by compare-and-swap,
  forward only. From then on the base is the head, and saves continue on the new timeline.
* :func:`rollback` -- :func:`claim_timeline` from a checkpoint the user names (after a loss
  spike, say); the steps after it on the old line are abandoned (kept for ``keep_abandoned``,
  then collected).
* :func:`quarantine` -- a marker ``quarantine/<timeline>-<step>.json`` that makes restores skip a
  checkpoint (and ``verify`` report it) without deleting anything.
"""

from __future__ import annotations

import logging

from . import layout
from .commit import advance_pointer
from .errors import AlreadyExistsError, CommitError, NoCheckpointError
from .manifest import Manifest, canonical_json
from .pointer import Pointer, TimelineClaim
from .reader import Reader
from .store.base import PutMode, Store

__all__ = ["claim_timeline", "quarantine", "rollback", "unquarantine"]

log = logging.getLogger("objckpt.timelines")

#: claims tried before giving up when other writers keep taking the next number
CLAIM_ATTEMPTS = 32


def claim_timeline(store: Store, base: Manifest, *, reason: str) -> TimelineClaim:
    """Claim the next timeline, continuing from ``base``, and make it the head.

    Atomicity: the claim is one create-if-absent write (invariant T1): exactly one claimant wins
    each number, and a timeline can therefore never hold checkpoints from two bases. The pointer
    then moves to ``(new timeline, base)`` forward-only; if that fails, readers roll forward
    onto the claim anyway.

    Raises:
        CommitError: no number could be claimed in :data:`CLAIM_ATTEMPTS` tries.
        StoreError: the store could not be written.
    """
    history = Reader(store).history
    # every timeline above 0 is claimed before anything is committed on it, so the claims alone
    # say which number is next
    number = max([*history.claim_numbers(), base.timeline]) + 1
    for _ in range(CLAIM_ATTEMPTS):
        claim = TimelineClaim.create(timeline=number, base=base, reason=reason)
        try:
            store.put(claim.key, claim.encode(), mode=PutMode.CREATE)
        except AlreadyExistsError:
            number += 1  # another claimant won this number: take the next
            continue
        advance_pointer(store, Pointer.for_manifest(base, timeline=number))
        log.info(
            "claimed timeline %d under %s, continuing from step %s (%s)",
            number,
            store.location,
            base.label,
            reason,
        )
        return claim
    raise CommitError(f"could not claim a new timeline under {store.location} in {CLAIM_ATTEMPTS} tries")


def rollback(store: Store, step: int, *, timeline: int | None = None) -> TimelineClaim:
    """Make committed checkpoint ``step`` the head again (metadata only, one claim and one
    pointer update); the next save continues from it on the new timeline.

    ``step`` is looked up on the head's line (``timeline`` names another one). The checkpoint's
    shards are checked first (HEAD): rolling back onto a damaged checkpoint is refused.

    Raises:
        NoCheckpointError: no such committed checkpoint, or it is damaged or quarantined.
    """
    reader = Reader(store)
    base = reader.load(step, timeline)
    problems = reader.check(base)
    if problems:
        raise NoCheckpointError(
            f"cannot roll back to step {base.label}: it is damaged ({'; '.join(map(str, problems))})"
        )
    if reader.is_quarantined(base):
        raise NoCheckpointError(f"cannot roll back to step {base.label}: it is quarantined")
    abandoned = [ref for ref in reader.line() if ref > base.ref and ref[0] >= base.timeline]
    claim = claim_timeline(store, base, reason="rollback")
    log.info(
        "rolled back %s to step %s on timeline %d; abandoned: %s",
        store.location,
        base.label,
        claim.timeline,
        ", ".join(_label(r) for r in abandoned) or "nothing",
    )
    return claim


def quarantine(store: Store, step: int, *, timeline: int | None = None, reason: str = "") -> Manifest:
    """Set checkpoint ``step`` aside: restores skip it, ``verify`` reports it; nothing is deleted.

    Idempotent. Returns the quarantined manifest.

    Raises:
        NoCheckpointError: no such committed checkpoint.
    """
    reader = Reader(store)
    manifest = reader.load(step, timeline)
    body = canonical_json({"format": "objckpt.quarantine", "manifest": manifest.key, "reason": reason})
    try:
        store.put(layout.quarantine_key(manifest.timeline, manifest.step), body, mode=PutMode.CREATE)
    except AlreadyExistsError:
        pass  # already set aside
    log.warning("quarantined checkpoint step %s under %s: %s", manifest.label, store.location, reason or "-")
    return manifest


def unquarantine(store: Store, step: int, *, timeline: int | None = None) -> Manifest:
    """Undo :func:`quarantine`."""
    manifest = Reader(store).load(step, timeline)
    store.delete([layout.quarantine_key(manifest.timeline, manifest.step)])
    return manifest


def _label(ref: tuple[int, int]) -> str:
    return str(ref[1]) if ref[0] == 0 else f"t{ref[0]}:{ref[1]}"
