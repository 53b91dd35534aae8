from __future__ import annotations

from typing import Any

import pytest

from objckpt import _crc
from objckpt.store import Store
from objckpt.testing._contract_writes import expect_gap as contract_expect_gap
from tests.backends import BACKEND_NAMES, Backend

pytest_plugins = [
    "tests.backends.memory",
    "tests.backends.local",
    "tests.backends.s3",
    "tests.backends.gcs",
]


@pytest.fixture(params=BACKEND_NAMES)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Every backend in turn (those without a reachable server are skipped with the reason)."""
    return request.getfixturevalue(f"backend_{request.param}")


@pytest.fixture
def store(backend: Backend) -> Store:
    """A fresh, empty store on every backend in turn."""
    s = backend.new_store()
    yield s
    s.close()


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes CRC32C-hashed so far (every hash goes through ``_crc.crc32c_update``): what the
    one-CRC-pass-per-byte tests count. Reset ``hashed[0] = 0`` before the part measured."""
    seen = [0]
    update = _crc.crc32c_update

    def counting(crc: int, data: Any) -> int:
        seen[0] += memoryview(data).nbytes
        return update(crc, data)

    monkeypatch.setattr(_crc, "crc32c_update", counting)
    return seen


def expect_gap(request: pytest.FixtureRequest, backend: Backend, gap: str) -> None:
    """Mark the running test xfail(strict) when ``backend`` is known to lack ``gap``: the contract
    suite's rule, with the backend's name in the reason."""
    reason = backend.gaps.get(gap)
    contract_expect_gap(request, {gap: f"{backend.name}: {reason}"} if reason else {}, gap)
