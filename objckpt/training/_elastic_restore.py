"""Restoring at another world size (an elastic restore): which per-rank state a rank
takes, and the re-partitioning of data positions. Separate from :mod:`.shards`, whose
:func:`~.shards.stage` calls it, only for length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ManifestError, TrainingStateError


def refuse_unpartitionable_positions(
    state: Mapping[str, Any],
    local_names: list[str],
    reshardable: list[str],
    step: int,
    saved_world: int,
    world_size: int,
    rank: int,
) -> None:
    """Raise :class:`TrainingStateError` for a loader or sampler among the per-rank items whose
    position cannot be re-partitioned to ``world_size`` ranks (it would repeat or skip samples)."""
    from torch.utils.data import DataLoader, Sampler

    for name in local_names:
        obj = state[name]
        if name not in reshardable and isinstance(obj, (DataLoader, Sampler)):
            raise TrainingStateError(
                f"cannot restore checkpoint step {step} (written by {saved_world} rank(s)) on rank {rank} of "
                f"{world_size}: state[{name!r}] is a {type(obj).__qualname__}, whose position cannot be "
                "re-partitioned across world sizes (it would repeat or skip samples). Use "
                "objckpt.training.ResumableDataLoader / ResumableDistributedSampler, or restore at "
                f"{saved_world} rank(s)"
            )


def apply_elastic_rule(
    state: Mapping[str, Any],
    items: dict[str, Any],
    per_rank: Mapping[int, tuple[Mapping[str, Any], Any]],
    reshardable: list[str],
    step: int,
    rank: int,
    saved_world: int,
    world_size: int,
) -> str:
    """Apply the elastic rule to ``items`` (this rank's per-rank items); returns how."""
    for name in reshardable:
        states = [per_rank[r][0].get(name) for r in range(saved_world)]
        absent = [r for r, s in enumerate(states) if s is None]
        if absent:
            if len(absent) == saved_world:
                continue  # not in the checkpoint at all: check_restorable reports it
            raise ManifestError(
                f"checkpoint step {step}: state[{name!r}] is missing from the shards of ranks {absent}"
            )
        try:
            items[name] = state[name].reshard_state(states, num_replicas=world_size, rank=rank)
        except TrainingStateError as exc:
            raise TrainingStateError(
                f"cannot re-partition state[{name!r}] of checkpoint step {step} from {saved_world} to "
                f"{world_size} rank(s) (rank {rank}): {exc}"
            ) from exc
    how = f"step {step} was written by {saved_world} rank(s), restored by {world_size}: "
    if rank < saved_world:
        how += f"rank {rank} keeps its own per-rank state and RNG"
    else:
        how += f"rank {rank} is new: per-rank state from rank 0, generators and RNG seeded from rank 0's and the rank"
    if reshardable:
        how += f"; {reshardable} re-partitioned from every rank's consumed samples"
    return how
