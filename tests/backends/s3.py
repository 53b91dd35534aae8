from __future__ import annotations

import pytest

# Placeholder until the backend lands: the fixtures skip with the reason.


@pytest.fixture(scope="session")
def backend_s3_moto():
    pytest.skip("S3 backend not written yet")


@pytest.fixture(scope="session")
def backend_s3_localstack():
    pytest.skip("S3 backend not written yet")


@pytest.fixture(scope="session")
def backend_s3_env():
    pytest.skip("S3 backend not written yet")
