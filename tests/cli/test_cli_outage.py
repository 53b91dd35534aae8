"""An outage is a store error (exit 4), never a failed verification (1) or a fallback to an older
checkpoint: the server unreachable past the retry budget, or failing only the shard requests."""

from __future__ import annotations

import json
import socket
import uuid
from urllib.parse import urlencode

import pytest

from objckpt.store import open_store

from .conftest import commit_step, run_cli

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "ysecretvalue"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nobody listens there


@pytest.mark.parametrize("command", ["verify", "ls", "latest", "show", "runs"])
def test_unreachable_server_exits_4_naming_endpoint_and_bucket(command):
    pytest.importorskip("objckpt.store.s3", reason="s3:// backend not installed")
    port = _closed_port()
    uri = f"s3://outage-bucket/run?endpoint_url=http://127.0.0.1:{port}&deadline=2&max_attempts=2"
    r = run_cli(command, uri, env=FAKE_CREDENTIALS)
    assert r.rc == 4, (r.rc, r.out, r.err)
    assert f"127.0.0.1:{port}" in r.err and "outage-bucket" in r.err
    assert "ysecretvalue" not in r.out + r.err and "Traceback" not in r.err
    j = run_cli(command, uri, "--json", env=FAKE_CREDENTIALS)
    assert j.rc == 4 and json.loads(j.out)["error"]["exit_code"] == 4


@pytest.fixture
def behind_proxy(moto):
    """Steps 1 and 2 on moto; a URI that reaches moto through a proxy failing every shard
    request (HEAD and GET under data/) with 500, past the retry budget."""
    from objckpt.testing.chaos_proxy import ChaosProxy

    prefix = f"runs/{uuid.uuid4().hex[:8]}"
    store = open_store(moto.uri("cli-bucket", prefix))
    for step in (1, 2):
        commit_step(store, step, size=2000)
    store.close()
    with ChaosProxy(moto.endpoint_url, fault_rate=0.0) as proxy:
        proxy.inject("internal", phase="before", path_contains="/data/", times=10_000)
        options = {
            **moto.store_options,
            "endpoint_url": proxy.endpoint_url,
            "deadline": "2",
            "max_attempts": "2",
        }
        yield f"s3://cli-bucket/{prefix}?{urlencode(options)}", proxy


@pytest.mark.parametrize(
    "args",
    [("latest",), ("ls",), ("verify",), ("verify", "@1"), ("show",), ("runs",)],
    ids=lambda a: "-".join(a),
)
def test_shard_outage_is_not_damage(behind_proxy, args, tmp_path):
    uri, proxy = behind_proxy
    command, *rest = args
    target = uri.replace("?", f"{rest[0]}?", 1) if rest else uri
    r = run_cli(command, target)
    assert r.rc == 4, (r.rc, r.out, r.err)  # not 1 (bad object), not a fallback to step 1
    assert "DAMAGED" not in r.out and "cli-bucket" in r.err
    assert proxy.stats["internal"] > 0


def test_cp_during_a_shard_outage_exits_4(behind_proxy, tmp_path):
    uri, _ = behind_proxy
    r = run_cli("cp", uri, f"file://{tmp_path}/dst")
    assert r.rc == 4, (r.rc, r.out, r.err)
