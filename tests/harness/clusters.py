"""The tests' clusters: one trainer-side scheme in the test process and N
workers (processes on pipes, ranks, threads or Ray actors), each obeying
commands from the test (:func:`.workers.worker_main`)."""

from __future__ import annotations

import contextlib
import copy
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

import weightsync as ws

from .ray_runtime import RAY_NODES, RayRuntime
from .schemes import TEST_TIMEOUT, make_scheme, spec
from .workers import build_model, worker_main

# Worker processes are forked from multiprocessing's fork server, which has
# imported torch and weightsync once: a spawned interpreter spends 1-2 s of a
# core importing torch, per worker, and that would be most of the suite's time.
# The workers are still fresh processes that share nothing with the test.
PROCS = mp.get_context("forkserver")
PROCS.set_forkserver_preload(
    ["torch", "tensordict", "weightsync", "harness.workers", "harness.torn_read_probe"]
)
READY_TIMEOUT = 90.0


def start_worker(
    target: Callable[..., None], args: Callable[[Connection], tuple[Any, ...]], **kwargs: Any
) -> tuple[Any, Connection]:
    """Start ``target(*args(conn), **kwargs)`` in a worker process (of the
    fork server, a daemon): ``conn`` is the worker's end of a pipe to the
    test. Returns the process and the test's end of the pipe; the worker's
    end is closed here."""
    ours, theirs = PROCS.Pipe()
    proc = PROCS.Process(target=target, args=args(theirs), kwargs=kwargs, daemon=True)
    proc.start()
    theirs.close()
    return proc, ours


def start_pipe_worker(
    target: Callable[..., None], args: Callable[[Connection, Connection], tuple[Any, ...]], **kwargs: Any
) -> tuple[Any, Connection, Connection]:
    """Start ``target(*args(pipe, ctrl), **kwargs)`` in a worker process (as
    :func:`start_worker`): ``pipe`` is the worker's end of its scheme's pipe,
    ``ctrl`` its end of the test's command pipe. Returns the process and the
    test's ends of both pipes (the scheme's first); the worker's ends are
    closed here."""
    ours, theirs = PROCS.Pipe()
    try:
        proc, ctrl = start_worker(target, lambda ctrl_child: args(theirs, ctrl_child), **kwargs)
    finally:
        theirs.close()
    return proc, ours, ctrl


def stop_pipe_workers(
    scheme: ws.WeightSyncScheme, procs: list[Any], ctrls: list[Connection], pipes: list[Connection]
) -> None:
    """End what :func:`start_pipe_worker` started: "stop" to every worker
    still running, reap them all (killing any late one), shut the trainer's
    side of ``scheme`` down and close the test's ends of the pipes."""
    for proc, ctrl in zip(procs, ctrls, strict=True):
        if proc.is_alive():
            with contextlib.suppress(OSError):
                ctrl.send("stop")
    reap(procs)
    for proc in procs:
        proc.close()
    scheme.shutdown()
    for conn in ctrls + pipes:
        conn.close()


def reap(procs: list[Any], timeout: float = 20.0) -> None:
    """Join worker processes; kill any that did not exit in time."""
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class Cluster:
    """One trainer-side scheme (in the test process) and N worker processes
    on pipes; the subclasses start their workers otherwise (:meth:`_start`)."""

    def __init__(
        self,
        scheme_name: str,
        kinds: list[str],
        model_id: str = "policy",
        trainer_kind: str = "net",
        timeout: float | None = TEST_TIMEOUT,
        **options: Any,
    ) -> None:
        self.scheme_name = scheme_name
        self.model_id = model_id
        self.scheme = make_scheme(scheme_name, timeout, **options)
        self.model = build_model(trainer_kind, seed=7)
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []
        self.pipes: list[Any] = []
        self.pids: list[int] = []
        try:
            self._start(kinds)
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

    def _start(self, kinds: list[str]) -> None:
        """Start a worker of each kind, then init the trainer on their pipes."""
        for kind in kinds:
            proc, ours, ctrl = start_pipe_worker(
                worker_main, lambda pipe, ctrl, kind=kind: (self.scheme, self.model_id, pipe, ctrl, kind)
            )
            self.procs.append(proc)
            self.ctrls.append(ctrl)
            self.pipes.append(ours)
        self.scheme.init_on_sender(self.model_id, pipes=self.pipes, model=self.model)

    def _wait_until_ready(self) -> None:
        for ctrl in self.ctrls:
            if not ctrl.poll(READY_TIMEOUT):
                raise RuntimeError("a worker did not start")
            tag, pid = ctrl.recv()
            assert tag == "ready"
            self.pids.append(pid)

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
        if spec(self.scheme_name).keeps_data_ptr:
            assert state["same_ptr"], "a tensor's data_ptr() changed"
        got = state["weights"]
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert torch.equal(got[name], value), f"worker {i}: {name} differs"

    def close(self) -> None:
        stop_pipe_workers(self.scheme, self.procs, self.ctrls, self.pipes)


class RankCluster(Cluster):
    """The same harness over :class:`ws.DistributedWeightSyncScheme`: the
    trainer inits first (its store on 127.0.0.1), then worker ``i`` joins as
    rank ``i + 1`` of the pickled scheme."""

    def __init__(self, kinds: list[str], *args: Any, **options: Any) -> None:
        super().__init__("distributed", kinds, *args, **options)

    def _start(self, kinds: list[str]) -> None:
        self.scheme.init_on_sender(self.model_id, num_workers=len(kinds), model=self.model, host="127.0.0.1")
        for rank, kind in enumerate(kinds, start=1):
            proc, ctrl = start_worker(
                worker_main,
                lambda ctrl, kind=kind: (self.scheme, self.model_id, None, ctrl, kind),
                worker_idx=rank,
            )
            self.procs.append(proc)
            self.ctrls.append(ctrl)


