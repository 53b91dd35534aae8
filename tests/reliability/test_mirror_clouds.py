"""Multi-cloud durability, end to end on the emulators: a job with ``mirror=`` on another cloud
(S3 -> GCS and GCS -> S3) commits, its checkpoints are re-committed on the mirror in the
background, then the primary's server goes away (its proxy is stopped: connections refused) and
a restarting job restores the last checkpoint from the mirror, bit for bit, loudly, through
``CheckpointManager`` -- instead of failing (no mirror) or losing work.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from objckpt.errors import TransientError  # noqa: E402
from objckpt.metrics import CheckpointMetrics  # noqa: E402
from objckpt.reader import Reader  # noqa: E402
from objckpt.store import open_store  # noqa: E402
from objckpt.training.manager import CheckpointManager  # noqa: E402
from objckpt.training.state import TrainingProgress  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

#: the primary's retry budget: how long "down" takes to be believed (the default is 120 s)
PRIMARY_DEADLINE = 2


@pytest.fixture(scope="module")
def moto() -> Iterator[Any]:
    from objckpt.testing.s3_servers import MotoServer, ServerStartError, create_bucket

    try:
        srv = MotoServer().start()
    except ServerStartError as exc:
        pytest.skip(f"moto server unavailable: {exc}")
    try:
        create_bucket(srv.endpoint_url, "mirror-s3")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def gcs() -> Iterator[Any]:
    mod = pytest.importorskip("objckpt.testing.gcs_server", reason="GCS emulator launcher not available")
    pytest.importorskip("objckpt.store.gcs", reason="GCS backend not available")
    try:
        srv = mod.FakeGcsServer().start()
    except mod.ServerStartError as exc:
        pytest.skip(f"fake-gcs-server unavailable: {exc}")
    try:
        srv.create_bucket("mirror-gcs")
        yield srv
    finally:
        srv.stop()


def _uri(kind: str, server: Any, endpoint: str, prefix: str, **extra: Any) -> str:
    from urllib.parse import urlencode

    if kind == "s3":
        options = {**server.store_options, "endpoint_url": endpoint, **extra}
        return f"s3://mirror-s3/{prefix}?{urlencode(options)}"
    return f"gs://mirror-gcs/{prefix}?{urlencode({'endpoint_url': endpoint, **extra})}"


def _state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return {"model": model, "optimizer": opt, "progress": TrainingProgress()}


def _train(state: dict[str, Any], steps: int) -> None:
    for _ in range(steps):
        state["model"](torch.randn(8, 16)).pow(2).mean().backward()
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        state["progress"].global_step += 1


def _params(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


@pytest.mark.parametrize("primary_kind, mirror_kind", [("s3", "gcs"), ("gcs", "s3")])
def test_a_job_restores_from_the_mirror_while_the_primary_is_down(
    moto: Any, gcs: Any, primary_kind: str, mirror_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    from objckpt.testing.chaos_proxy import ChaosProxy

    servers = {"s3": moto, "gcs": gcs}
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    upstream = servers[primary_kind].endpoint_url
    proxy = ChaosProxy(upstream, fault_rate=0.0, flavor="gcs" if primary_kind == "gcs" else "s3").start()
    try:
        primary = _uri(
            primary_kind, servers[primary_kind], proxy.endpoint_url, prefix, deadline=PRIMARY_DEADLINE
        )
        mirror = _uri(mirror_kind, servers[mirror_kind], servers[mirror_kind].endpoint_url, prefix)

        state = _state(0)
        metrics = CheckpointMetrics()
        with CheckpointManager(
            primary, mirror=mirror, mirror_policy="wait", keep_last=2, metrics=metrics
        ) as mgr:
            for step in (10, 20, 30):
                _train(state, 10)
                assert mgr.save(step, state) is not None
            saved = _params(state)
        # close() waited for the mirror: every commit is there, committed by the protocol
        snap = metrics.snapshot()
        assert snap["mirrored"] == 3 and snap["mirrored_step"] == 30 and snap["mirror_failures"] == 0
        with open_store(mirror) as m:
            assert Reader(m).steps() == [20, 30]  # the job's retention applies there too
            assert Reader(m).check(Reader(m).load(30)) == []

        proxy.stop()  # the primary's server is gone: connections are refused from now on
        with pytest.raises(TransientError):
            open_store(primary, check=True)

        fresh = _state(1)
        assert any(not torch.equal(v, saved[k]) for k, v in _params(fresh).items())
        restarted = CheckpointMetrics()
        with caplog.at_level(logging.WARNING, logger="objckpt"):
            with CheckpointManager(primary, mirror=mirror, on_save_error="warn", metrics=restarted) as mgr:
                assert mgr.restore(fresh) == 30
                for name, value in _params(fresh).items():
                    assert torch.equal(value, saved[name]), name  # bit for bit
                assert fresh["progress"].global_step == 30
                # training goes on; saves to the dead primary fail loudly, not fatally
                _train(fresh, 10)
                assert mgr.save(40, fresh) is None
        text = caplog.text
        assert "UNREACHABLE" in text and "RESTORED FROM THE MIRROR" in text and "CHECKPOINT NOT SAVED" in text
        assert restarted.snapshot()["restores_from_mirror"] == 1

        # without a mirror the outage is an error (never a silent fallback, never lost work)
        with pytest.raises(TransientError):
            CheckpointManager(primary)
    finally:
        proxy.stop()
