"""Options of torchrl's schemes: ``devices=`` gives the number of
workers, and ``per_worker_weights=True`` keeps weights of its own on each
worker (a policy factory per worker), updated by ``send({worker_id:
weights})`` or ``send(weights, worker_ids=i)``, under every scheme;
``params_map={worker_idx: weights}`` gives the workers and the weights
``send()`` reads, and ``sync=False`` returns from ``send()`` once the
weights are staged, under both pipe schemes."""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from harness import PROCS, Cluster, new_cluster, reap, schemes, start_worker
from harness import background_workers as workers
from harness.workers import Net, build_model
from tensordict import TensorDict

import weightsync as ws


def _weights(kind: str, seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(kind, seed=seed).state_dict().items()}


@pytest.mark.parametrize(
    "cls", [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme, ws.InProcessWeightSyncScheme]
)
def test_devices_give_the_number_of_workers(cls: type[ws.WeightSyncScheme]) -> None:
    scheme = cls()
    devices = [torch.device("cpu")] * 3
    if cls is ws.InProcessWeightSyncScheme:
        scheme.init_on_sender("policy", model=build_model("net"), devices=devices)
    else:
        spawn = mp.get_context("spawn")
        scheme.init_on_sender("policy", model=build_model("net"), devices=devices, ctx=spawn)
    try:
        assert sorted(scheme.sender_transports) == [0, 1, 2]
    finally:
        scheme.shutdown()


@pytest.mark.parametrize("scheme_name", schemes())
def test_each_worker_gets_its_own_weights(request: pytest.FixtureRequest, scheme_name: str) -> None:
    # Worker 2's policy has another layout (another factory): only its own
    # weights fit it.
    c: Cluster = new_cluster(request, scheme_name, ["net", "net", "wide"], per_worker_weights=True)
    try:
        own = {0: _weights("net", 10), 1: _weights("net", 11), 2: _weights("wide", 12)}
        report = c.scheme.send(own)
        assert report is not None and report.worker_ids == (0, 1, 2)
        for i in range(3):
            c.assert_has(i, own[i])
        # One worker alone, with weights of its own.
        alone = _weights("net", 13)
        c.sender.send(alone, worker_ids=1)
        for i, expected in ((0, own[0]), (1, alone), (2, own[2])):
            c.assert_has(i, expected)
        # Changed right after send_async() returned: each gets its own as at the call.
        again = {0: _weights("net", 14), 2: _weights("wide", 15)}
        expected = {i: {k: v.clone() for k, v in w.items()} for i, w in again.items()}
        c.sender.send_async(again)
        for weights in again.values():
            for tensor in weights.values():
                tensor.zero_()
        c.sender.wait_async(30)
        for i in (0, 2):
            c.assert_has(i, expected[i])
        c.assert_has(1, alone)
        # One set of weights for all does not fit worker 2: nothing moves.
        version = c.sender.async_sender.version
        with pytest.raises(ws.WeightMismatchError, match="worker 2"):
            c.scheme.send(_weights("net", 16))
        assert c.sender.async_sender.version == version
        with pytest.raises(ws.UnknownWorkerError):
            c.scheme.send({0: own[0], 7: own[1]})
        with pytest.raises(ValueError, match="worker_ids"):
            c.scheme.send({0: own[0]}, worker_ids=[0])
        assert c.sender.async_sender.version == version
    finally:
        c.close()


def test_weights_keyed_by_worker_need_per_worker_weights(request: pytest.FixtureRequest) -> None:
    c: Cluster = new_cluster(request, "inprocess", ["net", "net"])
    try:
        version = c.sender.async_sender.version
        with pytest.raises(ValueError, match="per_worker_weights=True"):
            c.scheme.send({0: _weights("net", 1), 1: _weights("net", 2)})
        assert c.sender.async_sender.version == version
        c.bump()
        c.scheme.send()
        for i in range(2):
            c.assert_has(i, c.expected())
    finally:
        c.close()


PIPE_CLASSES = [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme]


def _start_own_pipe_workers(scheme: ws.WeightSyncScheme, n: int) -> tuple[list[Connection], list[Any]]:
    """``n`` workers of a scheme that made its own pipes; each reports its
    tensors when asked on its connection."""
    conns, procs = [], []
    for i in range(n):
        proc, ctrl = start_worker(workers.own_pipe_worker, lambda ctrl, i=i: (scheme, i, ctrl))
        conns.append(ctrl)
        procs.append(proc)
    return conns, procs


