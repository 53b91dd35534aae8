"""Garbage collection (invariants 9 and 15).

Retention is decided from manifests only (keep the last N, every K-th step, pinned steps), never
from key name patterns. Always kept: the pointer's target, the newest committed step, and every
newer checkpoint down to (and including) the newest one whose shards pass the HEAD check, so the
previous checkpoint survives until its successor is verified. Unreadable manifests are left alone
(with everything of their step), because what they reference cannot be known.

Deletion order makes every crash safe: a manifest is deleted before its shards, so no surviving
manifest ever names missing data. An attempt prefix under ``data/`` that no manifest references
(a failed or conflicting attempt, leftovers of a crashed GC) is removed only when every object in
it is older than the grace period, which must exceed the longest save: the save in progress is
always younger. Incomplete multipart uploads are aborted under the same grace period.

``plan_gc`` only reads (a dry run is a plan that is not run); ``run_gc`` executes a plan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from . import layout
from .defaults import GC_GRACE_PERIOD
from .errors import ManifestError, NoCheckpointError, NotFoundError, NotSupportedError
from .manifest import Manifest
from .reader import Reader
from .store.base import PendingUpload, Store

__all__ = [
    "GcPlan",
    "GcResult",
    "ManifestDeletion",
    "OrphanPrefix",
    "RetentionPolicy",
    "plan_gc",
    "retain",
    "run_gc",
]

log = logging.getLogger("objckpt.gc")

DEFAULT_GRACE_PERIOD = GC_GRACE_PERIOD


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed steps to keep.

    Attributes:
        keep_last: the N newest committed steps.
        keep_every: also every step divisible by K (e.g. 10_000), if set.
        pinned: steps kept whatever else applies.
    """

    keep_last: int = 3
    keep_every: int | None = None
    pinned: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"keep_last must be an int >= 0, got {self.keep_last!r}")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise ValueError(f"keep_every must be None or an int >= 1, got {self.keep_every!r}")
        object.__setattr__(self, "pinned", frozenset(self.pinned))

    @classmethod
    def from_options(cls, keep_last: int | None, keep_every: int | None = None) -> RetentionPolicy | None:
        """The policy the ``keep_last=`` / ``keep_every=`` options of the APIs mean; ``None``
        (keep everything) when ``keep_last`` is None."""
        return None if keep_last is None else cls(keep_last=keep_last, keep_every=keep_every)


@dataclass(frozen=True)
class ManifestDeletion:
    """A committed step to collect: its manifest key first, then its shard keys."""

    step: int
    key: str
    attempt: str
    shard_keys: tuple[str, ...]
    size: int


@dataclass(frozen=True)
class OrphanPrefix:
    """An attempt prefix no manifest references, every object older than the grace period."""

    prefix: str
    step: int
    attempt: str
    keys: tuple[str, ...]
    size: int
    newest: datetime


@dataclass
class GcPlan:
    """What :func:`run_gc` would do. Built by :func:`plan_gc`; printing it is a dry run."""

    manifests: list[ManifestDeletion] = field(default_factory=list)
    orphans: list[OrphanPrefix] = field(default_factory=list)
    uploads: list[PendingUpload] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)  # step -> why
    notes: list[str] = field(default_factory=list)  # things deliberately left alone
    grace_period: timedelta = DEFAULT_GRACE_PERIOD
    now: datetime | None = None

    @property
    def empty(self) -> bool:
        return not (self.manifests or self.orphans or self.uploads)

    def describe(self) -> list[str]:
        """Human-readable lines, one per decision."""
        lines = [f"keep step {s}: {why}" for s, why in sorted(self.kept.items())]
        for d in self.manifests:
            lines.append(
                f"delete step {d.step}: manifest {d.key}, then {len(d.shard_keys)} shard(s), "
                f"{d.size} bytes (attempt {d.attempt})"
            )
        for o in self.orphans:
            lines.append(
                f"delete orphan {o.prefix}: {len(o.keys)} object(s), {o.size} bytes, newest "
                f"{o.newest.isoformat()} (older than {self.grace_period})"
            )
        for u in self.uploads:
            started = u.initiated.isoformat() if u.initiated else "?"
            lines.append(f"abort incomplete upload of {u.key} (started {started})")
        lines.extend(f"leave alone: {n}" for n in self.notes)
        if self.empty:
            lines.append("nothing to collect")
        return lines


@dataclass
class GcResult:
    deleted_manifests: list[str] = field(default_factory=list)
    deleted_objects: int = 0
    aborted_uploads: int = 0
    skipped: list[str] = field(default_factory=list)


