"""The Python blocks of README.md and docs/*.md run as they are written.

Every fenced ```python block is taken from the documents. Its first line
says what is done with it:

- ``# fragment`` (optionally followed by ``: why``, such as
  ``# fragment: needs torchrl``): a piece of a larger program. It is compiled
  (so a syntax error fails), never run.
- ``# extended`` (optionally followed by ``: why``, such as
  ``# extended: needs Ray``): a complete script that is run, as below, only
  under ``pytest -m extended`` (it starts Ray, or takes longer).
- anything else: a complete script. README's first block (the quickstart)
  runs in the default run; the others under ``pytest -m extended`` (a CI
  step), to keep the default run short.

A block that is run is written to a file of a temporary directory and run
there with this interpreter, in a subprocess of its own, with the
repository's root first on ``PYTHONPATH`` (so it imports this tree's
weightsync); it passes when it exits with status 0 within its time limit.
Blocks that need torchrl or several hosts are fragments.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FRAGMENT = "# fragment"
EXTENDED = "# extended"
# Seconds a block may run (a few interpreters that import torch, on a loaded machine).
BLOCK_TIMEOUT = 150
README_MAX_LINES = 400

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[A-Za-z0-9_+-]*)[ \t]*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    source: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        first = self.source.lstrip("\n").split("\n", 1)[0].strip()
        for marker, kind in ((FRAGMENT, "fragment"), (EXTENDED, "extended")):
            if first == marker or first.startswith(marker + ":"):
                return kind
        return "run"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, in order."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if opening["lang"] == "python":
            source = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            blocks.append(Block(path, i + 1, source))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


def _param(block: Block) -> object:
    quickstart = block is next(b for b in BLOCKS if b.path.name == "README.md")
    marks = [] if quickstart and block.kind == "run" else [pytest.mark.extended]
    return pytest.param(block, id=block.id, marks=marks)


def test_the_documents_have_python_blocks_and_the_quickstart_runs() -> None:
    readme = [block for block in BLOCKS if block.path.name == "README.md"]
    assert readme, "no ```python block found in README.md"
    assert readme[0].kind == "run", f"the quickstart ({readme[0].id}) must run in the default run"


def test_the_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS])
def test_every_block_compiles(block: Block) -> None:
    compile(block.source, block.id, "exec")


@pytest.mark.timeout(BLOCK_TIMEOUT + 30)
@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS if b.kind != "fragment"])
def test_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.source)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    # A block's ray.init() starts a Ray of its own, as it says, even where the
    # tests' own Ray cluster runs on this machine (ray.init() would join it).
    env["RAY_ADDRESS"] = "local"
    try:
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id} did not finish within {BLOCK_TIMEOUT} s\n{exc.stdout}\n{exc.stderr}")
    output = f"{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, f"{block.id} exited with {result.returncode}\n{output}"
