"""How a coroutine runs a long blocking step (a large copy, a ``ray.put``).

On an event loop shared with other tasks, such a step goes to a worker thread
so the loop stays responsive. On a private loop whose only caller is blocked
waiting for the result (the blocking facade's way in, see ``_runtime``), a
thread hop only adds latency: the step runs inline. The runtime marks that
case with :func:`caller_blocked`; the transports ask :func:`inline_allowed`.
The fact lives here, below the transports, so that they never import the
runtime that sets it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import anyio

__all__ = ["caller_blocked", "inline_allowed", "run_blocking"]

T = TypeVar("T")


# Below this size a step runs inline even on a shared loop: a thread hop
# would cost more than the step.
INLINE_BYTES = 1 << 20

_caller_blocked: ContextVar[bool] = ContextVar("weightsync_caller_blocked", default=False)


@contextmanager
def caller_blocked() -> Iterator[None]:
    """Mark coroutines run in this context as awaited by a blocked caller on
    a loop of their own."""
    token = _caller_blocked.set(True)
    try:
        yield
    finally:
        _caller_blocked.reset(token)


def inline_allowed() -> bool:
    """True when nothing else can run on this loop while a step blocks it."""
    return _caller_blocked.get()


async def run_blocking(nbytes: int, func: Callable[..., T], *args: object) -> T:
    """Run ``func(*args)``, a step that moves ``nbytes``, to completion.

    Inline when it is small or the caller is blocked anyway; otherwise in a
    worker thread. Never abandoned midway, whether the caller's cancel scope
    or its task (``task.cancel()``) is cancelled: a copy abandoned halfway
    would race the next one, or write memory that its owner frees. A
    cancellation waits for the step to end, then goes on.
    """
    if nbytes <= INLINE_BYTES or _caller_blocked.get():
        return func(*args)
    loop = asyncio.get_running_loop()
    # anyio's shield keeps its own scopes' cancellation out; asyncio.shield
    # keeps a plain task.cancel() from abandoning the thread's work.
    with anyio.CancelScope(shield=True):
        step = loop.run_in_executor(None, func, *args)
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            while not step.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([step])
            raise
    raise AssertionError("unreachable")  # for type checkers: the block returns or raises
