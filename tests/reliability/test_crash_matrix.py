"""SIGKILL at every protocol point, on every backend: the last committed state survives whole.

A real subprocess (``crash_worker.py``) performs a save -- or a GC run -- and kills itself with
SIGKILL at one point, leaving whatever a preempted node leaves: a pending multipart upload, parts,
complete shards with no manifest, a manifest with a stale pointer, or manifests deleted without
their shards. Then a fresh process's view must restore the last committed state bit for bit
(the new state where the manifest made it: roll-forward), never a mixture of attempts, and GC
with ``now`` past the grace period must sweep exactly the leftovers. See ``scenarios.py``.
"""

from __future__ import annotations

import pytest

from .harness import Leg
from .scenarios import CRASH_POINTS, crash_scenario

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_crash_point(mleg: Leg, point: str) -> None:
    out = crash_scenario(mleg, point)
    assert out.restored_step == out.expected_step
    assert out.bytes_equal is True
    assert out.orphans_swept is True
