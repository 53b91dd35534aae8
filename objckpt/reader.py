"""Resolving, validating and reading committed checkpoints (invariants 10-13).

Resolution costs a constant number of requests whatever the number of shards, of old
checkpoints and of timelines (:mod:`objckpt.history`): the pointer, a LIST of ``manifests/`` and
one of ``timelines/`` after it, the head's manifest and its quarantine marker. ``data/`` is never
listed.

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
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from . import _crc, layout
from ._crc import crc32c_combine, encode_crc32c
from .errors import (
    ChecksumMismatchError,
    DistributedError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    describe,
    is_damage,
)
from .history import Head, History, Line
from .manifest import MAX_MANIFEST_BYTES, Manifest, Pointer, Reference, ShardReceipt
from .store.base import Store

__all__ = ["SLICE_BYTES", "Problem", "Reader", "agree_on_step", "read_ranges_into", "read_window"]

#: the most bytes one buffer handed to ``Store.get_into`` holds (the S3 client receives each
#: buffer through a temporary of its size)
SLICE_BYTES = 1024 * 1024


def read_window(store: Store) -> int:
    """How many ranges are read at once: the store's ``read_concurrency`` where it has one
    (S3), else its ``max_in_flight``."""
    concurrency = getattr(store, "read_concurrency", None)
    return max(1, concurrency if isinstance(concurrency, int) else store.max_in_flight)


def read_ranges_into(
    store: Store,
    key: str,
    begin: int,
    end: int,
    views_of: Callable[[int, int], list[memoryview]],
    *,
    name: str = "objckpt-read-range",
) -> Iterator[tuple[int, int]]:
    """Read ``[begin, end)`` of ``key`` by ranged GETs of at most ``store.part_size``,
    :func:`read_window` at a time, each received in place into ``views_of(start, stop)`` (writable
    buffers of exactly ``stop - start`` bytes in all, each at most :data:`SLICE_BYTES`) and
    checksummed on the thread that read it; yields ``(crc, size)`` of each range, in order.
    Nothing is left running when it returns or raises.

    Raises:
        ChecksumMismatchError: a range came back short (the object is truncated).
        NotFoundError and the store's errors.
    """
    step = max(1, store.part_size)
    window = read_window(store)

    def fetch(start: int, stop: int) -> tuple[int, int]:
        views = views_of(start, stop)
        got = store.get_into(key, start, views)
        if got != stop - start:
            raise ChecksumMismatchError(
                f"ranged read [{start}, {stop}) returned {got} bytes (shard truncated?)",
                key=key,
                location=store.location,
            )
        crc = 0
        for view in views:
            crc = _crc.crc32c_update(crc, view)  # through the module: tests count the passes
        return crc, stop - start

    ranges = [(pos, min(pos + step, end)) for pos in range(begin, end, step)]
    if not ranges:
        return
    pending: deque[Future[tuple[int, int]]] = deque()
    with ThreadPoolExecutor(min(window, len(ranges)), thread_name_prefix=name) as pool:
        try:
            for start, stop in ranges:
                pending.append(pool.submit(fetch, start, stop))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:
                fut.cancel()


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
    """Reads committed checkpoints from one run root. Thread-safe; holds no state but the store.

    Resolution, the fallback order and step names follow the head's line (:mod:`objckpt.history`):
    a checkpoint on an abandoned branch is never returned as latest nor fallen back to.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.history = History(store)

    # ------------------------------------------------------------------ resolution

    def pointer(self) -> Pointer | None:
        """The decoded ``LATEST`` pointer (1 GET); None when absent or corrupt (logged)."""
        return self.history.pointer()

    def head(self) -> Head:
        """The head checkpoint's timeline and manifest key, in O(1) requests (not validated)."""
        return self.history.resolve()

    def latest(self) -> Manifest | None:
        """The newest committed checkpoint (on the newest timeline) whose manifest validates, or
        None if nothing is committed. Shards are not checked (see :meth:`latest_valid`).

        Costs O(1) requests in the common case: the pointer, a LIST of ``manifests/`` and one of
        ``timelines/`` after it, the head's manifest and its quarantine marker.
        """
        return next(self.manifests(), None)

    def latest_valid(self, *, full: bool = False) -> Manifest | None:
        """The newest checkpoint that passes :meth:`candidates` checks, or None."""
        return next(self.candidates(full=full), None)

    def candidates(self, *, full: bool = False) -> Iterator[Manifest]:
        """Validated, shard-checked manifests in fallback order: the head first, then along its
        line (parents, then older checkpoints of the line where the parent chain is broken).

        Each is checked with :meth:`check` (HEAD: presence, size, version), or with ``full=True``
        with :meth:`verify` (download and CRC32C of every shard). A rejected checkpoint is
        skipped with a ``logging.warning`` naming step, key and reason.
        """
        return self._walk(check_shards=True, full=full)

    def manifests(self, head: Head | None = None) -> Iterator[Manifest]:
        """Validated manifests in fallback order, without checking their shards: for restore
        paths that verify every byte they read anyway, so a shard check up front would only cost
        requests. Quarantined checkpoints are skipped (logged). ``head``: an already resolved
        head (saves resolving twice)."""
        return self._walk(check_shards=False, head=head)

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
                rejected.append(f"step {manifest.label}: {why}")
                log.warning(
                    "rejecting checkpoint step %s (%s) while loading, falling back to its parent %s: %s",
                    manifest.label,
                    manifest.key,
                    manifest.parent,
                    why,
                )
        detail = f" (rejected: {'; '.join(rejected)})" if rejected else ""
        raise NoCheckpointError(f"no valid checkpoint under {self.store.location}{detail}")

    def is_quarantined(self, manifest: Manifest) -> bool:
        """Whether ``manifest`` was set aside (``objckpt quarantine``): 1 GET."""
        try:
            self.store.head(layout.quarantine_key(manifest.timeline, manifest.step))
        except NotFoundError:
            return False
        return True

    def _walk(
        self, *, check_shards: bool, full: bool = False, head: Head | None = None
    ) -> Iterator[Manifest]:
        head = head or self.history.resolve()
        if head.key is None:
            return
        tried: set[str] = set()
        key: str | None = head.key
        line: Line | None = None
        listed: list[tuple[int, int]] = []
        last: tuple[int, int] | None = None
        while True:
            if key is None:
                # The parent chain ended or broke: walk the rest of the line from a listing.
                if line is None:
                    line = self.history.line(head.timeline)
                    listed = line.order(self.history.manifest_keys())
                    # only what lies below the last checkpoint tried, in the line's order
                    floor = _line_rank(line, last) if last is not None else None
                    listed = [r for r in listed if floor is None or _line_rank(line, r) > floor]
                while listed and layout.manifest_key(listed[0][1], listed[0][0]) in tried:
                    listed.pop(0)
                if not listed:
                    return
                ref = listed.pop(0)
                key = layout.manifest_key(ref[1], ref[0])
            tried.add(key)
            current, key = key, None
            last = layout.parse_manifest_key(current)
            try:
                manifest = self.fetch(current)
            except NotFoundError:
                log.debug("manifest %s is gone (collected); continuing along the line", current)
                continue
            except ManifestError as exc:
                label = "?" if last is None else (str(last[1]) if last[0] == 0 else f"t{last[0]}:{last[1]}")
                log.warning("rejecting checkpoint step %s (%s): %s", label, current, exc)
                continue
            if line is None:
                key = manifest.parent_key
                if key is not None and key in tried:
                    key = None
            if self.is_quarantined(manifest):
                log.warning(
                    "skipping checkpoint step %s (%s): it is quarantined (objckpt quarantine)",
                    manifest.label,
                    manifest.key,
                )
                continue
            if check_shards:
                problems = self.verify(manifest) if full else self.check(manifest)
                if problems:
                    log.warning(
                        "rejecting checkpoint step %s (%s), falling back to its parent %s: %s",
                        manifest.label,
                        current,
                        manifest.parent,
                        "; ".join(str(p) for p in problems),
                    )
                    continue
            yield manifest

    def fetch(self, key: str) -> Manifest:
        """The manifest stored at ``key``, validated.

        Raises:
            NotFoundError: no such manifest. ManifestError: it fails validation.
        """
        data = self.store.get(key)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest {key!r} is too large ({len(data)} bytes)", key=key)
        return Manifest.decode(data, key=key)

    _fetch = fetch

    def locate(self, step: int, timeline: int | None = None) -> str:
        """The manifest key of ``step``: on ``timeline`` when given, else the checkpoint of that
        step on the head's line, else on the newest timeline holding it (an abandoned one).

        Raises:
            NoCheckpointError: no committed checkpoint of that step.
        """
        if timeline is not None:
            return layout.manifest_key(step, timeline)
        keys = self.history.manifest_keys()
        matching = [ref for ref in keys if ref[1] == step]
        if not matching:
            raise NoCheckpointError(f"no committed checkpoint for step {step} under {self.store.location}")
        head = self.history.resolve()
        on_line = self.history.line(head.timeline).order(matching)
        ref = on_line[0] if on_line else max(matching)
        return keys[ref]

    def load(self, step: int, timeline: int | None = None) -> Manifest:
        """The manifest of ``step`` (see :meth:`locate`), validated (shards not checked).

        Raises:
            NoCheckpointError: no manifest for ``step``.
            ManifestError: it exists but fails validation.
        """
        key = self.locate(step, timeline)
        try:
            return self.fetch(key)
        except NotFoundError:
            raise NoCheckpointError(
                f"no committed checkpoint for step {step} ({key} not found in {self.store.location})"
            ) from None

    def line(self) -> list[tuple[int, int]]:
        """Every committed ``(timeline, step)`` on the head's line, newest first."""
        head = self.history.resolve()
        return self.history.line(head.timeline).order(self.history.manifest_keys())

    def steps(self) -> list[int]:
        """Committed steps on the head's line, ascending (abandoned branches left out)."""
        return sorted(step for _, step in self.line())

    def checkpoints(self) -> dict[tuple[int, int], str]:
        """Every committed ``(timeline, step)`` and its manifest key, abandoned ones included."""
        return self.history.manifest_keys()

    def _list_manifest_keys(self, start_after: str | None) -> dict[int, str]:
        """Steps of timeline 0 (revision-1 view), kept for the code that predates timelines."""
        return {step: key for (t, step), key in self.history.manifest_keys(start_after).items() if t == 0}

    # ------------------------------------------------------------------ shards

    def read_shard(self, receipt: ShardReceipt | Reference) -> bytes:
        """A shard's bytes, verified against its receipt's size and CRC32C.

        Raises:
            ChecksumMismatchError: the bytes differ from the receipt.
            NotFoundError: the shard is gone.
        """
        return b"".join(self.open_shard(receipt))

    def read_shard_into(self, receipt: ShardReceipt, dest: memoryview) -> None:
        """A shard's bytes straight into ``dest`` (writable, exactly ``receipt.size`` bytes),
        verified against its receipt's size and CRC32C. A shard larger than one of the store's
        parts is read by ranged GETs of at most ``part_size``, ``read_concurrency`` (S3) or
        ``max_in_flight`` at a time, each received in place (``Store.get_into``) and
        checksummed on the thread that read it, the pieces combined in order; a smaller one is
        streamed (:meth:`open_shard`: one GET). No memory beyond ``dest`` but the store's own
        per-request buffers (at most one :data:`SLICE_BYTES` slice each, where it receives
        into memory).

        Atomicity: on failure ``dest`` holds some of the bytes; nothing else is written.

        Raises:
            ChecksumMismatchError: a short read, or bytes that differ from the receipt.
            NotFoundError: the shard is gone.
        """
        view = memoryview(dest).cast("B")
        size = receipt.size
        if view.nbytes != size:
            raise ValueError(f"{receipt.key}: {view.nbytes} bytes to read {size} into")
        if size <= self.store.part_size:
            offset = 0
            for chunk in self.open_shard(receipt):
                n = len(chunk)
                if offset + n > size:
                    raise ChecksumMismatchError(
                        f"{receipt.key}: the store sent more than the receipt's {size} bytes",
                        key=receipt.key,
                        location=self.store.location,
                    )
                view[offset : offset + n] = chunk
                offset += n
            if offset != size:  # the verifying stream raises first
                raise ChecksumMismatchError(
                    f"{receipt.key}: the store sent {offset} of {size} bytes",
                    key=receipt.key,
                    location=self.store.location,
                )
            return
        layout.validate_key_in_root(receipt.key)

        def views_of(start: int, stop: int) -> list[memoryview]:
            return [view[i : min(i + SLICE_BYTES, stop)] for i in range(start, stop, SLICE_BYTES)]

        crc = 0
        for range_crc, n in read_ranges_into(
            self.store, receipt.key, 0, size, views_of, name="objckpt-read-into"
        ):
            crc = crc32c_combine(crc, range_crc, n)
        if encode_crc32c(crc) != receipt.crc32c:
            raise ChecksumMismatchError(
                f"CRC32C mismatch: read {encode_crc32c(crc)}, receipt says {receipt.crc32c}",
                key=receipt.key,
                location=self.store.location,
            )

    def open_shard(self, receipt: ShardReceipt | Reference) -> Iterator[bytes]:
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

        def one(r: ShardReceipt | Reference) -> Problem | None:
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

        # references are checked like shards: they are part of what this checkpoint needs
        shards: list[ShardReceipt | Reference] = [*manifest.shards, *manifest.references]
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
        needed: list[ShardReceipt | Reference] = [*manifest.shards, *manifest.references]
        for r in needed:
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


def _line_rank(line: Line, ref: tuple[int, int]) -> tuple[int, int]:
    position = line.position(ref)
    return (position if position is not None else len(line.segments), -ref[1])


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
