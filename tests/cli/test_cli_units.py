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
