"""What the interpreter's exit closes: the trainer's open channels, before
Python waits for its child processes.

A trainer that ends without ``shutdown()`` (it returned, an exception
escaped, Ctrl-C) would otherwise hang: ``multiprocessing`` joins every
child at exit, and a worker blocked in its ``receive()`` loop never hears
that the trainer is gone, since the trainer's process, and so its end of
each pipe, is still there. Each scheme initialised as a sender is held
here (its sender, and weakly the scheme that drives it) until it is
closed, and closed by one ``atexit`` hook if it is still open then, which
runs before ``multiprocessing``'s: ``atexit`` runs
its hooks last registered first, and ``multiprocessing.util`` (imported
here) registered its own when it was first imported.

The sender is held, not weakly tracked: a scheme the trainer no longer
refers to (made in a function that returned) may be gone while its
channels, in a reference cycle, still hold the pipes open; holding the
sender keeps the one object that can close them.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401  (its exit hook must be registered before ours)
import os
import threading
import weakref
from typing import Protocol

__all__ = ["ClosesAtExit", "close_at_exit", "closed", "front_of"]

_log = logging.getLogger("weightsync")


class ClosesAtExit(Protocol):
    def _close_at_exit(self) -> None:
        """Close without waiting for any worker's answer. Never raises."""


# What is still open, by the identity of the object that closes it: that
# object (held), and the front a user drives it by (a scheme, weakly: it
# closes it best, a send under way included), if any.
_open: dict[int, tuple[ClosesAtExit, weakref.ref[ClosesAtExit] | None]] = {}
_lock = threading.Lock()
_registered = False


def close_at_exit(owner: ClosesAtExit, front: ClosesAtExit | None = None) -> None:
    """Hold ``owner`` until :func:`closed`, and have it closed when the
    interpreter exits if it is still open then: by ``front._close_at_exit()``
    if ``front`` is still alive, else by ``owner._close_at_exit()``. Never blocks."""
    global _registered
    with _lock:
        _open[id(owner)] = (owner, None if front is None else weakref.ref(front))
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def front_of(owner: ClosesAtExit, front: ClosesAtExit) -> None:
    """``front`` now drives ``owner`` (held until :func:`closed` already)."""
    with _lock:
        if id(owner) in _open:
            _open[id(owner)] = (owner, weakref.ref(front))


def closed(owner: ClosesAtExit) -> None:
    """``owner`` closed itself: let go of it. Never blocks."""
    with _lock:
        _open.pop(id(owner), None)


def _forget_in_child() -> None:
    """A forked child does not own its parent's senders: its exit must not
    close the parent's channels (the descriptors it inherited)."""
    global _lock
    _lock = threading.Lock()
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _at_exit() -> None:
    with _lock:
        entries = list(_open.values())
        _open.clear()
    for owner, front in entries:
        closer = (front() if front is not None else None) or owner
        try:
            closer._close_at_exit()
        except BaseException as exc:  # exit goes on for the others, whatever one raised
            _log.warning("weightsync: closing %r at exit failed: %r", closer, exc)
