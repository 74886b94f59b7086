"""DistributedWeightSyncScheme on one host: the trainer (this process, rank 0)
and worker processes (ranks 1..N) on 127.0.0.1, the bytes along a gloo
chain, control over the trainer's TCPStore.

What is specific to the scheme: the chain (bit-exact at every worker, only
the targeted ones in it), the host leader that feeds the host's other
workers through shared memory (``share_on_host``, the default: here every
worker is on one host), a worker of another user put in the chain itself, a
worker or a host leader killed or stopped (named, the others updated, the
next send formed without it), the torn-read probe, nothing left behind after
shutdown(), and the refused nccl backend. Across hosts, on an emulated
cluster: test_distributed_cluster.py.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import _distributed_workers as dw
import _probe
import pytest
import torch
from harness import PROCS, fd_baseline, open_fds, reap

import weightsync as ws

pytestmark = pytest.mark.timeout(120)

SHAPES = {"w0": 1 << 20, "w1": 3001, "w2": 7}  # 4 MiB and two odd sizes (chunks span tensors)


class Workers:
    """The trainer's scheme and ``n`` worker processes, each answering over a pipe."""

    def __init__(
        self, n: int, shapes: dict[str, int] = SHAPES, uids: dict[int, int] | None = None, **options: Any
    ) -> None:
        self.shapes = shapes
        dtype = options.pop("worker_dtype", torch.float32)
        self.trainer = dw.build_model(shapes)
        self.scheme = ws.DistributedWeightSyncScheme(timeout=options.pop("timeout", 30.0), **options)
        self.scheme.init_on_sender("policy", num_workers=n, model=self.trainer, host="127.0.0.1")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(1, n + 1):
            ours, theirs = PROCS.Pipe()
            uid = (uids or {}).get(rank)
            proc = PROCS.Process(
                target=dw.pipe_worker, args=(self.scheme, rank, theirs, shapes, uid, dtype), daemon=True
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.poll(60), "a worker did not start"
            assert conn.recv()[0] == "ready"

    def randomize(self) -> None:
        for tensor in self.trainer.values():
            tensor.normal_()

    def state(self, worker_id: int) -> tuple[int | None, dict[str, str]]:
        conn = self.conns[worker_id]
        conn.send("state")
        assert conn.poll(30), f"worker {worker_id} did not answer"
        _, version, digests = conn.recv()
        return version, digests

    def expected(self) -> dict[str, str]:
        return dw.state_of(self.trainer)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.scheme.shutdown()
        reap(self.procs)
        for conn in self.conns:
            conn.close()


@contextlib.contextmanager
def workers(n: int, **options: Any) -> Iterator[Workers]:
    made = Workers(n, **options)
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize("share", [True, False], ids=["host-leader", "all-in-chain"])
def test_every_worker_gets_the_weights_bit_for_bit(share: bool) -> None:
    with workers(3, share_on_host=share) as w:
        w.scheme.connect()
        for _ in range(3):
            w.randomize()
            report = w.scheme.send()
            assert report.worker_ids == (0, 1, 2)
            # One chain: rank 1 feeds the others through shared memory, or all in rank order.
            assert w.scheme.last_routes == ([((1,), {1: (2, 3)})] if share else [((1, 2, 3), {})])
        for wid in range(3):
            assert w.state(wid) == (report.version, w.expected())
        # Only the targeted workers take part; the other keeps its version.
        w.randomize()
        subset = w.scheme.send(worker_ids=[0, 2])
        assert w.scheme.last_routes == ([((1,), {1: (3,)})] if share else [((1, 3), {})])
        assert w.state(0) == (subset.version, w.expected())
        assert w.state(2) == (subset.version, w.expected())
        assert w.state(1)[0] == report.version
        # send_async() returns once staged: the trainer's weights may change at once.
        w.randomize()
        sent = w.expected()
        w.scheme.get_sender().send_async()
        w.randomize()
        w.scheme.get_sender().wait_async()
        assert w.state(1)[1] == sent


def test_a_mismatch_is_refused_before_any_worker_is_touched() -> None:
    with workers(2) as w:
        w.scheme.connect()
        before = [w.state(wid) for wid in range(2)]
        notices = dict(w.scheme.staging.workers.notices)
        wrong = dw.build_model({**SHAPES, "w1": 3002})
        with pytest.raises(ws.WeightMismatchError, match="w1"):
            w.scheme.send(wrong)
        # No notice left for any worker, nothing applied, no version used.
        assert w.scheme.staging.workers.notices == notices
        assert [w.state(wid) for wid in range(2)] == before
        w.randomize()
        assert w.scheme.send().version == before[0][0] + 1


@pytest.mark.parametrize("share", [True, False], ids=["host-leader", "all-in-chain"])
def test_a_killed_worker_is_named_and_the_others_are_updated(share: bool) -> None:
    with workers(3, share_on_host=share) as w:
        w.scheme.connect()
        os.kill(w.procs[1].pid, signal.SIGKILL)
        w.procs[1].join(10)
        w.randomize()
        started = time.monotonic()
        with pytest.raises(ws.WorkerLostError) as caught:
            w.scheme.send()
        assert time.monotonic() - started < 5  # at once, not at the deadline
        error = caught.value
        assert error.worker_ids == (1,), error
        assert error.exit_signal == signal.SIGKILL
        assert "worker 1" in str(error) and "SIGKILL" in str(error)
        assert w.state(0) == (error.version, w.expected())
        assert w.state(2) == (error.version, w.expected())
        # The chain went around it, and so do later sends.
        assert w.scheme.last_routes == ([((1,), {1: (3,)})] if share else [((1, 3), {})])
        w.randomize()
        report = w.scheme.send(worker_ids=[0, 2])
        assert w.state(0) == (report.version, w.expected())
        assert w.state(2) == (report.version, w.expected())
        with pytest.raises(ws.WorkerLostError):
            w.scheme.send()  # it is still a worker: named again, at once


def test_a_killed_host_leader_is_named_and_another_feeds_the_host() -> None:
    with workers(3) as w:
        w.scheme.connect()
        os.kill(w.procs[0].pid, signal.SIGKILL)
        w.procs[0].join(10)
        w.randomize()
        with pytest.raises(ws.WorkerLostError) as caught:
            w.scheme.send()
        assert caught.value.worker_ids == (0,)
        assert w.scheme.last_routes == [((2,), {2: (3,)})]
        assert w.state(1) == (caught.value.version, w.expected())
        assert w.state(2) == (caught.value.version, w.expected())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to start a worker as another user")
def test_a_worker_that_cannot_map_its_host_leaders_memory_joins_the_chain() -> None:
    """Worker 1 runs as user nobody: /proc/<leader>/fd is closed to it.
    Its copy fails, the send gives it a chain of its own, and later sends
    put it in the chain, beside the leader that feeds the third."""
    with workers(3, uids={2: 65534}) as w:
        w.scheme.connect()  # (the first weights already went this way)
        w.randomize()
        report = w.scheme.send()
        assert w.scheme.last_routes == [((1, 2), {1: (3,)})]
        for wid in range(3):
            assert w.state(wid) == (report.version, w.expected())
        w.randomize()
        report = w.scheme.send()
        assert w.scheme.last_routes == [((1, 2), {1: (3,)})]
        for wid in range(3):
            assert w.state(wid) == (report.version, w.expected())


@pytest.mark.extended
@pytest.mark.parametrize("share", [True, False], ids=["host-leader", "all-in-chain"])
def test_a_stopped_worker_misses_the_deadline_and_the_others_are_updated(share: bool) -> None:
    with workers(3, timeout=5.0, share_on_host=share) as w:
        w.scheme.connect()
        os.kill(w.procs[1].pid, signal.SIGSTOP)
        try:
            w.randomize()
            started = time.monotonic()
            with pytest.raises(ws.AckTimeoutError) as caught:
                w.scheme.send()
            assert 4.9 < time.monotonic() - started < 8
            assert caught.value.worker_ids == (1,)
            # The error says why: where the chain broke, or that it never answered.
            message = str(caught.value)
            if share:
                assert re.search("(did not report|had not reported) on its chain", message), message
            else:
                assert "the chain broke at rank 2 (host" in message, message
            assert w.state(0) == (caught.value.version, w.expected())
            assert w.state(2) == (caught.value.version, w.expected())
        finally:
            os.kill(w.procs[1].pid, signal.SIGCONT)
        # Resumed, it takes the next send.
        w.randomize()
        report = w.scheme.send()
        assert all(w.state(wid) == (report.version, w.expected()) for wid in range(3))


def test_a_worker_connects_with_store_info_and_applies_in_the_background() -> None:
    """sync=False: connect() starts the background applier, so a worker
    that never calls receive() is updated and acks."""
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=30.0)
    trainer = dw.build_model(SHAPES)
    scheme.init_on_sender("policy", num_workers=1, model=trainer, host="127.0.0.1")
    info = scheme.get_store_info()
    assert info is not None and info["host"] == "127.0.0.1" and info["port"] > 0
    ours, theirs = PROCS.Pipe()
    proc = PROCS.Process(target=_background_worker, args=(info, theirs, SHAPES), daemon=True)
    proc.start()
    theirs.close()
    try:
        scheme.connect()
        for tensor in trainer.values():
            tensor.normal_()
        report = scheme.send()
        ours.send("state")
        assert ours.poll(30)
        assert ours.recv() == (report.version, dw.state_of(trainer))
        ours.send("stop")
    finally:
        scheme.shutdown()
        reap([proc])
        ours.close()


