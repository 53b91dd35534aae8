"""A distributed sampler that resumes mid-epoch exactly, at the same or another world size.

Like ``torch.utils.data.DistributedSampler`` (same padding, same ``rank::num_replicas`` split,
same seed + epoch shuffle, so the order matches it for the same arguments), plus
``state_dict()`` = ``{"epoch", "position", ...}``: after ``load_state_dict`` the next
iteration continues with the sample after the last one *consumed*.

What "consumed" means depends on who iterates the sampler:

* :class:`~objckpt.training.data.ResumableDataLoader` (any ``num_workers``, ``prefetch_factor``,
  ``persistent_workers``): the loader tells the sampler which batches the training loop has
  received, so ``position`` counts exactly those, however far the workers prefetched.
* A plain ``DataLoader`` with ``num_workers=0``, or iterating the sampler yourself: indices are
  drawn exactly when a batch is built, so ``position`` counts indices handed out.
* A plain ``DataLoader`` with workers prefetches indices ahead of the training loop: ``position``
  would count what the workers prefetched, not what was trained on. The sampler notices (a
  ``RuntimeWarning`` when such a loader starts iterating it) and ``CheckpointManager`` refuses to
  save it (:class:`TrainingStateError`). torchdata's ``StatefulDataLoader`` snapshots the sampler
  state of the batch it yields: save the loader (it restores the sampler) and it is exact.

Elastic resume: :meth:`ResumableDistributedSampler.reshard_state` turns the states of every
rank of a job into the state of a rank of a job of another size. The samples the old ranks
consumed in the epoch are removed from its order; the rest of the epoch is split across the new
ranks (padded or cut as ``drop_last`` says), so no sample is repeated or skipped beyond that
padding. The next epoch is a normal one at the new world size.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence, Sized
from types import FrameType
from typing import Any

import torch
from torch.utils.data import Sampler

from .state import TrainingStateError

__all__ = ["ResumableDistributedSampler"]

log = logging.getLogger("objckpt.training")

#: the configuration that must match for a position to point at the same samples
_CONFIG = ("seed", "shuffle", "dataset_len", "drop_last")


class ResumableDistributedSampler(Sampler[int]):
    """Deterministic per-epoch shuffling, sharded across ranks, resumable mid-epoch.

    Args:
        dataset: a map-style dataset (anything with ``len``) or its length.
        num_replicas, rank: default to the initialised process group's world size and rank
            (1 and 0 without torch.distributed).
        shuffle: permute with ``torch.Generator().manual_seed(seed + epoch)``.
        seed: must be the same on every rank.
        drop_last: drop the tail instead of padding with repeated indices.
    """

    def __init__(
        self,
        dataset: Sized | int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        dist = torch.distributed
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} for num_replicas {num_replicas}")
        if n < 0:
            raise ValueError(f"dataset length must be >= 0, got {n}")
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._full_samples = self._per_rank(n, num_replicas)
        self.total_size = self._full_samples * num_replicas
        self.epoch = 0
        self.position = 0  # indices of this epoch consumed by this rank
        self._finished_pass = False  # an iterator of this epoch ran to its end
        # re-partitions of the current epoch (elastic restores): what the ranks of each earlier
        # world size had consumed of it; [] for an epoch that started at this world size
        self._resharded: list[dict[str, Any]] = []
        self._resharded_samples = 0
        self._drawn = 0  # indices handed out by the current iterator (ahead of position when tracked)
        #: set by a ResumableDataLoader: it reports consumption, so drawing does not advance position
        self._tracked = False
        #: a description of the prefetching loader that iterates this sampler untracked, if any
        self._prefetched_by: str | None = None
        self._warned = False

    @property
    def num_samples(self) -> int:
        """Indices this rank gets in the current epoch (fewer in an epoch re-partitioned by an
        elastic restore: only the rest of the epoch is split)."""
        return self._resharded_samples if self._resharded else self._full_samples

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``. Setting the epoch a resumed sampler is already in keeps its position,
        so the usual ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop resumes
        mid-epoch without special cases."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0
            self._finished_pass = False
            self._resharded = []

    # ------------------------------------------------------------------ order

    def _per_rank(self, n: int, replicas: int) -> int:
        if self.drop_last and n % replicas:
            return n // replicas
        return math.ceil(n / replicas)

    def _global(self, order: list[int], replicas: int) -> list[int]:
        """``order`` padded with its own head (or cut, ``drop_last``) to a multiple of ``replicas``."""
        total = self._per_rank(len(order), replicas) * replicas
        if total > len(order) and order:
            pad = total - len(order)
            return order + (order * math.ceil(pad / len(order)))[:pad]
        return order[:total]

    def _base(self, epoch: int) -> list[int]:
        """The dataset indices still to be split in ``epoch``: all of them, minus what the ranks
        of earlier world sizes had consumed when the epoch was re-partitioned."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        if epoch == self.epoch:
            for record in self._resharded:
                replicas, positions = record["num_replicas"], record["positions"]
                flat = self._global(order, replicas)
                consumed: set[int] = set()
                for r in range(replicas):
                    consumed.update(flat[r::replicas][: positions[r]])
                order = [i for i in order if i not in consumed]
        return order

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full index order for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        return self._global(self._base(epoch), self.num_replicas)[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples and self._finished_pass:
            # Iterating again after a completed pass without set_epoch repeats the epoch, as
            # DistributedSampler does (a whole pass at this world size). A position restored
            # from a checkpoint taken right after the epoch's last batch (pass not finished yet)
            # yields nothing instead, exactly as the uninterrupted run's iterator had nothing left.
            self.position = 0
            self._resharded = []
        self._finished_pass = False
        tracked = self._tracked
        self._prefetched_by, snapshots = (None, False) if tracked else _prefetching_loader()
        if self._prefetched_by is not None and not snapshots and not self._warned:
            self._warned = True
            msg = (
                f"ResumableDistributedSampler is iterated by {self._prefetched_by}, which prefetches "
                "indices ahead of the training loop: its position would count prefetched samples, so "
                "CheckpointManager refuses to save it. Use objckpt.training.ResumableDataLoader (a "
                "DataLoader that reports what the loop consumed), or save torchdata's StatefulDataLoader"
            )
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        order = self.indices()
        self._drawn = self.position
        for i in range(self.position, len(order)):
            # advance before yielding: once the consumer holds index i, it is consumed (a
            # ResumableDataLoader moves position itself when the batch reaches the training loop)
            self._drawn = i + 1
            if not tracked:
                self.position = i + 1
            yield order[i]
        if not tracked:
            self._finished_pass = True

    # ------------------------------------------------------------------ for ResumableDataLoader

    def _consumed(self, position: int) -> None:
        """The training loop received every index before ``position``."""
        self.position = position

    def _pass_done(self) -> None:
        """The loader's iterator ran to its end: the epoch is fully consumed (a batch tail that
        ``drop_last`` dropped included)."""
        self.position = self.num_samples
        self._finished_pass = True

    @property
    def exact(self) -> bool:
        """Whether :attr:`position` counts what the training loop consumed (False while an
        untracked multi-worker ``DataLoader`` iterates this sampler)."""
        return self._prefetched_by is None

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "dataset_len": self.dataset_len,
            "drop_last": self.drop_last,
        }
        if self._resharded:
            state["resharded"] = [
                {"num_replicas": r["num_replicas"], "positions": list(r["positions"])}
                for r in self._resharded
            ]
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s epoch and position.

        Raises:
            TrainingStateError: the checkpoint was taken with a different seed, shuffle,
                drop_last, number of replicas or dataset length, so its position would point
                at different samples (:meth:`reshard_state` maps a checkpoint of another world
                size; ``CheckpointManager`` does that itself), or the state is malformed.
        """
        for key, live in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("num_replicas", self.num_replicas),
            ("dataset_len", self.dataset_len),
            ("drop_last", self.drop_last),
        ):
            if key in state and state[key] != live:
                raise TrainingStateError(
                    f"sampler checkpoint has {key}={state[key]!r} but this sampler has {live!r}; "
                    "resuming would replay or skip samples"
                )
        records = _records(state.get("resharded", []))
        epoch = int(state["epoch"])
        position = int(state["position"])
        saved = (self.epoch, self._resharded, self._resharded_samples)
        self.epoch, self._resharded = epoch, records
        self._resharded_samples = len(self.indices()) if records else 0
        if not 0 <= position <= self.num_samples:
            limit = self.num_samples
            self.epoch, self._resharded, self._resharded_samples = saved
            raise TrainingStateError(f"sampler checkpoint position {position} is outside [0, {limit}]")
        self.position = position
        self._finished_pass = False

    def reshard_state(
        self, states: Sequence[Mapping[str, Any]], *, num_replicas: int, rank: int
    ) -> dict[str, Any]:
        """The state that continues, on rank ``rank`` of ``num_replicas``, the epoch that
        ``states`` (the states of every rank of the job that saved them, in rank order) were in.

        The samples those ranks consumed are removed from the epoch's order and the rest is split
        across the ``num_replicas`` ranks as usual; the next epoch is a normal one. Repeated
        re-partitions of one epoch stack (each is a record in ``state["resharded"]``).

        Raises:
            TrainingStateError: the states do not describe one job's ranks in one epoch (their
                number is not their ``num_replicas``, or seeds, epochs, ... differ), naming the
                first rank that differs and the key.
        """
        if not states:
            raise TrainingStateError("no sampler states to re-partition")
        first = states[0]
        for r, s in enumerate(states):
            if int(s.get("num_replicas", -1)) != len(states):
                raise TrainingStateError(
                    f"the sampler state of rank {r} has num_replicas={s.get('num_replicas')!r} but "
                    f"{len(states)} rank(s) saved it: its positions cannot be re-partitioned"
                )
            for key in (*_CONFIG, "epoch", "resharded"):
                if s.get(key) != first.get(key):
                    raise TrainingStateError(
                        f"the sampler states of ranks 0 and {r} differ in {key!r} ({first.get(key)!r} vs "
                        f"{s.get(key)!r}): they are not one job's ranks in one epoch"
                    )
        records = _records(first.get("resharded", []))
        positions = [int(s["position"]) for s in states]
        if any(positions):
            records.append({"num_replicas": len(states), "positions": positions})
        out: dict[str, Any] = {key: first[key] for key in _CONFIG if key in first}
        out.update(epoch=int(first["epoch"]), position=0, num_replicas=num_replicas)
        if records:
            out["resharded"] = records
        return out


def _records(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise TrainingStateError(f"sampler checkpoint has a malformed 'resharded' record: {value!r}")
    out = []
    for rec in value:
        replicas = rec.get("num_replicas") if isinstance(rec, Mapping) else None
        positions = rec.get("positions") if isinstance(rec, Mapping) else None
        if (
            not isinstance(replicas, int)
            or replicas < 1
            or not isinstance(positions, list)
            or len(positions) != replicas
            or not all(isinstance(p, int) and p >= 0 for p in positions)
        ):
            raise TrainingStateError(f"sampler checkpoint has a malformed 'resharded' record: {rec!r}")
        out.append({"num_replicas": replicas, "positions": list(positions)})
    return out


def _prefetching_loader(depth: int = 12) -> tuple[str | None, bool]:
    """Which multi-worker ``DataLoader`` iterator (if any) is drawing from the calling sampler,
    and whether it is torchdata's (which snapshots the sampler state of every batch it yields).

    Called from the sampler's generator when the first index is drawn: the frames above it are
    the batch sampler's and the ``DataLoader`` iterator's ``_next_index``. A ``DataLoader`` has
    no public hook that tells its sampler who iterates it, so look at the callers' ``self``.
    """
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    frame: FrameType | None = sys._getframe(2)  # 0: this function, 1: the sampler's generator
    for _ in range(depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter):
            workers = int(getattr(owner, "_num_workers", 0) or 0)
            if workers <= 0:
                break
            package = type(owner).__module__.split(".")[0]
            return f"a {package} {type(owner).__name__} with num_workers={workers}", package == "torchdata"
        frame = frame.f_back
    return None, False
