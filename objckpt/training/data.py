"""A ``DataLoader`` whose saved position is what the training loop consumed.

::

    loader = ResumableDataLoader(dataset, batch_size=32, num_workers=4, seed=0)
    state = {"model": model, "optimizer": opt, "loader": loader, "progress": progress}
    manager.restore(state)
    for epoch in range(progress.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:          # resumes with the batch after the last one trained on
            ...

Why: a ``DataLoader`` with workers draws indices from its sampler ahead of the training loop
(``prefetch_factor * num_workers`` batches), so a sampler that counts the indices it handed out
is ahead of what was trained on when a checkpoint is taken, and a resumed run silently skips
those batches. :class:`ResumableDataLoader` records, for every batch it dispatches to a worker,
where the sampler stood after it, and moves the sampler's position there when that batch is
handed to the training loop. Batches arrive in dispatch order (``in_order=True``, the default; it
refuses ``False``), so the position is exact for any ``num_workers``, ``prefetch_factor`` and
``persistent_workers``. Save the loader or its sampler: both give the same state.

It also draws each iterator's worker base seed from a generator of its own, seeded from
``(seed, epoch, rank)``, instead of the global torch RNG that a plain ``DataLoader`` draws from
at every ``iter()``: a resumed run creates its iterator at another point of that stream, so
dropout and augmentation in the main process would differ from the uninterrupted run.

:func:`check_data_position` is what ``CheckpointManager`` calls before a save: it refuses a
:class:`ResumableDistributedSampler` that a plain multi-worker ``DataLoader`` iterates (its
position counts prefetched samples), unless torchdata's ``StatefulDataLoader`` around it is
saved too (that loader restores the sampler from its own per-batch snapshots).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from .sampler import ResumableDistributedSampler
from .state import TrainingStateError

__all__ = ["ResumableDataLoader", "check_data_position"]


class ResumableDataLoader(DataLoader[Any]):
    """``torch.utils.data.DataLoader`` over a :class:`ResumableDistributedSampler` that counts
    what the training loop consumed.

    Args:
        dataset: a map-style dataset.
        batch_size: as ``DataLoader``; ``None`` disables batching (one index per item).
        sampler: the sampler to draw from; default: a new
            ``ResumableDistributedSampler(dataset, shuffle=shuffle, seed=seed)`` over the
            initialised process group's ranks.
        shuffle, seed: for the default sampler (pass them to your own sampler instead).
        drop_last: drop each epoch's last incomplete batch, as ``DataLoader``.
        generator: the generator worker base seeds are drawn from; default: one seeded from
            ``(seed, epoch, rank)`` at every ``iter()``.
        **kwargs: any other ``DataLoader`` argument (``num_workers``, ``prefetch_factor``,
            ``persistent_workers``, ``collate_fn``, ``pin_memory``, ...).

    Restored: the sampler's epoch and consumed position (``state_dict()`` is
    ``{"sampler": sampler.state_dict()}``). At another world size ``CheckpointManager``
    re-partitions the rest of the epoch (:meth:`reshard_state`).

    Raises:
        TypeError: ``sampler`` is not a ``ResumableDistributedSampler``.
        ValueError: an ``IterableDataset``, a ``batch_sampler``, ``in_order=False``, or
            ``shuffle``/``seed`` together with ``sampler`` (the loader could not report
            consumption exactly, or the arguments would be ignored).
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        *,
        sampler: ResumableDistributedSampler | None = None,
        shuffle: bool | None = None,
        seed: int | None = None,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ValueError(
                "ResumableDataLoader needs a map-style dataset (an IterableDataset has no sampler whose "
                "position could be saved): make the dataset itself stateful, or use torchdata's "
                "StatefulDataLoader"
            )
        if kwargs.get("batch_sampler") is not None:
            raise ValueError(
                "ResumableDataLoader builds its own batches from the sampler (pass batch_size and drop_last): "
                "a custom batch_sampler could read ahead of the batches it yields"
            )
        kwargs.pop("batch_sampler", None)
        if kwargs.get("in_order", True) is False:
            raise ValueError(
                "ResumableDataLoader needs in_order=True: with out-of-order batches the consumed position "
                "is not a prefix of the epoch and cannot be resumed exactly"
            )
        if sampler is None:
            if not isinstance(dataset, Sized):
                raise ValueError("ResumableDataLoader needs a dataset with len() to build its sampler")
            sampler = ResumableDistributedSampler(
                dataset, shuffle=True if shuffle is None else shuffle, seed=0 if seed is None else seed
            )
        elif not isinstance(sampler, ResumableDistributedSampler):
            raise TypeError(
                f"ResumableDataLoader draws from a ResumableDistributedSampler, got {type(sampler).__qualname__}"
            )
        elif shuffle is not None or seed is not None:
            raise ValueError("pass shuffle= and seed= to the sampler, not to ResumableDataLoader")
        # set before DataLoader.__init__: its __setattr__ guards attributes after initialisation
        self._dispatched: deque[int] = deque()
        self._own_generator = generator is None
        self._resumable = sampler  # ``self.sampler``, typed
        super().__init__(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            drop_last=drop_last,
            generator=generator,
            **kwargs,
        )
        sampler._tracked = True  # this loader reports consumption: drawing no longer counts

    # DataLoader iterators draw indices from ``loader._index_sampler`` (the batch sampler, or the
    # sampler without batching), in the main process, when they dispatch a batch to a worker.
    @property
    def _index_sampler(self) -> Any:
        return _Dispatch(super()._index_sampler, self)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self._own_generator:
            self.generator = torch.Generator().manual_seed(_loader_seed(self._resumable))
        inner = super().__iter__()  # creates (or resets) the iterator, which starts dispatching
        return _Consuming(inner, self._dispatched, self._resumable)

    def set_epoch(self, epoch: int) -> None:
        """``sampler.set_epoch(epoch)`` (a resumed loader already in ``epoch`` keeps its position)."""
        self._resumable.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self._resumable.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the sampler's epoch and consumed position.

        Raises:
            TrainingStateError: not a ResumableDataLoader state, or one the sampler refuses.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("sampler"), Mapping):
            raise TrainingStateError("the checkpoint holds no ResumableDataLoader state (no 'sampler' entry)")
        self._resumable.load_state_dict(state["sampler"])

    def reshard_state(
        self, states: Sequence[Mapping[str, Any]], *, num_replicas: int, rank: int
    ) -> dict[str, Any]:
        """The state that continues the epoch of ``states`` (every saved rank's, in rank order) on
        rank ``rank`` of ``num_replicas`` (see :meth:`ResumableDistributedSampler.reshard_state`)."""
        for r, s in enumerate(states):
            if not isinstance(s, Mapping) or not isinstance(s.get("sampler"), Mapping):
                raise TrainingStateError(f"the ResumableDataLoader state of rank {r} has no 'sampler' entry")
        samplers = [s["sampler"] for s in states]
        return {"sampler": self._resumable.reshard_state(samplers, num_replicas=num_replicas, rank=rank)}


