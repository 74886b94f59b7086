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


# -- the documents agree with each other, and name tests that exist ----------------

# The one table of which weightsync scheme works in which torchrl collector.
COLLECTOR_TABLE = (ROOT / "docs" / "usage.md", "### Which scheme works in which torchrl collector")
TESTS = ROOT / "tests"

_SCHEME = re.compile(r"\b(?:MultiProcess|SharedMem|Ray|Distributed|InProcess|No)WeightSyncScheme\b")
# torchrl's multi-process collectors share a column; older torchrl names included.
_COLLECTORS = {
    "multi-process collectors": re.compile(r"\bMulti[Aa]?[Ss]ync(?:Data)?Collector\b"),
    "RayCollector": re.compile(r"\bRayCollector\b"),
    "DistributedCollector": re.compile(r"\bDistributed(?:Data)?Collector\b"),
}
# A scheme named as torchrl's own (torchrl's `X`, torchrl 0.14.1's own `X`) is not weightsync's.
_TORCHRLS = re.compile(r"torchrl(?: [\d.]+)?'s (?:own )?`?$")
_NEGATIVE = re.compile(
    r"\b(?:not offered|not supported|unsupported|does not work|do not work|doesn't work|don't work|"
    r"cannot be used|can't be used|not tested|untested|not available)\b",
    re.IGNORECASE,
)
_POSITIVE = re.compile(r"\b(?:works?|tested|supported|offered)\b", re.IGNORECASE)
_FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*(\[])")


@dataclass(frozen=True)
class Cell:
    """One cell of the collector table: ``tested`` (naming ``tests``) or not."""

    tested: bool
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Claim:
    """What a clause of a document says of a (scheme, collector) pair:
    that it works or is tested (``positive``), or the opposite."""

    scheme: str
    collector: str
    positive: bool
    where: str
    text: str


def _collector_of(text: str) -> str | None:
    return next((name for name, pattern in _COLLECTORS.items() if pattern.search(text)), None)


def _table_lines(text: str, heading: str) -> list[str]:
    """The lines of the first Markdown table under ``heading``."""
    lines = text.splitlines()
    start = lines.index(heading)
    rows: list[str] = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def collector_table(text: str, heading: str) -> dict[tuple[str, str], Cell]:
    """The collector table under ``heading``: a row per scheme, a column per
    torchrl collector; each cell ``tested: `test_a`, `test_b``` (with
    anything between ``tested`` and the colon) or ``not tested``.

    :raises ValueError: the table is not of that form.
    """
    header, _rule, *rows = _table_lines(text, heading)
    columns = [_collector_of(cell) for cell in _cells(header)[1:]]
    if None in columns or len(set(columns)) != len(_COLLECTORS):
        raise ValueError(f"the table's columns are not one per collector: {header}")
    table: dict[tuple[str, str], Cell] = {}
    for row in rows:
        first, *cells = _cells(row)
        scheme = _SCHEME.search(first)
        if scheme is None or len(cells) != len(columns):
            raise ValueError(f"not a row of a scheme: {row}")
        for collector, cell in zip(columns, cells, strict=True):
            assert collector is not None
            if cell == "not tested":
                table[scheme[0], collector] = Cell(False, ())
            elif cell.startswith("tested") and ":" in cell:
                names = tuple(re.findall(r"`(test_\w+)`", cell.split(":", 1)[1]))
                table[scheme[0], collector] = Cell(True, names)
            else:
                raise ValueError(f"a cell is neither 'tested: ...' nor 'not tested': {cell!r}")
    return table


