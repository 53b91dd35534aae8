"""ResumableDistributedSampler: DistributedSampler's order, resumable mid-epoch exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from objckpt.training.sampler import ResumableDistributedSampler
from objckpt.training.state import TrainingStateError


@pytest.mark.parametrize(
    "n, replicas, drop_last", [(10, 3, False), (10, 3, True), (7, 2, False), (2, 4, False)]
)
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_order_as_distributed_sampler(n: int, replicas: int, drop_last: bool, shuffle: bool) -> None:
    data = list(range(n))
    for rank in range(replicas):
        for epoch in (0, 3):
            ours = ResumableDistributedSampler(
                data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            ref = DistributedSampler(
                data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
            )
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref) and len(ours) == len(ref)


def test_resumes_mid_epoch_exactly() -> None:
    full = ResumableDistributedSampler(100, num_replicas=2, rank=1, seed=3)
    full.set_epoch(2)
    expected = list(full)

    s = ResumableDistributedSampler(100, num_replicas=2, rank=1, seed=3)
    s.set_epoch(2)
    it = iter(s)
    head = [next(it) for _ in range(17)]
    saved = s.state_dict()
    assert saved["epoch"] == 2 and saved["position"] == 17

    r = ResumableDistributedSampler(100, num_replicas=2, rank=1, seed=3)
    r.load_state_dict(saved)
    r.set_epoch(2)  # the training loop's usual call keeps the restored position
    assert head + list(r) == expected
    r.set_epoch(3)
    assert r.position == 0 and len(list(r)) == 50


def test_dataloader_batches_resume_at_the_next_batch() -> None:
    s = ResumableDistributedSampler(40, seed=1)
    seen = []
    for i, batch in enumerate(
        DataLoader(list(range(40)), batch_size=4, sampler=s, generator=torch.Generator())
    ):
        seen += batch.tolist()
        if i == 4:
            state = s.state_dict()
            break
    assert state["position"] == 20
    r = ResumableDistributedSampler(40, seed=1)
    r.load_state_dict(state)
    rest = [x for b in DataLoader(list(range(40)), batch_size=4, sampler=r) for x in b.tolist()]
    assert seen + rest == ResumableDistributedSampler(40, seed=1).indices()


def test_checkpoint_at_end_of_epoch_does_not_replay_it() -> None:
    s = ResumableDistributedSampler(8, seed=0)
    it = iter(s)
    for _ in range(8):
        next(it)  # last index handed out, iterator not yet exhausted (save point)
    state = s.state_dict()
    r = ResumableDistributedSampler(8, seed=0)
    r.load_state_dict(state)
    assert list(r) == []  # the epoch is complete, as for the uninterrupted iterator
    assert next(it, None) is None  # the uninterrupted iterator finishes its pass...
    assert list(s) == s.indices()  # ...and iterating again repeats the epoch (DistributedSampler)


def test_mismatched_configuration_is_refused() -> None:
    state = ResumableDistributedSampler(100, num_replicas=2, rank=0, seed=3).state_dict()
    with pytest.raises(TrainingStateError, match="seed"):
        ResumableDistributedSampler(100, num_replicas=2, rank=0, seed=4).load_state_dict(state)
    with pytest.raises(TrainingStateError, match="num_replicas"):
        ResumableDistributedSampler(100, num_replicas=4, rank=0, seed=3).load_state_dict(state)
    with pytest.raises(TrainingStateError, match="dataset_len"):
        ResumableDistributedSampler(99, num_replicas=2, rank=0, seed=3).load_state_dict(state)
    with pytest.raises(TrainingStateError, match="position"):
        ResumableDistributedSampler(100, num_replicas=2, rank=0, seed=3).load_state_dict(
            {**state, "position": 51}
        )
