"""Blocking calls and coroutines.

Every blocking call of the facade, made inside a coroutine running on an
event loop, raises :class:`BlockingCallError` at once, before anything is
staged, naming the coroutine and what to await there. The same call works
where nothing would be stalled: a thread with no loop, and code that a
running loop calls outside any task (a loop's callback; a notebook cell's
own code, see ``test_a_notebook_cell_may_block_its_kernels_loop``).

Both senders take the same verbs: ``send``, ``send_async`` (returns once
staged, with a handle) and ``wait_async``; the blocking sender's handle is
waited on outside a loop and awaited inside one.

Trainer and workers are one process here (the in-process scheme: real
pipes, a real shared segment), the workers on threads of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import weightsync as ws


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Trainer:
    """An in-process trainer with ``workers`` worker threads, each calling
    ``receive()`` at its safe point until stopped."""

    def __init__(self, workers: int = 2, spare: int = 0) -> None:
        self.scheme = ws.InProcessWeightSyncScheme(timeout=30)
        self.model = _net(0)
        self.scheme.init_on_sender("policy", model=self.model, num_workers=workers)
        self.stop = threading.Event()
        self.paused = threading.Event()  # set: the workers stay alive, receiving nothing
        self.models: dict[int, nn.Module] = {}
        self.threads: list[threading.Thread] = []
        for i in range(workers + spare):
            self.models[i] = _net(i + 1)
            if i < workers:
                self.start_worker(i)
        self.scheme.wait_for_workers(timeout=30)

    def start_worker(self, i: int) -> None:
        ready = threading.Event()

        def work() -> None:
            scheme = copy.copy(self.scheme)
            scheme.init_on_worker("policy", model=self.models[i], worker_idx=i)
            ready.set()
            try:
                while not self.stop.is_set():
                    if self.paused.is_set():
                        time.sleep(0.01)
                        continue
                    scheme.receive(timeout=0.02)
            except ws.SenderClosedError:
                pass
            finally:
                scheme.shutdown()

        thread = threading.Thread(target=work, name=f"worker-{i}", daemon=True)
        thread.start()
        assert ready.wait(30)
        self.threads.append(thread)

    def pause(self) -> None:
        self.paused.set()
        time.sleep(0.2)  # a receive(timeout=0.02) under way has ended

    @property
    def sender(self) -> ws.WeightSender:
        return self.scheme.get_sender()

    def bump(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)

    def holds_the_trainers_weights(self, i: int) -> bool:
        return all(
            torch.equal(a, b)
            for a, b in zip(_weights(self.models[i]).values(), _weights(self.model).values(), strict=True)
        )

    def close(self) -> None:
        self.stop.set()
        self.scheme.shutdown()
        for thread in self.threads:
            thread.join(30)


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    made = Trainer(workers=2, spare=1)
    try:
        yield made
    finally:
        made.close()


def in_a_coroutine(call: Callable[[], Any]) -> Any:
    """``call()`` made inside a coroutine (a task of a running loop)."""

    async def trainer_step() -> Any:
        return call()

    return asyncio.run(trainer_step())


def in_a_loop_callback(call: Callable[[], Any]) -> Any:
    """``call()`` made by a running loop outside any task (a plain callback),
    as code that a loop runs but no coroutine awaits."""

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def cell() -> None:
            assert asyncio.current_task() is None
            try:
                done.set_result(call())
            except BaseException as exc:
                done.set_exception(exc)

        loop.call_soon(cell)
        return await done

    return asyncio.run(main())


# -- the trainer's blocking calls ----------------------------------------------------
#: name -> (the call, what the error tells to await, how the call is undone after it worked)
SENDER_CALLS: dict[str, tuple[Callable[[Trainer], Any], str]] = {
    "send()": (lambda t: t.sender.send(), "await scheme.get_async_sender().send(...)"),
    "send_async()": (
        lambda t: t.sender.send_async().wait(),
        "await scheme.get_async_sender().send_async(...)",
    ),
    "update_weights()": (
        lambda t: t.sender.update_weights(t.model),
        "await scheme.get_async_sender().send(...)",
    ),
    "scheme.send()": (lambda t: t.scheme.send(), "await scheme.get_async_sender().send(...)"),
    "wait_for_workers()": (
        lambda t: t.scheme.wait_for_workers(timeout=5),
        "await scheme.get_async_sender().wait_for_workers(...)",
    ),
    "connect()": (lambda t: t.sender.connect(timeout=5), "await scheme.get_async_sender().connect(...)"),
    "remove_worker()": (
        lambda t: t.scheme.remove_worker(1),
        "await scheme.get_async_sender().remove_worker(...)",
    ),
    "add_worker()": (
        lambda t: t.scheme.add_worker(worker_id=2),
        "await scheme.get_async_sender().add_worker(...)",
    ),
    "shutdown()": (lambda t: t.sender.shutdown(), "await scheme.get_async_sender().aclose()"),
}


def _call_name(name: str) -> str:
    return name.removeprefix("scheme.")


@pytest.mark.parametrize("name", list(SENDER_CALLS))
def test_a_blocking_trainer_call_inside_a_coroutine_is_refused_before_anything_moves(
    trainer: Trainer, name: str
) -> None:
    call, instead = SENDER_CALLS[name]
    trainer.bump()
    version = trainer.scheme.get_async_sender().version
    with pytest.raises(ws.BlockingCallError) as info:
        in_a_coroutine(lambda: call(trainer))
    message = str(info.value)
    assert f"{_call_name(name).replace('update_weights', 'send')}" in message or name == "update_weights()"
    assert "inside the coroutine in_a_coroutine.<locals>.trainer_step()" in message
    assert instead in message, message
    assert "asyncio.to_thread" in message
    assert isinstance(info.value, RuntimeError)  # a lifecycle misuse, as the reference pages raise
    # Nothing moved: no version used, no worker touched, no send pending.
    assert trainer.scheme.get_async_sender().version == version
    assert not trainer.sender.pending
    assert not any(trainer.holds_the_trainers_weights(i) for i in (0, 1))
    assert sorted(trainer.scheme.sender_transports) == [0, 1]
    # The sender is as it was: the call works where nothing is stalled.
    if name == "add_worker()":
        trainer.start_worker(2)
    call(trainer)


@pytest.mark.parametrize("name", list(SENDER_CALLS))
def test_a_blocking_trainer_call_works_from_a_loops_callback(trainer: Trainer, name: str) -> None:
    call, _ = SENDER_CALLS[name]
    if name == "add_worker()":
        trainer.sender.send()  # a worker added after a send gets the latest weights
        trainer.start_worker(2)
    trainer.bump()
    in_a_loop_callback(lambda: call(trainer))
    if name in ("send()", "send_async()", "update_weights()", "scheme.send()"):
        assert trainer.holds_the_trainers_weights(0) and trainer.holds_the_trainers_weights(1)
    if name == "add_worker()":
        trainer.bump()
        trainer.sender.send()
        assert trainer.holds_the_trainers_weights(2)
    if name == "remove_worker()":
        assert sorted(trainer.scheme.sender_transports) == [0]


def test_waiting_on_a_send_async_inside_a_coroutine_names_the_handle(trainer: Trainer) -> None:
    trainer.bump()
    handle = trainer.sender.send_async()
    for wait in (trainer.sender.wait_async, handle.wait):
        with pytest.raises(
            ws.BlockingCallError, match=r"await the (SendHandle that send_async\(\) returned|handle)"
        ):
            in_a_coroutine(wait)
    assert trainer.sender.pending  # still there: the refusal took nothing
    # Waited for where nothing is stalled, either way.
    report = in_a_loop_callback(trainer.sender.wait_async)
    assert report.version == handle.version and handle.done()
    assert handle.wait() == report  # once over, a handle keeps its outcome


# -- the worker's blocking calls -----------------------------------------------------
class Worker:
    """One worker on this thread; its trainer on a thread of its own."""

    def __init__(self) -> None:
        self.trainer = ws.InProcessWeightSyncScheme(timeout=30)
        self.trainer_model = _net(0)
        self.trainer.init_on_sender("policy", model=self.trainer_model, num_workers=1)
        self.scheme = copy.copy(self.trainer)
        self.model = _net(1)
        self.scheme.init_on_worker("policy", model=self.model, worker_idx=0)
        self.trainer.wait_for_workers(timeout=30)
        self.sent: list[threading.Thread] = []

    def send_soon(self) -> None:
        """A send from the trainer's thread (it blocks until this worker receives)."""
        thread = threading.Thread(target=self.trainer.send, daemon=True)
        thread.start()
        self.sent.append(thread)

    def close(self) -> None:
        self.scheme.shutdown()
        for thread in self.sent:
            thread.join(30)
        self.trainer.shutdown()


