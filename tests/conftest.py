"""Shared fixtures: real worker processes (spawn), real pipes, real shared memory."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _workers import build_model, worker_main

import weightsync as ws

SPAWN = mp.get_context("spawn")
READY_TIMEOUT = 90.0

# The conformance suite runs over every scheme listed here.
SCHEMES: dict[str, Callable[[], ws.WeightSyncScheme]] = {
    "multiprocess": lambda: ws.MultiProcessWeightSyncScheme(timeout=30),
    "shared": lambda: ws.SharedMemWeightSyncScheme(timeout=30),
}
# Whether a worker's tensors keep their data_ptr() across updates (identity
# is kept by every scheme).
KEEPS_DATA_PTR = {"multiprocess": True, "shared": False}


def reap(procs: list[Any], timeout: float = 20.0) -> None:
    """Join worker processes; kill any that did not exit in time."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class Cluster:
    """One trainer-side scheme (in the test process) and N worker processes."""

    def __init__(
        self, scheme_name: str, kinds: list[str], model_id: str = "policy", trainer_kind: str = "net"
    ) -> None:
        self.scheme_name = scheme_name
        self.model_id = model_id
        self.scheme = SCHEMES[scheme_name]()
        self.model = build_model(trainer_kind, seed=7)
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []
        self.pipes: list[Any] = []
        self.pids: list[int] = []
        try:
            for kind in kinds:
                ours, theirs = SPAWN.Pipe()
                ctrl, ctrl_child = SPAWN.Pipe()
                proc = SPAWN.Process(
                    target=worker_main,
                    args=(self.scheme, model_id, theirs, ctrl_child, kind),
                    daemon=True,
                )
                proc.start()
                theirs.close()
                ctrl_child.close()
                self.procs.append(proc)
                self.ctrls.append(ctrl)
                self.pipes.append(ours)
            self.scheme.init_on_sender(model_id, pipes=self.pipes, model=self.model)
            for ctrl in self.ctrls:
                if not ctrl.poll(READY_TIMEOUT):
                    raise RuntimeError("a worker did not start")
                tag, pid = ctrl.recv()
                assert tag == "ready"
                self.pids.append(pid)
        except BaseException:
            self.close()
            raise

    @property
    def sender(self) -> ws.WeightSender:
        return self.scheme.get_sender()

    def command(self, i: int, cmd: str, timeout: float = 30.0) -> Any:
        self.ctrls[i].send(cmd)
        if not self.ctrls[i].poll(timeout):
            raise TimeoutError(f"worker {i} did not answer {cmd!r}")
        return self.ctrls[i].recv()

    def state(self, i: int) -> dict[str, Any]:
        return self.command(i, "state")

    def pause(self, i: int) -> None:
        assert self.command(i, "pause") == "ok"

    def resume(self, i: int) -> None:
        assert self.command(i, "resume") == "ok"

    def kill(self, i: int) -> None:
        os.kill(self.pids[i], signal.SIGKILL)
        self.procs[i].join(10)

    def bump(self, amount: float = 1.0) -> None:
        """Change the trainer's weights so the next send is distinguishable."""
        with torch.no_grad():
            for tensor in self.model.state_dict().values():
                if tensor.dtype == torch.bool:
                    tensor.logical_not_()
                elif tensor.is_floating_point() or tensor.is_complex():
                    tensor.add_(amount)
                else:
                    tensor.add_(1)

    def expected(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def assert_has(self, i: int, expected: dict[str, torch.Tensor]) -> None:
        state = self.state(i)
        assert state["same_identity"], "a tensor of the worker's model was replaced"
        if KEEPS_DATA_PTR[self.scheme_name]:
            assert state["same_ptr"], "a tensor's data_ptr() changed"
        got = state["weights"]
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"worker {i}: {name} differs"

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.is_alive():
                with contextlib.suppress(OSError):
                    self.ctrls[i].send("stop")
        reap(self.procs)
        for proc in self.procs:
            proc.close()
        self.scheme.shutdown()
        for conn in self.ctrls + self.pipes:
            conn.close()


@pytest.fixture(params=list(SCHEMES))
def scheme_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=list(SCHEMES))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Three healthy workers shared by the non-destructive tests of a module."""
    c = Cluster(request.param, ["net", "net", "net"])
    yield c
    c.close()


@pytest.fixture
def make_cluster(scheme_name: str) -> Iterator[Callable[..., Cluster]]:
    """A factory of clusters for tests that kill, pause or break workers."""
    made: list[Cluster] = []

    def make(kinds: list[str], model_id: str = "policy", trainer_kind: str = "net") -> Cluster:
        c = Cluster(scheme_name, kinds, model_id, trainer_kind)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def weightsync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("weightsync", "AnyIO"))]


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def open_fds() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every async test runs on asyncio's own loop and on uvloop."""
    import asyncio

    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def fd_baseline() -> set[int]:
    """Open descriptors once the loop machinery has run once in this process.

    uvloop keeps two process-wide descriptors from its first loop on (not one
    per loop), and multiprocessing's spawn keeps one pipe to its resource
    tracker; neither is weightsync's to close.
    """
    from multiprocessing import resource_tracker

    import anyio

    resource_tracker.ensure_running()

    from weightsync._facade import LOOP

    LOOP.acquire()
    try:
        LOOP.portal().call(anyio.sleep, 0)
    finally:
        LOOP.release()
    return open_fds()
