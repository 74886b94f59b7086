"""The library's loop thread runs on uvloop when installed, on asyncio's loop
otherwise (WEIGHTSYNC_LOOP=asyncio), and background sends work on both."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Cluster, weightsync_threads

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
