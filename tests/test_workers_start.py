"""Workers that are still starting: the trainer can wait for them, sees who
it waits for, and a send to them tells their start apart from its own time.

A worker process spends seconds importing torch before it calls
``init_on_worker``; these workers sleep first to stand for that.
"""

from __future__ import annotations

import logging

import pytest
from harness import make_scheme, schemes, start_pipe_worker, stop_pipe_workers
from harness.workers import build_model, late_worker

import weightsync as ws
from weightsync import _announce

pytestmark = pytest.mark.parametrize("scheme_name", schemes(pipes=True))


class LateWorkers:
    """Pipe workers that call ``init_on_worker`` only after ``delay`` seconds."""

    def __init__(self, scheme_name: str, count: int, delay: float, timeout: float = 30.0) -> None:
        self.scheme = make_scheme(scheme_name, timeout)
        self.procs, self.ctrls, pipes = [], [], []
        for _ in range(count):
            proc, ours, ctrl = start_pipe_worker(
                late_worker, lambda pipe, ctrl: (self.scheme, "policy", pipe, ctrl, "net", delay)
            )
            self.procs.append(proc)
            self.ctrls.append(ctrl)
            pipes.append(ours)
        self.pipes = pipes
        self.scheme.init_on_sender("policy", pipes=pipes, model=build_model("net", seed=7))

    def close(self) -> None:
        for proc, ctrl in zip(self.procs, self.ctrls, strict=True):
            if not ctrl.poll():
                proc.kill()  # still asleep: it would hear no "stop"
        stop_pipe_workers(self.scheme, self.procs, self.ctrls, self.pipes)


@pytest.fixture
def late(request: pytest.FixtureRequest, scheme_name: str):
    made: list[LateWorkers] = []

    def make(count: int, delay: float, timeout: float = 30.0) -> LateWorkers:
        made.append(LateWorkers(scheme_name, count, delay, timeout))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def test_wait_for_workers_returns_once_every_worker_announced(late) -> None:
    c = late(2, delay=0.5)
    took = c.scheme.wait_for_workers(timeout=30)
    assert sorted(took) == [0, 1]
    assert all(seconds >= 0.4 for seconds in took.values()), took
    # Waiting again costs nothing: they have announced themselves.
    assert c.scheme.wait_for_workers() == {0: 0.0, 1: 0.0}
    report = c.scheme.get_sender().send()
    assert report.announce_seconds == 0.0
    assert report.worker_ids == (0, 1)


@pytest.mark.asyncio
async def test_an_async_trainer_awaits_its_workers(late) -> None:
    c = late(2, delay=0.5)
    sender = c.scheme.get_async_sender()
    took = await sender.wait_for_workers(timeout=30)
    assert sorted(took) == [0, 1] and min(took.values()) >= 0.4
    report = await sender.send()
    assert report.announce_seconds == 0.0 and report.version == 1
    await sender.aclose()


def test_a_first_send_reports_the_start_apart_and_does_not_count_it_against_its_timeout(late) -> None:
    c = late(2, delay=2.0)
    # The workers start after 2 s; the send's own deadline is shorter, and
    # only starts once they have announced themselves.
    report = c.scheme.get_sender().send(timeout=1.5)
    assert report.worker_ids == (0, 1)
    assert report.announce_seconds >= 1.5, report
    assert report.staged_seconds < report.announce_seconds
    assert report.seconds >= report.announce_seconds + report.staged_seconds


def test_a_long_wait_logs_who_is_awaited_and_names_every_absent_worker(
    late, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Workers that never announce themselves (each sleeps past the wait).
    c = late(2, delay=60.0)
    monkeypatch.setattr(_announce, "_PROGRESS_EVERY", 0.2)
    caplog.set_level(logging.INFO, logger="weightsync")
    with pytest.raises(ws.AckTimeoutError) as info:
        c.scheme.wait_for_workers(timeout=1.0)
    assert set(info.value.failures) == {0, 1}
    assert "did not announce itself" in str(info.value)
    progress = [r.getMessage() for r in caplog.records if "announced themselves" in r.getMessage()]
    assert progress, caplog.text
    assert "0 of 2 workers announced themselves" in progress[0]
    assert "still waiting for worker(s) 0, 1" in progress[0]


def test_wait_for_workers_is_the_senders(scheme_name: str) -> None:
    scheme = make_scheme(scheme_name)
    with pytest.raises(RuntimeError, match="wait_for_workers"):
        scheme.wait_for_workers()
