"""README.md tells the truth: its ``python`` blocks run, its tables match the code.

Every ```` ```python ```` block is executed, in order, in one namespace (as a doctest would: later
blocks use what earlier ones defined), after :data:`SETUP` defines the stand-ins a README assumes
(``model``, ``opt``, ``sched``, ``dataset``, ``train_one_step``, ``total_steps``). Run roots are
redirected: ``s3://BUCKET/...`` and ``gs://BUCKET/...`` become ``file://<tmp>/BUCKET/...`` (same
path, same query string), and relative paths land in a temporary working directory.

A block is skipped, with the reason, when

* its first line is ``# requires: pkg, ...`` and one of those packages is not installed (it runs
  whenever they are), or
* its fence is ```` ```python notest <reason> ````.

The store-options table must be what ``scripts/readme_options.py`` generates; the credential
options must be explained; the dependency table must name every package ``pyproject.toml``
declares; the command-line section may only show commands the CLI has.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import sys
import textwrap
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

SETUP = textwrap.dedent(
    """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    dataset = torch.utils.data.TensorDataset(torch.randn(9600, 8), torch.randn(9600, 4))
    total_steps = 300

    def train_one_step(batch=None):
        x, y = batch if batch is not None else (torch.randn(4, 8), torch.randn(4, 4))
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    """
)

#: stand-ins a block that requires a package uses, defined before its first such block
REQUIRES_SETUP = {
    "transformers": textwrap.dedent(
        """
        import transformers as _tf

        torch.manual_seed(0)
        llm = _tf.LlamaForCausalLM(_tf.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
        llm_opt = torch.optim.AdamW(llm.parameters(), lr=1e-3)
        """
    ),
}

#: checks after a block ran (what its comments claim), by a substring of the block
AFTER = {
    "AutoModelForCausalLM.from_pretrained": "assert all(torch.equal(reloaded.state_dict()[k], v) "
    "for k, v in llm.state_dict().items())",
    "start_http_server": "exporter.stop_http_server()",
}

_URI = re.compile(r"\b(?:s3|gs)://([A-Za-z0-9][A-Za-z0-9._-]*)/")


@dataclass
class Block:
    line: int
    info: list[str]
    code: str
    skip: str | None = None
    requires: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"README.md:{self.line}"


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, info string, body) of every fenced block."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info = i + 1, lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append((start, info, "\n".join(lines[i + 1 : j]) + "\n"))
            i = j + 1
        else:
            i += 1
    return out


def python_blocks() -> list[Block]:
    blocks = []
    for line, info, code in fenced_blocks(README.read_text()):
        words = info.split()
        if not words or words[0] != "python":
            continue
        block = Block(line, words, code)
        if "notest" in words[1:]:
            reason = " ".join(words[words.index("notest") + 1 :]) or "marked notest"
            block.skip = f"{block.id}: {reason}"
        first = code.lstrip().splitlines()[0] if code.strip() else ""
        m = re.match(r"#\s*requires:\s*(.+)", first)
        if m:
            block.requires = [p.strip() for p in m.group(1).split(",") if p.strip()]
            missing = [p for p in block.requires if importlib.util.find_spec(p) is None]
            if missing and block.skip is None:
                block.skip = f"{block.id} needs {', '.join(missing)} (not installed)"
        blocks.append(block)
    return blocks


BLOCKS = python_blocks()


class Runner:
    """Runs the blocks in order, once each, in one namespace (a test asks for block ``i``: the
    blocks before it run first)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ns: dict[str, Any] = {"__name__": "__readme__"}
        self.done = 0
        self.failed: dict[int, str] = {}
        self.prepared: set[str] = set()
        exec(compile(SETUP, "<readme setup>", "exec"), self.ns)

    def rewrite(self, code: str) -> str:
        return _URI.sub(lambda m: f"file://{self.root}/{m.group(1)}/", code)

    def run_until(self, index: int) -> None:
        while self.done <= index:
            i, self.done = self.done, self.done + 1
            block = BLOCKS[i]
            if block.skip is not None:
                continue
            try:
                for pkg in block.requires:
                    if pkg in REQUIRES_SETUP and pkg not in self.prepared:
                        exec(compile(REQUIRES_SETUP[pkg], f"<readme setup for {pkg}>", "exec"), self.ns)
                        self.prepared.add(pkg)
                exec(compile(self.rewrite(block.code), block.id, "exec"), self.ns)
                for marker, check in AFTER.items():
                    if marker in block.code:
                        exec(compile(check, f"{block.id} (check)", "exec"), self.ns)
            except BaseException:  # noqa: BLE001 - reported by the block's own test
                self.failed[i] = traceback.format_exc()


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("torch")
    work = tmp_path_factory.mktemp("readme")
    (work / "cwd").mkdir()
    old = os.getcwd()
    os.chdir(work / "cwd")
    try:
        yield Runner(work / "roots")
    finally:
        os.chdir(old)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[b.id for b in BLOCKS])
