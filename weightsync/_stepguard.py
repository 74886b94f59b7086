"""The step guard: updates applied in the background land between two steps
of the worker's model, never during one.

A step is one forward call of an ``nn.Module`` (the guard hooks it), or any
block the worker wraps in :meth:`StepGuard.step`. Steps are readers: any
number run at once, on any threads, and a step may call the model again
(nested calls count once). Applying an update is the writer: it waits for
the steps under way to end, and new steps wait for it. A waiting writer goes
first, so a worker that steps without pause still takes its updates.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["StepGuard"]


class StepGuard:
    """A readers-writer lock between a model's steps and the updates applied
    to it in the background."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._steps = 0
        self._writing = False
        self._writers_waiting = 0
        # Steps this thread is inside of (a nested call enters once).
        self._depth = threading.local()
        self._hooks: list[Any] = []

    # -- steps (readers) ----------------------------------------------------
    def enter(self) -> None:
        """Begin a step: blocks while an update is being applied, or waits to be."""
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            with self._cond:
                while self._writing or self._writers_waiting:
                    self._cond.wait()
                self._steps += 1
        self._depth.n = depth + 1

    def exit(self) -> None:
        """End a step begun by :meth:`enter` on this thread."""
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            return  # hooked in the middle of a call: its pre-hook never ran
        self._depth.n = depth - 1
        if depth == 1:
            with self._cond:
                self._steps -= 1
                if self._steps == 0:
                    self._cond.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        """No update is applied while this block runs."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    # -- the update (the writer) -------------------------------------------
    @contextmanager
    def writing(self, stop: threading.Event) -> Iterator[bool]:
        """Hold off new steps and wait for the running ones to end. Yields
        True once the model is the writer's alone; False when ``stop`` was
        set first (or this thread is inside a step), and then nothing may be
        written. :meth:`wake` makes a waiting writer look at ``stop``."""
        got = False
        with self._cond:
            self._writers_waiting += 1
            try:
                while (self._writing or self._steps) and not stop.is_set():
                    if getattr(self._depth, "n", 0):
                        break  # a step cannot wait for itself to end
                    self._cond.wait()
                got = not (self._writing or self._steps or stop.is_set())
                if got:
                    self._writing = True
            finally:
                self._writers_waiting -= 1
                if not got:
                    self._cond.notify_all()
        try:
            yield got
        finally:
            if got:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def wake(self) -> None:
        """Wake the threads waiting here (e.g. after a stop was set)."""
        with self._cond:
            self._cond.notify_all()

    # -- hooks on a module ------------------------------------------------------
    def attach(self, model: Any) -> None:
        """Make every forward call of ``model`` (an ``nn.Module``) a step.
        Detaches from the previous model. Other models are left alone: the
        worker guards their use with :meth:`step`."""
        self.detach()
        if not isinstance(model, nn.Module):
            return
        self._hooks = [
            model.register_forward_pre_hook(_StepHook(self.enter)),
            # always_call: a forward that raises still ends its step.
            model.register_forward_hook(_StepHook(self.exit), always_call=True),
        ]

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class _StepHook:
    """A forward hook that begins or ends a step. A copy of the model
    (``copy.deepcopy``, pickling) gets an inert hook instead: the guard
    belongs to this process's receiver, and the copy is not what it updates."""

    def __init__(self, action: Any) -> None:
        self._action = action

    def __call__(self, *args: Any) -> None:
        self._action()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_inert_hook, ())


def _inert_hook() -> Any:
    return _do_nothing


def _do_nothing(*args: Any) -> None:
    return None
