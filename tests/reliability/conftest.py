"""Backends of the crash / corruption / concurrency / hostile-input matrix.

Each leg opens run roots by URI (so a crash worker subprocess can open the same root): file://
under a temporary directory, S3 on a moto server started for the module, and S3 on LocalStack
(the faithful S3) when ``scripts/localstack.sh`` installed it -- skipped, with the reason,
otherwise. moto accepts 64 KiB parts here so multipart paths run with small shards; LocalStack,
like S3, insists on 5 MiB.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from .harness import Leg, file_leg, localstack_unavailable, s3_leg

MATRIX_BACKENDS = [
    "file",
    "s3_moto",
    pytest.param("s3_localstack", marks=[pytest.mark.localstack, pytest.mark.slow]),
]


@pytest.fixture(scope="session")
def file_backend(tmp_path_factory: pytest.TempPathFactory) -> Leg:
    return file_leg(str(tmp_path_factory.mktemp("reliability-file")))


@pytest.fixture(scope="session")
def moto_backend() -> Iterator[Leg]:
    from objckpt.testing.s3_servers import MotoServer, ServerStartError

    try:
        srv = MotoServer(min_part_size=64 * 1024).start()
    except ServerStartError as exc:
        pytest.skip(f"moto server unavailable: {exc}")
    try:
        yield s3_leg("s3_moto", srv, f"rel-{uuid.uuid4().hex[:8]}")
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def localstack_backend() -> Iterator[Leg]:
    why = localstack_unavailable()
    if why:
        pytest.skip(why)
    from objckpt.testing.s3_servers import LocalStackServer, ServerStartError

    try:
        srv = LocalStackServer().start()
    except ServerStartError as exc:
        pytest.skip(f"LocalStack did not start: {str(exc)[:300]}")
    try:
        yield s3_leg("s3_localstack", srv, f"rel-{uuid.uuid4().hex[:8]}", min_part_size=5 * 1024 * 1024)
    finally:
        srv.stop()


@pytest.fixture(params=MATRIX_BACKENDS)
def mleg(request: pytest.FixtureRequest) -> Leg:
    """Every matrix backend in turn."""
    name = {"file": "file_backend", "s3_moto": "moto_backend", "s3_localstack": "localstack_backend"}
    return request.getfixturevalue(name[request.param])
