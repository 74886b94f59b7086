"""The progress line of ``weightsync bench`` on stderr: cases done / total,
the current case, and an estimate of the time left.

The estimate weighs each case by the work it does, ``(sends + references) x
(bytes x (workers + 1) + 1 MiB x workers)`` (the bytes it copies, and a fixed
cost per worker and send), and scales the seconds the finished cases took
by the weight left. On a terminal the line is redrawn in place (``\\r``);
elsewhere (``--progress`` into a file or pipe) each update is its own line.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TextIO

from ._types import MIB, BenchConfig, Case

__all__ = ["Progress"]


def _weight(case: Case, config: BenchConfig) -> float:
    rounds = config.warmup + config.repeats + max(config.repeats, 6)
    return rounds * (case.nbytes * (case.workers + 1) + MIB * case.workers)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"


class Progress:
    """Call :meth:`start` before each case and :meth:`clear` before writing
    anything else to the terminal; :meth:`finish` at the end."""

    def __init__(self, stream: TextIO, cases: Sequence[Case], config: BenchConfig) -> None:
        self.stream = stream
        self.cases = list(cases)
        self.weights = [_weight(case, config) for case in self.cases]
        self.tty = stream.isatty()
        self._began: float | None = None
        self._shown = False

    def start(self, index: int, case: Case) -> None:
        now = time.perf_counter()
        if self._began is None:
            self._began = now
        done = sum(self.weights[:index])
        if index == 0 or done <= 0:
            left = "estimating time left"
        else:
            rate = (now - self._began) / done
            left = f"~{_duration(rate * sum(self.weights[index:]))} left"
        line = (
            f"[{index}/{len(self.cases)} done] {case.scheme} {case.size_mib:g} MiB, "
            f"{case.workers} worker(s), {case.tensors} tensors, {case.dtype}; {left}"
        )
        if self.tty:
            self.stream.write("\r\x1b[K" + line)
            self._shown = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def finish(self) -> None:
        self.clear()
