"""The one store contract suite (objckpt/testing/contract.py) over every backend and wrapper.

Backends: memory, file, S3 on moto / LocalStack / ``$OBJCKPT_TEST_S3_URI``, GCS on an emulator
(tests/backends; those without a reachable server skip with the reason). Wrappers are stores too,
so they keep the same contract: ``PrefixStore`` over a memory and a file store shared by every
test of the session (so each test also proves that other prefixes' objects stay invisible), and
``CountingStore`` / ``FaultInjectingStore`` (no faults) over fresh memory and file stores. Known
server gaps are strict xfails (tests/backends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from objckpt.store import PrefixStore, Store, open_store
from objckpt.store.memory import MemoryStore
from objckpt.store.wrappers import CountingStore, FaultInjectingStore
from objckpt.testing.contract import StoreContract
from tests.backends import BACKEND_NAMES, Backend

WRAPPED = [
    "prefix_memory",
    "prefix_file",
    "counting_memory",
    "counting_file",
    "faults_memory",
    "faults_file",
]


@pytest.fixture(scope="session")
def shared_inner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Store]]:
    """One memory and one file store that every PrefixStore leg of the session writes below."""
    stores = {
        "memory": MemoryStore("shared"),
        "file": open_store(f"file://{tmp_path_factory.mktemp('prefix-file')}"),
    }
    yield stores
    for store in stores.values():
        store.close()


def _wrapped_leg(name: str, shared: dict[str, Store], root: str) -> Backend:
    wrapper, inner_kind = name.split("_")

    def fresh_inner(prefix: str) -> Store:
        return MemoryStore(prefix) if inner_kind == "memory" else open_store(f"file://{root}/{prefix}")

    makers: dict[str, Callable[[str], Store]] = {
        "prefix": lambda prefix: PrefixStore(shared[inner_kind], f"runs/{prefix}", close_inner=False),
        "counting": lambda prefix: CountingStore(fresh_inner(prefix)),
        "faults": lambda prefix: FaultInjectingStore(fresh_inner(prefix), []),
    }
    return Backend(name, makers[wrapper])


@pytest.fixture(params=BACKEND_NAMES + WRAPPED)
def leg(
    request: pytest.FixtureRequest, shared_inner: dict[str, Store], tmp_path_factory: pytest.TempPathFactory
) -> Backend:
    if request.param in WRAPPED:
        return _wrapped_leg(request.param, shared_inner, str(tmp_path_factory.getbasetemp() / "wrapped"))
    return request.getfixturevalue(f"backend_{request.param}")


class TestStoreContract(StoreContract):
    @pytest.fixture
    def make_store(self, leg: Backend) -> Callable[[], Store]:
        return leg.new_store

    @pytest.fixture
    def store_gaps(self, leg: Backend) -> dict[str, str]:
        return leg.gaps

    @pytest.fixture
    def make_missing_bucket_store(self, leg: Backend) -> Callable[[], Store] | None:
        return leg.missing_bucket
