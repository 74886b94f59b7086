"""The examples run as they are (all three at once: each spends most of its
time starting interpreters that import torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

# Interpreters that import torch, several at once: CI runs these in a step of
# their own (pytest -m extended).
pytestmark = pytest.mark.extended

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUNS = {
    "async_trainer.py": ["--workers", "2", "--steps", "6"],
    "sync_collectors.py": ["--workers", "2", "--steps", "6"],
    "versioned_batches.py": ["--workers", "2", "--steps", "12"],
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, subprocess.CompletedProcess[str]]:
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(EXAMPLES / name), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in RUNS.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


@pytest.mark.parametrize("name", ["async_trainer.py", "sync_collectors.py"])
def test_example_runs(name: str, outputs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = outputs[name]
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    assert result.stdout.count("worker") + result.stdout.count("collector") >= 2
    if name == "sync_collectors.py":
        final = int(result.stdout.split("final version ")[1].split()[0])
        assert result.stdout.count(f"last version {final}") == 2, result.stdout


def test_every_batch_stamp_is_a_version_sent_and_never_goes_back(
    outputs: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    result = outputs["versioned_batches.py"]
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    sent = set(ast.literal_eval(result.stdout.split("sent versions ")[1].splitlines()[0]))
    stamps: dict[int, list[int]] = {}
    for line in result.stdout.splitlines():
        if line.startswith("collector "):
            who, version = line.removeprefix("collector ").split(": batch of version ")
            stamps.setdefault(int(who), []).append(int(version))
    assert set(stamps) == {0, 1}, result.stdout
    for versions in stamps.values():
        assert set(versions) <= sent
        assert versions == sorted(versions)  # never decreases
        assert len(versions) > 3
