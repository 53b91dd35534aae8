from __future__ import annotations

import pytest

# Placeholder until the backend lands: the fixtures skip with the reason.


@pytest.fixture(scope="session")
def backend_gcs():
    pytest.skip("GCS backend not written yet")