def _sentences(text: str) -> list[tuple[int, str]]:
    """The prose of a Markdown text as (line, sentence): code blocks left
    out; a table row, a heading or a list item starts a sentence of its own."""
    text = _FENCED.sub(lambda m: "\n" * m[0].count("\n"), text)
    paragraphs: list[tuple[int, list[str]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped:
            paragraphs.append((number, []))
        elif stripped.startswith(("|", "#", "- ", "* ")) or re.match(r"\d+\. ", stripped):
            paragraphs.append((number, [stripped]))
            if stripped.startswith(("|", "#")):
                paragraphs.append((number, []))
        elif paragraphs and paragraphs[-1][1]:
            paragraphs[-1][1].append(stripped)
        else:
            paragraphs.append((number, [stripped]))
    return [
        (number, sentence)
        for number, lines in paragraphs
        if lines
        for sentence in _SENTENCE_END.split(" ".join(lines))
    ]


def scheme_collector_claims(text: str, where: str) -> list[Claim]:
    """Every clause (a sentence, or its part between semicolons) that names
    weightsync schemes and torchrl collectors and says they work or are
    tested (anywhere in its sentence), or that they do not or are not (in
    the clause itself): a claim for each scheme and collector it names."""
    claims: list[Claim] = []
    for line, sentence in _sentences(text):
        positive = bool(_POSITIVE.search(_NEGATIVE.sub("", sentence)))
        for clause in sentence.split(";"):
            schemes = {m[0] for m in _SCHEME.finditer(clause) if not _TORCHRLS.search(clause[: m.start()])}
            collectors = {name for name, pattern in _COLLECTORS.items() if pattern.search(clause)}
            negative = bool(_NEGATIVE.search(clause))
            if not (schemes and collectors and (negative or positive)):
                continue
            claims += [
                Claim(scheme, collector, not negative, f"{where}:{line}", clause.strip())
                for scheme in sorted(schemes)
                for collector in sorted(collectors)
            ]
    return claims


def contradictions(table: dict[tuple[str, str], Cell], claims: list[Claim]) -> list[str]:
    """The claims that the collector table contradicts: one that says a
    tested pair does not work (or is not tested), or that a pair the table
    has not tested works or is tested."""
    found = []
    for claim in claims:
        cell = table.get((claim.scheme, claim.collector))
        if cell is None:
            found.append(
                f"{claim.where}: {claim.scheme} in {claim.collector} is not in the table: {claim.text}"
            )
        elif cell.tested != claim.positive:
            said = "works or is tested" if claim.positive else "does not work or is not tested"
            table_says = "tested" if cell.tested else "not tested"
            found.append(
                f"{claim.where}: says {claim.scheme} in {claim.collector} {said}; the table: {table_says}: "
                f"{claim.text}"
            )
    return found


def _defined_tests(source: str) -> set[str]:
    return set(re.findall(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test_\w+)", source, re.MULTILINE))


def missing_tests(table: dict[tuple[str, str], Cell], tests_source: str) -> list[str]:
    """The tests that a ``tested`` cell names (or a cell that names none)
    and ``tests_source`` does not define."""
    defined = _defined_tests(tests_source)
    missing = []
    for (scheme, collector), cell in table.items():
        if cell.tested and not cell.tests:
            missing.append(f"{scheme} in {collector}: 'tested' names no test")
        missing += [f"{scheme} in {collector}: {name}" for name in cell.tests if name not in defined]
    return missing


def _collector_table() -> dict[tuple[str, str], Cell]:
    path, heading = COLLECTOR_TABLE
    return collector_table(path.read_text(), heading)


def test_the_collector_table_has_a_row_per_scheme_and_names_tests_that_exist() -> None:
    table = _collector_table()
    schemes = {scheme for scheme, _ in table}
    assert schemes == {
        f"{s}WeightSyncScheme" for s in ("MultiProcess", "SharedMem", "Ray", "Distributed", "InProcess", "No")
    }
    assert len(table) == len(schemes) * len(_COLLECTORS)
    assert missing_tests(table, (TESTS / "test_torchrl.py").read_text()) == []


def test_no_document_contradicts_the_collector_table() -> None:
    table = _collector_table()
    path, heading = COLLECTOR_TABLE
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        if document == path:  # the table itself is no claim about itself
            for row in _table_lines(text, heading):
                text = text.replace(row, "")
        found += contradictions(table, scheme_collector_claims(text, str(document.relative_to(ROOT))))
    assert found == [], "\n".join(found)


def test_the_collector_table_check_can_fail() -> None:
    table = _collector_table()
    # A sentence that once stood in guarantees.md, and a claim of a pair never tested.
    contradicting = (
        "One is `test_ray_weight_sync_copy_preserves_config_and_resets_runtime`, which reads torchrl's\n"
        "private Ray-scheme state (so weightsync's `RayWeightSyncScheme` is not offered for torchrl's\n"
        "`RayCollector`); one is the asynchronous collector's.\n\n"
        "- `MultiProcessWeightSyncScheme` works in `DistributedCollector` too.\n"
    )
    found = contradictions(table, scheme_collector_claims(contradicting, "text"))
    assert len(found) == 2, found
    assert "text:1: says RayWeightSyncScheme in RayCollector does not work" in found[0]
    assert "text:5: says MultiProcessWeightSyncScheme in DistributedCollector works" in found[1]
    # torchrl's own schemes, and sentences that claim nothing, are not claims.
    harmless = (
        "torchrl 0.14.1's own `MultiProcessWeightSyncScheme` mixed versions in `MultiAsyncCollector`.\n"
        '`RayWeightSyncScheme`\'s default strategy is `"tensordict"`, as `RayCollector` extracts it.\n'
    )
    assert scheme_collector_claims(harmless, "text") == []
    # A table whose cell names a test that does not exist, or none.
    heading = "### Which"
    bad = (
        f"{heading}\n\n| scheme | `MultiSyncCollector` | `RayCollector` | `DistributedCollector` |\n"
        "|---|---|---|---|\n"
        "| `RayWeightSyncScheme` | not tested | tested: `test_that_was_renamed` | tested |\n"
    )
    with pytest.raises(ValueError, match="neither"):
        collector_table(bad, heading)
    bad = bad.replace("| tested |", "| tested: nothing |")
    assert missing_tests(collector_table(bad, heading), "def test_other():\n    pass\n") == [
        "RayWeightSyncScheme in RayCollector: test_that_was_renamed",
        "RayWeightSyncScheme in DistributedCollector: 'tested' names no test",
    ]


# A test named in a document: `test_file.py::test_name`, `tests/test_file.py`,
# or a bare `test_name` (of the file named before it in the same sentence).
_NAMED_TEST = re.compile(
    r"`(?:tests/)?(?P<file>test_\w+\.py)(?:::(?P<name>test_\w+))?(?:\[[^\]`]*\])?`|`(?P<bare>test_\w+)`"
)


def named_tests_missing(text: str, tests: Path) -> list[str]:
    """The tests and test files that ``text`` names and ``tests`` lacks."""
    missing = []
    every = set().union(*(_defined_tests(f.read_text()) for f in tests.glob("test_*.py")))
    for match in _NAMED_TEST.finditer(text):
        file, name, bare = match["file"], match["name"], match["bare"]
        if bare is not None:
            if bare not in every:
                missing.append(bare)
        elif not (tests / file).is_file():
            missing.append(file)
        elif name is not None and name not in _defined_tests((tests / file).read_text()):
            missing.append(f"{file}::{name}")
    return missing


def test_every_test_named_in_the_guarantees_exists() -> None:
    text = (ROOT / "docs" / "guarantees.md").read_text()
    assert len(_NAMED_TEST.findall(text)) > 40
    assert named_tests_missing(text, TESTS) == []


def test_the_named_test_check_can_fail() -> None:
    text = "Held by `test_conformance.py::test_no_such_thing`, `test_gone_too` and `tests/test_nowhere.py`."
    assert named_tests_missing(text, TESTS) == [
        "test_conformance.py::test_no_such_thing",
        "test_gone_too",
        "test_nowhere.py",
    ]
