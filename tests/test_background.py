"""The rendezvous of ``connect()`` and the background applier: how a worker
that never calls ``receive()`` (torchrl's collectors) takes its updates.

- ``connect()`` on both sides: the sender sends the initial weights once
  every worker announced itself; each worker blocks until they are applied,
  a model built on the meta device included, which is never acked before it
  holds them.
- After it, each update is applied as it arrives, between two forward calls
  of the worker's model, never during one (a torn-read probe whose every
  forward call reads all the tensors slowly).
"""

from __future__ import annotations

import time

import pytest
import torch
from harness import PROCS, make_scheme, reap, schemes, start_pipe_worker, start_worker, torn_read_probe
from harness import background_workers as workers
from harness.workers import Net, snapshot
from tensordict import TensorDict

import weightsync as ws

SHAPES = {f"w{i}": 1024 * 1024 for i in range(4)}  # 4 x 4 MiB of float32
SEND_SECONDS = 2.0


def _start(target: object, scheme: ws.WeightSyncScheme, n: int, *args: object) -> tuple[list, list, list]:
    """``n`` worker processes running ``target(scheme, pipe, ctrl, *args)``:
    (the trainer's pipe ends, the control ends, the processes)."""
    pipes, conns, procs = [], [], []
    for _ in range(n):
        proc, ours, ctrl = start_pipe_worker(target, lambda pipe, ctrl: (scheme, pipe, ctrl, *args))
        pipes.append(ours)
        conns.append(ctrl)
        procs.append(proc)
    return pipes, conns, procs


def _ready(conns: list) -> None:
    for conn in conns:
        assert conn.poll(60), "a worker did not start"
        assert conn.recv()[0] == "ready"


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_background_updates_land_between_two_forward_calls(scheme_name: str) -> None:
    scheme = make_scheme(scheme_name)
    trainer = TensorDict({name: torch.zeros(numel) for name, numel in SHAPES.items()}, batch_size=[])
    pipes, conns, procs = _start(workers.background_probe, scheme, 2, SHAPES, 60.0)
    try:
        scheme.init_on_sender("policy", pipes=pipes, model=trainer)
        torn_read_probe.start(conns)
        sends = 1
        torn_read_probe.fill(trainer, sends)
        report = scheme.connect()
        assert report is not None and report.version == 1 and report.worker_ids == (0, 1)
        deadline = time.monotonic() + SEND_SECONDS
        while time.monotonic() < deadline:
            sends += 1
            torn_read_probe.fill(trainer, sends)
            scheme.send(timeout=30)  # acked: applied by the workers' applier threads
        results = []
        for conn in conns:
            conn.send("stop")
            assert conn.poll(30), "a probe did not report"
            results.append(conn.recv())
    finally:
        reap(procs)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    for _, report, applied in results:
        print(
            f"{scheme_name} probe {report.pid}: {report.reads} forward calls, {report.mixed} mixed, "
            f"{len(report.versions)} versions seen whole; {applied} of {sends} sends applied"
        )
        assert report.mixed == 0
        assert len(report.versions) > 1  # updates landed while it ran
        assert applied == sends  # every send was applied and called on_update


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_a_meta_model_gets_storage_and_the_weights_before_its_ack(scheme_name: str) -> None:
    scheme = make_scheme(scheme_name)
    trainer = Net()
    pipes, conns, procs = _start(workers.meta_worker, scheme, 1, 16)
    try:
        scheme.init_on_sender("policy", pipes=pipes, model=trainer)
        _ready(conns)
        report = scheme.connect()
        assert report is not None and report.worker_ids == (0,)
        assert conns[0].poll(30)
        tag, weights, version = conns[0].recv()
        conns[0].send("done")
    finally:
        reap(procs)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    assert tag == "weights" and version == 1
    expected = snapshot(trainer)
    assert set(weights) == set(expected)
    for name, tensor in expected.items():
        assert weights[name].device.type == "cpu", name
        assert torch.equal(weights[name], tensor), name


def test_a_meta_model_that_does_not_fit_is_refused_and_never_acked() -> None:
    scheme = ws.MultiProcessWeightSyncScheme(timeout=30)
    pipes, conns, procs = _start(workers.meta_worker, scheme, 1, 32)  # the trainer's Net has 16
    try:
        scheme.init_on_sender("policy", pipes=pipes, model=Net())
        _ready(conns)
        with pytest.raises(ws.WeightMismatchError, match="worker 0"):
            scheme.connect()
        scheme.shutdown()  # the worker's connect() then ends
        assert conns[0].poll(30)
        tag, kind, message, weights = conns[0].recv()
        conns[0].send("done")
    finally:
        reap(procs)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    assert (tag, kind) == ("error", "SenderClosedError"), message
    assert all(t.is_meta for t in weights.values())  # never written, never acked


def test_connect_waits_for_the_initial_weights_up_to_its_timeout() -> None:
    # A worker whose sender never sends: connect() raises in time, model untouched.
    worker = ws.InProcessWeightSyncScheme()
    trainer = ws.InProcessWeightSyncScheme()
    trainer.init_on_sender("policy", num_workers=1)  # no model: nothing to send at connect
    model = Net()
    before = snapshot(model)
    try:
        import copy

        worker = copy.copy(trainer)
        worker.init_on_worker("policy", model=model, worker_idx=0)
        assert trainer.connect(timeout=10) is None  # announced, nothing to send
        started = time.monotonic()
        with pytest.raises(ws.WaitTimeoutError, match=r"within 0\.5 s"):
            worker.connect(timeout=0.5)
        assert 0.5 <= time.monotonic() - started < 5
        assert not worker.synchronized_on_receiver
        for name, tensor in before.items():
            assert torch.equal(snapshot(model)[name], tensor)
    finally:
        worker.shutdown()
        trainer.shutdown()