def _loader_seed(sampler: ResumableDistributedSampler) -> int:
    digest = hashlib.sha256(f"objckpt-loader:{sampler.seed}:{sampler.epoch}:{sampler.rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class _Dispatch:
    """The loader's index sampler, recording after every batch where the sampler stood."""

    def __init__(self, inner: Any, loader: ResumableDataLoader) -> None:
        self.inner = inner
        self.loader = loader

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        # eager, not a generator: the queue must be the loader's as soon as the DataLoader
        # iterator calls iter() on us, before it dispatches anything
        queue: deque[int] = deque()
        self.loader._dispatched = queue
        return self._batches(queue)

    def _batches(self, queue: deque[int]) -> Iterator[Any]:
        sampler = self.loader._resumable
        for batch in self.inner:
            queue.append(sampler._drawn)
            yield batch


class _Consuming:
    """The DataLoader iterator, moving the sampler's position as batches reach the caller."""

    def __init__(self, inner: Any, queue: deque[int], sampler: ResumableDistributedSampler) -> None:
        self.inner = inner
        self.queue = queue
        self.sampler = sampler

    def __iter__(self) -> _Consuming:
        return self

    def __len__(self) -> int:
        return len(self.inner)

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            self.sampler._pass_done()
            raise
        if not self.queue:
            raise RuntimeError(
                "ResumableDataLoader received a batch it never dispatched (was the loader iterated twice "
                "at once?); its position would be wrong"
            )
        self.sampler._consumed(self.queue.popleft())
        return batch


def _wraps(loader: Any, sampler: Any) -> bool:
    batch_sampler = getattr(loader, "batch_sampler", None)
    return getattr(loader, "sampler", None) is sampler or getattr(batch_sampler, "sampler", None) is sampler


def check_data_position(state: Mapping[str, Any], *, step: int, rank: int) -> None:
    """Refuse to save a sampler whose position counts prefetched rather than consumed samples.

    Raises:
        TrainingStateError: a :class:`ResumableDistributedSampler` in ``state`` is iterated by a
            ``DataLoader`` with workers that does not report consumption, and no torchdata
            ``StatefulDataLoader`` around it is saved (naming the step, the rank and the key).
    """
    for name, obj in state.items():
        if not isinstance(obj, ResumableDistributedSampler) or obj.exact:
            continue
        if any(
            isinstance(other, DataLoader)
            and callable(getattr(other, "state_dict", None))
            and _wraps(other, obj)
            for other in state.values()
        ):
            continue  # a StatefulDataLoader restores its sampler from the snapshot of its last batch
        raise TrainingStateError(
            f"cannot save step {step} exactly on rank {rank}: state[{name!r}] is iterated by "
            f"{obj._prefetched_by}, which draws indices ahead of the training loop, so its position "
            f"({obj.position}) counts prefetched samples and a resume would skip them. Iterate it with "
            "objckpt.training.ResumableDataLoader (same arguments as DataLoader), or use torchdata's "
            "StatefulDataLoader and save the loader"
        )
