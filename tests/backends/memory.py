from __future__ import annotations

from collections.abc import Iterator

import pytest

from objckpt.store.memory import MemoryStore

from . import Backend


@pytest.fixture(scope="session")
def backend_memory() -> Iterator[Backend]:
    yield Backend("memory", lambda prefix: MemoryStore(prefix))
