"""RPCWeightSyncScheme over a real ``torch.distributed.rpc`` job on one
host: the trainer (this process, rank 0, ``trainer``) and two worker
processes (ranks 1 and 2, workers 0 and 1), each applying updates with the
background applier, as in torchrl's ``RPCCollector`` (see
``harness.rpc_workers``).

What is checked: every version lands bit for bit and is acked by number;
the worker's ``connect()`` never waits; an update never lands during a
forward call, and a worker inside one past the deadline is an
``AckTimeoutError`` that names it (the update lands after); weights that do
not fit are refused before anything moves; a killed worker is a
``WorkerLostError`` that names it and its signal, and the other still
acks. In torchrl's own ``RPCCollector``: ``tests/test_torchrl.py``.

The first test needs no job (the default run); the others share one job
(``init_rpc`` costs seconds: they run in the extended step), in order, the
kill last. Teardown is ``rpc.shutdown(graceful=False)``: a
graceful one waits for every peer, a dead one included.
"""

from __future__ import annotations

import pickle
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness import reap, start_worker, weight_checksums
from harness import rpc_workers as rw

import weightsync as ws
from weightsync._transports._rpc._transport import rpc_ready

rpc = pytest.importorskip("torch.distributed.rpc")
if not rpc.is_available():
    pytest.skip("torch.distributed.rpc is not available in this torch build", allow_module_level=True)

pytestmark = pytest.mark.timeout(180)

WORKERS = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Job:
    """The trainer's scheme and model, and its two workers' processes and pipes."""

    def __init__(self) -> None:
        port = _free_port()
        world = WORKERS + 1
        self.trainer = rw.StepModel()
        self.scheme = ws.RPCWeightSyncScheme(timeout=20.0)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(1, world):
            proc, conn = start_worker(
                rw.serve, lambda conn, rank=rank: (self.scheme, rank, world, port, conn)
            )
            self.procs.append(proc)
            self.conns.append(conn)
        rw.join("trainer", 0, world, port)
        for conn in self.conns:
            assert conn.poll(120), "a worker did not start"
            assert conn.recv()[0] == "ready"

    def ask(self, worker_id: int, command: Any, wait: float = 30.0) -> tuple[Any, ...]:
        conn = self.conns[worker_id]
        conn.send(command)
        assert conn.poll(wait), f"worker {worker_id} did not answer {command!r}"
        return conn.recv()

    def randomize(self) -> None:
        with torch.no_grad():
            for param in self.trainer.parameters():
                param.normal_()

    def close(self) -> None:
        try:
            self.scheme.shutdown()
            for proc, conn in zip(self.procs, self.conns, strict=True):
                if proc.is_alive():
                    conn.send("stop")
        finally:
            rpc.shutdown(graceful=False)
            reap(self.procs)


def test_the_scheme_pickles_as_its_options_and_its_sender_needs_rpc() -> None:
    scheme = ws.RPCWeightSyncScheme("state_dict", timeout=5.0)
    copy = pickle.loads(pickle.dumps(scheme))
    assert (copy.strategy_str, copy.timeout) == ("state_dict", 5.0)
    assert not rpc_ready()
    model = rw.StepModel()
    with pytest.raises(ws.WeightSyncStateError, match="init_rpc"):
        scheme.init_on_sender("policy", workers=["worker1"], model=model)
    with pytest.raises(ValueError, match="workers="):
        scheme.init_on_sender("policy", model=model)
    # A worker registers without a sender, and its connect() does not wait.
    scheme.init_on_worker("policy", model=model)
    started = time.monotonic()
    assert scheme.connect() is None
    assert time.monotonic() - started < 1.0 and scheme.synchronized_on_receiver
    assert scheme.get_receiver().applying_in_background
    scheme.shutdown()


@pytest.fixture(scope="module")
def job() -> Iterator[Job]:
    made = Job()
    try:
        yield made
    finally:
        made.close()


@pytest.mark.extended
def test_workers_connected_before_the_sender_then_each_version_lands_bit_for_bit(job: Job) -> None:
    # The workers' connect() returned with no sender yet (they answered "ready").
    job.scheme.init_on_sender("policy", workers=["worker1", "worker2"], model=job.trainer)
    report = job.scheme.connect()
    assert report is not None and report.version == 1 and report.worker_ids == (0, 1)
    for version in (2, 3):
        job.randomize()
        report = job.scheme.send()
        assert report.version == version
        assert job.scheme.get_sender().worker_versions == {0: version, 1: version}
        expected = weight_checksums(job.trainer)
        for wid in range(WORKERS):
            _, applied, sums, mixed = job.ask(wid, "state")
            assert (applied, sums, mixed) == (version, expected, 0)


@pytest.mark.extended
def test_an_update_waits_for_the_forward_call_and_the_deadline_names_the_worker(job: Job) -> None:
    job.randomize()
    conn = job.conns[0]
    conn.send(("step", 3.0))  # worker 0 is inside one forward call for 3 s
    time.sleep(0.3)
    started = time.monotonic()
    with pytest.raises(ws.AckTimeoutError) as caught:
        job.scheme.send(timeout=1.0)
    assert time.monotonic() - started < 2.5
    assert caught.value.worker_ids == (0,)
    assert "worker 0" in str(caught.value)
    version = caught.value.version
    assert job.scheme.get_sender().worker_versions[1] == version
    assert conn.poll(10) and conn.recv() == ("stepped",)
    # The update landed once the call ended, not during it.
    deadline = time.monotonic() + 10
    while (state := job.ask(0, "state"))[1] != version and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state[1:] == (version, weight_checksums(job.trainer), 0)
    report = job.scheme.send()
    assert report.version == version + 1 and report.worker_ids == (0, 1)


@pytest.mark.extended
def test_weights_that_do_not_fit_are_refused_before_anything_moves(job: Job) -> None:
    before = job.scheme.get_sender().worker_versions
    wrong = {"w0": torch.zeros(5), "w1": torch.zeros(3001), "w2": torch.zeros(7)}
    with pytest.raises(ws.WeightMismatchError) as caught:
        job.scheme.send({f"weights.{k}": v for k, v in wrong.items()})
    assert "w0" in str(caught.value)
    assert job.scheme.get_sender().worker_versions == before
    assert job.ask(0, "state")[1] == before[0]


@pytest.mark.extended
def test_a_killed_worker_is_named_with_its_signal_and_the_other_still_acks(job: Job) -> None:
    job.procs[1].kill()
    job.procs[1].join(10)
    job.randomize()
    started = time.monotonic()
    with pytest.raises(ws.WorkerLostError) as caught:
        job.scheme.send()
    assert time.monotonic() - started < 5.0  # long before the 20 s deadline
    assert caught.value.worker_ids == (1,)
    assert caught.value.failures[1].exit_signal == signal.SIGKILL
    assert "worker 1" in str(caught.value)
    version = caught.value.version
    assert job.ask(0, "state")[1:] == (version, weight_checksums(job.trainer), 0)
    report = job.scheme.send(worker_ids=0)
    assert report.version == version + 1
