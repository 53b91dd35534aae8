"""CheckpointManager's ``replicated_read`` default follows ``Store.cheap_reads``, the DCP
reader's rule: read once and exchanged on object stores (invariant 16), by every rank on file://
(page-cache copies, measured faster read per rank; ``shards.default_replicated_read``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from objckpt.store import open_store
from objckpt.store.wrappers import CountingStore
from objckpt.training import shards
from objckpt.training.manager import CheckpointManager


def _modes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = shards.stage

    def stage(*args: Any, **kw: Any) -> Any:
        seen.append(kw["replicated_read"])
        return real(*args, **kw)

    monkeypatch.setattr(shards, "stage", stage)
    return seen


@pytest.mark.parametrize(
    ("cheap", "option", "expect"),
    [
        (True, None, "every"),  # file://
        (False, None, "once"),  # an object store
        (True, "once", "once"),  # the option wins
        (False, "every", "every"),
    ],
)
def test_the_default_reads_once_on_object_stores_and_per_rank_on_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cheap: bool, option: str | None, expect: str
) -> None:
    store = CountingStore(open_store(f"file://{tmp_path}/run"))
    assert store.cheap_reads  # a wrapper says what it wraps
    store.cheap_reads = cheap
    state = {"model": torch.nn.Linear(4, 3)}
    CheckpointManager(store, keep_last=None).save(1, state)
    seen = _modes(monkeypatch)
    assert CheckpointManager(store, keep_last=None, replicated_read=option).restore(state) == 1
    assert seen == [expect]


def test_an_unknown_replicated_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicated_read"):
        CheckpointManager(f"file://{tmp_path}/run", replicated_read="twice")