WORKER_CALLS: dict[str, tuple[Callable[[Worker], Any], str]] = {
    "receive()": (lambda w: w.scheme.receive(timeout=10), "await scheme.get_async_receiver().receive(...)"),
    "wait_for_version()": (
        lambda w: w.scheme.get_receiver().wait_for_version(1, timeout=10),
        "await scheme.get_async_receiver().wait_for_version(...)",
    ),
    "shutdown()": (
        lambda w: w.scheme.get_receiver().shutdown(),
        "await scheme.get_async_receiver().aclose()",
    ),
}


@pytest.mark.parametrize("name", list(WORKER_CALLS))
def test_a_blocking_worker_call_inside_a_coroutine_is_refused_and_works_outside(name: str) -> None:
    call, instead = WORKER_CALLS[name]
    worker = Worker()
    try:
        worker.send_soon()
        with pytest.raises(ws.BlockingCallError) as info:
            in_a_coroutine(lambda: call(worker))
        assert f"{name} blocks" in str(info.value) and instead in str(info.value)
        assert worker.scheme.get_receiver().version is None  # nothing applied
        if name != "shutdown()":
            assert in_a_loop_callback(lambda: call(worker)) == 1
            assert all(
                torch.equal(a, b)
                for a, b in zip(
                    _weights(worker.model).values(), _weights(worker.trainer_model).values(), strict=True
                )
            )
        else:
            in_a_loop_callback(lambda: worker.scheme.receive(timeout=10))
            in_a_loop_callback(lambda: call(worker))
            assert worker.scheme.get_async_receiver().closed
    finally:
        worker.close()


