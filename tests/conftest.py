"""Shared fixtures: real worker processes, real pipes, real shared memory, a real Ray cluster."""

from __future__ import annotations

import contextlib
import copy
import functools
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _workers import build_model, worker_main

import weightsync as ws

# Worker processes are forked from multiprocessing's fork server, which has
# imported torch and weightsync once: a spawned interpreter spends 1-2 s of a
# core importing torch, per worker, and that would be most of the suite's time.
# The workers are still fresh processes that share nothing with the test.
PROCS = mp.get_context("forkserver")
PROCS.set_forkserver_preload(["torch", "tensordict", "weightsync", "_workers", "_probe"])
READY_TIMEOUT = 90.0

# The conformance suite runs over every scheme listed here.
SCHEME_CLASSES: dict[str, type[ws.WeightSyncScheme]] = {
    "multiprocess": ws.MultiProcessWeightSyncScheme,
    "shared": ws.SharedMemWeightSyncScheme,
    "ray": ws.RayWeightSyncScheme,
}
# The tests' schemes send with a deadline of 30 s unless told otherwise.
TEST_TIMEOUT = 30.0
SCHEMES: dict[str, Callable[..., ws.WeightSyncScheme]] = {
    name: functools.partial(cls, timeout=TEST_TIMEOUT) for name, cls in SCHEME_CLASSES.items()
}


def make_scheme(
    scheme_name: str, timeout: float | None = TEST_TIMEOUT, **options: Any
) -> ws.WeightSyncScheme:
    """A scheme with the given deadline (and ``options``); ``timeout=None``
    gives none, so the scheme keeps the library's default."""
    others: dict[str, type[ws.WeightSyncScheme]] = {
        "inprocess": ws.InProcessWeightSyncScheme,
        "distributed": ws.DistributedWeightSyncScheme,
    }
    cls = others.get(scheme_name) or SCHEME_CLASSES[scheme_name]
    return cls(**options) if timeout is None else cls(timeout=timeout, **options)


# The schemes whose workers are processes joined by the user's pipes.
PIPE_SCHEMES = ["multiprocess", "shared"]
# The conformance suite also runs over the in-process scheme (worker threads)
# and the torch.distributed scheme (worker processes reached by rank, through
# the trainer's store on 127.0.0.1; not in the default run).
CONFORMANCE_SCHEMES = [*SCHEMES, "inprocess", pytest.param("distributed", marks=pytest.mark.extended)]
# Whether a worker's tensors keep their data_ptr() across updates (identity
# is kept by every scheme).
KEEPS_DATA_PTR = {"multiprocess": True, "shared": False, "ray": True, "inprocess": True, "distributed": True}


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
            for kind in kinds:
                ours, theirs = PROCS.Pipe()
                ctrl, ctrl_child = PROCS.Pipe()
                proc = PROCS.Process(
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
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

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


class RankCluster(Cluster):
    """The same harness over :class:`ws.DistributedWeightSyncScheme`: the
    trainer inits first (its store on 127.0.0.1), then worker ``i`` joins as
    rank ``i + 1`` of the pickled scheme."""

    def __init__(
        self,
        kinds: list[str],
        model_id: str = "policy",
        trainer_kind: str = "net",
        timeout: float | None = TEST_TIMEOUT,
        **options: Any,
    ) -> None:
        self.scheme_name = "distributed"
        self.model_id = model_id
        self.scheme = make_scheme("distributed", timeout, **options)
        self.model = build_model(trainer_kind, seed=7)
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []
        self.pipes: list[Any] = []
        self.pids: list[int] = []
        try:
            self.scheme.init_on_sender(model_id, num_workers=len(kinds), model=self.model, host="127.0.0.1")
            for rank, kind in enumerate(kinds, start=1):
                ctrl, ctrl_child = PROCS.Pipe()
                proc = PROCS.Process(
                    target=worker_main,
                    args=(self.scheme, model_id, None, ctrl_child, kind),
                    kwargs={"worker_idx": rank},
                    daemon=True,
                )
                proc.start()
                ctrl_child.close()
                self.procs.append(proc)
                self.ctrls.append(ctrl)
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise


class ThreadCluster(Cluster):
    """The same harness over :class:`ws.InProcessWeightSyncScheme`: each worker
    is a thread of this process running the same loop, on its own copy of
    the scheme."""

    def __init__(
        self,
        kinds: list[str],
        model_id: str = "policy",
        trainer_kind: str = "net",
        timeout: float | None = TEST_TIMEOUT,
        **options: Any,
    ) -> None:
        self.scheme_name = "inprocess"
        self.model_id = model_id
        self.scheme = make_scheme("inprocess", timeout, **options)
        self.model = build_model(trainer_kind, seed=7)
        self.procs: list[Any] = []
        self.ctrls: list[Any] = []
        self.pipes: list[Any] = []
        self.pids: list[int] = []
        self._ctrl_children: list[Any] = []
        try:
            for i, kind in enumerate(kinds):
                ctrl, ctrl_child = mp.Pipe()
                thread = threading.Thread(
                    target=worker_main,
                    args=(copy.copy(self.scheme), model_id, None, ctrl_child, kind),
                    kwargs={"worker_idx": i},
                    name=f"test-worker-{i}",
                    daemon=True,
                )
                thread.start()
                self.procs.append(thread)
                self.ctrls.append(ctrl)
                self._ctrl_children.append(ctrl_child)
            self.scheme.init_on_sender(model_id, model=self.model, num_workers=len(kinds))
            self._wait_until_ready()
        except BaseException:
            self.close()
            raise

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


# The custom resources of the two Ray test nodes, for pinning actors.
RAY_NODES = ("head_node", "second_node")
# Idle test actors kept ready on each node once a test gave its actors back.
SPARE_ACTORS = 2


class RayRuntime:
    """The test session's Ray: a two-node cluster on this machine (Ray's own
    ``ray.cluster_utils.Cluster``), and a pool of worker actors reused from
    test to test (an actor costs seconds to start: it imports torch)."""

    def __init__(self) -> None:
        import ray
        from _workers import RayWorker
        from ray.cluster_utils import Cluster as RayTestCluster

        node = {"num_cpus": 1, "object_store_memory": 256 << 20}
        self.nodes = RayTestCluster(
            initialize_head=True, head_node_args={**node, "resources": {RAY_NODES[0]: 1}}
        )
        self.nodes.add_node(**node, resources={RAY_NODES[1]: 1})
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        ray.init(
            address=self.nodes.address,
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
                }
            },
            log_to_driver=False,
        )
        # No CPU is reserved per actor: tests start more actors than cores.
        self.actor_class = ray.remote(num_cpus=0, concurrency_groups={"ctrl": 1})(RayWorker)
        self.idle: list[Any] = []
        self.node_of: dict[Any, str] = {}  # actor -> the node resource it is pinned to

    def actor(self, node: str | None = None, **options: Any) -> Any:
        """A fresh actor (``options`` as for ``.options()``), pinned to
        ``node`` (one of :data:`RAY_NODES`) if given."""
        if node is not None:
            options = {"resources": {node: 0.01}, **options}
        actor = self.actor_class.options(**options).remote()
        if node is not None:
            self.node_of[actor] = node
        return actor

    def take(self, n: int) -> list[Any]:
        """``n`` actors, idle ones first; any two or more span both nodes."""
        taken: list[Any] = []
        for i in range(n):
            idle = {node: [a for a in self.idle if self.node_of.get(a) == node] for node in RAY_NODES}
            missing = [node for node in RAY_NODES if node not in {self.node_of[a] for a in taken}]
            # The slots left must cover the nodes not used yet; among the
            # nodes allowed, the one with the most idle actors.
            allowed = missing if n - i <= len(missing) else list(RAY_NODES)
            node = max(allowed, key=lambda nd: len(idle[nd]))
            if idle[node]:
                self.idle.remove(idle[node][0])
                taken.append(idle[node][0])
            else:
                taken.append(self.actor(node))
        return taken

    def give_back(self, actors: list[Any]) -> None:
        self.idle.extend(actors)
        self._top_up()

    def _top_up(self) -> None:
        """Start actors until :data:`SPARE_ACTORS` are idle on each node. An
        actor spends seconds of CPU importing torch: started here, between
        two tests, it is ready when a later test takes it. (Starting one opens
        no descriptor and no thread in this process; the first call does.)"""
        for node in RAY_NODES:
            for _ in range(SPARE_ACTORS - sum(self.node_of.get(a) == node for a in self.idle)):
                self.idle.append(self.actor(node))

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.nodes.shutdown()