def _background_worker(info: dict[str, Any], conn: Any, shapes: dict[str, int]) -> None:
    torch.set_num_threads(1)
    model = dw.build_model(shapes)
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=30.0)  # a fresh one, not pickled
    scheme.init_on_worker("policy", model=model, worker_idx=1, store_info=info)
    try:
        scheme.connect()  # waits for the initial weights, then applies in the background
        while conn.poll(30) and conn.recv() == "state":
            conn.send((scheme.get_receiver().async_receiver.version, dw.state_of(model)))
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("pace", ["acked", pytest.param("overlapping", marks=pytest.mark.extended)])
def test_workers_never_see_a_mix_of_versions(pace: str) -> None:
    """The torn-read probe of test_torn_reads.py: every element of every
    tensor holds the version; a worker that reads a mix fails. Overlapping:
    most sends have a deadline of 1 ms, so the next send's chain runs while
    the workers copy the last one into their models."""
    shapes = {f"w{i}": 1024 * 1024 for i in range(4)}  # 4 x 4 MiB
    scheme = ws.DistributedWeightSyncScheme(timeout=30.0)
    trainer = dw.build_model(shapes)
    scheme.init_on_sender("policy", num_workers=2, model=trainer, host="127.0.0.1")
    receive_timeout = 0.05 if pace == "overlapping" else 0.0
    conns, procs = [], []
    sends = timed_out = 0
    try:
        for rank in (1, 2):
            ctrl, ctrl_child = PROCS.Pipe()
            proc = PROCS.Process(
                target=_probe.scheme_probe,
                args=(scheme, "policy", None, ctrl_child, shapes, 60.0, receive_timeout, rank),
                daemon=True,
            )
            proc.start()
            ctrl_child.close()
            conns.append(ctrl)
            procs.append(proc)
        _probe.start(conns)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            sends += 1
            _probe.fill(trainer, sends)
            if pace == "overlapping" and sends % 4:
                try:
                    scheme.send(timeout=0.001)
                except ws.AckTimeoutError:
                    timed_out += 1
                continue
            scheme.send(timeout=30)
        sends += 1
        _probe.fill(trainer, sends)
        scheme.send(timeout=30)
        reports = _probe.stop(conns)
    finally:
        scheme.shutdown()
        reap(procs)
        for conn in conns:
            conn.close()
    for report in reports:
        assert report.mixed == 0, f"{report.mixed} of {report.reads} reads saw two versions mixed"
        assert report.reads > 0
        assert len(report.versions) > 1
        assert report.last == (float(sends), float(sends))
    if pace == "overlapping":
        assert timed_out > 0