# -- one set of verbs ----------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_async_sender_takes_the_blocking_senders_verbs(trainer: Trainer) -> None:
    sender = trainer.scheme.get_async_sender()
    trainer.bump()
    report = await sender.send()
    trainer.bump()
    pending = await sender.send_async()
    assert pending.version == report.version + 1 and sender.pending is pending
    with pytest.raises(
        ws.WeightSyncStateError, match=r"send\(\) while a send_async\(\) .* await wait_async\(\) first"
    ):
        await sender.send()  # refused before anything is staged
    assert sender.version == pending.version
    assert (await sender.wait_async()).version == pending.version
    assert sender.pending is None and pending.done()
    assert (await pending).version == pending.version  # once over, it keeps its outcome
    with pytest.raises(ws.WeightSyncStateError, match=r"wait_async\(\) with no send_async\(\) pending"):
        await sender.wait_async()
    trainer.bump()
    assert (await (await sender.send_async())).version == pending.version + 1  # awaited directly
    assert trainer.holds_the_trainers_weights(0) and trainer.holds_the_trainers_weights(1)


@pytest.mark.asyncio
async def test_an_async_wait_that_times_out_leaves_the_send_going(trainer: Trainer) -> None:
    sender = trainer.scheme.get_async_sender()
    trainer.pause()  # the workers stop receiving: nobody acks
    pending = await sender.send_async(timeout=3)
    with pytest.raises(TimeoutError, match=r"is still waiting for acks after 0\.2 s; the send goes on"):
        await sender.wait_async(timeout=0.2)
    assert sender.pending is pending and not pending.done()
    with pytest.raises(ws.AckTimeoutError, match=r"within send_async\(\)'s timeout of 3 s"):
        await pending
    assert sender.pending is None


