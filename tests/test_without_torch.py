"""Without torch: ``import objckpt`` works, and the torch integration says which extra to install
(``pip install 'objckpt[torch]'``) instead of a bare ``ModuleNotFoundError``.

Each case runs in a fresh interpreter where ``torch`` cannot be imported (``sys.modules['torch']
= None``, which is what Python does for a package that is absent).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_SHIM = "import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"


def run_without_torch(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _SHIM + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    [
        "from objckpt import CheckpointManager",
        "import objckpt; objckpt.CheckpointManager",
        "from objckpt import save_sharded",
        "from objckpt import TrainingProgress",
    ],
)
def test_the_torch_integration_names_the_extra(statement: str) -> None:
    out = run_without_torch(
        f"""
        import json
        try:
            {statement}
        except ImportError as exc:
            print(json.dumps({{"type": type(exc).__name__, "message": str(exc), "name": exc.name}}))
        else:
            print(json.dumps({{"type": None}}))
        """
    )
    assert out["type"] == "ModuleNotFoundError"  # still an ImportError for code that catches one
    assert "pip install 'objckpt[torch]'" in out["message"]
    assert out["name"] == "torch"


def test_the_torch_free_core_still_imports() -> None:
    out = run_without_torch(
        """
        import json
        import objckpt
        from objckpt import Reader, open_store, CheckpointMetrics
        store = open_store("memory://t")
        print(json.dumps({"latest": Reader(store).latest(), "version": objckpt.__version__}))
        """
    )
    assert out["latest"] is None and out["version"]


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    out = run_without_torch(
        """
        import json
        import objckpt
        try:
            objckpt.NoSuchThing
        except AttributeError as exc:
            print(json.dumps({"message": str(exc)}))
        """
    )
    assert "NoSuchThing" in out["message"]


def test_cli_export_without_torch_says_which_extra(tmp_path: Path) -> None:
    out = run_without_torch(
        f"""
        import contextlib, io, json
        from objckpt.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["export", "file://{tmp_path}/run", "{tmp_path}/m.safetensors"])
        print(json.dumps({{"code": code, "stderr": err.getvalue()}}))
        """
    )
    assert out["code"] == 2
    assert "pip install 'objckpt[torch]'" in out["stderr"]
