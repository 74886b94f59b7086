"""The library's loop thread runs on uvloop when installed, on asyncio's loop
otherwise (WEIGHTSYNC_LOOP=asyncio), and background sends work on both."""

from __future__ import annotations

import asyncio

import pytest
from harness import Cluster, weightsync_threads

from weightsync._runtime import RUNTIME as LOOP


# The facade and the loops are the same for every transport: one scheme is enough.
@pytest.fixture
def scheme_name() -> str:
    return "multiprocess"


@pytest.mark.parametrize("choice, loop_module", [("asyncio", "asyncio"), ("uvloop", "uvloop")])
def test_the_loop_thread_runs_on_the_chosen_loop(
    monkeypatch: pytest.MonkeyPatch, scheme_name: str, choice: str, loop_module: str
) -> None:
    assert not weightsync_threads(), "a loop thread from an earlier test is still running"
    monkeypatch.setenv("WEIGHTSYNC_LOOP", choice)
    c = Cluster(scheme_name, ["net"])
    try:

        async def loop_type() -> str:
            return type(asyncio.get_running_loop()).__module__

        assert LOOP.portal().call(loop_type).startswith(loop_module)
        c.bump()
        c.sender.send_async()  # runs on the loop thread
        c.sender.wait_async()
        c.assert_has(0, c.expected())
    finally:
        c.close()


def _use_the_loop_in_a_forked_child(result) -> None:  # runs in the child
    async def answer() -> int:
        return 42

    LOOP.acquire()
    try:
        result.send((LOOP.portal().call(answer), LOOP.call(answer)))
    finally:
        LOOP.release()


def test_a_forked_child_starts_its_own_loop() -> None:
    import multiprocessing as mp

    async def nothing() -> None:
        return None

    LOOP.acquire()
    try:
        LOOP.portal().call(nothing)  # the parent's loop thread is running now
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_use_the_loop_in_a_forked_child, args=(theirs,))
        child.start()
        assert ours.poll(30), "the forked child hung on the parent's loop"
        assert ours.recv() == (42, 42)
        child.join(10)
        assert child.exitcode == 0
    finally:
        LOOP.release()


def test_trio_is_refused_with_a_clear_error_and_nothing_moves() -> None:
    """weightsync's coroutines run on asyncio only; awaited under trio they
    raise before anything is sent or applied, and say what to do instead."""
    import copy

    import torch
    import trio
    from torch import nn

    import weightsync as ws

    trainer, worker_model = nn.Linear(4, 4), nn.Linear(4, 4)
    before = {k: v.clone() for k, v in worker_model.state_dict().items()}
    scheme = ws.InProcessWeightSyncScheme()
    scheme.init_on_sender("policy", model=trainer, num_workers=1)
    worker = copy.copy(scheme)
    worker.init_on_worker("policy", model=worker_model, worker_idx=0)
    try:
        with pytest.raises(ws.WeightSyncStateError, match="asyncio") as sent:
            trio.run(scheme.get_async_sender().send)
        assert "trio" in str(sent.value)
        with pytest.raises(ws.WeightSyncStateError, match="asyncio"):
            trio.run(worker.get_async_receiver().receive)
        for name, tensor in worker_model.state_dict().items():
            assert torch.equal(tensor, before[name])
    finally:
        worker.shutdown()
        scheme.shutdown()
