"""Which event loop weightsync's steps run on.

weightsync's coroutines run on asyncio (uvloop included) only: the loops
that async RL trainers, Ray's async actors and inference servers run are
asyncio's, and the transports wait on descriptors (pipes, pidfds) with the
loop's own readers. :func:`require_asyncio` refuses any other anyio backend
with a clear error instead of half-working there.

A step that can also run with no loop at all (a worker's ``receive()``
whose update is already pending) says :data:`NEEDS_LOOP` where it cannot
after all, having changed nothing.
"""

from __future__ import annotations

import asyncio
import enum

from ._exceptions import WeightSyncStateError

__all__ = ["NEEDS_LOOP", "NeedsLoop", "require_asyncio", "thread_runs_a_loop"]


class NeedsLoop(enum.Enum):
    NEEDS_LOOP = "needs the event loop"


#: Returned by a step tried on the calling thread without an event loop (a
#: receive whose update is pending) where the
#: coroutine must run instead; the step changed nothing.
NEEDS_LOOP = NeedsLoop.NEEDS_LOOP


def thread_runs_a_loop() -> bool:
    """Whether the calling thread is running an asyncio loop now. Never raises."""
    # (asyncio's own test without raising: every blocking call asks, and a
    # RuntimeError raised and caught costs ten times the question.)
    return asyncio._get_running_loop() is not None


def require_asyncio(model_id: str | None = None) -> None:
    """Check that the running coroutine is on an asyncio loop.

    :raises WeightSyncStateError: it runs under another async library
        (trio, say); nothing was started.
    """
    try:
        asyncio.get_running_loop()
        return
    except RuntimeError:
        pass
    try:  # every other async library (trio) depends on sniffio, which names it
        import sniffio

        library = sniffio.current_async_library()
    except Exception:
        library = "another async library, or outside any event loop"
    raise WeightSyncStateError(
        f"weightsync's coroutines run on asyncio (or uvloop) only, not under {library}: "
        "await them from an asyncio loop, or call the blocking sender and receiver "
        "(scheme.get_sender(), scheme.receive()) from a worker thread",
        model_id=model_id,
    )