def test_an_on_update_that_raises_is_reported_to_the_sender_and_the_applier_goes_on() -> None:
    scheme = ws.MultiProcessWeightSyncScheme(timeout=30)
    trainer = Net()
    pipes, conns, procs = _start(workers.raising_on_update, scheme, 1)
    try:
        scheme.init_on_sender("policy", pipes=pipes, model=trainer)
        _ready(conns)
        scheme.connect()  # the first call of on_update succeeds
        raised = "on_update raised ValueError: the user's callback failed"
        with pytest.raises(ws.WorkerApplyError, match=raised):
            scheme.send()
        with pytest.raises(ws.WorkerApplyError, match="worker 0"):
            scheme.send()  # the applier is still there: it answers again
        conns[0].send("stop")
        assert conns[0].poll(30)
        tag, calls = conns[0].recv()
    finally:
        reap(procs)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    assert (tag, calls) == ("calls", [1, 2, 3])


def test_the_scheme_makes_its_own_pipes_and_the_workers_find_their_ends() -> None:
    # As torchrl's collectors use it: init_on_sender(ctx=...) makes the pipes,
    # the pickled scheme carries the worker ends, worker_idx picks one.
    scheme = ws.MultiProcessWeightSyncScheme(timeout=30)
    trainer = Net()
    scheme.init_on_sender("policy", model=trainer, num_workers=2, ctx=PROCS)
    conns, procs = [], []
    try:
        for i in range(2):
            proc, ctrl = start_worker(workers.own_pipe_worker, lambda ctrl, i=i: (scheme, i, ctrl))
            conns.append(ctrl)
            procs.append(proc)
        scheme.connect()
        with torch.no_grad():
            trainer.inp.weight.add_(1.0)
        scheme.send()
        for conn in conns:
            conn.send("report")
        results = [conn.recv() if conn.poll(30) else None for conn in conns]
        assert all(torch.equal(r["inp.weight"], trainer.inp.weight.detach()) for r in results)
        # The trainer let go of the worker ends at connect(): a worker that
        # dies is seen at once, by name.
        procs[1].kill()
        procs[1].join(10)
        with pytest.raises(ws.WorkerLostError, match="worker 1"):
            scheme.send(timeout=20)
    finally:
        for conn in conns:
            conn.close()
        reap(procs)
        scheme.shutdown()


def test_a_worker_given_a_new_model_updates_it_from_then_on() -> None:
    # torchrl's collectors do this when they move a worker's policy to its device.
    import copy
    import pickle
    import threading

    trainer_model = Net()
    trainer = ws.InProcessWeightSyncScheme(timeout=30)
    trainer.init_on_sender("policy", model=trainer_model, num_workers=1)
    worker = copy.copy(trainer)
    first = Net()
    worker.init_on_worker("policy", model=first, worker_idx=0)
    try:
        joined = threading.Thread(target=worker.connect)
        joined.start()
        trainer.connect()
        joined.join(30)
        assert worker.synchronized_on_receiver and worker.get_receiver().applying_in_background
        second = copy.deepcopy(first)
        before = snapshot(first)
        worker.model = second
        with torch.no_grad():
            trainer_model.inp.weight.add_(1.0)
        trainer.send()
        assert torch.equal(second.inp.weight, trainer_model.inp.weight)
        assert all(torch.equal(t, before[name]) for name, t in snapshot(first).items())
        # The hooks that guard its forward calls do not keep it from being pickled.
        assert torch.equal(pickle.loads(pickle.dumps(second)).inp.weight, second.inp.weight)
    finally:
        worker.shutdown()
        trainer.shutdown()


def test_a_foreign_message_at_the_rendezvous_names_the_worker() -> None:
    # What torchrl's collector workers send on their own pipes: had the scheme
    # been given those, connect() would read it. A weightsync error, by name.
    import multiprocessing

    scheme = ws.MultiProcessWeightSyncScheme(timeout=10)
    ours, theirs = multiprocessing.Pipe()
    try:
        scheme.init_on_sender("policy", pipes=[ours], model=Net())
        theirs.send({"error": True, "exception_type": "KeyError", "exception_msg": "0"})
        with pytest.raises(ws.WorkerProtocolError, match="worker 0") as raised:
            scheme.connect()
        assert raised.value.worker_ids == (0,)
    finally:
        scheme.shutdown()
        theirs.close()


def test_a_context_counts_the_updates_after_the_initial_weights() -> None:
    # torchrl's collectors count policy versions: the initial weights (the
    # sender's connect) are version 0, each later update adds one.
    import copy
    import threading

    class Context:
        def __init__(self, model: Net) -> None:
            self.model = model
            self.versions = 0

        def increment_version(self) -> None:
            self.versions += 1

    trainer_model = Net()
    trainer = ws.InProcessWeightSyncScheme(timeout=30)
    trainer.init_on_sender("policy", model=trainer_model, num_workers=1)
    worker = copy.copy(trainer)
    context = Context(Net())
    worker.init_on_worker("policy", context=context, worker_idx=0)
    try:
        joined = threading.Thread(target=worker.connect)
        joined.start()
        assert trainer.connect() is not None  # the initial weights went out
        joined.join(30)
        assert worker.synchronized_on_receiver and context.versions == 0
        for sent in (1, 2):
            trainer.send()  # returns once applied, on_update and the count included
            assert context.versions == sent
    finally:
        worker.shutdown()
        trainer.shutdown()
