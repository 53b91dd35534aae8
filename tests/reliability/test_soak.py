"""The randomized soak's CI sample: a fixed seed, a few hundred episodes over memory://, file://,
S3 (moto) and GCS (fake-gcs-server) -- SIGKILLs at random calls of random ranks during save,
commit, pointer update, GC, rollback and cp, network faults through the chaos proxy, bit flips --
each followed by the invariant checks (tests/reliability/soak.py). The full run is
``scripts/soak.py --episodes 10000`` (RELIABILITY.md has its counts)."""

from __future__ import annotations

import os

import pytest

from .soak import Soak, quiet

pytestmark = [pytest.mark.timeout(900)]

SEED = 20261201
EPISODES = int(os.environ.get("OBJCKPT_SOAK_EPISODES", "240"))
BACKENDS = ("memory", "file", "s3_moto", "gcs")


def test_the_soak_sample_holds_every_invariant() -> None:
    with quiet(), Soak(SEED, backends=BACKENDS) as soak:
        stats = soak.run(range(EPISODES))
        skipped = soak.skipped
    assert stats.episodes == EPISODES
    assert not stats.violations, "\n".join(
        f"episode {v['episode']} ({v['backend']} {v['op']} {v['fault']}): {v['violation']} "
        f"[replay: scripts/soak.py --seed {SEED} --episode {v['episode']}]"
        for v in stats.violations
    )
    # the sample really exercised what it claims (counts, not timings)
    kills = {k for k, n in stats.faults.items() if k.startswith("kill:") and k != "kill:not_reached" and n}
    assert {"kill:save", "kill:commit", "kill:gc"} <= kills, stats.faults
    assert any(k.startswith("bitflip:") for k in stats.faults), stats.faults
    if "s3_moto" not in skipped or "gcs" not in skipped:
        assert any(k.startswith("net:") for k in stats.faults), stats.faults
    assert stats.checks["restores compared"] >= EPISODES
