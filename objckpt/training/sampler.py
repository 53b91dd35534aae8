"""A distributed sampler that resumes mid-epoch exactly.

Like ``torch.utils.data.DistributedSampler`` (same padding, same ``rank::num_replicas`` split,
same seed + epoch shuffle, so the order matches it for the same arguments), plus
``state_dict()`` = ``{"epoch", "position", ...}``: after ``load_state_dict`` the next
iteration continues with the sample after the last one handed out.

``position`` counts indices handed to the consumer. With a ``DataLoader`` and ``num_workers=0``
indices are drawn exactly when a batch is built, so a checkpoint taken after an optimizer step
resumes at the next unseen sample. A multi-worker ``DataLoader`` prefetches indices ahead of
training; use torchdata's ``StatefulDataLoader`` there (it snapshots the sampler state of the
batch it yields), or set :attr:`position` to the number of samples this rank consumed in the
epoch before saving.

Note that ``DataLoader`` draws a seed from the *global* torch RNG each time an iterator is
created (once per epoch); a resumed run creates its iterator at a different point of the RNG
stream. Give the loader its own ``generator=torch.Generator()`` so the global stream (dropout,
augmentation) stays identical to the uninterrupted run's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from .state import TrainingStateError

__all__ = ["ResumableDistributedSampler"]


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
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch = 0
        self.position = 0  # indices of this epoch already handed out by this rank
        self._finished_pass = False  # an iterator of this epoch ran to its end

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

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full index order for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        if not self.drop_last:
            pad = self.total_size - len(order)
            if pad > 0 and order:
                order += (order * math.ceil(pad / len(order)))[:pad]
        else:
            order = order[: self.total_size]
        return order[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.num_samples and self._finished_pass:
            # Iterating again after a completed pass without set_epoch repeats the epoch, as
            # DistributedSampler does. A position restored from a checkpoint taken right after
            # the epoch's last batch (pass not finished yet) yields nothing instead, exactly as
            # the uninterrupted run's iterator had nothing left.
            self.position = 0
        self._finished_pass = False
        order = self.indices()
        for i in range(self.position, len(order)):
            # advance before yielding: once the consumer holds index i, it is consumed
            self.position = i + 1
            yield order[i]
        self._finished_pass = True

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_replicas": self.num_replicas,
            "dataset_len": self.dataset_len,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s epoch and position.

        Raises:
            TrainingStateError: the checkpoint was taken with a different seed, shuffle,
                drop_last, number of replicas or dataset length, so its position would point
                at different samples.
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
        position = int(state["position"])
        if not 0 <= position <= self.num_samples:
            raise TrainingStateError(
                f"sampler checkpoint position {position} is outside [0, {self.num_samples}]"
            )
        self.epoch = int(state["epoch"])
        self.position = position
        self._finished_pass = False
