"""The coordinator's checks of a commit's receipts (invariants 4 and 5): every rank reported
valid receipts, and the store holds exactly what they say -- by the coordinator's own LISTs or by
the ranks' LISTs of their verification slices (``verify="ranks"``). Pure checks over a store's
listings; :class:`objckpt.commit.Coordinator` runs them before it writes a manifest.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Union

from . import layout
from ._receipts import ShardReceipt
from .errors import CommitError
from .store.base import ObjectMeta, Store

__all__ = ["NO_RANK", "RankReport", "check_reports", "check_store"]

RankReport = Union[Sequence[ShardReceipt], BaseException, str]
"""What each rank contributes to a commit: its receipts, or the error (or its text) it hit."""

#: rank used in ``CommitError.failures`` for a stray key that lies under no rank's prefix
NO_RANK = -1
#: LISTs of spread attempt prefixes the coordinator runs at once
_LIST_THREADS = 16


def check_reports(
    step: int,
    attempt: str,
    receipts: Mapping[int, RankReport],
    world_size: int,
) -> dict[str, ShardReceipt]:
    """Invariant 4 and step 1 of a commit: every rank ``0..world_size-1`` reported receipts,
    each under its own rank's prefix of this attempt (spread or not), none twice; returns them
    by key.

    Raises:
        CommitError: naming every rank whose report is missing, an error or invalid.
    """
    failures: dict[int, str] = {}
    expected: dict[str, ShardReceipt] = {}
    for rank in receipts:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
            failures[rank if isinstance(rank, int) else NO_RANK] = (
                f"reported as rank {rank!r}, outside world of size {world_size}"
            )
    for rank in range(world_size):
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


def check_store(
    store: Store,
    step: int,
    attempt: str,
    expected: Mapping[str, ShardReceipt],
    world_size: int,
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

    Raises:
        CommitError: naming every failing rank (``NO_RANK`` for a stray under no rank).
        StoreError: one of the coordinator's own LISTs failed.
    """
    failures: dict[int, list[str]] = {}

    def fail(rank: int, why: str) -> None:
        failures.setdefault(rank, []).append(why)

    used = sorted({p for k in expected if (p := layout.attempt_prefix_of(k)) is not None})
    listed: list[ObjectMeta] = []  # what the store holds under the attempt's prefixes
    if listings is None:
        to_list = used or [layout.attempt_prefix(step, attempt)]  # no receipts: must be empty too
    else:
        slices = layout.verification_slices(step, attempt, world_size, spread=spread)
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
        listed.extend(store.list(to_list[0]))
    elif to_list:
        with ThreadPoolExecutor(
            min(_LIST_THREADS, len(to_list)), thread_name_prefix="objckpt-verify"
        ) as pool:
            for page in pool.map(lambda p: list(store.list(p)), to_list):
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
            fail(r.rank, f"{meta.key!r} has version {meta.version} in the store, receipt says {r.version}")
        elif meta.crc32c is not None and meta.crc32c != r.crc32c:
            fail(r.rank, f"{meta.key!r} has CRC32C {meta.crc32c} in the store, receipt says {r.crc32c}")
    for key, r in expected.items():
        if key not in seen:
            fail(r.rank, f"{key!r} is missing from the store")
    if failures:
        raise CommitError(
            f"step {step} attempt {attempt} not committed: the store does not hold what the ranks reported",
            {rank: "; ".join(why) for rank, why in failures.items()},
        )
