"""In-process checks of the CLI's small pure helpers (the commands are tested through the real
console script in the other modules)."""

from __future__ import annotations

import pytest

from objckpt import cli
from objckpt.errors import (
    ChecksumMismatchError,
    CommitConflict,
    ConfigError,
    ManifestError,
    NoCheckpointError,
    NotFoundError,
    PermissionDeniedError,
    TransientError,
)


@pytest.mark.parametrize(
    "target, uri, step",
    [
        ("s3://b/run", "s3://b/run", None),
        ("s3://b/run@20", "s3://b/run", 20),
        ("s3://b/run@latest", "s3://b/run", None),
        ("file:///tmp/a@b/run@7", "file:///tmp/a@b/run", 7),
        ("s3://b/run@20?endpoint_url=http://h:9000", "s3://b/run?endpoint_url=http://h:9000", 20),
        ("s3://b/run?endpoint_url=http://h:9000@20", "s3://b/run?endpoint_url=http://h:9000", 20),
    ],
)
def test_split_step(target, uri, step):
    assert cli.split_step(target) == (uri, step)


def test_split_step_rejects_garbage():
    with pytest.raises(cli.CliError) as e:
        cli.split_step("s3://b/run@-1")
    assert e.value.code == cli.EXIT_USAGE


def test_redact():
    text = "s3://b/r?access_key_id=AKIA1&secret_access_key=s3cr3t&session_token=tok&region=x"
    out = cli.redact(text)
    assert "AKIA1" not in out and "s3cr3t" not in out and "tok&" not in out and "region=x" in out


@pytest.mark.parametrize(
    "exc, code",
    [
        (ConfigError("x"), 2),
        (ValueError("x"), 2),
        (NoCheckpointError("x"), 3),
        (NotFoundError("x"), 3),
        (ChecksumMismatchError("x"), 1),
        (ManifestError("x"), 1),
        (CommitConflict("x"), 1),
        (PermissionDeniedError("x"), 4),
        (TransientError("x"), 4),
        (RuntimeError("x"), 1),
    ],
)
def test_exit_codes(exc, code):
    assert cli.exit_code_for(exc) == code


def test_main_returns_codes_in_process(capsys):
    assert cli.main(["--version"]) == 0
    assert cli.main(["ls"]) == 2  # argparse: missing URI
    assert cli.main(["plan", "--save", "12s", "--json"]) == 0
    assert '"daly_interval_seconds"' in capsys.readouterr().out


@pytest.mark.parametrize(
    "uri, prefix, child",
    [
        ("s3://b/runs?endpoint_url=http://h:9000", "eta/", "s3://b/runs/eta?endpoint_url=http://h:9000"),
        ("s3://b", "team/eta/", "s3://b/team/eta"),
        ("file:///tmp/runs/", "a/", "file:///tmp/runs/a"),
        ("memory://name", "x/", "memory://name/x"),
        ("gs://b/runs", "", "gs://b/runs"),
    ],
)
def test_child_uri(uri, prefix, child):
    from objckpt.cli._common import child_uri

    assert child_uri(uri, prefix) == child


def test_rm_refusal_rules_are_one_function():
    from objckpt.cli._manage import RmFacts, rm_refusals

    facts = dict(head=30, pointer_step=30, newest_valid=20, retention=None)
    assert len(rm_refusals(RmFacts(step=30, **facts))) == 2
    assert rm_refusals(RmFacts(step=20, **facts)) == [
        "it is the newest valid checkpoint (what a restore uses)"
    ]
    assert rm_refusals(RmFacts(step=10, **facts)) == []
    assert rm_refusals(RmFacts(step=10, **{**facts, "retention": "pinned"})) == ["retention keeps it: pinned"]
