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
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from . import layout
from .defaults import GC_GRACE_PERIOD, KEEP_ABANDONED
from .errors import ManifestError, NotFoundError, NotSupportedError
from .history import Line
from .manifest import Manifest
from .pointer import TimelineClaim
from .reader import Reader
from .store.base import PendingUpload, Store

__all__ = [
    "GcPlan",
    "GcResult",
    "ManifestDeletion",
    "OrphanPrefix",
    "RetentionPolicy",
    "plan_gc",
    "live_keys",
    "retain",
    "run_gc",
]

log = logging.getLogger("objckpt.gc")

DEFAULT_GRACE_PERIOD = GC_GRACE_PERIOD


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints to keep (invariant 15).

    Attributes:
        keep_last: the N newest committed checkpoints *of the head's line* (its ancestry across
            timelines); checkpoints of abandoned branches do not count.
        keep_every: also every step of the line divisible by K (e.g. 10_000), if set.
        pinned: kept whatever else applies: steps (an int: that step on any timeline) or
            ``(timeline, step)`` pairs.
        keep_abandoned: checkpoints off the line (steps after a rollback's base, a stale
            coordinator's late commits) are kept this long after they were abandoned, then
            collected; ``None`` keeps them forever.
    """

    keep_last: int = 3
    keep_every: int | None = None
    pinned: frozenset[int | tuple[int, int]] = frozenset()
    keep_abandoned: timedelta | None = KEEP_ABANDONED

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 0:
            raise ValueError(f"keep_last must be an int >= 0, got {self.keep_last!r}")
        if self.keep_every is not None and (not isinstance(self.keep_every, int) or self.keep_every < 1):
            raise ValueError(f"keep_every must be None or an int >= 1, got {self.keep_every!r}")
        if self.keep_abandoned is not None and self.keep_abandoned < timedelta(0):
            raise ValueError("keep_abandoned must not be negative")
        object.__setattr__(self, "pinned", frozenset(self.pinned))

    def is_pinned(self, ref: tuple[int, int]) -> bool:
        return ref in self.pinned or ref[1] in self.pinned

    @classmethod
    def from_options(cls, keep_last: int | None, keep_every: int | None = None) -> RetentionPolicy | None:
        """The policy the ``keep_last=`` / ``keep_every=`` options of the APIs mean; ``None``
        (keep everything) when ``keep_last`` is None."""
        return None if keep_last is None else cls(keep_last=keep_last, keep_every=keep_every)


@dataclass(frozen=True)
class ManifestDeletion:
    """A committed checkpoint to collect: its manifest key first, then its shard keys."""

    step: int
    key: str
    attempt: str
    shard_keys: tuple[str, ...]
    size: int
    timeline: int = 0
    #: its objects that stay: a retained checkpoint references them (deduplication)
    shared_keys: tuple[str, ...] = ()
    shared_size: int = 0

    @property
    def label(self) -> str:
        return str(self.step) if self.timeline == 0 else f"t{self.timeline}:{self.step}"


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
    kept: dict[tuple[int, int], str] = field(default_factory=dict)  # (timeline, step) -> why
    notes: list[str] = field(default_factory=list)  # things deliberately left alone
    grace_period: timedelta = DEFAULT_GRACE_PERIOD
    now: datetime | None = None

    @property
    def empty(self) -> bool:
        return not (self.manifests or self.orphans or self.uploads)

    def why_kept(self, step: int, timeline: int | None = None) -> str | None:
        """Why ``step`` (on ``timeline``, or any) is kept, or None when it is not."""
        for (t, s), why in sorted(self.kept.items(), reverse=True):
            if s == step and (timeline is None or t == timeline):
                return why
        return None

    def describe(self) -> list[str]:
        """Human-readable lines, one per decision."""
        lines = [f"keep step {_label(ref)}: {why}" for ref, why in sorted(self.kept.items())]
        for d in self.manifests:
            lines.append(
                f"delete step {d.label}: manifest {d.key}, then {len(d.shard_keys)} shard(s), "
                f"{d.size} bytes (attempt {d.attempt})"
                + (
                    f"; {len(d.shared_keys)} shared object(s), {d.shared_size} bytes, stay (a kept checkpoint "
                    "references them)"
                    if d.shared_keys
                    else ""
                )
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
    verified: Collection[tuple[int, int]] = (),
) -> GcPlan:
    """Decide what to collect; reads only (manifests, the pointer, listings, HEADs).

    ``verified``: checkpoints ``(timeline, step)`` whose shards the caller has just checked
    against the store itself -- the commit that wrote them (invariant 5) -- so invariant 9's
    "newest checkpoint that verifies" needs no HEAD of each of their shards again (at 4,096
    ranks x 8 shards that was 32,768 HEADs after every commit).

    Raises:
        StoreError: the store could not be read; nothing is planned.
    """
    if grace_period < timedelta(0):
        raise ValueError("grace_period must not be negative")
    now = now or datetime.now(timezone.utc)
    cutoff = now - grace_period
    plan = GcPlan(grace_period=grace_period, now=now)
    reader = Reader(store)

    history = reader.history
    head = history.resolve()
    manifest_keys = history.manifest_keys()
    claims = history.claims()
    line = history.line(head.timeline, claims)
    manifests: dict[tuple[int, int], Manifest] = {}
    unreadable: set[tuple[int, int]] = set()
    for ref, key in sorted(manifest_keys.items()):
        try:
            manifests[ref] = reader.fetch(key)
        except NotFoundError:
            continue  # collected concurrently
        except ManifestError as exc:
            unreadable.add(ref)
            plan.kept[ref] = f"manifest does not validate ({exc}); left for a human"
            log.warning("gc: leaving step %s alone: %s", _label(ref), exc)

    def keep(ref: tuple[int, int] | None, why: str) -> None:
        if ref is not None and ref in manifest_keys:
            plan.kept.setdefault(ref, why)

    on_line = line.order(manifest_keys)  # newest first
    if head.ref is not None:
        keep(head.ref, "the head (newest checkpoint of the newest timeline)")
    if head.pointer is not None:
        keep(layout.parse_manifest_key(head.pointer.manifest_key), "target of LATEST")
    # Invariant 9: never lose the last good checkpoint. Keep every checkpoint from the head down
    # its line to the newest one whose shards verify (HEAD), so a parent survives until its
    # successor is known to be usable.
    for ref in on_line:
        if ref not in manifests:
            continue
        if reader.is_quarantined(manifests[ref]):
            keep(ref, "quarantined; kept until a newer checkpoint verifies")
            continue  # restores skip it: the one they use is further down the line
        problems = [] if ref in verified else reader.check(manifests[ref])
        if not problems:
            keep(ref, "newest checkpoint that verifies")
            break
        keep(ref, f"kept until a newer checkpoint verifies ({problems[0]})")
    for ref in on_line[: policy.keep_last]:
        keep(ref, f"among the last {policy.keep_last} of the line")
    for ref in on_line:
        if policy.keep_every and ref[1] % policy.keep_every == 0:
            keep(ref, f"multiple of keep_every={policy.keep_every}")
    for ref in manifest_keys:
        if policy.is_pinned(ref):
            keep(ref, "pinned")
    # A base is kept while anything depends on it: the base of every timeline that still holds
    # a kept checkpoint (and, transitively, the bases those bases stand on).
    changed = True
    while changed:
        changed = False
        for timeline in sorted({t for t, _ in plan.kept} | {head.timeline}):
            claim = claims.get(timeline)
            if claim is not None and claim.base_ref in manifest_keys and claim.base_ref not in plan.kept:
                keep(claim.base_ref, f"base of timeline {timeline}")
                changed = True
    # Abandoned checkpoints (off the line) wait out keep_abandoned from when they were left.
    for ref in sorted(manifest_keys):
        if ref in plan.kept or line.contains(ref):
            continue
        left = _abandoned_at(ref, line, claims)
        if policy.keep_abandoned is None:
            keep(ref, "abandoned; kept (keep_abandoned=None)")
        elif left is None or left > now - policy.keep_abandoned:
            keep(ref, f"abandoned {_age(now, left)} ago; kept for keep_abandoned={policy.keep_abandoned}")

    # Liveness (invariant 15): an object stays while any retained manifest needs it, as a shard
    # or as a reference.
    live = {key for ref, m in manifests.items() if ref in plan.kept for key in m.object_keys}
    for ref, m in sorted(manifests.items()):
        if ref in plan.kept:
            continue
        own = [s for s in m.shards if s.key not in live]
        shared = [s for s in m.shards if s.key in live]
        plan.manifests.append(
            ManifestDeletion(
                m.step,
                m.key,
                m.attempt,
                tuple(s.key for s in own),
                sum(s.size for s in own),
                m.timeline,
                tuple(s.key for s in shared),
                sum(s.size for s in shared),
            )  # fmt: skip
        )

    # Orphans: attempt prefixes that no remaining manifest references. Prefixes of steps whose
    # manifest is unreadable are left alone (we cannot tell which attempt it names), and those of
    # manifests being deleted are handled by their deletion.
    referenced = {(m.step, m.attempt) for m in manifests.values()}
    for key in live:
        parsed_key = layout.parse_shard_key(key)
        if parsed_key is not None:
            referenced.add(parsed_key[:2])
    unreadable_steps = {step for _, step in unreadable}
    for prefix in _attempt_prefixes(store):
        parsed = layout.parse_attempt_prefix(prefix)
        if parsed is None:
            plan.notes.append(f"{prefix}: not an objckpt attempt prefix")
            continue
        if parsed in referenced or parsed[0] in unreadable_steps:
            continue
        objects = list(store.list(prefix))
        if not objects:
            continue
        stamps = [o.last_modified for o in objects if o.last_modified is not None]
        if len(stamps) != len(objects):
            plan.notes.append(f"{prefix}: the store reports no modification times")
            continue
        newest = max(stamps)
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


def live_keys(reader: Reader) -> set[str]:
    """Every object some committed manifest needs right now (shards and references)."""
    live: set[str] = set()
    for key in reader.checkpoints().values():
        try:
            live.update(reader.fetch(key).object_keys)
        except NotFoundError:
            continue
        except ManifestError as exc:
            log.warning("gc: %s does not validate (%s); its objects cannot be known", key, exc)
    return live


def _label(ref: tuple[int, int]) -> str:
    return str(ref[1]) if ref[0] == 0 else f"t{ref[0]}:{ref[1]}"


def _age(now: datetime, then: datetime | None) -> str:
    return "?" if then is None else str(now - then).split(".")[0]


def _abandoned_at(ref: tuple[int, int], line: Line, claims: dict[int, TimelineClaim]) -> datetime | None:
    """When ``ref`` was left behind: the claim of the first timeline of the line newer than its
    own (the rollback or fallback that went on without it). None when unknown (kept)."""
    for timeline in sorted(t for t in line.timelines if t > ref[0]):
        claim = claims.get(timeline)
        if claim is not None:
            return datetime.fromisoformat(claim.created_at.replace("Z", "+00:00"))
    return None


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
    doomed = [d for d in plan.manifests if pointer is None or d.key != pointer.manifest_key]
    for d in plan.manifests:
        if d not in doomed:
            result.skipped.append(f"step {d.label}: it became the target of LATEST")

    # 1. manifests: after this the steps are no longer committed and their shards unreferenced.
    if doomed:
        store.delete(d.key for d in doomed)
        result.deleted_manifests = [d.key for d in doomed]
    # 2. their shards -- except what a manifest committed since the plan references (a save
    # that reused an object of a checkpoint being collected keeps it alive).
    live_now = live_keys(reader) if any(d.shard_keys for d in doomed) else set()
    shard_keys = [k for d in doomed for k in d.shard_keys if k not in live_now]
    if shard_keys:
        store.delete(shard_keys)
        result.deleted_objects += len(shard_keys)
    # 3. orphans, re-checked: an attempt committed since the plan was made is not an orphan.
    committed = reader.checkpoints() if plan.orphans else {}
    for o in plan.orphans:
        verdict = None
        for ref, key in committed.items():
            if ref[1] != o.step:
                continue
            try:
                if reader.fetch(key).attempt == o.attempt:
                    verdict = "committed after the plan was made"
            except ManifestError:
                verdict = f"step {o.step} now has an unreadable manifest"
            except NotFoundError:
                continue
            if verdict:
                break
        if verdict:
            result.skipped.append(f"{o.prefix}: {verdict}")
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
    verified: Collection[tuple[int, int]] = (),
) -> GcResult | None:
    """Apply ``policy`` right after a commit; never raises. ``verified``: as :func:`plan_gc`
    (the commit just made, whose shards its own checks verified).

    Used by the save session on the coordinator. A failure is logged, not raised: the save is
    already committed, and retention only ever deletes what the manifests say is no longer kept
    (the newest commit, its parent until it verifies, and any save in progress are never
    touched), so a skipped round is harmless.
    """
    try:
        plan = plan_gc(store, policy, grace_period=grace_period, verified=verified)
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


def _attempt_prefixes(store: Store) -> list[str]:
    """Every prefix one level below ``data/`` that may be an attempt's, and below each spread
    prefix ``data/<spread>/`` (layout.py) the attempt prefixes there: both layouts. The (up to
    256) spread prefixes are listed 16 at a time."""
    spread: list[str] = []
    out: list[str] = []
    for prefix in store.list_prefixes(layout.DATA_PREFIX):
        (spread if layout.is_spread_prefix(prefix) else out).append(prefix)
    if spread:
        with ThreadPoolExecutor(min(16, len(spread)), thread_name_prefix="objckpt-gc") as pool:
            for below in pool.map(store.list_prefixes, spread):
                out.extend(below)
    return out
