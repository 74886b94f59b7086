"""DistributedWeightSyncScheme with models on a GPU (``cuda``; skipped where
no CUDA device is visible): the trainer's model on the GPU, its workers'
on the GPU and on the host, all on one host (ranks 1..N on 127.0.0.1,
rank 1 the host leader that feeds the others, as in test_distributed.py).

What each case holds: every worker gets the trainer's weights bit for bit
and its tensors keep their device and memory; the trainer's staging buffer
is page-locked; work the trainer enqueues on its stream right after
``send()`` or ``send_async()`` returned never reaches a worker (the copies
out of the GPU run on that stream, in chunks that the chain's frames wait
for); deltas and digests (``verify=True``) are taken over the same bytes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness import start_worker, weight_checksums
from tensordict import TensorDict
from test_distributed import Workers

import weightsync as ws

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
    pytest.mark.timeout(120),
]

# 12 MiB in a few tensors: several of the copies' chunks, and frames that span tensors.
SHAPES = {"w0": 3 << 20, "w1": 3001, "w2": 7}


def make_model(shapes: dict[str, int], device: str) -> TensorDict:
    tensors = {name: torch.zeros(numel, device=device) for name, numel in shapes.items()}
    return TensorDict(tensors, batch_size=[])


def gpu_worker(scheme: ws.DistributedWeightSyncScheme, rank: int, conn: Any, device: str) -> None:
    """Worker ``rank`` with its model on ``device``: receives at its safe
    point and answers "state" with (version, checksums, devices, data_ptrs)."""
    model = make_model(SHAPES, device)
    ptrs = {name: t.data_ptr() for name, t in model.items()}
    scheme.init_on_worker("policy", model=model, worker_idx=rank)
    conn.send(("ready", os.getpid(), ptrs))
    version = None
    try:
        while True:
            try:
                got = scheme.receive(timeout=0.02)
            except ws.SenderClosedError:
                return
            if got is not None:
                version = got
            if conn.poll():
                if conn.recv() == "stop":
                    return
                tensors = dict(model.items())
                conn.send(
                    (
                        version,
                        weight_checksums(model),
                        {name: t.device.type for name, t in tensors.items()},
                        {name: t.data_ptr() for name, t in tensors.items()},
                    )
                )
    finally:
        scheme.shutdown()


class GpuWorkers(Workers):
    """The trainer (this process, its model on the GPU) and one worker
    process per entry of ``devices``, rank 1 first (test_distributed's
    ``Workers``, on the GPU)."""

    def __init__(self, devices: list[str], **options: Any) -> None:
        self.devices = devices
        self.trainer = make_model(SHAPES, "cuda")
        self.scheme = ws.DistributedWeightSyncScheme(timeout=60.0, **options)
        self.scheme.init_on_sender("policy", num_workers=len(devices), model=self.trainer, host="127.0.0.1")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.ptrs: list[dict[str, int]] = []
        for rank, device in enumerate(devices, start=1):
            proc, ours = start_worker(gpu_worker, lambda conn, r=rank, d=device: (self.scheme, r, conn, d))
            self.procs.append(proc)
            self.conns.append(ours)
        for conn in self.conns:
            assert conn.poll(90), "a worker did not start"
            tag, _, ptrs = conn.recv()
            assert tag == "ready"
            self.ptrs.append(ptrs)

    def check(self, version: int, expected: dict[str, int]) -> None:
        """Every worker holds ``version``, bit for bit ``expected``, on its own device and memory."""
        for i, conn in enumerate(self.conns):
            conn.send("state")
            assert conn.poll(60), f"worker {i} did not answer"
            got, sums, devices, ptrs = conn.recv()
            assert got == version, f"worker {i} holds version {got}, not {version}"
            assert sums == expected, f"worker {i} ({self.devices[i]}) does not hold the weights sent"
            assert set(devices.values()) == {self.devices[i]}, f"worker {i}: {devices}"
            assert ptrs == self.ptrs[i], f"worker {i}: a tensor moved"


@contextlib.contextmanager
def gpu_workers(devices: list[str], **options: Any) -> Iterator[GpuWorkers]:
    made = GpuWorkers(devices, **options)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def mixed() -> Iterator[GpuWorkers]:
    """A host leader on the GPU, a follower on the host, a follower on the GPU."""
    with gpu_workers(["cuda", "cpu", "cuda"]) as w:
        w.scheme.connect()
        yield w


def test_gpu_and_cpu_workers_get_a_gpu_trainers_weights_bit_exact(mixed: GpuWorkers) -> None:
    for _ in range(3):
        mixed.randomize()
        expected = mixed.expected()
        report = mixed.scheme.send()
        assert report.worker_ids == (0, 1, 2)
        mixed.check(report.version, expected)
    staged = mixed.scheme.staging._buffer
    assert staged is not None and staged.is_pinned(), "the trainer's staging buffer is not page-locked"


@pytest.mark.parametrize("call", ["send", "send_async"])
def test_work_enqueued_after_send_never_reaches_a_worker(mixed: GpuWorkers, call: str) -> None:
    """A fill_ enqueued on the trainer's stream as soon as the call returned
    (before anything synchronises) is never what a worker holds."""
    mixed.randomize()
    expected = mixed.expected()
    sender = mixed.scheme.get_sender()
    if call == "send":
        version = sender.send().version
    else:
        sender.send_async()
    for tensor in mixed.trainer.values():
        tensor.fill_(float("nan"))
    if call == "send_async":
        version = sender.wait_async().version
    mixed.check(version, expected)


def test_deltas_from_a_gpu_trainer_are_bit_exact() -> None:
    pytest.importorskip("blosc2")
    with gpu_workers(["cuda", "cpu"], delta="always") as w:
        w.scheme.connect()
        for _ in range(4):
            # About 1% of the elements change, on the GPU.
            for tensor in w.trainer.values():
                picked = torch.randperm(tensor.numel(), device="cuda")[: max(1, tensor.numel() // 100)]
                tensor[picked] += torch.randn(picked.numel(), device="cuda")
            expected = w.expected()
            report = w.scheme.send()
            assert w.scheme.last_delta == [True], w.scheme.last_delta_choice
            w.check(report.version, expected)


def test_verified_sends_from_a_gpu_trainer_are_bit_exact() -> None:
    pytest.importorskip("xxhash")
    with gpu_workers(["cuda", "cpu"], verify=True) as w:
        w.scheme.connect()
        for _ in range(2):
            w.randomize()
            expected = w.expected()
            report = w.scheme.send()
            w.check(report.version, expected)
