"""send_async() returns once the weights are staged: the trainer may change
them at once, and every worker still gets exactly the weights as they were
at the call.

The workers are torn-read probes (``harness.torn_read_probe``): each checks, between two
``receive()`` calls, that its weights hold one value throughout, and applies
an update as soon as it is announced, so it copies while the trainer
changes its weights. The trainer fills every element with the version
number, calls ``send_async()``, and at once fills them with minus that
number (the next training step, writing the same tensors), then
``wait_async()``. A worker that read the trainer's tensors after the call
would see a negative value, whole or mixed with the version. Over every
scheme, and over the coroutine API (``send_async`` then ``await``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch
from harness import RayRuntime, make_scheme, reap, start_pipe_worker, torn_read_probe
from tensordict import TensorDict

import weightsync as ws

SHAPES = {f"w{i}": 4 * 1024 * 1024 for i in range(4)}  # 4 x 16 MiB of float32
SEND_SECONDS = 1.0
WORKERS = 2


def _trainer_weights() -> TensorDict:
    return TensorDict({name: torch.zeros(numel) for name, numel in SHAPES.items()}, batch_size=[])


def _start_probes(scheme_name: str, scheme: ws.WeightSyncScheme) -> tuple[list[Any], list[Any], list[Any]]:
    """The probe workers (processes, or threads of the in-process scheme),
    their control connections, and the trainer's pipe ends (if any)."""
    workers, conns, pipes = [], [], []
    for i in range(WORKERS):
        worker: Any
        if scheme_name == "inprocess":
            ctrl, ctrl_child = mp.Pipe()
            worker = threading.Thread(
                target=torn_read_probe.scheme_probe,
                args=(copy.copy(scheme), "policy", None, ctrl_child, SHAPES, 60.0, 0.05),
                kwargs={"worker_idx": i},
                daemon=True,
            )
            worker.start()
        else:
            worker, ours, ctrl = start_pipe_worker(
                torn_read_probe.scheme_probe,
                lambda pipe, ctrl: (scheme, "policy", pipe, ctrl, SHAPES, 60.0, 0.05),
            )
            pipes.append(ours)
        workers.append(worker)
        conns.append(ctrl)
    return workers, conns, pipes


def _check(reports: list[torn_read_probe.ProbeReport], last: int, sends: int) -> None:
    for report in reports:
        print(
            f"probe {report.pid}: {report.reads} reads, {report.mixed} mixed, "
            f"{len(report.versions)} versions seen whole of {sends} sends"
        )
        assert report.mixed == 0, f"{report.mixed} of {report.reads} reads saw two versions mixed"
        changed = sorted(v for v in report.versions if v < 0)
        assert not changed, f"a worker saw weights changed after send_async() returned: {changed}"
        assert len(report.versions) > 1, "no update landed while the probe read"
        assert report.last == (float(last), float(last)), f"ended on {report.last}, not version {last}"


def _send_and_change(sender: ws.WeightSender, trainer: TensorDict) -> tuple[int, int]:
    """Send, changing the weights right after each send_async(), for
    SEND_SECONDS; the last version and the number of sends."""
    sends = 0
    deadline = time.monotonic() + SEND_SECONDS
    while time.monotonic() < deadline:
        sends += 1
        torn_read_probe.fill(trainer, sends)
        sender.send_async()
        torn_read_probe.fill(trainer, -sends)
        report = sender.wait_async(30)
        assert report.version == sends
        assert 0 < report.staged_seconds <= report.seconds
    return sends, sends


async def _send_and_change_async(sender: ws.AsyncWeightSender, trainer: TensorDict) -> tuple[int, int]:
    sends = 0
    deadline = time.monotonic() + SEND_SECONDS
    while time.monotonic() < deadline:
        sends += 1
        torn_read_probe.fill(trainer, sends)
        pending = await sender.send_async()
        assert pending.version == sends
        torn_read_probe.fill(trainer, -sends)
        report = await (pending if sends % 2 else sender.wait_async())
        assert report.version == sends
        assert await pending == report  # once over, it keeps its outcome
    return sends, sends


@pytest.mark.parametrize(
    "scheme_name, api",
    [
        ("multiprocess", "blocking"),
        ("shared", "blocking"),
        ("inprocess", "blocking"),
        ("multiprocess", "async"),
    ],
)
def test_weights_changed_once_send_async_returned_reach_no_worker(scheme_name: str, api: str) -> None:
    scheme = make_scheme(scheme_name)
    trainer = _trainer_weights()
    workers, conns, pipes = _start_probes(scheme_name, scheme)
    try:
        if scheme_name == "inprocess":
            scheme.init_on_sender("policy", model=trainer, num_workers=WORKERS)
        else:
            scheme.init_on_sender("policy", pipes=pipes, model=trainer)
        torn_read_probe.start(conns)
        if api == "async":
            last, sends = asyncio.run(_send_and_change_async(scheme.get_async_sender(), trainer))
        else:
            last, sends = _send_and_change(scheme.get_sender(), trainer)
        reports = torn_read_probe.stop(conns)
    finally:
        if scheme_name == "inprocess":
            for conn in conns:
                with contextlib.suppress(OSError):  # (a probe that stopped closed its end)
                    conn.send("stop")
            for thread in workers:
                thread.join(20)
        else:
            reap(workers)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    _check(reports, last, sends)


def test_weights_changed_once_send_async_returned_reach_no_ray_actor(ray_runtime: RayRuntime) -> None:
    ray = pytest.importorskip("ray")
    from harness.workers import AsyncRayProbe, probe_weights

    # An async actor's scan reads its weights again and again, awaiting in
    # between: the points where an update may land.
    actor = ray.remote(num_cpus=0)(AsyncRayProbe).remote(ws.RayWeightSyncScheme())
    trainer = probe_weights()
    scheme = make_scheme("ray")
    scheme.init_on_sender("probe", remote_collectors=[actor], model=trainer)
    try:
        torn_read_probe.fill(trainer, 1)
        scheme.send()
        scan = actor.scan.remote(SEND_SECONDS + 1.0)
        sender = scheme.get_sender()
        sends = 1
        deadline = time.monotonic() + SEND_SECONDS
        while time.monotonic() < deadline:
            sends += 1
            torn_read_probe.fill(trainer, sends)
            sender.send_async()
            torn_read_probe.fill(trainer, -sends)
            assert sender.wait_async(30).version == sends
        report = ray.get(scan, timeout=60)
        first, last = ray.get(actor.rollout.remote(0.0), timeout=30)
    finally:
        scheme.shutdown()
        ray.kill(actor)
    print(f"ray probe: {report}, {sends} sends")
    assert report["mixed"] == 0, report
    assert all(v > 0 for v in report["values"]), f"the actor saw weights changed after the call: {report}"
    assert len(report["values"]) > 1, report
    assert first == last == (float(sends), float(sends))
