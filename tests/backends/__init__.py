"""Backends the store contract suite (and protocol tests) run against.

Each backend module registers a *session* fixture named ``backend_<name>`` that yields a
:class:`Backend`: a factory of fresh, empty stores (a unique prefix per call, so tests never see
each other's objects) plus the gaps the backend is known to have. A gap is a contract case the
backend's server does not implement (e.g. moto does not verify part checksums): the contract test
marks itself ``xfail(strict=True)`` with the reason, so the gap is recorded and a fixed gap turns
the run red instead of passing vacuously.

Backends that need a server they cannot start here ``pytest.skip`` with the reason.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from objckpt.store import Store
from objckpt.testing.contract import (  # the gap ids live with the shipped contract suite
    GAP_ATOMIC_CONDITIONALS,
    GAP_CONDITIONAL_COMPLETE,
    GAP_PART_CHECKSUM,
)

#: names in the order the contract suite parametrises over them
BACKEND_NAMES = ["memory", "file", "s3_moto", "s3_localstack", "s3_env", "gcs"]

__all__ = [
    "BACKEND_NAMES",
    "GAP_ATOMIC_CONDITIONALS",
    "GAP_CONDITIONAL_COMPLETE",
    "GAP_PART_CHECKSUM",
    "Backend",
]


@dataclass
class Backend:
    name: str
    make: Callable[[str], Store]  # make(unique_prefix) -> empty store rooted there
    gaps: dict[str, str] = field(default_factory=dict)  # gap id -> reason
    uri_for: Callable[[str], str] | None = None  # unique_prefix -> run-root URI (CLI tests)
    missing_bucket: Callable[[], Store] | None = None  # a store on a bucket that does not exist

    def new_store(self, **_: object) -> Store:
        return self.make(f"t-{uuid.uuid4().hex[:12]}")

    def new_root(self) -> tuple[str, Store]:
        """A unique run-root URI and a store opened on it (for CLI / subprocess tests)."""
        prefix = f"t-{uuid.uuid4().hex[:12]}"
        if self.uri_for is None:
            raise RuntimeError(f"backend {self.name} has no URI form")
        return self.uri_for(prefix), self.make(prefix)
