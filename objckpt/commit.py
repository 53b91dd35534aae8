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
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Union

from . import layout
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
from .manifest import Manifest, Pointer, Reference, ShardReceipt
from .reader import Reader
from .store.base import ObjectMeta, PutMode, Store, time_budget

__all__ = ["Coordinator", "RankReport", "advance_pointer"]

log = logging.getLogger("objckpt.commit")

RankReport = Union[Sequence[ShardReceipt], BaseException, str]
"""What each rank contributes to a commit: its receipts, or the error (or its text) it hit."""

_WARNED_NON_ATOMIC: set[str] = set()

#: rank used in ``CommitError.failures`` for a stray key that lies under no rank's prefix
NO_RANK = -1
#: LISTs of spread attempt prefixes the coordinator runs at once
_LIST_THREADS = 16


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
        expected = self._check_reports(step, attempt, receipts)
        self._check_store(step, attempt, expected, listings, spread)
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

    # -- 1. every rank, each under its own prefix

    def _check_reports(
        self,
        step: int,
        attempt: str,
        receipts: Mapping[int, RankReport],
    ) -> dict[str, ShardReceipt]:
        failures: dict[int, str] = {}
        expected: dict[str, ShardReceipt] = {}
        for rank in receipts:
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
                failures[rank if isinstance(rank, int) else NO_RANK] = (
                    f"reported as rank {rank!r}, outside world of size {self.world_size}"
                )
        for rank in range(self.world_size):
            if rank not in receipts:
                failures[rank] = "sent no receipts (did not take part in the save)"
                continue
            report = receipts[rank]
            if isinstance(report, BaseException):
                failures[rank] = f"{type(report).__name__}: {report}"
                continue
            if isinstance(report, str):
                failures[rank] = report or "failed (no reason given)"
                continue
            problems: list[str] = []
            for r in report:
                if not isinstance(r, ShardReceipt):
                    problems.append(f"not a ShardReceipt: {type(r).__name__}")
                    continue
                parsed = layout.parse_shard_key(r.key)  # either layout: spread or not
                if r.rank != rank or parsed is None or parsed[:3] != (step, attempt, rank):
                    prefix = layout.rank_prefix(step, attempt, rank)
                    problems.append(
                        f"receipt {r.key!r} (rank {r.rank}) is outside its prefix {prefix!r} (or its spread form)"
                    )
                elif parsed[3] != r.name:
                    problems.append(f"receipt {r.key!r} does not match its name {r.name!r}")
                elif r.key in expected:
                    problems.append(f"receipt {r.key!r} reported twice")
                else:
                    expected[r.key] = r
            if problems:
                failures[rank] = "; ".join(problems)
        if failures:
            raise CommitError(
                f"step {step} attempt {attempt} not committed: not every rank delivered valid receipts",
                failures,
            )
        return expected

    # -- 2. receipts against the store itself

    def _check_store(
        self,
        step: int,
        attempt: str,
        expected: Mapping[str, ShardReceipt],
        listings: Mapping[int, Sequence[ObjectMeta]] | None = None,
        spread: bool = True,
    ) -> None:
        """Every receipt against a listing of the store: present, same size, version and CRC32C,
        and nothing else under the prefixes listed.

        ``listings`` None: the coordinator LISTs itself every attempt prefix the receipts use
        (one per spread prefix used, in parallel; one LIST per 1,000 shards under each).
        Otherwise the ranks' LISTs of their :func:`~objckpt.layout.verification_slices`
        (``verify="ranks"``; ``spread``: the layout the slices follow), which together cover
        every attempt prefix the ranks write to, strays under no rank's prefix included: each
        slice must come from its lister and hold only keys of that slice. The coordinator LISTs
        only prefixes some receipt uses that no slice covers (a rank that wrote the other
        layout): none, normally.
        """
        failures: dict[int, list[str]] = {}

        def fail(rank: int, why: str) -> None:
            failures.setdefault(rank, []).append(why)

        used = sorted({p for k in expected if (p := layout.attempt_prefix_of(k)) is not None})
        listed: list[ObjectMeta] = []  # what the store holds under the attempt's prefixes
        if listings is None:
            to_list = used or [layout.attempt_prefix(step, attempt)]  # no receipts: must be empty too
        else:
            slices = layout.verification_slices(step, attempt, self.world_size, spread=spread)
            listers = {s.lister for s in slices}
            for s in slices:
                if s.lister not in listings:
                    fail(s.lister, f"sent no listing of its verification slice {s.prefix!r} (verify='ranks')")
                    continue
                for meta in listings[s.lister]:
                    if s.holds(meta.key):
                        listed.append(meta)
                    else:
                        fail(s.lister, f"listed {meta.key!r}, outside its verification slice {s.prefix!r}")
            for rank in sorted(set(listings) - listers):
                fail(rank, "sent a listing but verifies no slice (verify='ranks')")
            covered = {s.prefix for s in slices}  # each prefix's slices cover all of it
            to_list = [p for p in used if p not in covered]
        if len(to_list) == 1:  # the layout without spreading: the one LIST, on this thread
            listed.extend(self.store.list(to_list[0]))
        elif to_list:
            with ThreadPoolExecutor(
                min(_LIST_THREADS, len(to_list)), thread_name_prefix="objckpt-verify"
            ) as pool:
                for page in pool.map(lambda p: list(self.store.list(p)), to_list):
                    listed.extend(page)
        seen: set[str] = set()
        for meta in listed:
            r = expected.get(meta.key)
            if r is None:
                # A zombie writer (e.g. a rank of an earlier incarnation still uploading) or a
                # stray object: committing would publish an attempt whose prefix holds data no
                # receipt vouches for.
                parsed = layout.parse_shard_key(meta.key)
                owner = parsed[2] if parsed is not None and parsed[:2] == (step, attempt) else NO_RANK
                fail(owner, f"unexpected object {meta.key!r} in the attempt prefix")
                continue
            seen.add(meta.key)
            if meta.size != r.size:
                fail(r.rank, f"{meta.key!r} is {meta.size} bytes in the store, receipt says {r.size}")
            elif meta.version != r.version:
                fail(
                    r.rank, f"{meta.key!r} has version {meta.version} in the store, receipt says {r.version}"
                )
            elif meta.crc32c is not None and meta.crc32c != r.crc32c:
                fail(r.rank, f"{meta.key!r} has CRC32C {meta.crc32c} in the store, receipt says {r.crc32c}")
        for key, r in expected.items():
            if key not in seen:
                fail(r.rank, f"{key!r} is missing from the store")
        if failures:
            raise CommitError(
                f"step {step} attempt {attempt} not committed: the store does not hold what the "
                "ranks reported",
                {rank: "; ".join(why) for rank, why in failures.items()},
            )

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