_RAY: RayRuntime | None = None


@pytest.fixture(scope="session")
def ray_runtime() -> Iterator[RayRuntime]:
    """One Ray instance for the whole session, started on first use."""
    pytest.importorskip("ray")
    global _RAY
    _RAY = RayRuntime()
    yield _RAY
    _RAY.close()
    _RAY = None


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
                    a.setup.remote(SCHEMES["ray"](), model_id, kind)
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


@pytest.fixture(params=list(SCHEMES))
def scheme_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=list(SCHEMES))
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Three healthy workers shared by the non-destructive tests of a module."""
    c = new_cluster(request, request.param, ["net", "net", "net"])
    yield c
    c.close()


@pytest.fixture
def make_cluster(request: pytest.FixtureRequest, scheme_name: str) -> Iterator[Callable[..., Cluster]]:
    """A factory of clusters for tests that kill, pause or break workers."""
    made: list[Cluster] = []

    def make(
        kinds: list[str],
        model_id: str = "policy",
        trainer_kind: str = "net",
        timeout: float | None = TEST_TIMEOUT,
    ) -> Cluster:
        c = new_cluster(request, scheme_name, kinds, model_id, trainer_kind, timeout)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def weightsync_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("weightsync", "AnyIO"))]


def _family() -> set[int]:
    """This process and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    family, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        family.add(pid)
        todo.extend(children.get(pid, []))
    return family


def _held_by_others(names: set[str]) -> set[str]:
    """Of ``names`` (entries of /dev/shm), those mapped by a process outside
    this test's process tree: another program's, not this test's leak."""
    family, held = _family(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in family:
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        held |= {name for name in names if f"/dev/shm/{name}" in maps}
    return held


def shm_entries() -> set[str]:
    """The entries of /dev/shm, less those another program on the machine
    holds (its multiprocessing semaphores come and go meanwhile)."""
    try:
        names = set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()
    return names - _held_by_others(names)


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
    per loop), and multiprocessing keeps one pipe to its resource tracker and
    one socket to its fork server; none is weightsync's to close.
    """
    from multiprocessing import forkserver, resource_tracker

    import anyio

    resource_tracker.ensure_running()
    forkserver.ensure_running()

    from weightsync._runtime import RUNTIME as LOOP

    LOOP.acquire()
    try:
        LOOP.portal().call(anyio.sleep, 0)
    finally:
        LOOP.release()
    return open_fds()
