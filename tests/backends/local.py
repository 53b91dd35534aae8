from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import Backend


@pytest.fixture(scope="session")
def backend_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    pytest.importorskip("objckpt.store.local", reason="file:// backend not written yet")
    from objckpt.store import open_store

    root = tmp_path_factory.mktemp("file-store")
    yield Backend(
        "file",
        lambda prefix: open_store(f"file://{root}/{prefix}"),
        uri_for=lambda prefix: f"file://{root}/{prefix}",
    )