def _reports(conns: list[Connection]) -> Iterator[dict[str, torch.Tensor]]:
    for conn in conns:
        conn.send("report")
        assert conn.poll(30), "a worker did not report"
        yield conn.recv()


@pytest.mark.parametrize("cls", PIPE_CLASSES)
def test_params_map_gives_the_workers_and_the_weights_that_send_reads(
    cls: type[ws.WeightSyncScheme],
) -> None:
    # As torchrl's SharedMemWeightSyncScheme takes it before a collector
    # starts: a worker per key, and (no model given) send() reads the
    # weights of worker 0's entry.
    trainer = Net()
    weights = TensorDict.from_module(trainer)
    scheme = cls(timeout=30)
    scheme.init_on_sender(params_map={0: weights, 1: weights}, ctx=PROCS)
    conns, procs = _start_own_pipe_workers(scheme, 2)
    try:
        assert sorted(scheme.sender_transports) == [0, 1]
        scheme.connect()
        with torch.no_grad():
            trainer.inp.weight.add_(1.0)
        scheme.send()
        for report in _reports(conns):
            assert torch.equal(report["inp.weight"], trainer.inp.weight.detach())
    finally:
        for conn in conns:
            conn.close()
        reap(procs)
        scheme.shutdown()


@pytest.mark.parametrize(
    ("params_map", "kwargs", "match"),
    [
        ({1: None, 2: None}, {}, "worker indices 0 to N-1"),
        ({0: None, 2: None}, {}, "worker indices 0 to N-1"),
        ({}, {}, "worker indices 0 to N-1"),
        ([None, None], {}, "must be a dict"),
        ({0: None, 1: None}, {"num_workers": 3}, "num_workers=3 but params_map has 2 workers"),
    ],
)
def test_a_params_map_that_does_not_name_the_workers_is_refused(
    params_map: Any, kwargs: dict[str, Any], match: str
) -> None:
    weights = TensorDict.from_module(Net())
    if isinstance(params_map, dict):
        params_map = dict.fromkeys(params_map, weights)
    scheme = ws.SharedMemWeightSyncScheme()
    with pytest.raises(ValueError, match=match):
        scheme.init_on_sender("policy", params_map=params_map, ctx=PROCS, **kwargs)
    assert not scheme.initialized_on_sender
    scheme.shutdown()


@pytest.mark.parametrize("cls", PIPE_CLASSES)
def test_sync_false_returns_once_staged_and_the_next_send_gathers_the_acks(
    cls: type[ws.WeightSyncScheme],
) -> None:
    assert cls().sync and not cls(sync=False).sync
    assert not pickle.loads(pickle.dumps(cls(sync=False))).sync
    trainer = Net()
    scheme = cls(timeout=30, sync=False)
    scheme.init_on_sender("policy", model=trainer, num_workers=2, ctx=PROCS)
    conns, procs = _start_own_pipe_workers(scheme, 2)
    sender = scheme.get_sender()
    try:
        scheme.connect()  # the rendezvous still waits for every worker
        assert not sender.pending
        with torch.no_grad():
            trainer.inp.weight.add_(1.0)
        expected = trainer.inp.weight.detach().clone()
        assert scheme.send() is None
        assert sender.pending
        with torch.no_grad():
            trainer.inp.weight.add_(1.0)  # after the call: not sent
        report = sender.wait_async(30)
        assert report.worker_ids == (0, 1)
        for worker in _reports(conns):
            assert torch.equal(worker["inp.weight"], expected)
        # Two sends in a row: the second waits for the first's acks.
        assert scheme.send() is None
        assert scheme.send() is None
        sender.wait_async(30)
        for worker in _reports(conns):
            assert torch.equal(worker["inp.weight"], trainer.inp.weight.detach())
        # A send's error comes from the next send, before that one moves anything.
        procs[1].kill()
        procs[1].join(10)
        assert scheme.send(timeout=20) is None
        version = sender.async_sender.version
        with pytest.raises(ws.WorkerLostError, match="worker 1"):
            scheme.send(timeout=20)
        assert sender.async_sender.version == version
        assert not sender.pending
    finally:
        for conn in conns:
            conn.close()
        reap(procs)
        scheme.shutdown()
