"""A trainer that ends frees its workers: however it ends (an exception,
Ctrl-C, an asyncio trainer returning, a send still under way), its
channels close before Python waits for its child processes, each worker's
next ``receive()`` raises ``SenderClosedError``, and the trainer's process
exits within seconds, its workers with it. Real trainers and workers, in
processes of their own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.programs import TESTS_DIR, program

ROOT = Path(__file__).resolve().parent.parent
# From the moment the trainer is where it ends: what its exit, and its
# workers', may take (each interpreter tears torch down: about 1.5 s here).
EXIT_WITHIN = 5.0


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no longer does)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _run_until_ending(
    cmd: list[str], cwd: Path, *, env: dict[str, str] | None = None, interrupt: bool = False
) -> tuple[float, int, str, list[int]]:
    """Start ``cmd``; once it prints ``ending <worker pids>``, time how long
    it takes to exit (``interrupt``: SIGINT to it alone first). Returns
    (seconds, exit status, stderr, the worker pids)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = next((line for line in proc.stdout if line.startswith("ending")), None)
        if line is None:
            proc.wait(30)
            pytest.fail(f"the trainer never got to its end:\n{proc.stderr.read()}")
        pids = [int(p) for p in line.split()[1:]]
        if interrupt:
            time.sleep(0.3)  # in its send loop
            os.kill(proc.pid, signal.SIGINT)  # the trainer alone, not its workers
        ended = time.monotonic()
        try:
            status = proc.wait(EXIT_WITHIN + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the trainer did not exit within {EXIT_WITHIN + 30} s")
        return time.monotonic() - ended, status, proc.stderr.read(), pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _check(seconds: float, pids: list[int], stderr: str) -> None:
    assert seconds < EXIT_WITHIN, f"the trainer took {seconds:.1f} s to exit:\n{stderr[-3000:]}"
    assert len(pids) == 2
    deadline = time.monotonic() + 2
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, pids)), f"a worker outlived the trainer: {[p for p in pids if _alive(p)]}"


def _quickstart() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0] + "\n"


def test_the_quickstart_with_a_line_that_raises_exits_within_seconds_with_its_workers(tmp_path: Path) -> None:
    source = _quickstart()
    anchor = next(line for line in source.splitlines() if 'print(f"version' in line)
    indent = anchor[: len(anchor) - len(anchor.lstrip())]
    raising = (
        f"{anchor}\n{indent}print('ending', *[p.pid for p in procs], flush=True)\n"
        f"{indent}raise RuntimeError('a line that raises')"
    )
    script = tmp_path / "quickstart.py"
    script.write_text(source.replace(anchor, raising, 1))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    seconds, status, stderr, pids = _run_until_ending([sys.executable, str(script)], tmp_path, env=env)
    assert status == 1 and "a line that raises" in stderr, stderr[-3000:]
    _check(seconds, pids, stderr)


# (Each mode starts three interpreters: in the extended run, beside the
# quickstart and Ctrl-C cases of the default one.)
@pytest.mark.extended
@pytest.mark.parametrize("mode", ["raise", "pending", "async", "dropped"])
def test_a_trainer_that_ends_without_shutdown_frees_its_workers(mode: str) -> None:
    seconds, status, stderr, pids = _run_until_ending(program("exiting_trainer", mode), TESTS_DIR)
    assert status == (0 if mode in ("async", "dropped") else 1), stderr[-3000:]
    assert "Traceback" not in stderr or "the trainer failed" in stderr, stderr[-3000:]
    _check(seconds, pids, stderr)


def test_ctrl_c_to_the_trainer_alone_frees_its_workers() -> None:
    seconds, _, stderr, pids = _run_until_ending(
        program("exiting_trainer", "sigint"), TESTS_DIR, interrupt=True
    )
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    _check(seconds, pids, stderr)
