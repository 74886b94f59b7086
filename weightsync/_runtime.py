"""How a blocking call enters an event loop: the one module that knows.

Two ways in, one coroutine core:

- A blocking call (``send()``, ``receive()``) runs its coroutine to the end on
  a private asyncio loop of the calling thread, created once per thread. The
  caller is blocked anyway, so no other thread needs to be woken: on a 2-core
  machine a hop into a loop thread through a ``BlockingPortal`` costs about
  130 us a call, ``run_until_complete`` on a kept loop about 20 us (asyncio's
  loop; uvloop re-arms its signal handling on every run and costs about
  80 us there). Long steps then run inline (see ``_offload``).
- A call that must go on in the background (``send_async()``), or a blocking
  call from a thread that already runs an event loop (a notebook, an async
  app), goes through the process-wide loop thread, entered with an anyio
  ``BlockingPortal``; the calling thread blocks while it waits. That loop runs
  on uvloop when uvloop is installed, unless ``WEIGHTSYNC_LOOP=asyncio``.

A blocking call from the loop thread itself raises instead of deadlocking,
and one made inside a coroutine (a task of a running loop) raises at once,
naming the coroutine to await (:meth:`Runtime.refuse_in_coroutine`): it
would stall that loop, every other task of it, for as long as it waits.
A notebook cell is the exception: IPython's kernel runs each cell, sync or
not, inside a task of its loop, and a cell's code is the user's to block
(an ``async def`` that the cell awaits is not: it refuses there too).

Ctrl-C during a blocking call on the main thread cancels the coroutine
through its cancel scope, so every copy it started (shielded) ends and every
channel is left in a known state before ``KeyboardInterrupt`` is raised; a
second Ctrl-C raises at once.

The loop thread starts on first use and, like the private loops, is closed
when the last sender or receiver lets go of the runtime (:meth:`Runtime.release`),
so an idle process holds no weightsync thread. After ``fork`` the child
forgets the parent's loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import os
import signal
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ._exceptions import BlockingCallError, WeightSyncStateError, out_of_resources
from ._loops import thread_runs_a_loop
from ._offload import caller_blocked

__all__ = ["RUNTIME", "LOOP_THREAD_NAME", "Runtime"]

T = TypeVar("T")
LOOP_THREAD_NAME = "weightsync-loop"


def _backend_options() -> dict[str, Any]:
    choice = os.environ.get("WEIGHTSYNC_LOOP", "auto")
    if choice == "asyncio":
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise
        return {}
    return {"use_uvloop": True}


# Every blocking call swaps the SIGINT handler twice. ``signal.signal`` and
# ``getsignal`` convert to and from enums on each call, which costs more than
# a small receive's own work (about 8 us against 0.5 us for the C functions
# they wrap); the C module takes and returns the same handler objects.
try:
    import _signal as _handlers
except ImportError:  # another Python implementation
    _handlers = signal


# The packages that run a notebook's cells (ipykernel's shell, IPython's
# runner): a blocking call whose nearest coroutine is theirs was made by a
# cell's own code, which blocks the kernel's loop whatever it does.
_NOTEBOOK_PACKAGES = frozenset({"ipykernel", "IPython"})
_COROUTINE_CODE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _blocked_coroutine() -> str | None:
    """The name of the coroutine that a blocking call made here would
    stall: the nearest one up the calling thread's stack, in a task of a
    running loop. None: no task runs here (no loop, or a plain callback of
    one), or the call is a notebook cell's (IPython runs each cell inside a
    task of the kernel's loop: a sync cell under its own coroutines, a cell
    with a top-level ``await`` as a coroutine of the cell's ``<module>``)."""
    if not thread_runs_a_loop():
        return None
    task = asyncio.current_task()
    if task is None:
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_flags & _COROUTINE_CODE:
            module = frame.f_globals.get("__name__", "")
            if code.co_name == "<module>" or module.partition(".")[0] in _NOTEBOOK_PACKAGES:
                return None
            qualname: str | None = getattr(code, "co_qualname", None)  # Python 3.11+
            if qualname is not None:
                return qualname
            # Python 3.10: only the coroutine (or async generator) object has the
            # qualified name; it is on the task's await chain, whose link is its frame.
            awaited: Any = task.get_coro()
            for _ in range(1000):  # bounded: an await chain never loops, but stay safe
                if awaited is None:
                    break
                if frame in (getattr(awaited, a, None) for a in ("cr_frame", "ag_frame", "gi_frame")):
                    return str(awaited.__qualname__)
                links = (getattr(awaited, a, None) for a in ("cr_await", "ag_await", "gi_yieldfrom"))
                awaited = next((link for link in links if link is not None), None)
            return code.co_name
        frame = frame.f_back
    coro = task.get_coro()
    return getattr(coro, "__qualname__", None) or task.get_name()