def test_a_worker_hears_at_once_that_its_trainer_died() -> None:
    """This process is the worker; the trainer is SIGKILLed: the next
    receive() raises SenderLostError at once (the liveness connection
    closed), not at its deadline, and shutdown() leaves no thread."""
    ours, theirs = PROCS.Pipe()
    trainer = PROCS.Process(target=dw.trainer_main, args=(theirs, SHAPES), daemon=True)
    trainer.start()
    theirs.close()
    scheme = ws.DistributedWeightSyncScheme(timeout=30.0)
    try:
        assert ours.poll(60)
        info = ours.recv()
        model = dw.build_model(SHAPES)
        scheme.init_on_worker("policy", model=model, worker_idx=1, store_info=info)
        scheme.connect(background=False)
        assert ours.poll(30) and ours.recv() == "connected"
        assert scheme.get_receiver().async_receiver.version == 1
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.join(10)
        started = time.monotonic()
        with pytest.raises(ws.SenderLostError) as caught:
            scheme.receive(timeout=20)
        assert not isinstance(caught.value, ws.SenderClosedError)
        assert time.monotonic() - started < 5
    finally:
        scheme.shutdown()
        reap([trainer])
        ours.close()
    assert not [t for t in _weightsync_threads() if t.name.startswith("weightsync-relay")]


