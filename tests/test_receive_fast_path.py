"""receive() with an update pending: applied and acked on the calling thread,
without entering an event loop, with every guarantee of the coroutine path.

Trainer and worker share this process (the trainer's sends run on a thread),
so the test sees which of the worker's calls enter a loop."""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import weightsync as ws
from weightsync._runtime import RUNTIME


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


class Pair:
    def __init__(self) -> None:
        ours, theirs = mp.Pipe()
        self.trainer = _model()
        self.worker = _model()
        with torch.no_grad():
            for p in self.worker.parameters():
                p.zero_()
        self.sending = ws.MultiProcessWeightSyncScheme(timeout=10)
        self.sending.init_on_sender("m", model=self.trainer, pipes=[ours], num_workers=1)
        self.receiving = ws.MultiProcessWeightSyncScheme(timeout=10)
        self.receiving.init_on_worker("m", pipe=theirs, model=self.worker)
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def send(self, weights: Any = None) -> concurrent.futures.Future[Any]:
        return self.pool.submit(self.sending.get_sender().send, weights)

    def receive(self, timeout: float = 10.0) -> int | None:
        return self.receiving.receive(timeout=timeout)

    def close(self) -> None:
        self.pool.shutdown()
        self.receiving.shutdown()
        self.sending.shutdown()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    first = p.send()
    assert p.receive() == 1  # the first call announces the worker: it runs the coroutine
    first.result(10)
    yield p
    p.close()


@pytest.fixture
def no_loop_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any blocking call of this thread that would enter an event loop."""
    me = threading.current_thread()
    call = RUNTIME.call

    def guarded(func: Any, *args: Any) -> Any:
        assert threading.current_thread() is not me, "the worker entered an event loop"
        return call(func, *args)

    monkeypatch.setattr(RUNTIME, "call", guarded)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_a_pending_update_is_applied_and_acked_without_a_loop(pair: Pair, no_loop_here: None) -> None:
    ptrs = [p.data_ptr() for p in pair.worker.parameters()]
    with torch.no_grad():
        pair.trainer[0].weight.add_(1.0)
    sent = pair.send()
    assert pair.receive() == 2
    report = sent.result(10)
    assert report.version == 2 and pair.sending.get_sender().worker_versions == {0: 2}
    assert _same(pair.trainer, pair.worker)
    assert [p.data_ptr() for p in pair.worker.parameters()] == ptrs  # copied in place


def test_an_update_that_no_longer_fits_is_refused_and_the_model_left_alone(
    pair: Pair, no_loop_here: None
) -> None:
    with torch.no_grad():
        pair.trainer[1].bias.add_(1.0)
    pair.worker[1].bias.data = torch.zeros(3)  # the worker's model changed since it announced
    before = {k: v.clone() for k, v in pair.worker.state_dict().items()}
    sent = pair.send()
    assert pair.receive() is None
    with pytest.raises(ws.WorkerApplyError, match="layout"):
        sent.result(10)
    assert all(torch.equal(before[k], v) for k, v in pair.worker.state_dict().items())


def test_a_sender_that_shut_down_is_reported_without_a_loop(pair: Pair, no_loop_here: None) -> None:
    pair.pool.submit(pair.sending.shutdown).result(10)
    with pytest.raises(ws.SenderClosedError):
        pair.receive(timeout=5.0)


def test_a_sender_whose_pipe_closed_is_reported(pair: Pair) -> None:
    pair.sending.get_sender().async_sender.transports[0]._channel.conn.close()
    with pytest.raises(ws.SenderLostError):
        pair.receive(timeout=5.0)