class ThreadCluster(Cluster):
    """The same harness over :class:`ws.InProcessWeightSyncScheme`: each worker
    is a thread of this process running the same loop, on its own copy of
    the scheme."""

    def __init__(self, kinds: list[str], *args: Any, **options: Any) -> None:
        self._ctrl_children: list[Any] = []
        super().__init__("inprocess", kinds, *args, **options)

    def _start(self, kinds: list[str]) -> None:
        for i, kind in enumerate(kinds):
            ctrl, ctrl_child = mp.Pipe()
            thread = threading.Thread(
                target=worker_main,
                args=(copy.copy(self.scheme), self.model_id, None, ctrl_child, kind),
                kwargs={"worker_idx": i},
                name=f"test-worker-{i}",
                daemon=True,
            )
            thread.start()
            self.procs.append(thread)
            self.ctrls.append(ctrl)
            self._ctrl_children.append(ctrl_child)
        self.scheme.init_on_sender(self.model_id, model=self.model, num_workers=len(kinds))

    def kill(self, i: int) -> None:
        """A thread cannot be killed: it ends at once, without a word to the
        sender, and its end of the pipe closes as a dead process's would."""
        self.ctrls[i].send("stop")
        self.procs[i].join(10)

    def close(self) -> None:
        for i, thread in enumerate(self.procs):
            if thread.is_alive():
                with contextlib.suppress(OSError):
                    self.ctrls[i].send("stop")
        for thread in self.procs:
            thread.join(20)
        self.scheme.shutdown()
        for conn in self.ctrls + self._ctrl_children:
            conn.close()


class RayCluster(Cluster):
    """The same harness over Ray actors: the trainer (this process) is the
    Ray driver, each worker an actor; commands are actor calls."""

    def __init__(
        self,
        runtime: RayRuntime,
        kinds: list[str],
        model_id: str = "policy",
        trainer_kind: str = "net",
        actors: list[Any] | None = None,
        timeout: float | None = TEST_TIMEOUT,
        **options: Any,
    ) -> None:
        import ray

        self.scheme_name = "ray"
        self.model_id = model_id
        self.runtime = runtime
        self.scheme = make_scheme("ray", timeout, **options)
        self.model = build_model(trainer_kind, seed=7)
        self.actors = actors if actors is not None else runtime.take(len(kinds))
        self.dead: set[int] = set()
        self.holds: dict[int, Any] = {}
        try:
            self.pids = ray.get(
                [
                    a.setup.remote(make_scheme("ray"), model_id, kind)
                    for a, kind in zip(self.actors, kinds, strict=True)
                ],
                timeout=READY_TIMEOUT,
            )
            if actors is None and len(self.actors) > 1:
                nodes = ray.get([self._ctrl(i, "node_id") for i in range(len(self.actors))], timeout=30)
                assert len(set(nodes)) == len(RAY_NODES), f"the actors are not on both nodes: {nodes}"
            self.scheme.init_on_sender(model_id, remote_collectors=self.actors, model=self.model)
        except BaseException:
            self.close()
            raise

    def command(self, i: int, cmd: str, timeout: float = 30.0) -> Any:
        import ray

        actor = self.actors[i]
        if cmd == "pause":
            self.holds[i] = actor.hold.remote()
            return "ok" if ray.get(self._ctrl(i, "wait_held"), timeout=timeout) else "not held"
        if cmd == "resume":
            ray.get(self._ctrl(i, "release"), timeout=timeout)
            ray.get(self.holds.pop(i), timeout=timeout)
            return "ok"
        if cmd == "state":
            return ray.get(self._ctrl(i, "state"), timeout=timeout)
        return ray.get(getattr(actor, cmd).remote(), timeout=timeout)

    def _ctrl(self, i: int, method: str) -> Any:
        """Call ``method`` in the actor's ``ctrl`` group, beside any update."""
        return getattr(self.actors[i], method).options(concurrency_group="ctrl").remote()

    def kill(self, i: int) -> None:
        os.kill(self.pids[i], signal.SIGKILL)
        self.dead.add(i)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{self.pids[i]}") and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        import ray

        self.scheme.shutdown()
        healthy = []
        for i, actor in enumerate(self.actors):
            if i in self.dead:
                continue
            with contextlib.suppress(Exception):
                ray.get(self._ctrl(i, "release"), timeout=10)
                ray.get(actor.teardown.remote(), timeout=30)
                healthy.append(actor)
        self.runtime.give_back(healthy)


def new_cluster(
    request: pytest.FixtureRequest,
    scheme_name: str,
    kinds: list[str],
    model_id: str = "policy",
    trainer_kind: str = "net",
    timeout: float | None = TEST_TIMEOUT,
    **options: Any,
) -> Cluster:
    """A cluster of ``scheme_name`` whose scheme sends with a deadline of
    ``timeout`` seconds (None: the library's default), made with ``options``."""
    if scheme_name == "ray":
        return RayCluster(
            request.getfixturevalue("ray_runtime"), kinds, model_id, trainer_kind, timeout=timeout, **options
        )
    if scheme_name == "inprocess":
        return ThreadCluster(kinds, model_id, trainer_kind, timeout=timeout, **options)
    if scheme_name == "distributed":
        return RankCluster(kinds, model_id, trainer_kind, timeout=timeout, **options)
    return Cluster(scheme_name, kinds, model_id, trainer_kind, timeout=timeout, **options)
