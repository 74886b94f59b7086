"""What can be known about a peer process on this host once it is gone:
how it ended (its exit status or signal), and the words that say so. The
pipe transport's channel and the torch.distributed transport's liveness
link both name a dead worker this way."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import signal
import time

__all__ = ["describe_exit", "exit_status", "started_here"]


# How long a lost peer's exit status may take to show once its pipe closed:
# it closes its descriptors before it becomes a zombie, and a fork server
# reports its children's status a moment after reaping them.
_STATUS_WAIT = 0.25


def started_here(pid: int) -> multiprocessing.process.BaseProcess | None:
    """The ``multiprocessing`` Process object of ``pid`` if this process
    started it (by any start method; a fork server's children are not our
    children, but their Process objects still learn how they ended)."""
    # multiprocessing keeps the unjoined children of this process here.
    for process in list(getattr(multiprocessing.process, "_children", ())):
        if process.pid == pid:
            return process
    return None


def _status_now(
    pid: int, process: multiprocessing.process.BaseProcess | None
) -> tuple[int | None, int | None] | None:
    """(exit code, signal) of process ``pid`` if it ended and this process can
    tell; None otherwise."""
    code: int | None = None
    if process is not None:
        with contextlib.suppress(ValueError):  # the user closed the Process object
            code = process.exitcode
    if code is not None:
        return (code, None) if code >= 0 else (None, -code)
    try:
        # Our child: read its status without reaping it (its Process object
        # or the user's waitpid still gets it).
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except OSError:  # not our child
        info = None
    if info is not None:
        if info.si_code == os.CLD_EXITED:
            return info.si_status, None
        return None, info.si_status
    # A zombie of another parent: /proc still has its wait status (field 52).
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        if fields[0] == b"Z" and len(fields) > 49:
            status = int(fields[49])
            return ((status >> 8) & 0xFF, None) if status & 0x7F == 0 else (None, status & 0x7F)
    except (OSError, ValueError, IndexError):
        pass
    return None


def exit_status(
    pid: int, process: multiprocessing.process.BaseProcess | None = None
) -> tuple[int | None, int | None]:
    """(exit code, signal) of a peer that is gone, waiting briefly for it to
    show; (None, None) when it cannot be told (or it still runs)."""
    deadline = time.monotonic() + _STATUS_WAIT
    while True:
        found = _status_now(pid, process)
        if found is not None:
            return found
        if time.monotonic() >= deadline or not _may_tell(pid, process):
            return None, None
        time.sleep(0.01)


def _may_tell(pid: int, process: multiprocessing.process.BaseProcess | None) -> bool:
    """Whether waiting can still bring the status: the process still exists
    (running, or a zombie), or its Process object will learn it."""
    if process is not None:
        with contextlib.suppress(ValueError):  # closed: it will never tell
            process.is_alive()
            return True
    return os.path.exists(f"/proc/{pid}")


def describe_exit(exit_code: int | None, exit_signal: int | None) -> str:
    if exit_signal is not None:
        try:
            name = signal.Signals(exit_signal).name
        except ValueError:
            name = f"signal {exit_signal}"
        if exit_signal == signal.SIGKILL:
            return f"it was killed by {name} (a kill -9, or the out-of-memory killer)"
        return f"it was killed by {name}"
    if exit_code is not None:
        return f"it exited with status {exit_code}"
    return ""
