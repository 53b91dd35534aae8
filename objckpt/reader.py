"""Resolving, validating and reading committed checkpoints (invariants 10-13).

Resolution costs a constant number of requests whatever the number of shards or of old
checkpoints: one GET of ``LATEST``, one LIST of ``manifests/`` after the pointer's key (which
rolls forward over a commit whose pointer update was lost), and one GET of the newest manifest.
``data/`` is never listed. With no pointer, or a corrupt one, ``manifests/`` is listed alone.

Every manifest is validated before use (:meth:`Manifest.decode`: schema, version, self-checksum,
every key inside its own attempt). :meth:`Reader.candidates` additionally HEAD-checks every shard
(size and version) and yields checkpoints newest first, falling back along the parent chain with
a ``logging.warning`` naming the step, key and reason for each rejected one. Shard bytes are
verified by size and CRC32C while streaming; :meth:`Reader.restore` falls back to the next
candidate when loading one fails verification, so a checkpoint is used whole or not at all.
Nothing read from the store is ever executed: the metadata is JSON and shards are returned as
bytes. :func:`agree_on_step` is the collective check that every rank restored the same step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from . import layout
from .errors import (
    DistributedError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    describe,
    is_damage,
)
from .manifest import MAX_MANIFEST_BYTES, Manifest, Pointer, ShardReceipt
from .store.base import Store

__all__ = ["Problem", "Reader", "agree_on_step"]

log = logging.getLogger("objckpt.reader")

T = TypeVar("T")

_HEAD_WORKERS = 16


@dataclass(frozen=True)
class Problem:
    """One reason a checkpoint cannot be used."""

    step: int
    key: str
    reason: str
    rank: int | None = None

    def __str__(self) -> str:
        who = f" (rank {self.rank})" if self.rank is not None else ""
        return f"step {self.step}: {self.key}{who}: {self.reason}"


class Reader:
    """Reads committed checkpoints from one run root. Thread-safe; holds no state but the store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    # ------------------------------------------------------------------ resolution

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

    def latest(self) -> Manifest | None:
        """The newest committed manifest that passes validation, or None if nothing is committed.

        Costs 1 GET (pointer) + 1 LIST (``manifests/`` after the pointer's key) + 1 GET
        (manifest) in the common case; shards are not checked (see :meth:`latest_valid`). A
        manifest that fails validation is skipped with a warning and its predecessor tried.
        """
        return next(self._walk(check_shards=False), None)

    def latest_valid(self, *, full: bool = False) -> Manifest | None:
        """The newest checkpoint that passes :meth:`candidates` checks, or None."""
        return next(self.candidates(full=full), None)

    def candidates(self, *, full: bool = False) -> Iterator[Manifest]:
        """Validated, shard-checked manifests in fallback order: the newest committed first, then
        along the parent chain (then older listed manifests where the chain is broken).

        Each is checked with :meth:`check` (HEAD: presence, size, version), or with ``full=True``
        with :meth:`verify` (download and CRC32C of every shard, which also catches bit rot the
        store's metadata does not show). A rejected checkpoint is skipped with a
        ``logging.warning`` naming step, key and reason.
        """
        return self._walk(check_shards=True, full=full)

    def restore(self, loader: Callable[[Manifest], T]) -> tuple[Manifest, T]:
        """Run ``loader(manifest)`` on each candidate in fallback order until one succeeds.

        ``loader`` should read every shard it needs through :meth:`read_shard` /
        :meth:`open_shard` (which verify size and CRC32C) and build its result without touching
        live state, so a checkpoint is used whole or not at all. A loader error that is damage
        (:func:`objckpt.errors.is_damage`) rejects that checkpoint (logged as a warning with the
        reason) and the next candidate is tried; any other error propagates at once, because
        falling back past an outage or a permission error would silently lose work.

        Raises:
            NoCheckpointError: no candidate could be loaded.
        """
        rejected: list[str] = []
        for manifest in self.candidates():
            try:
                return manifest, loader(manifest)
            except Exception as exc:
                if not is_damage(exc):
                    raise
                why = describe(exc)
                rejected.append(f"step {manifest.step}: {why}")
                log.warning(
                    "rejecting checkpoint step %d (%s) while loading, falling back to its parent %s: %s",
                    manifest.step,
                    manifest.key,
                    manifest.parent,
                    why,
                )
        detail = f" (rejected: {'; '.join(rejected)})" if rejected else ""
        raise NoCheckpointError(f"no valid checkpoint under {self.store.location}{detail}")

    def manifests(self) -> Iterator[Manifest]:
        """Validated manifests in fallback order (newest committed first, then along the parent
        chain), without checking their shards: for restore paths that verify every byte they
        read anyway, so a shard check up front would only cost requests."""
        return self._walk(check_shards=False)

    def latest_before(self, step: int) -> Manifest | None:
        """The newest validated manifest with a step below ``step`` (a commit's parent)."""
        for m in self._walk(check_shards=False, quiet_missing=True):
            if m.step < step:
                return m
        return None

    def _list_manifest_keys(self, start_after: str | None) -> dict[int, str]:
        found: dict[int, str] = {}
        for meta in self.store.list(layout.MANIFEST_PREFIX, start_after=start_after):
            step = layout.step_of_manifest_key(meta.key)
            if step is None:
                log.debug("ignoring non-manifest object %s under manifests/", meta.key)
                continue
            found[step] = meta.key
        return found

    def _walk(
        self, *, check_shards: bool, full: bool = False, quiet_missing: bool = False
    ) -> Iterator[Manifest]:
        pointer = self.pointer()
        # THE resolution LIST: only manifests/, only after the pointer's key. Never data/.
        known = self._list_manifest_keys(pointer.manifest_key if pointer else None)
        if pointer is not None:
            known.setdefault(pointer.step, pointer.manifest_key)
        fully_listed = pointer is None  # without a pointer the listing above was complete
        floor: int | None = None  # steps >= floor have been tried
        follow: int | None = None  # the parent step of the last manifest decoded
        while True:
            if follow is None:
                below = [s for s in known if floor is None or s < floor]
                if not below and not fully_listed:
                    # Fallback only (everything newer was rejected or the chain is broken):
                    # a full listing of manifests/ finds older committed steps.
                    known.update(self._list_manifest_keys(None))
                    fully_listed = True
                    continue
                if not below:
                    return
                step, via_parent = max(below), False
            else:
                step, via_parent, follow = follow, True, None
            floor = step
            key = layout.manifest_key(step)
            try:
                manifest = self._fetch(key)
            except NotFoundError:
                if via_parent or quiet_missing:
                    log.debug("parent manifest %s is gone (collected); continuing", key)
                else:
                    log.warning("checkpoint step %d: manifest %s is missing; skipping it", step, key)
                continue
            except ManifestError as exc:
                log.warning("rejecting checkpoint step %d (%s): %s", step, key, exc)
                continue
            follow = manifest.parent
            if check_shards:
                problems = self.verify(manifest) if full else self.check(manifest)
                if problems:
                    log.warning(
                        "rejecting checkpoint step %d (%s), falling back to its parent %s: %s",
                        step,
                        key,
                        manifest.parent,
                        "; ".join(str(p) for p in problems),
                    )
                    continue
            yield manifest

    def _fetch(self, key: str) -> Manifest:
        data = self.store.get(key)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest {key!r} is too large ({len(data)} bytes)", key=key)
        return Manifest.decode(data, key=key)

    def load(self, step: int) -> Manifest:
        """The manifest of ``step``, validated (shards not checked; see :meth:`check`).

        Raises:
            NoCheckpointError: no manifest for ``step``.
            ManifestError: it exists but fails validation.
        """
        key = layout.manifest_key(step)
        try:
            return self._fetch(key)
        except NotFoundError:
            raise NoCheckpointError(
                f"no committed checkpoint for step {step} ({key} not found in {self.store.location})"
            ) from None

    def steps(self) -> list[int]:
        """Committed steps, ascending, from one listing of ``manifests/``."""
        return sorted(self._list_manifest_keys(None))

    # ------------------------------------------------------------------ shards

    def read_shard(self, receipt: ShardReceipt) -> bytes:
        """A shard's bytes, verified against its receipt's size and CRC32C.

        Raises:
            ChecksumMismatchError: the bytes differ from the receipt.
            NotFoundError: the shard is gone.
        """
        return b"".join(self.open_shard(receipt))

    def open_shard(self, receipt: ShardReceipt) -> Iterator[bytes]:
        """Stream a shard; the final ``next()`` raises :class:`ChecksumMismatchError` on a size or
        CRC32C mismatch, so consumers must not commit to the data before exhausting it."""
        layout.validate_key_in_root(receipt.key)
        return self.store.get_stream(receipt.key, expected_size=receipt.size, expected_crc32c=receipt.crc32c)

    def check(self, manifest: Manifest) -> list[Problem]:
        """HEAD every shard: present, same size, same version (and CRC32C where the store
        reports it). Returns the problems found, sorted by key; empty means it passed.

        Raises:
            Any store error that is not damage (:func:`objckpt.errors.is_damage`): an outage,
                a permission or configuration error is not evidence about this checkpoint, so
                it is not reported as a problem.
        """

        def one(r: ShardReceipt) -> Problem | None:
            try:
                meta = self.store.head(r.key)
            except Exception as exc:
                # The one damage rule: a missing shard is damage; an outage, a permission or
                # configuration error says nothing about this checkpoint, so it propagates.
                if not is_damage(exc):
                    raise
                return Problem(manifest.step, r.key, "shard is missing", r.rank)
            if meta.size != r.size:
                return Problem(manifest.step, r.key, f"size is {meta.size}, receipt says {r.size}", r.rank)
            if meta.version != r.version:
                return Problem(
                    manifest.step, r.key, f"version is {meta.version}, receipt says {r.version}", r.rank
                )
            if meta.crc32c is not None and meta.crc32c != r.crc32c:
                return Problem(
                    manifest.step, r.key, f"CRC32C is {meta.crc32c}, receipt says {r.crc32c}", r.rank
                )
            return None

        shards = list(manifest.shards)
        if len(shards) <= 1:
            results = [one(r) for r in shards]
        else:
            with ThreadPoolExecutor(
                min(_HEAD_WORKERS, len(shards)), thread_name_prefix="objckpt-head"
            ) as pool:
                results = list(pool.map(one, shards))
        return sorted((p for p in results if p is not None), key=lambda p: p.key)

    def verify(self, manifest: Manifest, progress: Callable[[int], None] | None = None) -> list[Problem]:
        """Full check: :meth:`check`, then download every shard verifying size and CRC32C.

        ``progress(n)`` is called with the byte count of each chunk read. Returns the problems
        (damage only).

        Raises:
            Any error that is not damage (an outage past the retry budget, a permission error):
                the checkpoint could not be verified, which is not the same as bad.
        """
        problems = self.check(manifest)
        bad = {p.key for p in problems}
        for r in manifest.shards:
            if r.key in bad:
                continue
            try:
                for chunk in self.open_shard(r):
                    if progress is not None:
                        progress(len(chunk))
            except Exception as exc:
                if not is_damage(exc):
                    raise  # an outage is not damage: verify fails with the store's error
                problems.append(Problem(manifest.step, r.key, describe(exc, with_key=False), r.rank))
        return sorted(problems, key=lambda p: p.key)


def agree_on_step(steps_by_rank: Mapping[int, int | None]) -> int | None:
    """Invariant 13: every rank must have restored the same step (None: nothing restored).

    The torch layer gathers each rank's restored step and calls this on every rank (or on rank 0
    and broadcasts the outcome) before training resumes.

    Raises:
        DistributedError: ranks disagree; the message lists each rank's step.
    """
    if not steps_by_rank:
        raise DistributedError("no rank reported the step it restored")
    distinct = set(steps_by_rank.values())
    if len(distinct) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in sorted(steps_by_rank.items()))
        raise DistributedError(f"ranks restored different checkpoints ({detail}); refusing to resume")
    return distinct.pop()
