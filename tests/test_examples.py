"""The examples run as they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["async_trainer.py", "sync_collectors.py"])
def test_example_runs(name: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--workers", "2", "--steps", "6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    assert result.stdout.count("worker") + result.stdout.count("collector") >= 2
    if name == "sync_collectors.py":
        final = int(result.stdout.split("final version ")[1].split()[0])
        assert result.stdout.count(f"last version {final}") == 2, result.stdout
