"""Fixtures shared by the training-layer tests."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest


@pytest.fixture
def quiet_dcp() -> Iterator[None]:
    """Silence DCP's warning, on every call, that no process group is initialised: the DCP tests
    run in one process on purpose (``pytestmark = pytest.mark.usefixtures("quiet_dcp")``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is unavailable.*")
        yield