def _run_guarded(guard: _Interruptible, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``func(*args, **kwargs)`` with ``guard`` installed; KeyboardInterrupt
    once it returned (or raised) if Ctrl-C came meanwhile."""
    with guard:
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:
            if guard.interrupted and not isinstance(exc, KeyboardInterrupt):
                raise KeyboardInterrupt from exc
            raise
    if guard.interrupted:
        raise KeyboardInterrupt
    return result


class _Interruptible:
    """While installed on the main thread, SIGINT cancels the cancel scope of
    one blocking call instead of raising wherever the main thread happens to
    be (possibly between two reads of one pipe message, or while copy threads
    run); the call then raises KeyboardInterrupt once its work has stopped.
    A second SIGINT raises at once, as usual."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop  # None: a plain function runs (Runtime.run_now), no scope to cancel
        self.scope: anyio.CancelScope | None = None
        self.interrupted = False
        self._finished = False
        self._swapped = False  # SIGINT is ours while installed

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.interrupted:
            raise KeyboardInterrupt  # the user insists
        self.interrupted = True
        if self.loop is not None and self.scope is not None and not self._finished:
            self.loop.call_soon_threadsafe(self.scope.cancel)
        # Before the scope exists, run() cancels it as it opens; after the
        # work finished, call() raises KeyboardInterrupt on its way out.

    # Installed as a context (``with guard:``), where SIGINT is handled so on
    # the main thread if the user installed no handler of their own. (A
    # class's context, not a generator's: it wraps every blocking call, and
    # a receive that finds its update pending is a few dozen µs.)
    def __enter__(self) -> None:
        self._swapped = (
            _handlers.getsignal(signal.SIGINT) is signal.default_int_handler
            and threading.get_ident() == threading.main_thread().ident
        )
        if self._swapped:  # (else another thread, or the user's own handler: SIGINT is left alone)
            _handlers.signal(signal.SIGINT, self._on_sigint)

    def __exit__(self, *exc_info: object) -> None:
        if self._swapped:
            _handlers.signal(signal.SIGINT, signal.default_int_handler)

    async def run(self, func: Callable[..., Awaitable[T]], *args: Any) -> T | None:
        """``func(*args)``, or None once SIGINT cancelled it (the caller
        then raises KeyboardInterrupt: the work has stopped)."""
        try:
            with anyio.CancelScope() as scope:
                self.scope = scope
                if self.interrupted:
                    scope.cancel()
                return await func(*args)
            return None
        finally:
            self._finished = True


@dataclasses.dataclass(eq=False)
class _Job:
    """Background work handed to the loop thread, and where its outcome goes."""

    func: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    future: concurrent.futures.Future[Any]

    def forget(self, future: concurrent.futures.Future[Any]) -> None:
        """A job cancelled before it ran lets go of its work at once (what
        it would have run may hold a caller's weights), not once the loop
        thread gets to it."""
        if future.cancelled():
            self.func, self.args = _nothing, ()


async def _nothing() -> None:
    return None


async def _run_job(job: _Job, running: dict[concurrent.futures.Future[Any], anyio.CancelScope]) -> None:
    if not job.future.set_running_or_notify_cancel():
        return
    # A scope of its own: Runtime.cancel stops this job, not the loop thread.
    with anyio.CancelScope() as scope:
        running[job.future] = scope
        try:
            result = await job.func(*job.args)
        except BaseException as exc:
            job.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise  # a cancellation goes on (to this job's scope, or the thread's)
        else:
            job.future.set_result(result)
        finally:
            running.pop(job.future, None)


class Runtime:
    """The process-wide loop thread and the per-thread private loops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal: BlockingPortal | None = None
        self._submit: Callable[[_Job], Any] | None = None
        self._thread: threading.Thread | None = None
        self._users = 0
        self._local = threading.local()
        self._private: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        # The background jobs the loop thread runs now, by their future.
        self._running: dict[concurrent.futures.Future[Any], anyio.CancelScope] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the loop thread ---------------------------------------------------
    def _start(self) -> BlockingPortal:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def main() -> None:
            # Background work (start()) is handed over through a queue that
            # a thread feeds with call_soon_threadsafe, without waiting: the
            # portal's own start_task_soon waits until the loop thread has
            # spawned the task, and on a machine with few cores that thread,
            # once awake, runs the task (and wakes the workers it notifies)
            # before the caller gets its core back.
            loop = self._loop = asyncio.get_running_loop()
            queue: asyncio.Queue[_Job | None] = asyncio.Queue()
            async with BlockingPortal() as portal, anyio.create_task_group() as group:

                async def spawn() -> None:
                    while (job := await queue.get()) is not None:
                        group.start_soon(_run_job, job, self._running)

                group.start_soon(spawn)

                def submit(job: _Job) -> None:
                    loop.call_soon_threadsafe(queue.put_nowait, job)

                self._submit = submit
                ready.set_result(portal)
                await portal.sleep_until_stopped()
                queue.put_nowait(None)  # the jobs under way finish; then the group ends

        def run() -> None:
            try:
                anyio.run(main, backend="asyncio", backend_options=_backend_options())
            except BaseException as exc:  # surfaced to the thread that waits on ready
                if not ready.done():
                    ready.set_exception(exc)

        thread = threading.Thread(target=run, name=LOOP_THREAD_NAME, daemon=True)
        with out_of_resources("start weightsync's loop thread"):
            thread.start()
            self._thread = thread
            return ready.result()

    def _check_not_loop_thread(self) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise WeightSyncStateError(
                "a blocking weightsync call was made from weightsync's own event-loop thread; "
                "await the async API (get_async_sender / get_async_receiver) there instead"
            )

    def refuse_in_coroutine(self, call: str, instead: str, model_id: str | None = None) -> bool:
        """Raise if the calling thread runs a coroutine (a task of an event
        loop) that the blocking ``call`` would stall. Never blocks. Returns
        whether the thread runs no loop at all (:meth:`blocks_here`: the
        call may block in a step of its own).

        ``instead`` names what that coroutine should await. A loop's plain
        callback, a thread with no loop, and a notebook's cell pass.

        :raises BlockingCallError: called inside such a coroutine.
        :raises WeightSyncStateError: called from weightsync's loop thread.
        """
        self._check_not_loop_thread()
        if not thread_runs_a_loop():
            return True
        coroutine = _blocked_coroutine()
        if coroutine is None:
            return False
        raise BlockingCallError(
            f"{call} blocks, and was called inside the coroutine {coroutine}(): it would stall "
            f"that coroutine's event loop, every other task of it, for as long as it waits. "
            f"In a coroutine, {instead}; or run the blocking call on a thread "
            f"(await asyncio.to_thread(...))",
            model_id=model_id,
        )

    def portal(self) -> BlockingPortal:
        """The loop thread's portal, started on first use."""
        self._check_not_loop_thread()
        with self._lock:
            if self._portal is None:
                self._portal = self._start()
            return self._portal

    def start(self, func: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``func(*args)`` in the background on the loop thread. Never blocks
        (but for starting the thread on first use): the loop thread picks it
        up when it next runs."""
        self.portal()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        submit = self._submit
        assert submit is not None
        job = _Job(func, args, future)
        future.add_done_callback(job.forget)
        submit(job)
        return future

    def cancel(self, future: concurrent.futures.Future[Any], timeout: float) -> None:
        """Cancel the background job of ``future`` (:meth:`start`): at once if
        the loop thread has not started it, else by cancelling its task
        there, then wait up to ``timeout`` seconds for it to stop (its
        cancellation runs its cleanup first). Its future ends cancelled or
        with the job's own outcome."""
        if future.cancel() or future.done():
            return
        scope, loop = self._running.get(future), self._loop
        if scope is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # (the loop just ended)
                loop.call_soon_threadsafe(scope.cancel)
        concurrent.futures.wait([future], timeout)

    # -- blocking calls ----------------------------------------------------
    def _private_loop(self) -> asyncio.AbstractEventLoop:
        loop = getattr(self._local, "loop", None)
        if loop is None or loop.is_closed():
            with out_of_resources("start an event loop"):
                loop = asyncio.new_event_loop()
            self._local.loop = loop
            with self._lock:
                self._private.add(loop)
        return loop

    def call(self, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``func(*args)`` to the end and return its result, blocking.

        :raises WeightSyncStateError: called from the loop thread itself.
        :raises KeyboardInterrupt: Ctrl-C, once the coroutine has stopped.
        """
        self._check_not_loop_thread()
        if thread_runs_a_loop():
            return self.portal().call(func, *args)
        guard = _Interruptible(None)
        with guard:
            return self._on_private_loop(guard, func, *args)

    def _on_private_loop(self, guard: _Interruptible, func: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``func(*args)`` to its end on this thread's private loop, where
        ``guard`` (installed) cancels it on Ctrl-C."""
        loop = guard.loop = self._private_loop()
        guard.scope, guard._finished = None, False
        with caller_blocked():
            task = loop.create_task(guard.run(func, *args))
            try:
                result = loop.run_until_complete(task)
            except BaseException as exc:
                # Interrupted outside the coroutine's own scope (a second
                # Ctrl-C, a SystemExit from a handler): cancel it so its
                # channels end cleanly before the error goes on.
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        loop.run_until_complete(task)
                if guard.interrupted and not isinstance(exc, KeyboardInterrupt):
                    raise KeyboardInterrupt from exc
                raise
            finally:
                guard.loop, guard.scope = None, None
        if guard.interrupted:
            # Raised even when the work finished before the cancel reached
            # it: the user asked to stop.
            raise KeyboardInterrupt
        return result  # type: ignore[return-value]

    def run_now(self, func: Callable[..., T], *args: Any) -> T:
        """Run the plain function ``func(*args)`` on the calling thread, for
        a step that never waits (an update already pending, copied in and
        acked): entering an event loop would cost more than the step.

        As in :meth:`call`, Ctrl-C on the main thread does not stop the step
        midway (a copy half done): ``KeyboardInterrupt`` is raised once it
        returned. ``func`` must not block, or Ctrl-C waits for it.

        :raises KeyboardInterrupt: Ctrl-C, once ``func`` returned.
        """
        return _run_guarded(_Interruptible(None), func, *args)

    def blocks_here(self) -> bool:
        """Whether the calling thread may block in a step of its own, with
        no event loop (:meth:`run_waiting`): it runs no loop. Never blocks.

        :raises WeightSyncStateError: called from the loop thread itself.
        """
        self._check_not_loop_thread()
        return not thread_runs_a_loop()

    def run_waiting(self, func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``func(*args, **kwargs, guard=..., enter_loop=...)`` on
        the calling thread under one Ctrl-C guard, for work that blocks
        without an event loop (a send driven on the caller's thread), where
        :meth:`blocks_here`. ``guard.interrupted`` says whether Ctrl-C
        came: ``func`` must look at it while it waits, then stop.
        ``enter_loop(coroutine_function)`` runs a step that needs a loop to
        its end on this thread's private loop, under the same guard (Ctrl-C
        cancels it, then raises KeyboardInterrupt).

        :raises KeyboardInterrupt: Ctrl-C, once ``func`` returned or stopped.
        """
        guard = _Interruptible(None)

        def enter_loop(step: Callable[[], Awaitable[T]]) -> T:
            return self._on_private_loop(guard, step)

        return _run_guarded(guard, func, *args, guard=guard, enter_loop=enter_loop, **kwargs)

    def close_thread_loop(self) -> None:
        """Close the calling thread's private loop, if it has one (a thread
        of weightsync's own calls it before it ends)."""
        loop = getattr(self._local, "loop", None)
        self._local.loop = None
        if loop is not None and not loop.is_closed():
            with self._lock:
                self._private.discard(loop)
            loop.close()

    # -- lifetime ------------------------------------------------------------
    def acquire(self) -> None:
        """One more sender or receiver relies on the runtime."""
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """Drop one user; the last one closes the private loops and stops the
        loop thread."""
        with self._lock:
            self._users = max(self._users - 1, 0)
            if self._users:
                return
            private = [loop for loop in self._private if not loop.is_running()]
            for loop in private:
                self._private.discard(loop)
            portal, thread = self._portal, self._thread
            if thread is not None and threading.current_thread() is thread:
                portal = thread = None  # cannot stop from inside; the next release will
            else:
                self._portal = self._thread = None
                self._submit = None
        for loop in private:
            loop.close()
        if portal is not None and thread is not None:
            portal.call(portal.stop)
            thread.join(timeout=10)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._running = {}
        self._loop = None
        self._portal = None
        self._submit = None
        self._thread = None
        self._users = 0
        self._local = threading.local()
        self._private = weakref.WeakSet()


RUNTIME = Runtime()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=RUNTIME._after_fork)
