"""Peak extra memory of processes during a bench case, from Linux's RSS
high-water mark.

Method (:data:`weightsync.bench._types.MEMORY_METHOD`): before the case,
each process's peak RSS is reset (``5`` written to ``/proc/<pid>/clear_refs``,
Linux 4.0 on) and its current RSS (``VmRSS``) read; after the case, its peak
(``VmHWM``) is read. The extra memory is ``VmHWM after - VmRSS before``. RSS
counts every resident page the process maps, shared-memory pages included,
so a page shared by several processes counts once in each. Where the reset
is refused, the figure is the growth of the lifetime peak (``method`` says
``vmhwm-lifetime``), which understates a case that stayed under an earlier
one's peak; where ``/proc`` is missing, or for a process on another machine
(a Ray actor on another node), the figures are ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._types import PeakMemory

__all__ = ["PeakMemoryProbe"]


def _status_kib(pid: int | None, key: str) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_peak(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


class PeakMemoryProbe:
    """``start()`` before a case, ``stop()`` after it, which returns the case's
    :class:`PeakMemory`. ``pids[0]`` is the trainer, the rest its workers;
    None for a worker not on this machine."""

    def __init__(self, pids: Sequence[int | None]) -> None:
        self.pids = list(pids)
        self._before: list[int | None] = []
        self._reset = True

    def start(self) -> None:
        self._reset = all([_reset_peak(pid) for pid in self.pids if pid is not None])
        self._before = []
        for pid in self.pids:
            rss = _status_kib(pid, "VmRSS")
            if not self._reset:
                hwm = _status_kib(pid, "VmHWM")
                rss = None if rss is None or hwm is None else max(rss, hwm)
            self._before.append(rss)

    def stop(self) -> PeakMemory:
        extra: list[int | None] = []
        for pid, before in zip(self.pids, self._before, strict=True):
            peak = _status_kib(pid, "VmHWM")
            extra.append(None if peak is None or before is None else max(peak - before, 0) * 1024)
        if all(e is None for e in extra):
            method = "unavailable"
        else:
            method = "vmhwm-reset" if self._reset else "vmhwm-lifetime"
        return PeakMemory(method, extra[0], extra[1:])