def _weightsync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("weightsync-")]


def _fd_baseline() -> set[int]:
    """As conftest's, once a TCPStore has run in this process: the first one
    leaves a process-wide pipe (libuv's), which is not weightsync's to close."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    del store
    return fd_baseline()


@pytest.mark.parametrize("killed", [False, True], ids=["clean", "a-worker-killed"])
def test_nothing_is_left_behind_after_shutdown(killed: bool) -> None:
    """After shutdown() (and, killed: after a worker was SIGKILLed and
    named), no thread, descriptor or child process is left, in the trainer
    or in a worker."""
    fds_before = _fd_baseline()
    threads_before = set(_weightsync_threads())
    with workers(2) as w:
        w.scheme.connect()
        w.randomize()
        w.scheme.send()
        if killed:
            os.kill(w.procs[0].pid, signal.SIGKILL)
            with pytest.raises(ws.WorkerLostError):
                w.scheme.send()
        w.scheme.shutdown()
        w.scheme.shutdown()  # idempotent
        for conn in w.conns[1:] if killed else w.conns:
            assert conn.poll(30), "a worker did not hear the shutdown"
            kind, _, threads = conn.recv()
            assert kind == "closed"
            assert threads == [], f"a worker kept threads: {threads}"
        reap(w.procs)
        assert [p.exitcode for p in w.procs] == ([-signal.SIGKILL, 0] if killed else [0, 0])
        for proc in w.procs:
            proc.close()
        w.procs = []
    assert PROCS.active_children() == []
    assert set(_weightsync_threads()) <= threads_before
    deadline = time.monotonic() + 10
    while open_fds() - fds_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds() <= fds_before, _describe(open_fds() - fds_before)


def _describe(fds: set[int]) -> list[str]:
    found = []
    for fd in sorted(fds):
        with contextlib.suppress(OSError):
            found.append(f"{fd}: {os.readlink(f'/proc/self/fd/{fd}')}")
    return found


def test_nccl_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="CUDA staging"):
        ws.DistributedWeightSyncScheme(backend="nccl")
    with pytest.raises(ValueError, match="gloo"):
        ws.DistributedWeightSyncScheme(backend="mpi")


def test_the_scheme_pickles_as_configuration_with_its_store() -> None:
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=5.0)
    assert scheme.get_store_info() is None
    scheme.init_on_sender("policy", num_workers=1, model=dw.build_model(SHAPES), host="127.0.0.1")
    try:
        copy = pickle.loads(pickle.dumps(scheme))
        assert (copy.backend, copy.sync, copy.timeout) == ("gloo", False, 5.0)
        assert copy.get_store_info() == scheme.get_store_info()
        assert not copy.initialized_on_sender
        with pytest.raises(ValueError, match="worker_idx"):
            copy.init_on_worker("policy", model=dw.build_model(SHAPES), worker_idx=0)
    finally:
        scheme.shutdown()
