"""``plan`` outside Young/Daly's assumptions, ``-o`` scoped per side of ``cp``, and ``demo``
without its packages."""

from __future__ import annotations

from types import SimpleNamespace

from objckpt.reader import Reader
from objckpt.store import open_store

from .conftest import REPO, commit_step, run_cli

# ------------------------------------------------------------------------------ plan


def test_plan_refuses_an_interval_shorter_than_the_save():
    r = run_cli("plan", "--save", "1h", "--mtbf", "1h")
    assert r.rc == 2 and r.out == ""
    assert "shorter than the save itself" in r.err and "49.6min" in r.err
    assert len(r.err.strip().splitlines()) == 1


def test_plan_warns_when_the_save_is_not_small_against_the_mtbf():
    r = run_cli("plan", "--save", "10min", "--mtbf", "1h")
    assert r.rc == 0, r.err
    assert "warning:" in r.err and "not small against the MTBF" in r.err
    assert "recommended" in r.out
    d = run_cli("plan", "--save", "10min", "--mtbf", "1h", "--json").json()
    assert d["warnings"] and d["infeasible"] is False
    quiet = run_cli("plan", "--save", "12s")
    assert quiet.rc == 0 and "warning" not in quiet.err
    assert run_cli("plan", "--save", "12s", "--json").json()["warnings"] == []


# ------------------------------------------------------------------------------ -o per side


def test_cp_option_accepted_by_neither_side_names_the_per_side_flags(tmp_path):
    src = f"file://{tmp_path}/src"
    commit_step(open_store(src), 1, world_size=1, names=("m",), size=10)
    r = run_cli("cp", src, f"file://{tmp_path}/dst", "-o", "endpoint_url=http://127.0.0.1:9")
    assert r.rc == 2
    assert "endpoint_url" in r.err and "--src-option/--dst-option" in r.err
    assert "file://" in r.err
    # a global -o before the command is scoped the same way
    r = run_cli("-o", "region=x", "cp", src, f"file://{tmp_path}/dst")
    assert r.rc == 2 and "--src-option/--dst-option" in r.err


def test_cp_common_option_applies_to_both_sides(tmp_path):
    src = f"file://{tmp_path}/src"
    commit_step(open_store(src), 1, world_size=1, names=("m",), size=10)
    dst = f"file://{tmp_path}/dst"
    r = run_cli("cp", src, dst, "-o", "part_size=64KiB", "-o", "max_attempts=3")
    assert r.rc == 0, r.err
    assert Reader(open_store(dst)).steps() == [1]


def test_accepted_options_prefers_store_options_for(monkeypatch):
    from objckpt import store
    from objckpt.cli import _accepted_options

    assert {"part_size", "deadline", "max_attempts"} <= _accepted_options("file")
    assert "endpoint_url" not in _accepted_options("file")
    assert "endpoint_url" in _accepted_options("gs") or "endpoint_url" in _accepted_options("s3")
    specs = [SimpleNamespace(name="alpha"), SimpleNamespace(name="beta")]
    monkeypatch.setattr(store, "options_for", lambda scheme: specs, raising=False)
    assert _accepted_options("file") == {"alpha", "beta"}


# ------------------------------------------------------------------------------ demo


def test_demo_without_moto_names_the_extra(tmp_path):
    """A `moto` that cannot be imported (as when objckpt[dev] is not installed)."""
    shadow = tmp_path / "shadow" / "moto"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'moto'\", name='moto')\n")
    r = run_cli("demo", env={"PYTHONPATH": f"{shadow.parent}:{REPO}"})
    assert r.rc == 2, (r.out, r.err)
    assert "moto" in r.err and "pip install 'objckpt[dev" in r.err
    assert "ServerStartError" not in r.out + r.err


def test_missing_requirements_maps_import_errors_to_extras(monkeypatch):
    from objckpt import demo

    real = demo.importlib.import_module

    def fake_import_module(name, *args, **kwargs):
        if name.split(".")[0] in ("moto", "flask"):
            raise ImportError(f"No module named {name!r}", name=name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(demo.importlib, "import_module", fake_import_module)
    problem = demo.missing_requirements()
    assert problem is not None and "moto (the embedded S3 server)" in problem
    assert "pip install 'objckpt[dev" in problem
    monkeypatch.setattr(demo.importlib, "import_module", lambda name, *a, **k: object())
    assert demo.missing_requirements() is None  # everything importable: nothing to say
