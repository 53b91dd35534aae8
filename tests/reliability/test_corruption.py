"""Damage to a committed checkpoint is detected and the restore falls back to its parent, loudly.

Step 10 and step 20 are committed; then step 20 is damaged one way: a flipped byte in a shard
(on file:// as bit rot that keeps size, mtime and stored CRC, so only the CRC32C checked while
streaming can see it), a truncated shard, a deleted shard, another step's manifest copied over
step 20's, a corrupt ``LATEST``. A fresh restore must use step 10 whole and bit for bit, with a
warning naming step 20 and the reason -- except for ``LATEST``, which is only a hint: the reader
ignores it (with a warning) and still finds step 20 by listing ``manifests/``.
"""

from __future__ import annotations

import pytest

from .harness import Leg
from .scenarios import CORRUPTIONS, corruption_scenario


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corruption_is_detected_and_falls_back(mleg: Leg, kind: str) -> None:
    out = corruption_scenario(mleg, kind)
    assert out.restored_step == out.expected_step
    assert out.bytes_equal is True
