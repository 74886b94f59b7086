"""What the interpreter's exit closes: the trainer's open channels, before
Python waits for its child processes.

A trainer that ends without ``shutdown()`` (it returned, an exception
escaped, Ctrl-C) would otherwise hang: ``multiprocessing`` joins every
child at exit, and a worker blocked in its ``receive()`` loop never hears
that the trainer is gone, since the trainer's process, and so its end of
each pipe, is still there. Each scheme initialised as a sender is tracked
here (weakly) and closed by one ``atexit`` hook, which runs before
``multiprocessing``'s: ``atexit`` runs its hooks last registered first, and
``multiprocessing.util`` (imported here) registered its own when it was
first imported.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401  (its exit hook must be registered before ours)
import threading
import weakref
from typing import Protocol

__all__ = ["ClosesAtExit", "close_at_exit"]

_log = logging.getLogger("weightsync")


class ClosesAtExit(Protocol):
    def _close_at_exit(self) -> None:
        """Close without waiting for any worker's answer. Never raises."""


_open: weakref.WeakSet[ClosesAtExit] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def close_at_exit(owner: ClosesAtExit) -> None:
    """Have ``owner._close_at_exit()`` called when the interpreter exits,
    if ``owner`` is still alive then. Never blocks."""
    global _registered
    with _lock:
        _open.add(owner)
        if not _registered:
            atexit.register(_at_exit)
            _registered = True


def _at_exit() -> None:
    with _lock:
        owners = list(_open)
        _open.clear()
    for owner in owners:
        try:
            owner._close_at_exit()
        except BaseException as exc:  # exit goes on for the others, whatever one raised
            _log.warning("weightsync: closing %r at exit failed: %r", owner, exc)
