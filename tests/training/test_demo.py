"""The product demo, as users run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]


def test_demo_resumed_run_matches_uninterrupted_run() -> None:
    pytest.importorskip("moto")
    proc = subprocess.run(
        [sys.executable, "-m", "objckpt.demo"],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=REPO,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "last committed step: 30" in proc.stdout
    assert "steps lost: 7" in proc.stdout
    assert "resumed run matches uninterrupted run: YES" in proc.stdout
