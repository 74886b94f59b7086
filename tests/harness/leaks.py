"""What a test checks is left behind: weightsync's threads, descriptors,
/dev/shm entries."""

from __future__ import annotations

import os
import re
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


# Names weightsync would give a named shared-memory entry. Its segments are
# memfds (no name anywhere), so one of these in /dev/shm is a defect.
OWN_NAMES = ("weightsync",)
# torch's file_system sharing names its files ``torch_<pid>_...`` after the
# process that made them.
_TORCH_NAME = re.compile(r"torch_(\d+)_")


def _held_by(pids: set[int], names: set[str]) -> set[str]:
    """Of ``names`` (entries of /dev/shm), those that a process of ``pids``
    maps or holds open."""
    held: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            links = []
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:
            continue
        opened = "\n".join(links)
        held |= {name for name in names if f"/dev/shm/{name}" in maps or f"/dev/shm/{name}" in opened}
    return held


def shm_entries() -> set[str]:
    """The entries of /dev/shm that are this test's: named as weightsync
    would name one, made by torch in a process of this test's process tree
    (the trainer and its workers), or mapped or held open by one of them.

    Other programs on the machine come and go in /dev/shm meanwhile (a
    multiprocessing semaphore, ``sem.mp-...``, stays named but unmapped
    until its resource tracker removes it), and are no leak of this test's:
    the check counts only what it can attribute.
    """
    try:
        names = set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()
    family = _family()
    own = {name for name in names if name.startswith(OWN_NAMES)}
    for name in names:
        made_by = _TORCH_NAME.match(name)
        if made_by and int(made_by.group(1)) in family:
            own.add(name)
    return own | _held_by(family, names - own)


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
