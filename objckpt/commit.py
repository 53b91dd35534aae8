"""The coordinator's commit (invariants 5, 6, 8, 9).

A save is committed when, and only when, its manifest exists. The coordinator (rank 0) writes it
only after it holds every rank's receipts for the attempt and has checked them against the store
itself; it writes it create-if-absent, so two attempts can never both commit one step; then it
advances ``LATEST`` forward-only by compare-and-swap. It never deletes anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from . import layout
from ._commit_checks import NO_RANK, RankReport, check_reports, check_store
from .errors import (
    AlreadyExistsError,
    CommitConflict,
    CommitError,
    ManifestError,
    NotFoundError,
    NotSupportedError,
    PreconditionFailedError,
    StoreError,
)
from .manifest import Manifest, Pointer, Reference
from .reader import Reader
from .store.base import ObjectMeta, PutMode, Store, time_budget

__all__ = ["NO_RANK", "Coordinator", "RankReport", "advance_pointer"]

log = logging.getLogger("objckpt.commit")

_WARNED_NON_ATOMIC: set[str] = set()


class Coordinator:
    """Commits attempts for one run root.

    Args:
        store: must enforce create-if-absent and compare-and-swap.
        world_size: how many ranks take part in every save.
        pointer_retries: compare-and-swap rounds before giving up on moving ``LATEST``.

    Raises:
        NotSupportedError: the store lacks create-if-absent or compare-and-swap.
    """

    def __init__(self, store: Store, *, world_size: int, pointer_retries: int = 50) -> None:
        caps = store.capabilities
        missing = [n for n in ("create_if_absent", "compare_and_swap") if not getattr(caps, n)]
        if missing:
            raise NotSupportedError(
                f"committing needs {' and '.join(missing)}, which this store does not enforce "
                "(without them two attempts could both commit a step, or the pointer could move "
                "backwards)",
                location=store.location,
            )
        if not caps.atomic_conditionals and store.location not in _WARNED_NON_ATOMIC:
            _WARNED_NON_ATOMIC.add(store.location)  # once per store: a per-commit warning is noise
            log.warning(
                "store %s does not make conditional writes atomic under races; concurrent "
                "coordinators are not safe on it (fine for tests)",
                store.location,
            )
        if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= 100_000:
            raise ValueError(f"world_size must be an int in [1, 100000], got {world_size!r}")
        self.store = store
        self.world_size = world_size
        self.pointer_retries = pointer_retries
        self.reader = Reader(store)

    # ------------------------------------------------------------------ commit

    def commit(
        self,
        step: int,
        attempt: str,
        receipts: Mapping[int, RankReport],
        *,
        progress: Mapping[str, Any] | None = None,
        run: Mapping[str, Any] | None = None,
        topology: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        timeline: int = 0,
        after: tuple[int, int] | None = None,
        references: Mapping[int, Sequence[Reference]] | None = None,
        listings: Mapping[int, Sequence[ObjectMeta]] | None = None,
        spread: bool = True,
    ) -> Manifest:
        """Commit ``attempt`` of ``step`` on ``timeline`` from every rank's receipts; return its
        manifest.

        ``after``: the ``(timeline, step)`` this save continues from, as the caller knows it (its
        last commit, or the checkpoint it restored); the parent is the newest commit of
        ``timeline`` below ``step`` found from there, else the timeline's base. It bounds the
        LIST that finds the parent, so the commit's cost never grows with history.

        ``references``: per rank, the objects of ancestors its shards reuse (deduplication).
        Each must be a shard committed by the parent, or one the parent itself references, with
        the size, version and CRC32C recorded there, and present in the store as such; anything
        else fails the commit naming the rank (invariant 5).

        ``listings``: per lister rank, its LIST of its slice of the attempt
        (:func:`~objckpt.layout.verification_slices`, ``spread``: in which layout;
        ``verify="ranks"``), checked instead of the coordinator listing the attempt itself: the
        slices cover the same keys, strays included, with the LISTs spread over the ranks.

        Steps: (1) every rank ``0..world_size-1`` reported receipts, each under its own rank's
        prefix of this attempt (spread or not); (2) one LIST of each attempt prefix used (per
        1,000 shards; or the ranks' listings of its slices) shows every expected key with the receipt's
        size and version, and no other key; (3) the parent is the
        currently committed latest; (4) the manifest is written create-if-absent: the commit
        point; (5) ``LATEST`` is advanced forward-only by compare-and-swap.

        Atomicity: the checkpoint is committed iff the manifest exists; it appears whole in one
        write. Nothing is ever deleted. Calling again for the same attempt after a lost response
        returns the existing manifest (idempotent).

        Raises:
            CommitError: a rank failed or a check against the store failed; ``failures`` names
                every failing rank (``-1`` for a stray key under no rank). No manifest is written.
            CommitConflict: another attempt already committed this step.
            ValueError: invalid step, attempt id, or manifest fields.
        """
        layout.check_step(step)
        layout.check_attempt_id(attempt)
        layout.check_timeline(timeline)
        expected = check_reports(step, attempt, receipts, self.world_size)
        check_store(self.store, step, attempt, expected, self.world_size, listings, spread)
        parent = self._parent_of(timeline, step, after)
        reused = self._check_references(step, attempt, parent, references or {})
        manifest = Manifest.create(
            references=reused,
            timeline=timeline,
            step=step,
            attempt=attempt,
            world_size=self.world_size,
            shards=expected.values(),
            topology={"world_size": self.world_size, **dict(topology or {})},
            run=run,
            progress=progress,
            parent=None if parent is None else parent[1],
            parent_timeline=None if parent is None else parent[0],
            metadata=metadata,
        )
        manifest = self._write_manifest(manifest)
        self._advance_pointer(manifest)
        return manifest

    # -- 3. parent

    def _parent_of(self, timeline: int, step: int, after: tuple[int, int] | None) -> tuple[int, int] | None:
        """The checkpoint this one continues from: the newest commit of ``timeline`` below
        ``step``, else the timeline's base (T1: a timeline holds checkpoints of one base only)."""
        history = self.reader.history
        try:
            claim = history.claim(timeline) if timeline else None
            if timeline and claim is None:
                raise CommitError(
                    f"step {step} not committed: timeline {timeline} is not claimed under {self.store.location}"
                )
            start: str | None = None
            if after is not None and after[0] == timeline and after[1] < step:
                start = layout.manifest_key(after[1], timeline)
            elif after is None:
                pointer = history.pointer()  # a cheap bound when the caller knows nothing
                own = pointer is not None and pointer.manifest_key == layout.manifest_key(
                    pointer.step, timeline
                )
                if pointer is not None and own and pointer.timeline == timeline and pointer.step < step:
                    start = layout.manifest_key(pointer.step, timeline)
            prefix = layout.timeline_manifest_prefix(timeline) if timeline else layout.MANIFEST_PREFIX
            below = [start_ref] if (start_ref := layout.parse_manifest_key(start) if start else None) else []
            for meta in self.store.list(prefix, start_after=start):
                ref = layout.parse_manifest_key(meta.key)
                if ref is None or ref[0] != timeline:
                    if timeline == 0 and meta.key >= layout.MANIFEST_PREFIX + "t":
                        break  # timeline 0's keys all sort before any later timeline's
                    continue
                if ref[1] < step:
                    below.append(ref)
            if below:
                return max(below)
            if claim is not None:
                return claim.base_ref
            return None
        except ManifestError as exc:
            raise CommitError(
                f"step {step} not committed: timeline {timeline}'s claim is invalid: {exc}"
            ) from exc
        except StoreError as exc:
            raise CommitError(
                f"step {step} not committed: cannot resolve the previous checkpoint: {exc}"
            ) from exc

    # -- 3b. references: only what an ancestor committed, as it committed it

    def _check_references(
        self,
        step: int,
        attempt: str,
        parent: tuple[int, int] | None,
        references: Mapping[int, Sequence[Reference]],
    ) -> list[Reference]:
        by_identity: dict[tuple[int, int, int, str], Reference] = {}
        reporter: dict[tuple[int, int, int, str], int] = {}
        failures: dict[int, list[str]] = {}
        for rank, refs in sorted(references.items()):
            for ref in refs:
                if not isinstance(ref, Reference):
                    failures.setdefault(rank, []).append(f"not a Reference: {type(ref).__name__}")
                    continue
                if ref.identity in by_identity and by_identity[ref.identity] != ref:
                    failures.setdefault(rank, []).append(f"reference {ref.key!r} differs from another rank's")
                by_identity.setdefault(ref.identity, ref)
                reporter.setdefault(ref.identity, rank)
        if not by_identity and not failures:
            return []

        def fail(ref: Reference, why: str) -> None:
            failures.setdefault(reporter[ref.identity], []).append(f"reference {ref.key!r}: {why}")

        history = self.reader
        try:
            parent_manifest = history.fetch(layout.manifest_key(parent[1], parent[0])) if parent else None
        except (NotFoundError, ManifestError) as exc:
            parent_manifest = None
            log.warning("cannot read the parent of step %d to check its references: %s", step, exc)
        # The parent vouches for its own shards and for what it references itself (its commit
        # checked those against their origin; the origin's manifest may since be collected while
        # the object lives on, referenced).
        vouched: dict[tuple[int, int, int, str], Any] = {}
        if parent_manifest is not None:
            for s in parent_manifest.shards:
                vouched[(*parent_manifest.ref, s.rank, s.name)] = s
            for r in parent_manifest.references:
                vouched[r.identity] = r
        prefixes: dict[str, dict[str, Any]] = {}
        for ref in by_identity.values():
            entry = vouched.get(ref.identity)
            if entry is None:
                why = (
                    "this checkpoint has no parent to reuse objects from"
                    if parent_manifest is None
                    else f"checkpoint {ref.origin} is not an ancestor this checkpoint continues from "
                    f"(its parent {parent_manifest.ref} neither committed nor references it)"
                )
                fail(ref, why)
                continue
            if (entry.key, entry.size, entry.version, entry.crc32c) != (
                ref.key,
                ref.size,
                ref.version,
                ref.crc32c,
            ):
                fail(ref, f"checkpoint {ref.origin} did not commit it with this size, version and CRC32C")
                continue
            parsed = layout.parse_shard_key(ref.key)
            assert parsed is not None  # a Reference's key is a shard key (validated when built)
            prefix = layout.attempt_prefix_of(ref.key)  # the origin's attempt (prefix): one LIST each
            assert prefix is not None
            if prefix not in prefixes:
                prefixes[prefix] = {m.key: m for m in self.store.list(prefix)}
            meta = prefixes[prefix].get(ref.key)
            if meta is None:
                fail(ref, "it is missing from the store")
            elif meta.size != ref.size or meta.version != ref.version:
                fail(ref, f"the store holds {meta.size} bytes version {meta.version}")
            elif meta.crc32c is not None and meta.crc32c != ref.crc32c:
                fail(ref, f"the store's CRC32C is {meta.crc32c}")
        if failures:
            raise CommitError(
                f"step {step} attempt {attempt} not committed: its references are not what an ancestor committed",
                {rank: "; ".join(why) for rank, why in failures.items()},
            )
        return list(by_identity.values())

    # -- 4. the commit point

    def _write_manifest(self, manifest: Manifest) -> Manifest:
        key = manifest.key
        try:
            # THE COMMIT POINT. Before this write succeeds the attempt does not exist for any
            # reader (they resolve through manifests/ only); after it, the checkpoint is
            # committed whole, whatever happens to the pointer. Create-if-absent makes it
            # first-writer-wins: two attempts can never both commit this step.
            self.store.put(key, manifest.encode(), mode=PutMode.CREATE)
            log.info(
                "committed step %d attempt %s (%d shards)",
                manifest.step,
                manifest.attempt,
                len(manifest.shards),
            )
            return manifest
        except AlreadyExistsError:
            existing = self._read_existing(manifest)
        except StoreError as exc:
            # The outcome is unknown (e.g. the response was lost and retries ran out): the
            # manifest may exist. Read back before declaring failure.
            try:
                existing = self._read_existing(manifest)
            except CommitError:
                raise CommitError(
                    f"step {manifest.step} attempt {manifest.attempt} not committed: writing "
                    f"{key} failed: {exc}"
                ) from exc
        if existing.attempt == manifest.attempt:
            # Our own earlier write (a lost response that the retry re-sent, or a re-run
            # commit): the save is idempotent.
            log.info(
                "step %d attempt %s was already committed; reusing its manifest",
                manifest.step,
                manifest.attempt,
            )
            return existing
        raise CommitConflict(
            f"step {manifest.step} attempt {manifest.attempt} not committed: attempt "
            f"{existing.attempt} already committed this step ({key})"
        )

    def _read_existing(self, manifest: Manifest) -> Manifest:
        key = manifest.key
        try:
            return Manifest.decode(self.store.get(key), key=key)
        except NotFoundError as exc:
            raise CommitError(f"step {manifest.step}: {key} is not there after a failed write") from exc
        except ManifestError as exc:
            # Something else holds the step's manifest key and it is not ours.
            raise CommitConflict(
                f"step {manifest.step} attempt {manifest.attempt} not committed: {key} already "
                f"exists and is not a valid manifest ({exc})"
            ) from exc
        except StoreError as exc:
            raise CommitError(f"step {manifest.step}: cannot read back {key}: {exc}") from exc

    # -- 5. pointer: forward only, compare-and-swap

    def _advance_pointer(self, manifest: Manifest) -> None:
        advance_pointer(self.store, Pointer.for_manifest(manifest), retries=self.pointer_retries)


def advance_pointer(
    store: Store, pointer: Pointer, *, retries: int = 50, budget: float | None = None
) -> bool:
    """Move ``LATEST`` to ``pointer`` unless it already names a ``(timeline, step)`` >= ours
    (invariant 8: forward only, by compare-and-swap, so a stale or zombie coordinator -- on this
    timeline or an older one -- can never move it backwards or lose a concurrent update).

    Bounded in time as well as in rounds: every request of every round shares one time budget
    (``budget`` seconds, default the store's retry deadline), so neither a storm of competing
    writers nor a slow or flapping store can hold the commit up for more than one budget (each
    request would otherwise get a fresh budget in every round: up to ``3 x retries`` of them).

    Returns whether the pointer now names ``pointer``. Never raises: the checkpoint is committed
    (or the timeline claimed) already, and readers roll forward over a pointer that lags behind.
    """
    new = pointer.encode()
    key = layout.POINTER_KEY
    seconds = store.retry.deadline if budget is None else budget
    started = time.monotonic()
    try:
        with time_budget(seconds):
            moved, rounds = _cas_rounds(store, key, pointer, new, retries, started, seconds)
        if moved is not None:
            return moved
        log.warning(
            "timeline %d step %d is published but %s was not advanced after %d compare-and-swap rounds "
            "over %.1f s of a %g s budget; readers roll forward to it",
            pointer.timeline,
            pointer.step,
            key,
            rounds,
            time.monotonic() - started,
            seconds,
        )
    except StoreError as exc:
        log.warning(
            "timeline %d step %d is published but updating %s failed (%s); readers roll forward to it",
            pointer.timeline,
            pointer.step,
            key,
            exc,
        )
    return False


def _cas_rounds(
    store: Store, key: str, pointer: Pointer, new: bytes, retries: int, started: float, seconds: float
) -> tuple[bool | None, int]:
    """The compare-and-swap rounds: (``True``/``False`` when decided, ``None`` when out of
    rounds or of time; the rounds run)."""
    rounds = 0
    while rounds < retries:
        if rounds and time.monotonic() - started >= seconds:
            break  # the budget is spent: start no new round
        rounds += 1
        # HEAD before GET: if the pointer changes in between, the GET sees a newer value
        # than the version we hold, and the CAS below fails and we re-read. The other
        # order could decide on old data and then swap a newer pointer away.
        try:
            current_version = store.head(key).version
        except NotFoundError:
            current_version = None
        current: Pointer | None = None
        if current_version is not None:
            try:
                current = Pointer.decode(store.get(key), key=key)
            except NotFoundError:
                continue  # deleted between HEAD and GET: start over
            except ManifestError as exc:
                log.warning("replacing corrupt pointer %s: %s", key, exc)
        if current is not None and current.ref >= pointer.ref:
            # Forward only: a newer (or this same) checkpoint is already published.
            return current.ref == pointer.ref, rounds
        mode = PutMode.CREATE if current_version is None else PutMode.update(current_version)
        try:
            store.put(key, new, mode=mode)
            return True, rounds
        except (PreconditionFailedError, AlreadyExistsError):
            continue  # a concurrent coordinator moved it: re-read and decide again
    return None, rounds
