"""Workers that are still starting: the trainer can wait for them, sees who
it waits for, and a send to them is bounded by its one deadline (their
start included), which its report splits.

A worker process spends seconds importing torch before it calls
``init_on_worker``; these workers sleep first to stand for that.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from harness import make_scheme, schemes, start_pipe_worker, stop_pipe_workers
from harness.workers import build_model, late_worker

import weightsync as ws
from weightsync import _announce

# (The shared-memory scheme shares the pipes' start-up with multiprocess: its
# runs are in the extended step, which keeps the default run short.)
pytestmark = pytest.mark.parametrize("scheme_name", schemes(pipes=True, extended=("shared",)))


class LateWorkers:
    """Pipe workers that call ``init_on_worker`` only after ``delay`` seconds."""

    def __init__(
        self, scheme_name: str, count: int, delay: float | list[float], timeout: float = 30.0
    ) -> None:
        self.scheme = make_scheme(scheme_name, timeout)
        self.procs, self.ctrls, pipes = [], [], []
        delays = delay if isinstance(delay, list) else [delay] * count
        for delay in delays:
            proc, ours, ctrl = start_pipe_worker(
                late_worker, lambda pipe, ctrl, delay=delay: (self.scheme, "policy", pipe, ctrl, "net", delay)
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

    def make(count: int, delay: float | list[float], timeout: float = 30.0) -> LateWorkers:
        made.append(LateWorkers(scheme_name, count, delay, timeout))
        return made[-1]

    yield make
    for cluster in made:
        cluster.close()


def test_wait_for_workers_returns_once_every_worker_announced(late) -> None:
    c = late(2, delay=0.5)
    called = time.perf_counter()
    took = c.scheme.wait_for_workers(timeout=30)
    wall = time.perf_counter() - called
    assert sorted(took) == [0, 1]
    assert all(seconds >= 0.4 for seconds in took.values()), took
    # Each time is counted from the call: the last worker's is the call's
    # wall time, less the return's own few milliseconds.
    assert max(took.values()) <= wall and wall - max(took.values()) < 0.25, (wall, took)
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


def test_a_first_send_reports_the_start_apart_within_its_one_deadline(late) -> None:
    c = late(2, delay=1.0)
    report = c.scheme.get_sender().send(timeout=20)
    assert report.worker_ids == (0, 1)
    assert report.announce_seconds >= 0.9, report
    assert report.staged_seconds < report.announce_seconds
    assert report.seconds >= report.announce_seconds + report.staged_seconds


def test_a_send_timeout_bounds_the_wait_for_workers_still_starting(
    late, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheme keeps 60 s; the send's own 1.5 s wins, workers still
    starting included. The error names each worker, what it was waited for,
    and the timeout that applied; the wait is logged at WARNING once."""
    c = late(2, delay=60.0, timeout=60.0)
    monkeypatch.setattr(_announce, "_WARN_AFTER", 0.5)
    caplog.set_level(logging.INFO, logger="weightsync")
    started = time.monotonic()
    with pytest.raises(ws.AckTimeoutError) as info:
        c.scheme.get_sender().send(timeout=1.5)
    took = time.monotonic() - started
    assert 1.4 <= took < 2.5, took
    assert set(info.value.failures) == {0, 1}
    message = str(info.value)
    for wid in (0, 1):
        assert (
            f"worker {wid} (model 'policy') did not announce itself (start, then call init_on_worker() "
            "for this model) within send()'s timeout of 1.5 s"
        ) in message
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "has waited 1 s for worker(s) 0, 1 to announce themselves" in warnings[0] or (
        "for worker(s) 0, 1 to announce themselves" in warnings[0]
    )
    assert "call scheme.wait_for_workers()" in warnings[0]
    # Nothing was staged: the version is not used.
    assert c.scheme.get_async_sender().version == 0


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


def _weights(c: LateWorkers, i: int) -> dict:
    c.ctrls[i].send("state")
    while True:  # (after its "ready")
        assert c.ctrls[i].poll(30)
        reply = c.ctrls[i].recv()
        if isinstance(reply, dict):
            return reply


def test_a_worker_that_never_started_holds_no_other_back(late) -> None:
    """Two workers running, a third never announces itself: the send
    updates the two at once and names only the third, at the deadline."""
    c = late(3, delay=[0.0, 0.0, 60.0])
    c.scheme.wait_for_workers([0, 1], timeout=30)
    sender = c.scheme.get_sender()
    started = time.monotonic()
    with pytest.raises(ws.AckTimeoutError) as info:
        sender.send(timeout=2.0)
    assert time.monotonic() - started < 3.5
    assert info.value.worker_ids == (2,), info.value
    message = str(info.value)
    assert "worker 2 (model 'policy') did not announce itself" in message
    assert "worker 0" not in message and "worker 1" not in message
    assert sender.worker_versions == {0: 1, 1: 1, 2: None}
    model = c.scheme.model
    for i in (0, 1):
        state = _weights(c, i)
        assert state["applied"] == [1]
        for name, tensor in model.state_dict().items():
            assert torch.equal(state["weights"][name], tensor), name
    # The next send to the two that run takes no wait.
    assert sender.send(worker_ids=[0, 1], timeout=5).version == 2


def test_a_worker_that_announces_itself_during_a_send_joins_it(late) -> None:
    c = late(3, delay=[0.0, 0.0, 1.5])
    c.scheme.wait_for_workers([0, 1], timeout=30)
    report = c.scheme.get_sender().send(timeout=30)
    assert report.worker_ids == (0, 1, 2) and report.version == 1
    assert c.scheme.get_sender().worker_versions == {0: 1, 1: 1, 2: 1}
    assert _weights(c, 2)["applied"] == [1]


def test_a_failed_add_worker_leaves_no_member_behind(late) -> None:
    c = late(1, delay=0.0)
    sender = c.scheme.get_sender()
    assert sender.send(timeout=30).version == 1
    proc, ours, ctrl = start_pipe_worker(
        late_worker, lambda pipe, ctrl: (c.scheme, "policy", pipe, ctrl, "net", 60.0)
    )
    c.procs.append(proc)
    c.ctrls.append(ctrl)
    c.pipes.append(ours)
    with pytest.raises(ws.AckTimeoutError) as info:
        c.scheme.add_worker(ours, timeout=1.0)
    assert "worker 1 (model 'policy') did not announce itself" in str(info.value)
    assert "within add_worker()'s timeout of 1 s" in str(info.value)
    assert sorted(c.scheme.sender_transports) == [0]
    started = time.monotonic()
    assert sender.send(timeout=5).worker_ids == (0,)
    assert time.monotonic() - started < 1.0
