"""The device slab: a trainer on a GPU stages each send once into a slab on
its GPU, shared with the workers through CUDA IPC, and workers whose models
are on a GPU copy from it device to device (``weightsync._memory._slab``,
``weightsync._transports._pipes._device_staging``).

What each case holds: workers on the trainer's GPU get the weights bit for
bit through the slab, and the host staging is written only where a worker
is in host memory; the send's copies follow the work the caller enqueued on
its own stream; a worker's CUDA graph captured before any update replays
with each new update's weights (its tensors keep their memory); 200 sends
across a layout change and a worker restart leave no GPU memory,
descriptor or /dev/shm entry behind; a trainer whose allocator uses
expandable segments still reaches a GPU worker (or says why not); the shared
scheme's GPU workers copy too and keep their memory.

Every case needs a CUDA device: the module skips where none is visible.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import fd_baseline, open_fds, shm_entries, start_pipe_worker, stop_pipe_workers
from test_cuda import cuda_worker, make_model

import weightsync as ws

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is visible"),
]

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def on_host(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's weights, copied to the host."""
    return {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}


class Rig:
    """A trainer-side ``scheme`` in this process, its model on the trainer's
    GPU, and one :func:`test_cuda.cuda_worker` process per worker device."""

    def __init__(self, scheme_class: type[ws.WeightSyncScheme], width: int = 64) -> None:
        self.scheme = scheme_class(timeout=60)
        self.width = width
        self.model = make_model("cuda", seed=7, width=width)
        self.procs: list[Any] = []
        self.ctrls: list[Connection] = []
        self.pipes: list[Connection] = []
        self.pids: list[int] = []

    def start(self, devices: list[str]) -> None:
        started = [self._spawn(device, self.width) for device in devices]
        for proc, pipe, ctrl in started:
            self.procs.append(proc)
            self.pipes.append(pipe)
            self.ctrls.append(ctrl)
        self.scheme.init_on_sender("policy", pipes=self.pipes, model=self.model)
        self.pids = [self._ready(ctrl) for ctrl in self.ctrls]

    def _spawn(self, device: str, width: int) -> tuple[Any, Connection, Connection]:
        proc, pipe, ctrl = start_pipe_worker(
            cuda_worker, lambda pipe, ctrl: (self.scheme, pipe, ctrl, device, width)
        )
        return proc, pipe, ctrl

    @staticmethod
    def _ready(ctrl: Connection) -> int:
        assert ctrl.poll(60), "a worker did not start"
        tag, pid = ctrl.recv()
        assert tag == "ready", tag
        return pid

    def state(self, i: int) -> dict[str, Any]:
        self.ctrls[i].send("state")
        assert self.ctrls[i].poll(60), f"worker {i} did not answer"
        return self.ctrls[i].recv()

    def assert_holds(self, i: int, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Worker ``i`` holds ``expected`` bit for bit; returns its state."""
        state = self.state(i)
        assert state["same_identity"], f"worker {i}: a tensor of its model was replaced"
        assert set(state["weights"]) == set(expected), (sorted(state["weights"]), sorted(expected))
        for name, value in expected.items():
            got = state["weights"][name]
            assert got.dtype == value.dtype and got.shape == value.shape, (name, got.dtype, got.shape)
            assert torch.equal(got, value), f"worker {i}: {name} is not the trainer's"
        return state

    def bump(self) -> None:
        with torch.no_grad():
            for t in self.model.parameters():
                t.add_(torch.randn_like(t))

    def replace(self, i: int, *, kill: bool, width: int, weights: Any) -> None:
        """Worker ``i`` goes (SIGKILL, or a clean "stop"); a new process with a
        model of ``width`` comes back under its id (``add_worker``) and gets
        ``weights``."""
        proc, ctrl, old_pipe = self.procs[i], self.ctrls[i], self.pipes[i]
        if kill:
            os.kill(self.pids[i], signal.SIGKILL)
        else:
            ctrl.send("stop")
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        assert not proc.is_alive(), f"worker {i} did not exit"
        proc.close()
        ctrl.close()
        new_proc, pipe, new_ctrl = self._spawn("cuda", width)
        self.procs[i], self.ctrls[i], self.pipes[i] = new_proc, new_ctrl, pipe
        self.pids[i] = self._ready(new_ctrl)
        assert self.scheme.add_worker(pipe, worker_id=i, weights=weights, timeout=60) == i
        # (The scheme let go of the old channel: the pipe is the test's own.)
        old_pipe.close()

    def close(self) -> None:
        stop_pipe_workers(self.scheme, self.procs, self.ctrls, self.pipes)


@pytest.fixture
def rig() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(scheme_class: type[ws.WeightSyncScheme], devices: list[str], width: int = 64) -> Rig:
        r = Rig(scheme_class, width)
        made.append(r)
        r.start(devices)
        return r

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize(
    "devices",
    [pytest.param(["cuda", "cuda"], id="both-on-gpu"), pytest.param(["cuda", "cpu"], id="one-on-the-host")],
)
def test_workers_on_the_trainers_gpu_copy_from_a_device_slab_and_the_host_staging_is_not_written(
    rig: Callable[..., Rig], devices: list[str]
) -> None:
    """Workers on the trainer's GPU copy from the slab; the host staging is
    written only where a worker's model is in host memory (the second
    case: one worker on the GPU, one on the host, both get the weights)."""
    r = rig(ws.MultiProcessWeightSyncScheme, devices)
    before = [r.state(i) for i in range(2)]
    staging = r.scheme.staging
    assert staging is not None
    how = {"cuda": "same-device", "cpu": "device-to-host"}
    slab = None
    for _ in range(3):
        r.bump()
        report = r.scheme.get_sender().send()
        assert report.worker_ids == (0, 1)
        assert report.placements == {i: how[d] for i, d in enumerate(devices)}, report.placements
        # The slab holds this send: written, published, and the same slab
        # from send to send (one layout: allocated and exported once).
        assert staging.slab is not None, "no device slab for the workers on the GPU"
        assert staging.slab.header.published() == report.version
        assert slab is None or staging.slab is slab, "the slab was made again for the same layout"
        slab = staging.slab
        if "cpu" in devices:
            # The worker in host memory reads the host staging, written for this send.
            assert staging.host.segment is not None, "the host staging was not written"
            assert staging.host.segment.published() == report.version
        else:
            assert staging.host.segment is None, "the host staging was written, though no worker reads it"
        expected = on_host(r.model)
        for i, device in enumerate(devices):
            state = r.assert_holds(i, expected)
            assert all(d.split(":")[0] == device for d in state["devices"].values()), state["devices"]
            assert state["ptrs"] == before[i]["ptrs"], f"worker {i}: a tensor's data_ptr() changed"


def test_the_send_follows_work_enqueued_on_the_callers_stream(rig: Callable[..., Rig]) -> None:
    """The copies out of the trainer's tensors run on the stream that was
    current when the send was made: a fill enqueued on a side stream behind
    a long GPU spin is what every worker gets (a copy on the default
    stream, which does not wait for the side stream, would read the values
    from before the fill). One worker reads the slab, one the host staging."""
    assert hasattr(torch.cuda, "_sleep"), "torch.cuda._sleep (a GPU spin) is gone from this torch"
    r = rig(ws.MultiProcessWeightSyncScheme, ["cuda", "cpu"])
    # (The workers announced, the stagings exist and are page-locked: the
    # first sends may wait for the whole device, which would hide the case.)
    for _ in range(2):
        r.scheme.get_sender().send()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for value in (1.5, -2.25, 3.0):
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the side stream
            with torch.no_grad():
                for t in r.model.parameters():
                    t.fill_(value)
            report = r.scheme.get_sender().send()
        assert report.worker_ids == (0, 1)
        assert report.placements == {0: "same-device", 1: "device-to-host"}, report.placements
        expected = {name: torch.full_like(t, value) for name, t in on_host(r.model).items()}
        for i in range(2):
            r.assert_holds(i, expected)


# -- a worker that runs a CUDA graph -----------------------------------------------

GRAPH_IN, GRAPH_OUT, GRAPH_BATCH = 16, 8, 4


def graph_input(device: str) -> torch.Tensor:
    """The graph's input: small integers, so every sum is exact in float32
    (whatever the kernel and its order of summation)."""
    return ((torch.arange(GRAPH_BATCH * GRAPH_IN).reshape(GRAPH_BATCH, GRAPH_IN) % 7) - 3).float().to(device)


def graph_worker(scheme: ws.WeightSyncScheme, pipe: Connection, ctrl: Connection) -> None:
    """A worker on the GPU that captures a CUDA graph of its model's forward
    pass before any update, then after each update it applied replays the
    graph and reports its output, a fresh (eager) forward pass's, its
    weights (on the host) and whether their addresses stayed. Any error is
    reported on ``ctrl`` as ("error", traceback)."""
    try:
        torch.manual_seed(1000 + os.getpid())
        model = torch.nn.Linear(GRAPH_IN, GRAPH_OUT).cuda()
        static_in = graph_input("cuda")
        ptrs = {name: t.data_ptr() for name, t in model.state_dict().items()}
        # Warm up on a side stream, then capture (torch's CUDA graph recipe).
        warmup = torch.cuda.Stream()
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warmup), torch.no_grad():
            for _ in range(3):
                model(static_in)
        torch.cuda.current_stream().wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_out = model(static_in)
        torch.cuda.synchronize()
        scheme.init_on_worker("policy", pipe=pipe, model=model)
        ctrl.send(("ready", os.getpid()))
    except BaseException:
        ctrl.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            if ctrl.poll() and ctrl.recv() == "stop":
                break
            try:
                version = scheme.receive(timeout=0.02)
            except ws.SenderClosedError:
                break
            if version is None:
                continue
            graph.replay()
            torch.cuda.synchronize()
            replayed = static_out.detach().to("cpu", copy=True)
            with torch.no_grad():
                fresh = model(static_in)
            torch.cuda.synchronize()
            now = model.state_dict()
            ctrl.send(
                {
                    "version": version,
                    "replayed": replayed,
                    "fresh": fresh.detach().to("cpu", copy=True),
                    "weights": {name: t.detach().to("cpu", copy=True) for name, t in now.items()},
                    "ptrs_kept": all(now[name].data_ptr() == ptr for name, ptr in ptrs.items()),
                }
            )
    except BaseException:
        with contextlib.suppress(Exception):
            ctrl.send(("error", traceback.format_exc()))
        raise
    finally:
        scheme.shutdown()


def test_a_cuda_graph_captured_before_an_update_replays_with_the_new_weights() -> None:
    scheme = ws.MultiProcessWeightSyncScheme(timeout=60)
    trainer = torch.nn.Linear(GRAPH_IN, GRAPH_OUT).cuda()
    static_in = graph_input("cuda")
    proc, pipe, ctrl = start_pipe_worker(graph_worker, lambda pipe, ctrl: (scheme, pipe, ctrl))
    try:
        scheme.init_on_sender("policy", pipes=[pipe], model=trainer)
        assert ctrl.poll(60), "the worker did not start"
        ready = ctrl.recv()
        assert ready[0] == "ready", ready[1]
        generator = torch.Generator().manual_seed(11)
        for _ in range(3):
            # Integer weights: the expected output is exact on any kernel.
            with torch.no_grad():
                for t in trainer.parameters():
                    t.copy_(torch.randint(-4, 5, t.shape, generator=generator, dtype=torch.float32))
            report = scheme.get_sender().send()
            assert report.placements == {0: "same-device"}, report.placements
            with torch.no_grad():
                expected = trainer(static_in).to("cpu", copy=True)
            weights = on_host(trainer)
            got: Any = None
            deadline = time.monotonic() + 60
            while got is None or got.get("version") != report.version:
                remaining = deadline - time.monotonic()
                assert remaining > 0 and ctrl.poll(remaining), f"no report of version {report.version}"
                got = ctrl.recv()
                assert isinstance(got, dict), got[1] if isinstance(got, tuple) else got
            assert got["ptrs_kept"], "a tensor of the worker's model moved: its graph reads the old memory"
            for name, value in weights.items():
                assert torch.equal(got["weights"][name], value), f"{name} is not the trainer's"
            assert torch.equal(got["fresh"], expected), (got["fresh"], expected)
            assert torch.equal(got["replayed"], expected), (
                "the graph captured before the update did not run on the new weights",
                got["replayed"],
                expected,
            )
    finally:
        stop_pipe_workers(scheme, [proc], [ctrl], [pipe])


@pytest.mark.parametrize(
    "scheme_class",
    [ws.MultiProcessWeightSyncScheme, ws.SharedMemWeightSyncScheme],
    ids=["multiprocess", "shared"],
)
def test_200_sends_with_a_layout_change_and_a_worker_restart_leak_nothing(
    rig: Callable[..., Rig], scheme_class: type[ws.WeightSyncScheme]
) -> None:
    """100 sends to two GPU workers, then a wider model (one worker stopped,
    one killed, each replaced by a process with the wider model under its
    old id), then 100 more: GPU memory grows by at most the new slab,
    descriptors and /dev/shm entries not at all (but a small slack), and the
    slab has the new layout's size."""
    r = rig(scheme_class, ["cuda", "cuda"], width=64)
    sender = r.scheme.get_sender()
    staging = r.scheme.staging
    assert staging is not None
    # Both models exist before the baseline: only what the sends hold counts.
    wide = make_model("cuda", seed=8, width=96)

    def step(model: torch.nn.Module, weights: Any = None) -> None:
        with torch.no_grad():
            for t in model.parameters():
                t.add_(0.5)  # (in place: no allocation of its own)
        sender.send(weights)

    for _ in range(10):
        step(r.model)
    torch.cuda.synchronize()
    memory_before = torch.cuda.memory_allocated()
    shm_before = shm_entries()
    fds_before = len(fd_baseline())
    assert staging.slab is not None
    narrow_bytes = staging.slab.nbytes
    for _ in range(90):
        step(r.model)
    expected = on_host(r.model)
    for i in range(2):
        r.assert_holds(i, expected)
    del expected

    # The layout changes: each worker is replaced by one with the wider model.
    r.replace(0, kill=False, width=96, weights=wide)
    r.replace(1, kill=True, width=96, weights=wide)
    for _ in range(98):
        step(wide, wide)
    torch.cuda.synchronize()

    layout = r.scheme.sender_transports[0].layout
    assert layout is not None
    assert layout.nbytes > narrow_bytes
    assert staging.slab is not None
    assert staging.slab.nbytes == layout.nbytes, (staging.slab.nbytes, layout.nbytes)
    shared = scheme_class is ws.SharedMemWeightSyncScheme
    host_written = staging.host.slots if shared else staging.host.segment
    assert not host_written, "the host staging was written, though no worker reads it"
    # At most the new slab (or slots) more: the old ones may still wait in
    # torch's IPC limbo, for the killed worker never gave its export back.
    # The allocator rounds a block up to 512 bytes.
    slabs = len(getattr(staging.device, "slots", [staging.slab]))
    one_slab = -(-staging.slab.nbytes // 512) * 512
    memory_after = torch.cuda.memory_allocated()
    assert memory_after <= memory_before + slabs * one_slab, (memory_before, memory_after, slabs, one_slab)
    assert wait_for(lambda: len(open_fds()) <= fds_before + 2), (fds_before, sorted(open_fds()))
    # (Counted, not named: each worker process may keep entries of its own,
    # and two of them were replaced by two others.)
    shm_after = shm_entries()
    assert len(shm_after) <= len(shm_before) + 2, (sorted(shm_before), sorted(shm_after))

    expected = on_host(wide)
    for i in range(2):
        r.assert_holds(i, expected)


TRAINER_PROGRAM = r"""
import multiprocessing as mp
import sys

import torch

import weightsync as ws
from test_cuda import cuda_worker, make_model

ctx = mp.get_context("spawn")
scheme = ws.MultiProcessWeightSyncScheme(timeout=60)
model = make_model("cuda", seed=7)
ours, theirs = ctx.Pipe()
ctrl, ctrl_child = ctx.Pipe()
proc = ctx.Process(target=cuda_worker, args=(scheme, theirs, ctrl_child, "cuda", 64), daemon=True)
proc.start()
theirs.close()
ctrl_child.close()
try:
    scheme.init_on_sender("policy", pipes=[ours], model=model)
    if not ctrl.poll(60):
        sys.exit("the worker did not start")
    ctrl.recv()
    for _ in range(3):
        with torch.no_grad():
            for t in model.parameters():
                t.add_(torch.randn_like(t))
        scheme.get_sender().send()
        ctrl.send("state")
        if not ctrl.poll(60):
            sys.exit("the worker did not answer")
        got = ctrl.recv()["weights"]
        for name, value in model.state_dict().items():
            if not torch.equal(got[name], value.cpu()):
                sys.exit(f"{name} differs")
    print("OK", flush=True)
finally:
    try:
        ctrl.send("stop")
    except OSError:
        pass
    proc.join(20)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    scheme.shutdown()
"""


def run_trainer(argv: list[str], timeout: float, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``python *argv`` in a fresh interpreter (this repository and the
    tests importable, ``env`` added); its outcome, and all it printed."""
    full = {**os.environ, **env}
    full["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")) if p
    )
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout
    )
    return done, f"exit status {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


def test_a_trainer_with_expandable_segments_still_reaches_gpu_workers() -> None:
    """A trainer whose allocator uses expandable segments (a fresh
    interpreter: the setting is read once, at CUDA's start) sends to a GPU
    worker bit for bit, or fails with an error that names
    expandable_segments."""
    done, output = run_trainer(
        ["-c", TRAINER_PROGRAM], 90, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"
    )
    if done.returncode == 0 and "OK" in done.stdout.split():
        return
    assert done.returncode != 0, output
    assert "expandable_segments" in done.stdout + done.stderr, output


def lingering_worker(
    scheme: ws.WeightSyncScheme, pipe: Connection, ctrl: Connection, device: str, width: int
) -> None:
    """:func:`test_cuda.cuda_worker`, but one that goes on answering "state"
    once its sender shut down (as a collector finishing its episode would
    go on running its model), until "stop"."""
    model = make_model(device, seed=1000 + os.getpid(), width=width)
    scheme.init_on_worker("policy", pipe=pipe, model=model)
    ctrl.send(("ready", os.getpid()))
    closed = False
    try:
        while True:
            if ctrl.poll(0.02 if closed else 0):
                if ctrl.recv() == "stop":
                    break
                torch.cuda.synchronize()
                # The model still runs: a forward pass reads every parameter.
                model(torch.ones(1, width, device=device))
                torch.cuda.synchronize()
                ctrl.send(
                    {
                        "weights": {k: t.detach().cpu().clone() for k, t in model.state_dict().items()},
                        "allocated": torch.cuda.memory_allocated(),
                        "closed": closed,
                    }
                )
            if not closed:
                try:
                    scheme.receive(timeout=0.02)
                except ws.SenderClosedError:
                    closed = True
    finally:
        scheme.shutdown()


def model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_shared_scheme_workers_on_the_trainers_gpu_run_on_its_slots(rig: Callable[..., Rig]) -> None:
    """Under the shared scheme, workers on the trainer's GPU run on slots
    there (their parameters re-pointed, no copy: their own GPU memory is
    given back), two slots serve every send of a prompt pair, and a worker
    in host memory beside them still gets each send through the host slots."""
    r = rig(ws.SharedMemWeightSyncScheme, ["cuda", "cuda", "cpu"], width=1024)
    size = model_bytes(r.model)
    before = [r.state(i) for i in range(3)]
    staging = r.scheme.staging
    assert staging is not None
    last = [before[0]["ptrs"], before[1]["ptrs"]]
    for n in range(4):
        r.bump()
        report = r.scheme.get_sender().send()
        assert report.placements == {0: "same-device", 1: "same-device", 2: "device-to-host"}
        assert staging.slab is not None, "no device slot for the workers on the GPU"
        assert staging.slab.header.published() == report.version
        # Each send goes into a slot no worker runs on: two slots suffice
        # for workers that ack at once.
        assert len(staging.device.slots) == min(n + 1, 2), len(staging.device.slots)
        assert staging.host.slots, "the worker in host memory got no host slot"
        expected = on_host(r.model)
        for i in range(2):
            state = r.assert_holds(i, expected)
            assert all(d.startswith("cuda") for d in state["devices"].values()), state["devices"]
            moved = [k for k in expected if state["ptrs"][k] != last[i][k]]
            assert moved == list(expected), f"worker {i}: not moved to the new slot: {moved}"
            last[i] = state["ptrs"]
            # Its own copy of the weights is gone: it runs on the trainer's memory.
            assert state["allocated"] <= before[i]["allocated"] - size * 3 // 4, (
                before[i]["allocated"],
                state["allocated"],
                size,
            )
        r.assert_holds(2, expected)


def test_a_verified_send_reaches_workers_on_slots_without_writing_a_slot(rig: Callable[..., Rig]) -> None:
    """A verified send goes through host memory; workers that ran on a
    device slot take memory of their own for it, so the slot they left (which
    others may still run on) keeps its bytes; the next send re-points them."""
    r = rig(ws.SharedMemWeightSyncScheme, ["cuda", "cuda"], width=256)
    sender = r.scheme.get_sender()
    staging = r.scheme.staging
    assert staging is not None
    first = sender.send()
    assert first.placements == {0: "same-device", 1: "same-device"}, first.placements
    slot = staging.slab
    assert slot is not None and slot.data is not None
    held = slot.data.clone()
    r.bump()
    verified = sender.send(verify=True)
    # The report says what happened: through host memory, not device to device.
    assert verified.placements == {0: "through-host", 1: "through-host"}, verified.placements
    expected = on_host(r.model)
    for i in range(2):
        r.assert_holds(i, expected)
    torch.cuda.synchronize()
    assert slot.header.published() == first.version
    assert torch.equal(slot.data, held), "a verified send wrote into a device slot"
    r.bump()
    sender.send()
    expected = on_host(r.model)
    for i in range(2):
        r.assert_holds(i, expected)


def test_workers_on_slots_keep_their_weights_once_the_trainer_shuts_down() -> None:
    """The sender's shutdown tells each worker, which copies the weights it
    runs on into its own memory (a slot lives only as long as the trainer's
    process); the trainer's slots are then freed."""
    scheme = ws.SharedMemWeightSyncScheme(timeout=60)
    model = make_model("cuda", seed=7, width=1024)
    size = model_bytes(model)
    procs, pipes, ctrls = [], [], []
    try:
        for _ in range(2):
            proc, pipe, ctrl = start_pipe_worker(
                lingering_worker, lambda pipe, ctrl: (scheme, pipe, ctrl, "cuda", 1024)
            )
            procs.append(proc)
            pipes.append(pipe)
            ctrls.append(ctrl)
        scheme.init_on_sender("policy", pipes=pipes, model=model)
        for ctrl in ctrls:
            assert ctrl.poll(60) and ctrl.recv()[0] == "ready"
        for _ in range(3):
            with torch.no_grad():
                for t in model.parameters():
                    t.add_(torch.randn_like(t))
            scheme.get_sender().send()
        expected = on_host(model)
        staging = scheme.staging
        assert staging is not None
        slots = len(staging.device.slots)

        def state(i: int) -> dict[str, Any]:
            ctrls[i].send("state")
            assert ctrls[i].poll(60), f"worker {i} did not answer"
            return ctrls[i].recv()

        # (Each state runs a forward pass first: what it allocates for
        # itself is in both figures.)
        on_slots = [state(i)["allocated"] for i in range(2)]
        torch.cuda.synchronize()
        with_slots = torch.cuda.memory_allocated()
        scheme.shutdown()

        for i in range(2):
            assert wait_for(lambda i=i: state(i)["closed"], timeout=20), f"worker {i} was not told"
            got = state(i)
            assert got["allocated"] - on_slots[i] >= size * 3 // 4, (
                f"worker {i} does not hold its weights itself",
                on_slots[i],
                got["allocated"],
            )
            for name, value in expected.items():
                assert torch.equal(got["weights"][name], value), f"worker {i}: {name} changed"

        def freed() -> bool:
            torch.cuda.ipc_collect()
            return torch.cuda.memory_allocated() <= with_slots - slots * size

        assert wait_for(freed, timeout=10.0), (with_slots, slots, size, torch.cuda.memory_allocated())
    finally:
        stop_pipe_workers(scheme, procs, ctrls, pipes)


def test_the_trainers_gpu_memory_is_given_back_once_its_gpu_workers_are_gone() -> None:
    """Two GPU workers open the slab; once they stopped and the scheme shut
    down, torch frees it: each worker process got an export of its own,
    whose reference count it gave back (one export shared by both would be
    given back twice and never free the block)."""
    # Wide enough that the slab (4 MiB) stands far above what the
    # allocator's other small blocks come and go by.
    r = Rig(ws.MultiProcessWeightSyncScheme, width=1024)
    try:
        r.start(["cuda", "cuda"])
        for _ in range(3):
            r.bump()
            r.scheme.get_sender().send()
        slab = r.scheme.staging.slab
        assert slab is not None and slab.nbytes >= 4 << 20
        slab_bytes = slab.nbytes
        del slab
        expected = on_host(r.model)
        for i in range(2):
            r.assert_holds(i, expected)
        torch.cuda.synchronize()
        with_slab = torch.cuda.memory_allocated()
    finally:
        r.close()

    def freed() -> bool:
        torch.cuda.ipc_collect()
        return torch.cuda.memory_allocated() <= with_slab - slab_bytes

    assert wait_for(freed, timeout=10.0), (with_slab, slab_bytes, torch.cuda.memory_allocated())


def test_in_process_workers_on_the_trainers_gpu_copy_from_its_slab() -> None:
    """The in-process scheme: a worker thread whose model is on the trainer's
    GPU copies from the slab, taken as the tensor itself (no CUDA IPC
    within one process), and keeps its tensors' memory."""
    import copy
    import threading

    trainer_model = make_model("cuda", seed=7)
    trainer = ws.InProcessWeightSyncScheme(timeout=30)
    trainer.init_on_sender("policy", model=trainer_model, num_workers=1)
    worker = copy.copy(trainer)
    model = make_model("cuda", seed=8)
    ptrs = {name: t.data_ptr() for name, t in model.state_dict().items()}
    worker.init_on_worker("policy", model=model, worker_idx=0)
    try:
        joined = threading.Thread(target=worker.connect, daemon=True)
        joined.start()
        trainer.connect()
        joined.join(30)
        assert not joined.is_alive(), "the worker did not connect"
        for _ in range(3):
            with torch.no_grad():
                for t in trainer_model.parameters():
                    t.add_(1.0)
            report = trainer.send()
            assert report.placements == {0: "same-device"}, report.placements
            torch.cuda.synchronize()
            held = model.state_dict()
            for name, value in trainer_model.state_dict().items():
                assert torch.equal(held[name], value), f"{name} is not the trainer's"
        assert trainer.staging is not None and trainer.staging.slab is not None
        assert {name: t.data_ptr() for name, t in model.state_dict().items()} == ptrs
    finally:
        worker.shutdown()
        trainer.shutdown()


SHUTDOWN_PROGRAM = r"""
import multiprocessing as mp, sys, time
import torch
from torch import nn
import weightsync as ws

def collector(scheme, pipe):
    policy = nn.Linear(256, 256).to("cuda:0")
    scheme.init_on_worker("policy", pipe=pipe, model=policy)
    try:
        while True:
            scheme.receive(timeout=0.05)
    except ws.SenderClosedError:
        time.sleep(3.0)   # a collector finishing its episode, still running
    finally:
        scheme.shutdown()

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    scheme = getattr(ws, sys.argv[1])()
    pipes, procs = [], []
    for _ in range(2):
        ours, theirs = ctx.Pipe()
        # Daemons: the trainer ends without waiting for them.
        procs.append(ctx.Process(target=collector, args=(scheme, theirs), daemon=True))
        procs[-1].start()
        pipes.append(ours)
    policy = nn.Linear(256, 256).to("cuda:0")
    scheme.init_on_sender("policy", pipes=pipes, model=policy)
    scheme.wait_for_workers(timeout=120)
    for _ in range(3):
        with torch.no_grad():
            policy.weight.add_(1.0)
        report = scheme.get_sender().send()
    print("placements", sorted(set(report.placements.values())), flush=True)
    scheme.shutdown()
    print("OK", flush=True)
"""


@pytest.mark.parametrize("scheme_class", ["MultiProcessWeightSyncScheme", "SharedMemWeightSyncScheme"])
def test_a_trainer_that_ends_after_shutdown_leaves_torch_no_cuda_warning(
    scheme_class: str, tmp_path: Path
) -> None:
    """The trainer's shutdown waits (bounded) until its GPU workers let go of
    its GPU memory, so that a trainer ending at once (its workers still
    running) leaves torch nothing to warn of: no "Producer process has been
    terminated before all shared CUDA tensors released" on stderr."""
    program = tmp_path / "trainer.py"  # (a file: spawned workers import its collector)
    program.write_text(SHUTDOWN_PROGRAM)
    done, output = run_trainer([str(program), scheme_class], 180)
    assert done.returncode == 0 and "OK" in done.stdout.split(), output
    assert "same-device" in done.stdout, output  # the workers read the trainer's GPU memory
    assert "Producer process has been terminated" not in done.stderr, output