@pytest.mark.asyncio
async def test_an_async_trainer_that_takes_the_blocking_sender_is_told_what_to_await(
    trainer: Trainer,
) -> None:
    """The mistakes an asyncio trainer makes with the two senders: each is
    refused before anything is staged, with the coroutine to await."""
    blocking = trainer.sender
    trainer.bump()
    with pytest.raises(
        ws.BlockingCallError, match=r"In a coroutine, await scheme.get_async_sender\(\)\.send_async"
    ):
        await blocking.send_async()
    with pytest.raises(
        ws.BlockingCallError, match=r"In a coroutine, await scheme.get_async_sender\(\)\.send\(\.\.\.\)"
    ):
        blocking.send()
    assert trainer.scheme.get_async_sender().version == 0 and not blocking.pending
    report = await trainer.scheme.get_async_sender().send()
    assert report.version == 1


def test_the_blocking_senders_handle_is_awaited_inside_a_loop(trainer: Trainer) -> None:
    trainer.bump()
    handle = trainer.sender.send_async()
    assert isinstance(handle, ws.SendHandle) and handle.worker_ids == (0, 1)
    ticks = 0

    async def elsewhere() -> ws.SendReport:
        nonlocal ticks

        async def tick() -> None:
            nonlocal ticks
            while not handle.done():
                ticks += 1
                await asyncio.sleep(0.001)

        ticker = asyncio.ensure_future(tick())
        report = await handle
        await ticker
        return report

    report = asyncio.run(elsewhere())
    assert report.version == handle.version and not trainer.sender.pending
    assert trainer.holds_the_trainers_weights(0)
    # A send refused before staging comes back as a handle that raises.
    refused = trainer.sender.send_async({"nope": torch.zeros(1)})
    assert refused.version is None and refused.done()
    with pytest.raises(ws.WeightMismatchError):
        refused.wait()
    with contextlib.suppress(Exception):
        trainer.sender.wait_async()
    trainer.sender.send()


def test_a_send_timeout_bounds_a_blocking_handles_wait(trainer: Trainer) -> None:
    trainer.pause()
    started = time.monotonic()
    handle = trainer.sender.send_async(timeout=1.0)
    with pytest.raises(ws.AckTimeoutError, match=r"within send_async\(\)'s timeout of 1 s"):
        handle.wait()
    assert time.monotonic() - started < 3.0


def test_both_senders_handles_give_up_a_timed_wait_with_the_same_error(trainer: Trainer) -> None:
    """A wait with a limit that passes while the send goes on raises the
    built-in TimeoutError with one text, from either sender's handle (on
    Python 3.10 the blocking future's own is not a TimeoutError at all),
    and the send still ends with its own outcome."""
    trainer.pause()  # nobody acks
    handle = trainer.sender.send_async(timeout=1)
    with pytest.raises(
        TimeoutError, match=r"is still waiting for acks after 0\.2 s; the send goes on"
    ) as got:
        handle.wait(timeout=0.2)
    assert type(got.value) is TimeoutError and not handle.done()
    with pytest.raises(ws.AckTimeoutError, match=r"within send_async\(\)'s timeout of 1 s"):
        handle.wait(timeout=10)

    async def from_the_coroutine_sender() -> None:
        pending = await trainer.scheme.get_async_sender().send_async(timeout=1)
        with pytest.raises(TimeoutError, match=r"is still waiting for acks after 0\.2 s; the send goes on"):
            await pending.wait(timeout=0.2)
        with pytest.raises(ws.AckTimeoutError):
            await pending

    asyncio.run(from_the_coroutine_sender())


@pytest.mark.asyncio
async def test_a_coroutine_that_only_polls_done_sees_its_send_end(trainer: Trainer) -> None:
    """``done()`` in a running loop starts gathering the acks, as the
    blocking sender's handle does: a trainer that polls it between steps
    of its own, and never awaits the send, sees it end."""
    sender = trainer.scheme.get_async_sender()
    trainer.bump()
    pending = await sender.send_async()

    async def poll() -> None:
        while not pending.done():
            await asyncio.sleep(0.005)  # (the trainer's own step)

    await asyncio.wait_for(poll(), 10)
    assert (await pending).version == pending.version and sender.pending is None
    assert trainer.holds_the_trainers_weights(0) and trainer.holds_the_trainers_weights(1)
