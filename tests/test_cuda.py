"""Weights on GPUs: the conformance behaviours over the placements of a
trainer's and its workers' models on CUDA devices and the host.

Every placement but host to host needs a CUDA device: those cases carry the
``cuda`` marker and skip where none is visible. The host-to-host case runs
everywhere, so the checks themselves are exercised on every machine.

What each case holds: every worker gets the trainer's weights bit for bit;
its tensors keep their device, and under the multiprocess scheme their
``data_ptr()``; a send that does not fit is refused before any worker is
touched; work the trainer enqueues on its stream right after ``send()``
returned never reaches a worker; a killed worker is named.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from harness import start_pipe_worker, stop_pipe_workers

import weightsync as ws

HAS_CUDA = torch.cuda.is_available()
needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device; none is visible"),
]

# (trainer device, worker device)
PLACEMENTS = [
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cuda", "cuda", id="cuda-cuda", marks=needs_cuda),
    pytest.param("cuda", "cpu", id="cuda-cpu", marks=needs_cuda),
    pytest.param("cpu", "cuda", id="cpu-cuda", marks=needs_cuda),
]
SCHEMES = {"multiprocess": ws.MultiProcessWeightSyncScheme, "shared": ws.SharedMemWeightSyncScheme}
# What SendReport.placements says of each placement (one GPU: the same device).
PLACEMENT_OF = {
    ("cpu", "cpu"): "host",
    ("cuda", "cuda"): "same-device",
    ("cuda", "cpu"): "device-to-host",
    ("cpu", "cuda"): "host-to-device",
}


def device_label(device: str) -> str:
    """How a worker names ``device`` when it announces itself: the GPU by its
    UUID, as nvidia-smi -L shows it (``GPU-...``), not by its index."""
    if device == "cpu":
        return "cpu"
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    return f"cuda:{uuid if uuid.startswith('GPU-') else 'GPU-' + uuid}"


def make_model(device: str, seed: int, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 8))
    return model.to(device)


def cuda_worker(
    scheme: ws.WeightSyncScheme, pipe: Connection, ctrl: Connection, device: str, width: int
) -> None:
    """A worker whose model lives on ``device``: takes updates at its safe
    point, answers "state" with its weights (on the host), their devices and
    addresses, and whether every tensor kept its identity."""
    model = make_model(device, seed=1000 + os.getpid(), width=width)
    tensors = dict(model.state_dict(keep_vars=True))
    ids = {name: id(t) for name, t in tensors.items()}
    scheme.init_on_worker("policy", pipe=pipe, model=model)
    ctrl.send(("ready", os.getpid()))
    try:
        while True:
            if ctrl.poll():
                if ctrl.recv() == "stop":
                    break
                now = dict(model.state_dict(keep_vars=True))
                if device != "cpu":
                    torch.cuda.synchronize()
                ctrl.send(
                    {
                        # (A copy: a tensor sent over a multiprocessing pipe
                        # is moved to shared memory, its address with it.)
                        "weights": {name: t.detach().to("cpu", copy=True) for name, t in now.items()},
                        "devices": {name: str(t.device) for name, t in now.items()},
                        "ptrs": {name: t.data_ptr() for name, t in now.items()},
                        "same_identity": all(id(now[name]) == ids[name] for name in ids),
                        # What this process holds of its GPU's memory.
                        "allocated": torch.cuda.memory_allocated() if device != "cpu" else 0,
                    }
                )
            try:
                scheme.receive(timeout=0.02)
            except ws.SenderClosedError:
                break
    finally:
        scheme.shutdown()


class Placement:
    """A trainer on ``trainer_device`` in this process and ``count`` worker
    processes whose models live on ``worker_device``."""

    def __init__(self, scheme_name: str, trainer_device: str, worker_device: str, count: int = 2) -> None:
        self.scheme = SCHEMES[scheme_name](timeout=60)
        self.worker_device = worker_device
        self.model = make_model(trainer_device, seed=7)
        self.procs: list[Any] = []
        self.ctrls: list[Connection] = []
        self.pipes: list[Connection] = []
        self.pids: list[int] = []
        widths = [64] * count
        self._start(widths)

    def _start(self, widths: list[int]) -> None:
        for width in widths:
            proc, ours, ctrl = start_pipe_worker(
                cuda_worker,
                lambda pipe, ctrl, width=width: (self.scheme, pipe, ctrl, self.worker_device, width),
            )
            self.procs.append(proc)
            self.ctrls.append(ctrl)
            self.pipes.append(ours)
        self.scheme.init_on_sender("policy", pipes=self.pipes, model=self.model)
        for ctrl in self.ctrls:
            assert ctrl.poll(120), "a worker did not start"
            tag, pid = ctrl.recv()
            assert tag == "ready"
            self.pids.append(pid)

    def state(self, i: int) -> dict[str, Any]:
        self.ctrls[i].send("state")
        assert self.ctrls[i].poll(60), f"worker {i} did not answer"
        return self.ctrls[i].recv()

    def expected(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().cpu().clone() for name, t in self.model.state_dict().items()}

    def bump(self) -> None:
        with torch.no_grad():
            for t in self.model.parameters():
                t.add_(torch.randn_like(t))

    def close(self) -> None:
        stop_pipe_workers(self.scheme, self.procs, self.ctrls, self.pipes)


@pytest.fixture
def placement(request: pytest.FixtureRequest):
    made: list[Placement] = []

    def make(scheme_name: str, trainer_device: str, worker_device: str, count: int = 2) -> Placement:
        made.append(Placement(scheme_name, trainer_device, worker_device, count))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("trainer_device, worker_device", PLACEMENTS)
def test_workers_get_the_weights_bit_exact_and_keep_their_device(
    placement, scheme_name: str, trainer_device: str, worker_device: str
) -> None:
    p = placement(scheme_name, trainer_device, worker_device)
    before = [p.state(i) for i in range(2)]
    # Each worker named its device by the GPU's UUID, and the report says how
    # the weights reached it.
    p.scheme.get_sender().wait_for_workers()
    announced = p.scheme.get_sender().worker_devices
    assert announced == {i: (device_label(worker_device),) for i in range(2)}, announced
    how = PLACEMENT_OF[(trainer_device, worker_device)]
    for _ in range(3):
        p.bump()
        report = p.scheme.get_sender().send()
        assert report.worker_ids == (0, 1)
        assert report.placements == {0: how, 1: how}, report.placements
        expected = p.expected()
        for i in range(2):
            state = p.state(i)
            assert state["same_identity"], f"worker {i}: a tensor of its model was replaced"
            for name, value in expected.items():
                assert state["devices"][name].split(":")[0] == worker_device, (name, state["devices"][name])
                assert torch.equal(state["weights"][name], value), f"worker {i}: {name} differs"
            # A worker's tensors keep their memory under the multiprocess
            # scheme, and under the shared one where a view of the host slot
            # would move them off their GPU; a shared scheme's worker on the
            # trainer's GPU runs on a slot there instead (no copy).
            if scheme_name == "multiprocess" or (trainer_device, worker_device) == ("cpu", "cuda"):
                assert state["ptrs"] == before[i]["ptrs"], f"worker {i}: a tensor's data_ptr() changed"
            elif (trainer_device, worker_device) == ("cuda", "cuda"):
                moved = [n for n in expected if state["ptrs"][n] != before[i]["ptrs"][n]]
                assert moved == list(expected), f"worker {i}: not re-pointed to a slot: {moved}"


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("trainer_device, worker_device", PLACEMENTS)
def test_work_enqueued_after_send_never_reaches_a_worker(
    placement, scheme_name: str, trainer_device: str, worker_device: str
) -> None:
    """The trainer's stream goes on at once after send() returned: a fill_
    enqueued then (before anything synchronises) is never what a worker
    holds."""
    p = placement(scheme_name, trainer_device, worker_device)
    p.bump()
    expected = p.expected()
    p.scheme.get_sender().send()
    with torch.no_grad():
        for t in p.model.parameters():
            t.fill_(float("nan"))
    for i in range(2):
        got = p.state(i)["weights"]
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"worker {i}: {name} is not the weights sent"


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("trainer_device, worker_device", PLACEMENTS)
def test_weights_that_do_not_fit_touch_no_worker(
    placement, scheme_name: str, trainer_device: str, worker_device: str
) -> None:
    p = placement(scheme_name, trainer_device, worker_device)
    p.scheme.get_sender().send()
    held = [p.state(i)["weights"] for i in range(2)]
    wrong = make_model(trainer_device, seed=3, width=32)
    with pytest.raises(ws.WeightMismatchError):
        p.scheme.get_sender().send(wrong)
    for i in range(2):
        got = p.state(i)["weights"]
        for name, value in held[i].items():
            assert torch.equal(got[name], value), f"worker {i}: {name} changed"


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("trainer_device, worker_device", PLACEMENTS)
def test_a_killed_worker_is_named(
    placement, scheme_name: str, trainer_device: str, worker_device: str
) -> None:
    p = placement(scheme_name, trainer_device, worker_device)
    p.scheme.get_sender().send()
    os.kill(p.pids[1], signal.SIGKILL)
    p.procs[1].join(30)
    p.bump()
    with pytest.raises(ws.WorkerLostError) as info:
        p.scheme.get_sender().send()
    assert set(info.value.failures) == {1}
    expected = p.expected()
    got = p.state(0)["weights"]
    for name, value in expected.items():
        assert torch.equal(got[name], value), f"worker 0: {name} differs"
