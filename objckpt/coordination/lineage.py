"""Where the next save of a run root continues: the line this process is on (invariant T2).

Restoring decides where saving continues, for every API alike (CheckpointManager, ``load_sharded``
then ``save_sharded``, the plug-ins): the restore session records here what it restored and
whether that was the head; the save session's commit (rank 0) reads it. Restoring the head (or
nothing: a fresh run) continues on the head's timeline. Restoring anything else -- an explicit
older step, or a fallback past damage -- makes the next save claim a new timeline whose base is
the restored checkpoint, so re-saving a step that exists on the abandoned line succeeds and a
restart afterwards resolves the new timeline, never the abandoned one.

State is per process and per run root (the store's location; a memory store's identity).
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

from ..manifest import Manifest
from ..reader import Reader
from ..store.base import Store
from ..timelines import claim_timeline

__all__ = ["Position", "forget", "position", "record", "where_to_commit"]

# the logger of the save that asks (its messages were logged there before this moved here)
log = logging.getLogger("objckpt.save")


@dataclass(frozen=True)
class Position:
    """Where this process is on a run root's history.

    Attributes:
        base: the checkpoint the next save continues from (restored, or last committed).
        timeline: the timeline to save on; ``None``: claim a new one from ``base`` first.
        reason: why a new timeline is needed (``restore``, ``fallback``), for the claim.
        abandons: the steps of the old line the new timeline leaves behind (for the log).
        restored: ``base`` was restored (not committed by this process): saving a step that is
            not after it (re-saving the step just restored, say) branches a new timeline from it
            instead of colliding with the committed step.
    """

    base: Manifest
    timeline: int | None
    reason: str = ""
    abandons: tuple[str, ...] = ()
    restored: bool = False


_lock = threading.Lock()
_by_location: dict[str, Position] = {}
#: memory stores share names (every MemoryStore("x") is a different store): keyed by the object,
#: weakly, so a store's position dies with it and is never inherited by a later one
_by_object: weakref.WeakKeyDictionary[Store, Position] = weakref.WeakKeyDictionary()


def _target(store: Store) -> tuple[Store | None, str]:
    inner = store
    # a wrapper that keeps its store's run root (counting, faults) shares its entry; one that
    # names another root (a PrefixStore: every s3:// run root over one bucket client) does not
    while getattr(inner, "inner", None) is not None and inner.inner.location == inner.location:  # type: ignore[attr-defined]
        inner = inner.inner  # type: ignore[attr-defined]
    location = str(inner.location)
    return (inner if location.startswith("memory://") else None), location


def position(store: Store) -> Position | None:
    obj, location = _target(store)
    with _lock:
        return _by_object.get(obj) if obj is not None else _by_location.get(location)


def record(store: Store, pos: Position) -> None:
    obj, location = _target(store)
    with _lock:
        if obj is not None:
            _by_object[obj] = pos
        else:
            _by_location[location] = pos


def forget(store: Store) -> None:
    obj, location = _target(store)
    with _lock:
        if obj is not None:
            _by_object.pop(obj, None)
        else:
            _by_location.pop(location, None)


def where_to_commit(store: Store, step: int) -> tuple[int, tuple[int, int] | None]:
    """Rank 0 of a save of ``step``: the timeline it commits on and the checkpoint it continues from.

    After restoring the head (or nothing) that is the head's timeline; after restoring
    anything else (an explicit step, a fallback past damage) a new timeline is claimed here,
    once, whose base is the restored checkpoint (invariant T2), and the abandoned steps are
    logged at INFO.
    """
    pos = position(store)
    if pos is None:
        head = Reader(store).head()
        return head.timeline, head.ref
    if pos.restored and pos.timeline is not None and step <= pos.base.step:
        # Saving a step that is not after the checkpoint just restored (re-saving it, or an
        # earlier one): the committed steps from there on belong to the line being left.
        pos = Position(pos.base, None, "restore", (), restored=True)
    if pos.timeline is not None:
        pointer = Reader(store).pointer()
        if pointer is not None and pointer.timeline > pos.timeline:
            # Someone (a rollback from the CLI, another job) started a newer timeline: this
            # save lands on an abandoned line and will never be restored. Say so, loudly.
            log.warning(
                "saving on timeline %d under %s, but timeline %d has been started since (a rollback?): "
                "this checkpoint will never be the latest; restore to continue on the new head",
                pos.timeline,
                store.location,
                pointer.timeline,
            )
        return pos.timeline, pos.base.ref
    claim = claim_timeline(store, pos.base, reason=pos.reason or "restore")
    log.info(
        "saving on new timeline %d from step %s under %s (restored %s); abandoned: %s",
        claim.timeline,
        pos.base.label,
        store.location,
        "after a fallback past damage" if pos.reason == "fallback" else "a checkpoint that was not the head",
        ", ".join(pos.abandons) or "nothing",
    )
    record(store, Position(pos.base, claim.timeline))
    return claim.timeline, pos.base.ref
