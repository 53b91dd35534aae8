"""The defaults a newcomer never has to change, defined once (every API imports them from here).

Timeouts bound how long a rank waits for the others; they are not retry budgets (those are the
store's ``deadline``, see :class:`objckpt._retry.RetryPolicy`).
"""

from __future__ import annotations

from datetime import timedelta

#: seconds a rank waits for the others after transfers (must exceed the slowest rank's upload)
TIMEOUT = 1800.0
#: seconds a rank waits for the others to enter save/restore; a save called by rank 0 alone
#: raises DistributedError after this long instead of hanging
HANDSHAKE_TIMEOUT = 300.0
#: bytes of the padded buffer one round of ``Comm.all_gather_bytes`` may hold on a rank (over
#: gloo: world_size x the round's widest contribution); larger exchanges take several rounds
EXCHANGE_BUDGET = 256 * 1024 * 1024
#: up to this world size the gloo transport of ``Comm.all_gather_bytes`` sends each rank's bytes
#: with broadcasts straight into an exact buffer per source (no padding, no copy, 2.5x faster
#: than gloo's all-gather at 2 ranks, issue 14); above it, rounds of one all-gather (a ring,
#: whose cost does not grow with the number of collectives a world size issues)
EXCHANGE_BROADCAST_MAX_WORLD = 8
#: ``verify="auto"`` (the default) spreads a commit's verification LISTs over the ranks above
#: this world size; up to it the coordinator LISTs the attempt itself (one spread prefix a rank,
#: all at once: one round trip, no extra collective)
VERIFY_SPREAD_ABOVE = 16
#: committed checkpoints kept by CheckpointManager's retention
KEEP_LAST = 3
#: unreferenced attempt data and incomplete uploads younger than this are never collected;
#: it must exceed the longest save
GC_GRACE_PERIOD = timedelta(hours=6)

#: checkpoints of an abandoned branch (after a rollback or a fallback) are kept this long after
#: they were abandoned, then collected
KEEP_ABANDONED = timedelta(days=7)

__all__ = [
    "EXCHANGE_BROADCAST_MAX_WORLD",
    "EXCHANGE_BUDGET",
    "GC_GRACE_PERIOD",
    "HANDSHAKE_TIMEOUT",
    "KEEP_ABANDONED",
    "KEEP_LAST",
    "TIMEOUT",
    "VERIFY_SPREAD_ABOVE",
]
