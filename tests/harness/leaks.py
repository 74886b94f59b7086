"""What a test checks is left behind: weightsync's threads, descriptors,
/dev/shm entries."""

from __future__ import annotations

import os
import threading


def weightsync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("weightsync", "AnyIO"))]


def _family() -> set[int]:
    """This process and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    family, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        family.add(pid)
        todo.extend(children.get(pid, []))
    return family


def _held_by_others(names: set[str]) -> set[str]:
    """Of ``names`` (entries of /dev/shm), those mapped by a process outside
    this test's process tree: another program's, not this test's leak."""
    family, held = _family(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in family:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        held |= {name for name in names if f"/dev/shm/{name}" in maps}
    return held


def shm_entries() -> set[str]:
    """The entries of /dev/shm, less those another program on the machine
    holds (its multiprocessing semaphores come and go meanwhile)."""
    try:
        names = set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()
    return names - _held_by_others(names)


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def fd_baseline() -> set[int]:
    """Open descriptors once the loop machinery has run once in this process.

    uvloop keeps two process-wide descriptors from its first loop on (not one
    per loop), multiprocessing keeps one pipe to its resource tracker and
    one socket to its fork server, and the first TCPStore of a process
    leaves a process-wide pipe (libuv's): none is weightsync's to close.
    """
    import datetime
    from multiprocessing import forkserver, resource_tracker

    import anyio
    import torch.distributed as dist

    resource_tracker.ensure_running()
    forkserver.ensure_running()
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=1)
    )
    del store

    from weightsync._runtime import RUNTIME as LOOP

    LOOP.acquire()
    try:
        LOOP.portal().call(anyio.sleep, 0)
    finally:
        LOOP.release()
    return open_fds()