def plan_gc(
    store: Store,
    policy: RetentionPolicy,
    *,
    grace_period: timedelta = DEFAULT_GRACE_PERIOD,
    now: datetime | None = None,
) -> GcPlan:
    """Decide what to collect; reads only (manifests, the pointer, listings, HEADs).

    Raises:
        StoreError: the store could not be read; nothing is planned.
    """
    if grace_period < timedelta(0):
        raise ValueError("grace_period must not be negative")
    now = now or datetime.now(timezone.utc)
    cutoff = now - grace_period
    plan = GcPlan(grace_period=grace_period, now=now)
    reader = Reader(store)

    pointer = reader.pointer()
    manifest_keys = reader._list_manifest_keys(None)
    manifests: dict[int, Manifest] = {}
    unreadable: set[int] = set()
    for step, key in sorted(manifest_keys.items()):
        try:
            manifests[step] = reader._fetch(key)
        except NotFoundError:
            continue  # collected concurrently
        except ManifestError as exc:
            unreadable.add(step)
            plan.kept[step] = f"manifest does not validate ({exc}); left for a human"
            log.warning("gc: leaving step %d alone: %s", step, exc)

    steps = sorted(manifest_keys, reverse=True)

    def keep(step: int, why: str) -> None:
        plan.kept.setdefault(step, why)

    if steps:
        keep(steps[0], "newest committed step")
    if pointer is not None:
        keep(pointer.step, "target of LATEST")
    # Invariant 9: never lose the last good checkpoint. Keep every checkpoint from the newest
    # down to the newest one whose shards verify (HEAD), so a parent survives until its
    # successor is known to be usable.
    for step in sorted(manifests, reverse=True):
        problems = reader.check(manifests[step])
        if not problems:
            keep(step, "newest checkpoint that verifies")
            break
        keep(step, f"kept until a newer checkpoint verifies ({problems[0]})")
    for step in steps[: policy.keep_last]:
        keep(step, f"among the last {policy.keep_last}")
    for step in steps:
        if policy.keep_every and step % policy.keep_every == 0:
            keep(step, f"multiple of keep_every={policy.keep_every}")
        if step in policy.pinned:
            keep(step, "pinned")

    for step, m in sorted(manifests.items()):
        if step in plan.kept:
            continue
        plan.manifests.append(
            ManifestDeletion(step, m.key, m.attempt, tuple(s.key for s in m.shards), m.total_size)
        )

    # Orphans: attempt prefixes that no remaining manifest references. Prefixes of steps whose
    # manifest is unreadable are left alone (we cannot tell which attempt it names), and those of
    # manifests being deleted are handled by their deletion.
    referenced = {(m.step, m.attempt) for m in manifests.values()}
    for prefix in store.list_prefixes(layout.DATA_PREFIX):
        parsed = layout.parse_attempt_prefix(prefix)
        if parsed is None:
            plan.notes.append(f"{prefix}: not an objckpt attempt prefix")
            continue
        if parsed in referenced or parsed[0] in unreadable:
            continue
        objects = list(store.list(prefix))
        if not objects:
            continue
        stamps = [o.last_modified for o in objects]
        if any(t is None for t in stamps):
            plan.notes.append(f"{prefix}: the store reports no modification times")
            continue
        newest = max(stamps)  # type: ignore[type-var]
        if newest > cutoff:
            # Possibly the save in progress (or one that just failed): wait out the grace period.
            plan.notes.append(f"{prefix}: unreferenced but written {now - newest} ago (< grace period)")
            continue
        plan.orphans.append(
            OrphanPrefix(
                prefix,
                parsed[0],
                parsed[1],
                tuple(o.key for o in objects),
                sum(o.size for o in objects),
                newest,
            )
        )

    try:
        uploads = store.list_uploads("")
    except NotSupportedError:
        uploads = []
    for u in uploads:
        if u.initiated is not None and u.initiated <= cutoff:
            plan.uploads.append(u)
        else:
            plan.notes.append(f"incomplete upload of {u.key}: younger than the grace period or undated")
    return plan


def run_gc(store: Store, plan: GcPlan) -> GcResult:
    """Execute ``plan``: manifests first, then their shards, then orphans, then uploads.

    Atomicity: not atomic as a whole, but every prefix of it is safe: manifests go before the
    shards they name, so a crash leaves at worst unreferenced shards (collected as orphans by a
    later run once past the grace period), never a manifest that points at missing data.

    Raises:
        StoreError: a request failed; what was done before it stays done.
    """
    result = GcResult()
    reader = Reader(store)
    pointer = reader.pointer()
    doomed = [d for d in plan.manifests if pointer is None or d.step != pointer.step]
    for d in plan.manifests:
        if d not in doomed:
            result.skipped.append(f"step {d.step}: it became the target of LATEST")

    # 1. manifests: after this the steps are no longer committed and their shards unreferenced.
    if doomed:
        store.delete(d.key for d in doomed)
        result.deleted_manifests = [d.key for d in doomed]
    # 2. their shards.
    shard_keys = [k for d in doomed for k in d.shard_keys]
    if shard_keys:
        store.delete(shard_keys)
        result.deleted_objects += len(shard_keys)
    # 3. orphans, re-checked: an attempt committed since the plan was made is not an orphan.
    for o in plan.orphans:
        try:
            current = reader.load(o.step)
        except ManifestError:
            result.skipped.append(f"{o.prefix}: step {o.step} now has an unreadable manifest")
            continue
        except NoCheckpointError:  # still unreferenced
            current = None
        if current is not None and current.attempt == o.attempt:
            result.skipped.append(f"{o.prefix}: committed after the plan was made")
            continue
        store.delete(o.keys)  # only objects seen (old) at planning time
        result.deleted_objects += len(o.keys)
    # 4. incomplete uploads.
    for u in plan.uploads:
        store.abort_upload(u)
        result.aborted_uploads += 1
    return result


def retain(
    store: Store,
    policy: RetentionPolicy,
    *,
    grace_period: timedelta = DEFAULT_GRACE_PERIOD,
) -> GcResult | None:
    """Apply ``policy`` right after a commit; never raises.

    Used by the save session on the coordinator. A failure is logged, not raised: the save is
    already committed, and retention only ever deletes what the manifests say is no longer kept
    (the newest commit, its parent until it verifies, and any save in progress are never
    touched), so a skipped round is harmless.
    """
    try:
        plan = plan_gc(store, policy, grace_period=grace_period)
        if plan.empty:
            return None
        result = run_gc(store, plan)
        log.info(
            "retention: deleted %d checkpoint(s), %d object(s)",
            len(result.deleted_manifests),
            result.deleted_objects,
        )
        return result
    except Exception as exc:  # noqa: BLE001 - the save is committed whatever happens here
        log.warning("retention under %s failed (checkpoints are intact): %s", store.location, exc)
        return None
