"""Copy a committed checkpoint between run roots (S3 <-> GCS <-> file:// <-> S3 elsewhere).

:func:`replicate` re-commits a source step on the destination *by the same protocol a training
job uses*, so the copy is as trustworthy as the original:

1. the source manifest is resolved and validated by :class:`~objckpt.reader.Reader`;
2. every shard is streamed from the source (``Reader.open_shard``: size and CRC32C verified at
   the end of the stream) straight into a :class:`~objckpt.writer.ShardWriter` on the
   destination under a **fresh attempt id** (create-if-absent, bounded multipart). Memory is
   bounded by the destination's ``part_size x (max_in_flight + 1)`` plus one read chunk,
   whatever the shard sizes; a source shard that fails verification makes its final read raise,
   which aborts the destination upload, so a corrupt byte is never committed;
3. the destination receipts are compared with the source receipts (size and CRC32C);
4. :meth:`Coordinator.commit <objckpt.commit.Coordinator.commit>` checks the shards against the
   destination store, writes the manifest create-if-absent (THE commit point) and moves the
   destination's pointer forward by compare-and-swap.

References (deduplicated checkpoints): a checkpoint that reuses objects of its ancestors names
them by identity (origin checkpoint, rank, shard name), never by key, so its shards are copied
as they are and only the manifest's references are rewritten to the destination's keys. Each
referenced object is copied once, as a shard of the ancestor that committed it: copying a run
root (:func:`replicate_all`, oldest first) transfers the unique bytes only and the destination
shares them exactly as the source does. A single step that references ancestors needs those
ancestors at the destination first (the destination's parent must hold or reference every
object it reuses, as at the source; otherwise :class:`NoCheckpointError` says so and nothing is
copied). Not supported (refused the same way): an ancestor whose manifest the source has
already collected (its object lives on, referenced), and references into a timeline other than
0 (the destination commits every copy on timeline 0).

Idempotence: if the destination already has a manifest for that step holding the same content
(same world size and, per rank, the same shard names, sizes and CRC32Cs, and the same
references) nothing is written and that manifest is returned; a different checkpoint at that
step is a :class:`CommitConflict`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from . import layout
from .commit import Coordinator
from .errors import ChecksumMismatchError, CommitConflict, NoCheckpointError, NotFoundError
from .manifest import Manifest, Reference, ShardReceipt
from .reader import Reader
from .store.base import Store
from .writer import ShardWriter

__all__ = ["ReplicationResult", "copy_checkpoint", "replicate", "replicate_all", "same_checkpoint"]

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReplicationResult:
    """What :func:`replicate_all` did for one step."""

    step: int
    manifest: Manifest
    copied: bool  # False: the destination already had it (idempotent no-op)


def _content(m: Manifest) -> tuple[Any, ...]:
    return (
        m.world_size,
        tuple(sorted((s.rank, s.name, s.size, s.crc32c) for s in m.shards)),
        tuple(sorted((r.identity, r.size, r.crc32c) for r in m.references)),
    )


def same_checkpoint(a: Manifest, b: Manifest) -> bool:
    """True when two manifests commit the same content at the same step (attempt ids, keys,
    versions and commit times may differ: a replica gets its own attempt)."""
    return a.step == b.step and _content(a) == _content(b)


def _existing(dst_reader: Reader, step: int) -> Manifest | None:
    """The destination's manifest for ``step``, or None when there is none.

    An invalid manifest there is not "absent": it blocks the step, so it propagates
    (ManifestError) rather than being overwritten.
    """
    try:
        return dst_reader.load(step)
    except (NotFoundError, NoCheckpointError):
        return None


def _counting(chunks: Iterable[bytes], progress: Progress | None) -> Iterator[bytes]:
    for chunk in chunks:
        if progress is not None:
            progress(len(chunk))
        yield chunk


def replicate(
    src_store: Store,
    dst_store: Store,
    step: int | None = None,
    progress: Progress | None = None,
    *,
    on_exists: Callable[[Manifest], None] | None = None,
) -> Manifest:
    """Copy committed step ``step`` (default: the source's latest) to ``dst_store`` and commit it.

    Args:
        progress: called with a byte count as each chunk is read from the source (drives a bar;
            total = ``manifest.total_size``).
        on_exists: called with the destination's manifest when it already holds this step
            (the idempotent case), before returning it.

    Returns:
        The destination's committed manifest.

    Atomicity: the destination gains the step exactly when its manifest is written; until then
    its readers see nothing new. A failure before the commit leaves only shards under the fresh
    attempt's prefix, which are deleted best-effort here and otherwise collected by GC after its
    grace period.

    Raises:
        NoCheckpointError: the source has no (valid) committed checkpoint / no such step.
        ManifestError: the source manifest, or an existing destination manifest, is invalid.
        ChecksumMismatchError: a source shard does not match its receipt (nothing is committed).
        CommitConflict: the destination already committed different content at this step.
        CommitError: the destination commit failed (e.g. a shard missing on re-check).
        StoreError subclasses: a permanent store error on either side.
    """
    src = Reader(src_store)
    if step is None:
        manifest = src.latest()
        if manifest is None:
            raise NoCheckpointError(f"no committed checkpoint under {src_store.location}")
    else:
        manifest = src.load(step)

    dst = Reader(dst_store)
    existing = _existing(dst, manifest.step)
    if existing is not None:
        return _accept_existing(existing, manifest, dst_store, on_exists)
    after = _timeline0_parent(dst, manifest) if manifest.references else None
    provenance = {
        "location": src_store.location,
        "step": manifest.step,
        "attempt": manifest.attempt,
        "checksum": manifest.checksum,
    }
    try:
        return copy_checkpoint(
            src_store, manifest, dst_store, after=after, provenance=provenance, progress=progress
        )
    except CommitConflict:
        # Someone committed this step meanwhile (e.g. a concurrent copy of the same source):
        # fine if it is the same content. Our shards stay for GC: we cannot tell whether a
        # lost-response commit of ours references them.
        existing = _existing(dst, manifest.step)
        if existing is None:
            raise
        return _accept_existing(existing, manifest, dst_store, on_exists)


def copy_checkpoint(
    src_store: Store,
    manifest: Manifest,
    dst_store: Store,
    *,
    timeline: int = 0,
    after: tuple[int, int] | None = None,
    provenance: dict[str, Any],
    progress: Progress | None = None,
) -> Manifest:
    """Re-commit ``manifest`` (committed on ``src_store``) on ``dst_store`` at ``timeline``,
    continuing from the destination's checkpoint ``after`` (``None``: the coordinator's own
    choice of parent): the one copy procedure behind :func:`replicate` (``objckpt cp``) and the
    background mirror (:mod:`objckpt.coordination.mirror`).

    Every shard is streamed from the source (size and CRC32C verified at the end of its stream)
    into a :class:`ShardWriter` under a fresh attempt, the receipts compared, and the
    destination's coordinator checks the objects and commits; the references of a deduplicated
    checkpoint become the destination's references to the same identities, which the
    destination's parent ``after`` must hold or reference. ``provenance`` is recorded as the
    manifest's ``metadata.replicated_from``.

    Atomicity: the destination gains the checkpoint exactly when its manifest is written; a
    failure before that leaves only the fresh attempt's shards (deleted best-effort here, else
    collected by GC after its grace period).

    Raises:
        NoCheckpointError: the checkpoint reuses objects that the destination's parent neither
            holds nor references (copy its ancestors first); nothing is written.
        ChecksumMismatchError: a source shard does not match its receipt (nothing committed).
        CommitConflict, CommitError: from the destination's commit.
        StoreError subclasses: a permanent store error on either side.
    """
    references = _references_at(Reader(dst_store), manifest, dst_store, after)
    src = Reader(src_store)
    attempt = layout.new_attempt_id()
    writers: dict[int, ShardWriter] = {}
    try:
        for receipt in manifest.shards:
            writer = writers.get(receipt.rank)
            if writer is None:
                writer = writers[receipt.rank] = ShardWriter(
                    dst_store, step=manifest.step, attempt=attempt, rank=receipt.rank
                )
            copied = writer.write(receipt.name, _counting(src.open_shard(receipt), progress))
            _check_copy(receipt, copied, dst_store)
    except BaseException:
        # Nothing references this fresh attempt yet, so removing its shards cannot hurt anyone.
        _discard(dst_store, writers.values())
        raise
    receipts: dict[int, list[ShardReceipt]] = {r: [] for r in range(manifest.world_size)}
    for rank, writer in writers.items():
        receipts[rank] = writer.receipts
    metadata: dict[str, Any] = dict(manifest.metadata)
    metadata["replicated_from"] = dict(provenance)
    return Coordinator(dst_store, world_size=manifest.world_size).commit(
        step=manifest.step,
        attempt=attempt,
        receipts=receipts,
        progress=manifest.progress,
        run=manifest.run,
        topology=manifest.topology,
        metadata=metadata,
        timeline=timeline,
        after=after,
        references=references,
    )


def _timeline0_parent(dst: Reader, manifest: Manifest) -> tuple[int, int] | None:
    """The destination's newest timeline-0 checkpoint below ``manifest``'s step (``cp`` commits
    every copy on timeline 0)."""
    below = [ref for ref in dst.checkpoints() if ref[0] == 0 and ref[1] < manifest.step]
    return max(below) if below else None


def _references_at(
    dst: Reader, manifest: Manifest, dst_store: Store, parent_ref: tuple[int, int] | None
) -> dict[int, list[Reference]]:
    """Per rank, the destination's references for every object ``manifest`` reuses: the same
    identities, the destination's keys, as the destination's parent ``parent_ref`` holds or
    references them. The identities are the source's (the copied shards name them in their
    headers), so each must name a checkpoint the destination holds under the same
    ``(timeline, step)``.

    Raises:
        NoCheckpointError: the destination's parent does not hold or reference one of them
            (copy the ancestors first).
    """
    if not manifest.references:
        return {}
    parent = dst.fetch(layout.manifest_key(parent_ref[1], parent_ref[0])) if parent_ref is not None else None
    vouched: dict[tuple[int, int, int, str], Reference] = {}
    if parent is not None:
        for s in parent.shards:
            vouched[(*parent.ref, s.rank, s.name)] = Reference.to(s, parent)
        for r in parent.references:
            vouched[r.identity] = r
    out: dict[int, list[Reference]] = {}
    missing: list[str] = []
    for ref in manifest.references:
        there = vouched.get(ref.identity)
        if there is None or (there.size, there.crc32c) != (ref.size, ref.crc32c):
            missing.append(f"{ref.name} of rank {ref.rank} committed by step {ref.origin_step}")
            continue
        out.setdefault(ref.rank, []).append(there)
    if missing:
        raise NoCheckpointError(
            f"step {manifest.label} reuses objects of its ancestors that {dst_store.location} does not hold "
            f"as its parent {'(none)' if parent is None else parent.label} would need them "
            f"({'; '.join(missing)}): copy its ancestors first (replicate_all, or `objckpt cp` of the "
            "whole run root), oldest first"
        )
    return out


def _accept_existing(
    existing: Manifest,
    source: Manifest,
    dst_store: Store,
    on_exists: Callable[[Manifest], None] | None,
) -> Manifest:
    if not same_checkpoint(existing, source):
        raise CommitConflict(
            f"{dst_store.location} already has a different checkpoint at step {source.step} "
            f"(attempt {existing.attempt}); refusing to replace it with attempt {source.attempt}"
        )
    if on_exists is not None:
        on_exists(existing)
    return existing


def _check_copy(src: ShardReceipt, dst: ShardReceipt, dst_store: Store) -> None:
    # open_shard already verified the bytes read against the source receipt and the writer
    # checked what the destination stored against what it streamed; this closes the loop.
    if (src.size, src.crc32c) != (dst.size, dst.crc32c):
        raise ChecksumMismatchError(
            f"copy of {src.key} is {dst.size} bytes / CRC32C {dst.crc32c}, source receipt says "
            f"{src.size} / {src.crc32c}",
            key=dst.key,
            location=dst_store.location,
        )


def _discard(store: Store, writers: Iterable[ShardWriter]) -> None:
    keys = [r.key for w in writers for r in w.receipts]
    if keys:
        try:
            store.delete(keys)
        except Exception:  # noqa: BLE001 - best effort: the original error matters more; GC sweeps leftovers
            pass


def replicate_all(
    src_store: Store,
    dst_store: Store,
    progress: Progress | None = None,
    *,
    on_step: Callable[[ReplicationResult], None] | None = None,
) -> list[ReplicationResult]:
    """Replicate every committed step of the source, oldest first (so the destination's
    pointer only ever moves forward). Steps the destination already has are skipped.

    Invalid source manifests are not skipped silently: the first one raises ManifestError.

    Raises:
        NoCheckpointError: the source has no committed step.
        anything :func:`replicate` raises, for the first step that fails.
    """
    steps = sorted(Reader(src_store).steps())
    if not steps:
        raise NoCheckpointError(f"no committed checkpoint under {src_store.location}")
    results = []
    for step in steps:
        seen: list[Manifest] = []
        m = replicate(src_store, dst_store, step, progress, on_exists=seen.append)
        result = ReplicationResult(step, m, copied=not seen)
        results.append(result)
        if on_step is not None:
            on_step(result)
    return results
