"""The library's loop thread runs on uvloop when installed, on asyncio's loop
otherwise (WEIGHTSYNC_LOOP=asyncio), and background sends work on both."""

from __future__ import annotations

import asyncio

import pytest
from conftest import Cluster, weightsync_threads

from weightsync._facade import LOOP


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
