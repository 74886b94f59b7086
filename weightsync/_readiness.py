"""Readiness: waiting, in the running asyncio loop or on a blocked thread,
until descriptors turn readable or a process on this host exits.

Below every transport and the sender: the sender's gather of a send's acks,
the pipe channel and the torch.distributed liveness link all wait this way.
asyncio only (see ``_loops.require_asyncio``): the loop's ``add_reader``
costs less than anyio's per-descriptor waits, on every send's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from collections.abc import Iterator

__all__ = ["ProcessWatch", "ReadyWatch", "wait_readable_any"]


async def wait_readable_any(fds: list[int], timeout: float | None) -> None:
    """Wait until one of ``fds`` is readable or ``timeout`` seconds pass
    (None: no limit; the caller's cancel scope bounds it). Cancellable. The
    caller checks which, if any, happened."""
    loop = asyncio.get_running_loop()  # asyncio only: see _loops.require_asyncio
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    # A timer handle, not a cancel scope: this wait is on every send's path,
    # and a scope costs more than the rest of the wait. None where the
    # caller's deadline is a scope of its own (a send's acks).
    timer = None if timeout is None else loop.call_later(timeout, wake)
    for fd in fds:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if timer is not None:
            timer.cancel()
        for fd in fds:
            loop.remove_reader(fd)


class ReadyWatch:
    """Waits, in the running asyncio loop, until one of a changing set of
    descriptors is readable, and tells which: a send's gather watches every
    worker's pipe and pidfd at once, in one waiter.

    The descriptors sit in an epoll set of its own, kept from gather to
    gather, and only that set's descriptor is registered with the loop, once
    per gather (:meth:`armed`): the gather wakes once per ack, and on a
    machine with few cores the loop's own registrations (a waiter per
    worker, or a reader per descriptor) cost more than the acks.
    Readiness is level-triggered, so data that came between a poll and the
    next :meth:`wait` still wakes it.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._fds: set[int] = set()
        # The descriptor tuples kept since the last drop(), by identity (the
        # tuples themselves are held, so an id is never another's).
        self._kept: dict[int, tuple[int, ...]] = {}
        self._woken: asyncio.Future[None] | None = None

    def _wake(self) -> None:
        if self._woken is not None and not self._woken.done():
            self._woken.set_result(None)

    @contextlib.contextmanager
    def armed(self) -> Iterator[ReadyWatch]:
        """Registered with the running loop for :meth:`wait` (asyncio only:
        see ``_loops.require_asyncio``) while inside. (:meth:`poll` needs
        no loop.)"""
        loop = asyncio.get_running_loop()
        loop.add_reader(self._epoll.fileno(), self._wake)
        try:
            yield self
        finally:
            loop.remove_reader(self._epoll.fileno())

    def keep(self, fds: tuple[int, ...]) -> None:
        """Watch ``fds`` (and those still watched): they stay registered
        from gather to gather, so that a send to the same workers registers
        nothing. A number that now names another descriptor (the one
        registered closed, and the kernel dropped it) is registered again:
        ``modify`` tells the two apart (ENOENT). A channel hands the same
        tuple object for as long as its descriptors stay open (a new one
        once they change: ``PipeChannel.fds``), so a tuple kept before costs
        no system call."""
        if self._kept.get(id(fds)) is fds:
            return  # this very tuple was kept since the last drop()
        epoll = self._epoll
        for fd in fds:
            try:
                epoll.modify(fd, select.EPOLLIN)
            except FileNotFoundError:
                epoll.register(fd, select.EPOLLIN)
                self._fds.add(fd)
        self._kept[id(fds)] = fds

    def drop(self, fds: set[int]) -> None:
        """Stop watching ``fds`` (ready, but no longer waited for)."""
        self._kept.clear()
        for fd in fds:
            self._fds.discard(fd)
            with contextlib.suppress(OSError):  # closed meanwhile: the kernel dropped it
                self._epoll.unregister(fd)

    def poll(self, timeout: float) -> set[int]:
        """Block this thread up to ``timeout`` seconds until a watched
        descriptor is readable; those that are (or closed, or in error;
        empty: none came). ``poll(0)`` after :meth:`wait` says which."""
        return {fd for fd, _ in self._epoll.poll(timeout)}

    async def wait(self) -> None:
        """Until a watched descriptor is readable (at once if one is). No
        limit of its own: the caller's cancel scope bounds it."""
        self._woken = asyncio.get_running_loop().create_future()
        try:
            await self._woken
        finally:
            self._woken = None

    def close(self) -> None:
        self._epoll.close()


class ProcessWatch:
    """Tells whether another process on this host is still alive.

    Uses a pidfd where the kernel has them (exact, immune to pid reuse) and
    ``/proc/<pid>/stat`` otherwise; a zombie counts as dead.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    @property
    def fd(self) -> int | None:
        """A descriptor that becomes readable when the process exits, if any."""
        return self._pidfd

    def alive(self) -> bool:
        if self._pidfd is not None:
            readable, _, _ = select.select([self._pidfd], [], [], 0)
            return not readable
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in (b"Z", b"X")

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
