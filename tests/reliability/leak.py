"""Resource growth of repeated ``save_async`` calls (shared by tests/reliability/test_leak.py and
scripts/leak.py).

PyTorch's asynchronous DCP kept about one checkpoint's staging copy alive per save. Here the
staging buffer is reused from save to save, so after a warm-up a fixed state costs no new host
memory, no file descriptor and no thread per save. :func:`measure` saves a fixed state through
``CheckpointManager.save_async`` (file:// run root, retention on) and reports the resident set
size (``/proc/self/statm``), open descriptors (``/proc/self/fd``) and threads (``/proc/self/task``:
native ones too) before and after.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MiB = 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def native_threads() -> set[str]:
    """The ids of this process's native threads."""
    return set(os.listdir("/proc/self/task"))


@dataclass
class LeakReport:
    saves: int
    warmup: int
    state_bytes: int
    rss_start: int
    rss_end: int
    rss_max: int
    fds_start: int
    fds_end: int
    threads_start: int
    threads_end: int
    seconds: float
    samples: list[int] = field(default_factory=list)  # RSS after every `every`-th save
    #: threads alive at the end that were not at the start (the leak; threads_end may also be
    #: lower than threads_start, when threads of earlier work exit meanwhile)
    new_threads: int = 0

    @property
    def growth(self) -> int:
        return self.rss_end - self.rss_start

    @property
    def max_growth(self) -> int:
        return self.rss_max - self.rss_start

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "growth": self.growth, "max_growth": self.max_growth}

    def summary(self) -> str:
        return (
            f"{self.saves} save_async calls of a fixed {self.state_bytes / MiB:.1f} MiB state (after "
            f"{self.warmup} warm-up saves): RSS {self.rss_start / MiB:.1f} -> {self.rss_end / MiB:.1f} MiB "
            f"(growth {self.growth / MiB:+.2f} MiB, peak {self.max_growth / MiB:+.2f} MiB), open fds "
            f"{self.fds_start} -> {self.fds_end}, threads {self.threads_start} -> {self.threads_end} ({self.new_threads} new), "
            f"{self.seconds:.0f} s"
        )


def fixed_state(mib: int = 4) -> dict[str, Any]:
    import torch

    from objckpt.training.state import TrainingProgress

    torch.manual_seed(0)
    width = 512
    depth = max(1, mib * MiB // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(depth)])
    return {"model": model, "progress": TrainingProgress()}


def measure(root: str, *, saves: int, warmup: int = 10, mib: int = 4, every: int = 10) -> LeakReport:
    """``warmup`` then ``saves`` calls of ``save_async`` (each waited for) on a file:// root."""
    import torch

    from objckpt.training.manager import CheckpointManager

    state = fixed_state(mib)
    nbytes = sum(p.numel() * p.element_size() for p in state["model"].parameters())
    mgr = CheckpointManager(f"file://{root}", keep_last=2, check=False)
    step = 0
    try:
        for _ in range(warmup):
            step += 1
            mgr.save_async(step, state).wait()
        gc.collect()
        rss0, fds0, threads0 = rss_bytes(), open_fds(), native_threads()
        peak, samples = rss0, []
        started = time.monotonic()
        for i in range(saves):
            step += 1
            with torch.no_grad():
                for p in state["model"].parameters():
                    p.add_(1e-3)  # the same tensors, new values: a training step's worth of change
            state["progress"].global_step = step
            mgr.save_async(step, state).wait()
            if (i + 1) % every == 0:
                now = rss_bytes()
                peak = max(peak, now)
                samples.append(now)
        seconds = time.monotonic() - started
        gc.collect()
        rss1, fds1, threads1 = rss_bytes(), open_fds(), native_threads()
    finally:
        mgr.close()
    return LeakReport(
        saves,
        warmup,
        nbytes,
        rss0,
        rss1,
        max(peak, rss1),
        fds0,
        fds1,
        len(threads0),
        len(threads1),
        seconds,
        samples,
        new_threads=len(threads1 - threads0),
    )