def test_python_block_runs(runner: Runner, index: int) -> None:
    block = BLOCKS[index]
    if block.skip is not None:
        pytest.skip(block.skip)
    runner.run_until(index)
    earlier = [BLOCKS[i].id for i in sorted(runner.failed) if i < index]
    if index in runner.failed:
        note = f" (after earlier failures at {', '.join(earlier)})" if earlier else ""
        pytest.fail(f"{block.id} raised{note}:\n{runner.failed[index]}", pytrace=False)


def test_the_readme_has_python_blocks_and_every_skip_says_why() -> None:
    assert len(BLOCKS) >= 8
    for b in BLOCKS:
        assert b.skip is None or len(b.skip) > len(b.id) + 2, b


def test_the_five_line_loop_is_five_lines() -> None:
    first = BLOCKS[0].code.strip().splitlines()
    body = [ln for ln in first if ln.strip() and not ln.startswith(("from ", "import "))]
    assert body[0].startswith("ckpt = CheckpointManager(")
    loop = body[body.index(next(ln for ln in body if ln.startswith("state = "))) + 1 :]
    assert len(loop) == 4 and loop[1].startswith("for "), loop  # restore, for, train, save


# --------------------------------------------------------------------------------- the tables


def _section(title: str) -> str:
    text = README.read_text()
    assert f"\n## {title}\n" in text, f"README.md has no section {title!r}"
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _options_script() -> dict[str, Any]:
    return runpy.run_path(str(REPO / "scripts" / "readme_options.py"), run_name="readme_options")


def test_store_options_table_lists_every_option() -> None:
    from objckpt.errors import ConfigError

    script = _options_script()
    try:
        generated = script["table"]()
    except ConfigError as exc:  # a backend's SDK is not installed
        pytest.skip(f"cannot list every backend's options: {exc}")
    assert script["current"](README.read_text()) == generated, (
        "README.md's store-options table is stale: run python scripts/readme_options.py --write"
    )
    from objckpt.store import options_for

    names = {o.name for s in ("memory", "file", "s3", "gs") for o in options_for(s)}
    for name in names:
        assert f"| `{name}` |" in generated


def test_credential_options_say_when_to_use_them_and_prefer_the_sdk_chain() -> None:
    from objckpt.errors import ConfigError
    from objckpt.store import options_for

    try:
        options = [o for s in ("s3", "gs") for o in options_for(s)]
    except ConfigError as exc:
        pytest.skip(f"cannot list every backend's options: {exc}")
    section = _section("Run roots and options")
    paragraph = section.split("**Credentials", 1)[1].split("\n\n", 1)[0]
    assert "default chain" in paragraph and "prefer" in paragraph.lower()
    credentials = {o.name for o in options if o.secret} | {"anonymous"}
    assert credentials >= {"access_key_id", "secret_access_key", "session_token", "credentials"}
    for name in credentials:
        assert f"`{name}`" in paragraph, f"the credentials paragraph does not say when to use {name}"


def _base_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_dependency_table_names_every_declared_package() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_base_name(r) for r in project["dependencies"]}
    for reqs in project["optional-dependencies"].values():
        declared |= {_base_name(r) for r in reqs if not r.startswith("objckpt[")}
    rows = [ln for ln in _section("Why each dependency is there").splitlines() if ln.startswith("| ")]
    assert rows[0].startswith("| package |")
    rows = rows[1:]
    documented: set[str] = set()
    for row in rows:
        cell = row.split("|")[1]
        cell = re.sub(r"\(extras? [^)]*\)", "", cell)
        documented |= {_base_name(name) for name in cell.split(",") if name.strip()}
    missing = sorted(declared - documented)
    assert not missing, f"README.md does not say why these dependencies are there: {missing}"


def test_command_line_section_shows_only_real_commands() -> None:
    from objckpt.cli import build_parser

    section = _section("Command line")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    commands = set(sub.choices)
    shown = {m.group(1) for m in re.finditer(r"^objckpt (\w+)", section, re.MULTILINE)}
    assert shown and shown <= commands, sorted(shown - commands)
    assert "export" in shown


def test_two_setup_commands_come_first() -> None:
    text = README.read_text()
    first = text.split("\n## ", 2)[1]
    assert first.startswith("Two commands")
    assert "scripts/demo.sh" in first and "scripts/test.sh" in first
