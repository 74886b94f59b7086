"""Harness modules that run as programs of their own: the trainers and
workers that a test starts on an emulated host, or interrupts with a
signal (:mod:`.ray_cluster_trainer`, :mod:`.distributed_cluster_trainer`,
:mod:`.distributed_workers`, :mod:`.interrupted_trainer`).

Each runs as ``python -m harness.<module>`` from the tests' directory
(:data:`TESTS_DIR`, the ``cwd`` of the process): ``-m`` puts that
directory on the program's path, so it imports the harness as the tests
do, and a Ray driver started so passes it on to its workers (Ray adds the
driver's working directory to theirs).
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The directory of the test files and of the ``harness`` package.
TESTS_DIR = Path(__file__).resolve().parent.parent


def program(module: str, *args: str, python_options: tuple[str, ...] = ()) -> list[str]:
    """The command line that runs the harness module ``module`` as a program
    with ``args`` (``python_options`` go to the interpreter, e.g. ``-X
    faulthandler``); start it with ``cwd=TESTS_DIR``."""
    return [sys.executable, *python_options, "-m", f"harness.{module}", *args]
