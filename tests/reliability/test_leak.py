"""Repeated ``save_async`` of a fixed state leaks nothing (CI size): bounded host memory growth,
constant open file descriptors and threads. The full 1,000-call run is ``scripts/leak.py``, whose
figure is in RELIABILITY.md. (PyTorch's asynchronous DCP leaked about one checkpoint per save: at
the 4 MiB state here that would be ~4 MiB per call, far past the bound.)"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from .leak import MiB, measure  # noqa: E402

pytestmark = [pytest.mark.timeout(600)]

SAVES = 60  # x 4 MiB: a leak of one staging copy per save would grow RSS by ~240 MiB


def test_save_async_of_a_fixed_state_leaks_no_memory_fds_or_threads(tmp_path: Path) -> None:
    report = measure(str(tmp_path / "run"), saves=SAVES, warmup=10, mib=4)
    assert report.growth <= 10 * MiB, report.summary()
    assert report.max_growth <= 10 * MiB + report.state_bytes, report.summary()
    assert report.fds_end == report.fds_start, report.summary()
    assert report.new_threads == 0, report.summary()
