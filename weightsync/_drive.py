"""The two drivers of a send, side by side: they perform a
:class:`~._send.SendMachine`'s actions and feed it the results.

- :func:`drive`: a coroutine, in the running asyncio loop (the async
  sender, ``send_async()``'s background half, a blocking call from a
  thread that runs a loop of its own).
- :func:`drive_blocking`: on the calling thread, with no event loop, for a
  caller that blocks anyway (``send()``): the staging is written, the
  workers told and their acks awaited in a poll of that thread. An action
  whose step is a transport's coroutine (announcements, a channel's own
  delivery, a chain's hand-over) runs on a loop entered for it alone.

Each step is written once, on :class:`SendIO`; the drivers differ only in
how they wait. Either may stop at :data:`~._send.STAGED` and the other go
on from there (``send_async()`` stages on the caller's thread, the loop
thread gathers the acks).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import anyio

from ._announce import Announcements
from ._exceptions import WorkerError
from ._offload import run_blocking
from ._packet import Packet
from ._packing import Packer
from ._readiness import ReadyWatch
from ._send import (
    Action,
    Announce,
    Deliver,
    Done,
    HandOver,
    Listen,
    Post,
    SendMachine,
    SendReport,
    Staged,
    Write,
)
from ._transports._base import ChannelTransport, SenderTransport, SendHandler, Staging

__all__ = ["SendIO", "drive", "drive_blocking"]

# How long the blocking driver waits in one poll before it looks whether
# Ctrl-C came: the most a Ctrl-C is held back while no ack comes.
_POLL_SLICE = 0.05


class Interruption(Protocol):
    """What a blocking driver looks at between its steps (the runtime's
    Ctrl-C guard): an attribute, read where a call would cost more than
    the step it guards."""

    #: Whether Ctrl-C came: the driver then abandons the send.
    interrupted: bool


class SendIO:
    """What a sender's sends act on, and each step of a send written once:
    its channels (the sender's own mapping, which membership changes update
    in place), its staging, its packer, the wait for its workers to announce
    themselves (``Announcements``), and
    one epoll set kept from send to send."""

    def __init__(
        self,
        transports: Mapping[int, SenderTransport],
        staging: Staging | None,
        packer: Packer,
        announcements: Announcements,
    ) -> None:
        self.transports = transports
        #: The same mapping, as the channels it holds: a send yields Post,
        #: Listen and Deliver only where the staging is no handler.
        self.channels: Mapping[int, ChannelTransport] = transports  # type: ignore[assignment]
        self.staging, self.packer, self.announcements = staging, packer, announcements
        self._watch: ReadyWatch | None = None

    def watch(self) -> ReadyWatch:
        if self._watch is None:
            self._watch = ReadyWatch()
        return self._watch

    # -- the steps that never wait ------------------------------------------------
    def write(self, action: Write) -> Packet:
        return self.packer.stage(action.packet, self.staging, action.verify, action.placements)

    def post(self, action: Post) -> dict[int, Any]:
        told: dict[int, Any] = {}
        channels, packet = self.channels, action.packet
        keep = self.watch().keep
        for wid in action.worker_ids:
            channel = channels[wid]
            try:
                channel.post(packet)
                fds = told[wid] = channel.ack_fds(packet)
            except WorkerError as exc:
                told[wid] = exc
                continue
            if fds is not None:
                keep(fds)
        return told

    def take(self, packet: Packet, watched: Mapping[int, tuple[int, ...]], ready: set[int]) -> dict[int, Any]:
        """What each watched worker whose descriptors are ``ready`` sent."""
        heard: dict[int, Any] = {}
        channels = self.channels
        for wid, fds in watched.items():
            if not ready.isdisjoint(fds):
                try:
                    heard[wid] = channels[wid].try_ack(packet, ready)
                except WorkerError as exc:
                    heard[wid] = exc
        return heard

    @staticmethod
    def _wanted(watched: Mapping[int, tuple[int, ...]]) -> set[int]:
        """The descriptors of ``watched`` (the watch keeps others, of sends
        before, that a wakeup drops)."""
        return {fd for fds in watched.values() for fd in fds}

    # -- the steps that are a transport's coroutines --------------------------------
    async def announce(self, action: Announce) -> dict[int, WorkerError]:
        try:
            await self.announcements.announced(
                action.targets,
                action.timeout,
                action.version,
                limit=action.limit,
                warn=action.advice,
                first=action.first,
                name=action.name,
            )
        except WorkerError as exc:
            return dict(exc.failures)
        return {}

    async def deliver(self, action: Deliver) -> dict[int, WorkerError | None]:
        answers: dict[int, WorkerError | None] = {}
        channels, packet = self.channels, action.packet

        async def one(wid: int) -> None:
            try:
                await channels[wid].deliver(packet)
                answers[wid] = None
            except WorkerError as exc:
                answers[wid] = exc

        # One cancel scope for all: the deadline is the same for every worker.
        with anyio.move_on_after(max(action.deadline - time.monotonic(), 0)):
            if len(action.worker_ids) == 1:
                await one(action.worker_ids[0])
            else:
                async with anyio.create_task_group() as group:
                    for wid in action.worker_ids:
                        group.start_soon(one, wid)
        return answers

    async def hand_over(self, action: HandOver) -> None:
        handler = self.staging
        assert isinstance(handler, SendHandler)
        with anyio.move_on_after(max(action.deadline - time.monotonic(), 0)):
            await handler.handle_send(action.send, self.transports)

    async def listen(self, action: Listen) -> dict[int, Any]:
        """:class:`Listen` in the running loop: one waiter for every watched
        descriptor, woken once per readiness."""
        watch, wanted = self.watch(), self._wanted(action.watched)
        with watch.armed():
            while True:
                ready = watch.poll(0)
                if ready:
                    heard = self.take(action.packet, action.watched, ready)
                    if heard:
                        return heard
                    watch.drop(ready - wanted)  # (a worker of another send, or done already)
                left = action.deadline - time.monotonic()
                if left <= 0:
                    return {}
                with anyio.move_on_after(left):
                    await watch.wait()

    def listen_blocking(self, action: Listen, guard: Interruption) -> dict[int, Any]:
        """:class:`Listen` on the calling thread: a poll, in slices, so
        that Ctrl-C is seen (and a flooding worker cannot hold it off).

        :raises KeyboardInterrupt: ``guard.interrupted`` turned true.
        """
        watch = self.watch()
        while True:
            ready = watch.poll(max(min(action.deadline - time.monotonic(), _POLL_SLICE), 0.0))
            if ready:
                heard = self.take(action.packet, action.watched, ready)
                if heard:
                    return heard
                watch.drop(ready - self._wanted(action.watched))
            if guard.interrupted:
                raise KeyboardInterrupt
            if action.deadline <= time.monotonic():
                return {}

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None


async def drive(machine: SendMachine, io: SendIO, *, until_staged: bool = False) -> SendReport | None:
    """Perform ``machine``'s actions in the running loop, from its
    :meth:`~SendMachine.start` until it is done: its report. ``until_staged``: stop
    once the weights are staged (None); either driver goes on from there
    (``action=STAGED``). An interruption or a cancellation
    abandons the send (``machine.close()``) before it goes on.

    :raises: the send's errors (see ``AsyncWeightSender.send``).
    """
    return await resume(machine, io, machine.start(), until_staged=until_staged)


async def resume(
    machine: SendMachine, io: SendIO, action: Action, *, until_staged: bool = False
) -> SendReport | None:
    """:func:`drive`, from ``action`` (where another driver stopped)."""
    try:
        while True:
            match action:
                case Listen():
                    result: Any = await io.listen(action)
                case Write():
                    result = await run_blocking(action.packet.nbytes, io.write, action)
                case Post():
                    result = io.post(action)
                case Staged():
                    if until_staged:
                        return None
                    result = None
                case Done():
                    return action.report
                case Announce():
                    result = await io.announce(action)
                case Deliver():
                    result = await io.deliver(action)
                case HandOver():
                    await io.hand_over(action)
                    result = None
            action = machine.feed(result)
    except BaseException:
        machine.close()
        raise


def drive_blocking(
    machine: SendMachine,
    io: SendIO,
    *,
    enter_loop: Callable[[Callable[[], Awaitable[Any]]], Any],
    guard: Interruption,
    until_staged: bool = False,
    until_waiting: bool = False,
    action: Action | None = None,
) -> SendReport | Action | None:
    """Perform ``machine``'s actions on the calling thread, with no event
    loop (``action``: from where another driver stopped), until it is
    done: its report. An action that needs a loop runs through
    ``enter_loop`` (a coroutine function: run it to its end on a loop,
    blocking). ``until_staged``: stop once the weights are staged (None);
    either driver goes on from there (``action=STAGED``).
    ``until_waiting``: go on past the staging while the actions do not
    wait (the notices: every worker is told), and return the first that
    would wait (for acks, or a chain's whole send), unperformed, or the
    report if none is left; either driver goes on from it. Looks at
    ``guard.interrupted`` after every action and while it waits; once true,
    the send is abandoned (``machine.close()``) and KeyboardInterrupt
    raised: after the staging's copy, never during it.

    :raises: the send's errors (see ``AsyncWeightSender.send``).
    """
    try:
        if action is None:
            action = machine.start()
        staged = False
        while True:
            if staged and until_waiting and isinstance(action, Listen | Announce | Deliver | HandOver):
                return action
            match action:
                case Listen():
                    result: Any = io.listen_blocking(action, guard)
                case Write():
                    result = io.write(action)
                case Post():
                    result = io.post(action)
                case Staged():
                    if until_staged:
                        return None
                    staged = True
                    result = None
                case Done():
                    return action.report
                case Announce():
                    result = enter_loop(_step(io.announce, action))
                case Deliver():
                    result = enter_loop(_step(io.deliver, action))
                case HandOver():
                    result = enter_loop(_step(io.hand_over, action))
            if guard.interrupted:
                raise KeyboardInterrupt  # (nobody waits for the rest of the send)
            action = machine.feed(result)
    except BaseException:
        machine.close()
        raise


def _step(step: Callable[[Any], Awaitable[Any]], action: Any) -> Callable[[], Awaitable[Any]]:
    async def run() -> Any:
        return await step(action)

    return run
