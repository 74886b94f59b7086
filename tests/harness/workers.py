"""Worker processes and models for the tests (imported by spawned children)."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

import weightsync as ws


class Net(nn.Module):
    """A small policy with parameters and BatchNorm buffers."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.inp(x)))


def train_step(model: nn.Module) -> None:
    """Worker code that writes into the model's buffers: a forward pass in
    train mode updates BatchNorm's running statistics in place."""
    model.train()
    with torch.no_grad():
        model(torch.randn(8, 8))


class OverlapNet(Net):
    """Same names, shapes and dtypes as Net, but one buffer is a broadcast
    view that cannot be written in place: applying an update must fail on
    the worker, before anything is written."""

    def __init__(self) -> None:
        super().__init__()
        self.norm.running_mean = torch.zeros(1).expand(16)


class MixedNet(nn.Module):
    """Every dtype family a policy may hold, a 0-d and an empty tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.f16 = nn.Parameter(torch.randn(3, 5).half())
        self.bf16 = nn.Parameter(torch.randn(7).bfloat16())
        self.register_buffer("counts", torch.randint(-100, 100, (11,), dtype=torch.int8))
        self.register_buffer("mask", torch.rand(6) > 0.5)
        self.register_buffer("steps", torch.tensor(3, dtype=torch.int64))
        self.register_buffer("nothing", torch.zeros(0, 4))
        self.register_buffer("phase", torch.randn(2, dtype=torch.complex64))


class BigNet(nn.Module):
    """32 MiB of float32 in four buffers: a copy takes long enough to be
    interrupted."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(4):
            self.register_buffer(f"b{i}", torch.full((1 << 21,), float(i)))


def build_model(kind: str, seed: int = 0) -> Any:
    """A worker's or trainer's model: an ``nn.Module``, or for ``"dict"`` a
    plain dict of tensors with the names and shapes of :class:`Net`'s state."""
    torch.manual_seed(seed)
    if kind == "probe":
        return probe_weights()
    if kind == "dict":
        return {k: v.detach().clone() for k, v in Net().state_dict().items()}
    if kind == "big":
        return BigNet()
    if kind == "empty":
        return nn.Module()
    if kind == "mixed":
        return MixedNet()
    if kind == "net":
        return Net()
    if kind == "wide":
        return Net(hidden=32)
    if kind == "bf16":  # Net's layout in bfloat16: what wire_dtype=torch.bfloat16 sends to
        return Net().to(torch.bfloat16)
    if kind == "soak":  # 136 KiB: a leak of a copy of it per send is megabytes in a soak
        return Net(hidden=2048)
    if kind == "overlap":
        return OverlapNet()
    raise ValueError(kind)


def tensors_of(model: Any) -> dict[str, torch.Tensor]:
    """The model's own tensors by name (a module's parameters and buffers)."""
    return dict(model.state_dict(keep_vars=True)) if isinstance(model, nn.Module) else dict(model)


def snapshot(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors_of(model).items()}


# What weightsync's shared-memory segments are called in /proc (memfd_create's label).
MEMFD_LABEL = "memfd:weightsync"


def memfd_fds(pid: int | str = "self") -> list[str]:
    """The descriptors of process ``pid`` that are weightsync segments."""
    return [fd for fd in described_fds(set(os.listdir(f"/proc/{pid}/fd")), pid) if MEMFD_LABEL in fd]


def memfd_maps(pid: int | str = "self") -> list[str]:
    """The memory mappings (lines of /proc/<pid>/maps) of process ``pid``
    that are weightsync segments."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line.strip() for line in maps if MEMFD_LABEL in line]


def described_fds(fds: set[str], pid: int | str = "self") -> list[str]:
    """``fds`` of process ``pid`` that are open, as "fd -> what it is"."""
    described = []
    for fd in sorted(fds, key=int):
        try:
            described.append(f"{fd} -> {os.readlink(f'/proc/{pid}/fd/{fd}')}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return described


def memfd_maps_in_use(tensors: Any) -> tuple[list[str], list[str]]:
    """This process's mappings of weightsync segments that hold some of
    ``tensors``' data, and those that hold none. A shared-scheme worker's
    parameters run on a slot, which stays mapped as long as they do (even
    after shutdown); nothing else may stay."""
    tensors = [t for t in tensors if t.numel()]
    used, unused = [], []
    for line in memfd_maps():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        (used if any(start <= t.data_ptr() < end for t in tensors) else unused).append(line)
    return used, unused


def leftovers(tensors: Any, fds_before: set[str]) -> dict[str, list[str]]:
    """What this process holds of weightsync's once it shut down: its
    threads, descriptors opened since ``fds_before`` (the segments apart),
    segment descriptors, and segment mappings that ``tensors`` run on or not.

    Python's ``mmap`` keeps a descriptor of its own for each mapping, so a
    segment still mapped (under the model) comes with one descriptor."""
    import threading

    new = described_fds(set(os.listdir("/proc/self/fd")) - fds_before)
    used, unused = memfd_maps_in_use(tensors)
    return {
        "threads": sorted(t.name for t in threading.enumerate()),
        "new_fds": [fd for fd in new if MEMFD_LABEL not in fd],
        "memfd_fds": memfd_fds(),
        "used_memfd_maps": used,
        "unused_memfd_maps": unused,
    }


def worker_main(
    scheme: ws.WeightSyncScheme,
    model_id: str,
    pipe: Connection | None,
    ctrl: Connection,
    kind: str,
    poll: float = 0.02,
    worker_idx: int | None = None,
) -> None:
    """Receive updates in a loop; obey commands from the test over ``ctrl``.

    A process worker is given its ``pipe``; a thread of the in-process scheme
    its ``worker_idx`` instead.

    Commands: "pause" / "resume" (stop / start calling receive), "state"
    (reply with the model, the versions applied, and whether every tensor
    kept its identity and data_ptr), "stop".
    """
    model = build_model(kind, seed=1000 + os.getpid())
    tensors = tensors_of(model)
    ids = {k: id(v) for k, v in tensors.items()}
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    fds_before = set(os.listdir("/proc/self/fd"))
    if pipe is not None:
        scheme.init_on_worker(model_id, pipe=pipe, model=model)
    else:
        scheme.init_on_worker(model_id, model=model, worker_idx=worker_idx)
    ctrl.send(("ready", os.getpid()))
    receiving = True
    saved_limit = 0
    applied: list[int] = []
    errors: list[str] = []
    try:
        while True:
            if ctrl.poll():
                cmd = ctrl.recv()
                if cmd == "stop":
                    break
                if cmd in ("limit_files", "unlimit_files"):  # no descriptor left for anything new
                    import resource

                    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                    if cmd == "limit_files":
                        saved_limit = soft
                        soft = len(os.listdir("/proc/self/fd")) - 1
                    else:
                        soft = saved_limit
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
                if cmd == "exit3":  # a worker that exits with a status of its own
                    os._exit(3)
                if cmd == "write_params":  # worker code that writes into its parameters
                    with torch.no_grad():
                        for param in model.parameters():
                            param.add_(1)
                if cmd == "repoint":  # new storage, same shape: updates must follow it
                    model.out.weight.data = torch.zeros_like(model.out.weight)
                    ptrs["out.weight"] = model.out.weight.data_ptr()
                elif cmd == "restride":  # the same bytes read in another order: updates must follow it
                    rows, cols = model.out.weight.shape
                    with torch.no_grad():
                        model.out.weight.data = model.out.weight.data.as_strided((rows, cols), (1, rows))
                elif cmd == "reshape":  # new storage of another shape: updates must be refused
                    model.out.weight.data = torch.zeros(5, 16)
                    ptrs["out.weight"] = model.out.weight.data_ptr()
                elif cmd == "train_step":
                    train_step(model)
                elif cmd == "pause":
                    receiving = False
                elif cmd == "resume":
                    receiving = True
                elif cmd == "state":
                    now = tensors_of(model)
                    ctrl.send(
                        {
                            "weights": snapshot(model),
                            "applied": list(applied),
                            "same_identity": all(id(now[k]) == ids[k] for k in ids),
                            "same_ptr": all(now[k].data_ptr() == ptrs[k] for k in ids),
                            "errors": errors,
                        }
                    )
                    continue
                ctrl.send("ok")
            if receiving:
                try:
                    version = scheme.receive(timeout=poll)
                except ws.WeightSyncError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    receiving = False
                    continue
                if version:
                    applied.append(version)
            else:
                time.sleep(poll)
    finally:
        scheme.shutdown()
        ctrl.send(("bye", leftovers(tensors_of(model).values(), fds_before)))


def late_worker(
    scheme: ws.WeightSyncScheme, model_id: str, pipe: Connection, ctrl: Connection, kind: str, delay: float
) -> None:
    """:func:`worker_main`, after ``delay`` seconds: a worker that takes its
    time to start (a real one spends seconds importing torch)."""
    time.sleep(delay)
    worker_main(scheme, model_id, pipe, ctrl, kind)


def trainer_then_die(scheme: ws.WeightSyncScheme, model_id: str, pipe: Connection, sends: int) -> None:
    """A trainer that sends ``sends`` times, then kills itself with SIGKILL."""
    import signal

    model = build_model("net", seed=7)
    if isinstance(scheme, ws.DistributedWeightSyncScheme):
        # Its worker joins by rank, through the store whose address it is told.
        scheme.init_on_sender(model_id, num_workers=1, model=model, host="127.0.0.1")
        pipe.send(scheme.get_store_info())
    else:
        scheme.init_on_sender(model_id, pipes=[pipe], model=model)
    for _ in range(sends):
        with torch.no_grad():
            model.inp.weight.add_(1)
        scheme.send(timeout=30)
    os.kill(os.getpid(), signal.SIGKILL)


def describe(obj: Any) -> str:
    return f"{type(obj).__name__}: {obj}"


class RayWorker:
    """A Ray actor for the tests (made remote by the conftest), reused across
    tests: ``setup`` gives it a fresh model and scheme each time.

    Updates run in the default concurrency group (one at a time, between
    method calls); ``state``, ``wait_held`` and ``release`` run in the
    ``ctrl`` group, so the test can look at or free a held actor.
    """

    def __init__(self) -> None:
        import threading

        self.scheme: ws.WeightSyncScheme | None = None
        self.held = threading.Event()
        self.released = threading.Event()

    def setup(self, scheme: ws.WeightSyncScheme, model_id: str, kind: str) -> int:
        self.teardown()
        self.model = build_model(kind, seed=1000 + os.getpid())
        tensors = tensors_of(self.model)
        self.ids = {k: id(v) for k, v in tensors.items()}
        self.ptrs = {k: v.data_ptr() for k, v in tensors.items()}
        self.applied: list[int] = []
        self.scheme = scheme
        scheme.init_on_worker(model_id, model=self.model, on_update=self.applied.append)
        return os.getpid()

    def teardown(self) -> None:
        if self.scheme is not None:
            self.scheme.shutdown()
            self.scheme = None
        for scheme in getattr(self, "two_schemes", ()):
            scheme.shutdown()
        self.two_schemes: tuple[ws.WeightSyncScheme, ...] = ()

    def setup_two_models(self, policy_scheme: ws.WeightSyncScheme, value_scheme: ws.WeightSyncScheme) -> int:
        """Hold two models instead, each synchronised by its own scheme (as
        :class:`TwoModelRayWorker`)."""
        self.teardown()
        self.models = {"policy": build_model("net", seed=5), "value": build_model("wide", seed=6)}
        policy_scheme.init_on_worker("policy", model=self.models["policy"])
        value_scheme.init_on_worker("value", model=self.models["value"])
        self.two_schemes = (policy_scheme, value_scheme)
        return os.getpid()

    def weights(self) -> dict[str, dict[str, torch.Tensor]]:
        """The two models of :meth:`setup_two_models`."""
        return {name: snapshot(model) for name, model in self.models.items()}

    def hold(self, limit: float = 120.0) -> None:
        """Keep the actor busy (no update can run) until released (or for
        ``limit`` seconds: longer than the library's default deadline)."""
        self.released.clear()
        self.held.set()
        self.released.wait(limit)
        self.held.clear()

    def wait_held(self, limit: float = 30.0) -> bool:
        return self.held.wait(limit)

    def release(self) -> None:
        self.released.set()

    def repoint(self) -> str:
        self.model.out.weight.data = torch.zeros_like(self.model.out.weight)
        self.ptrs["out.weight"] = self.model.out.weight.data_ptr()
        return "ok"

    def restride(self) -> str:
        rows, cols = self.model.out.weight.shape
        with torch.no_grad():
            self.model.out.weight.data = self.model.out.weight.data.as_strided((rows, cols), (1, rows))
        return "ok"

    def reshape(self) -> str:
        self.model.out.weight.data = torch.zeros(5, 16)
        self.ptrs["out.weight"] = self.model.out.weight.data_ptr()
        return "ok"

    def train_step(self) -> str:
        train_step(self.model)
        return "ok"

    def state(self) -> dict[str, Any]:
        now = tensors_of(self.model)
        received = self.scheme.receive() if self.scheme is not None else None
        return {
            "weights": snapshot(self.model),
            "applied": list(self.applied),
            "received": received,
            "same_identity": all(id(now[k]) == self.ids[k] for k in self.ids),
            "same_ptr": all(now[k].data_ptr() == self.ptrs[k] for k in self.ids),
            "errors": [],
        }

    def python_threads(self) -> int:
        """The Python threads of this actor (Ray's own C++ threads, whose
        number varies with its RPC load, are not among them)."""
        import threading

        return threading.active_count()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def probe_weights() -> dict[str, torch.Tensor]:
    """4 x 4 MiB of float32: big enough that a copy takes a while."""
    return {f"w{i}": torch.zeros(1 << 20) for i in range(4)}


class RayProbe:
    """A Ray actor whose methods read the weights while updates arrive.

    ``rollout`` (a plain method) reads them at its start and its end;
    ``scan`` (the async variant, in AsyncRayProbe) reads them again and
    again, awaiting in between. Each read is classified as in :mod:`.torn_read_probe`.
    """

    def __init__(self, scheme: ws.WeightSyncScheme) -> None:
        self.weights = probe_weights()
        self.scheme = scheme
        self.versions: list[int] = []
        scheme.init_on_worker("probe", model=self.weights, on_update=self.versions.append)

    def rollout(self, seconds: float) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        from . import torn_read_probe

        first = torn_read_probe.span(self.weights)
        time.sleep(seconds)
        return first, torn_read_probe.span(self.weights)

    def timed_rollout(self, seconds: float) -> dict[str, Any]:
        """``rollout``, with when it ended (``time.monotonic()``: one clock
        for every process of this machine, which runs both Ray test nodes)."""
        first, last = self.rollout(seconds)
        return {"first": first, "last": last, "ended": time.monotonic()}

    def applied(self) -> list[int]:
        return list(self.versions)


class AsyncRayProbe(RayProbe):
    async def scan(self, seconds: float) -> dict[str, Any]:
        import asyncio

        from . import torn_read_probe

        verdicts = {"consistent": 0, "mixed": 0}
        seen = set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            verdicts[torn_read_probe.classify(self.weights)] += 1
            seen.add(float(self.weights["w0"][0]))
            await asyncio.sleep(0)
        return {**verdicts, "values": sorted(seen)}


class MixinRayWorker(ws.RayWeightSyncMixin):
    """A plain actor that uses the optional mixin."""

    def __init__(self, scheme: ws.WeightSyncScheme) -> None:
        self.model = build_model("net", seed=3)
        self.scheme = scheme
        scheme.init_on_worker("policy", model=self.model)

    def state(self) -> tuple[dict[str, torch.Tensor], int | None]:
        return snapshot(self.model), self.scheme.receive()


def two_model_worker(
    schemes: dict[str, ws.WeightSyncScheme], pipes: dict[str, Connection], ctrl: Connection
) -> None:
    """A worker process holding two models, each synchronised by its own
    scheme over its own pipe; it receives both in one loop."""
    models = {"policy": build_model("net", seed=5), "value": build_model("wide", seed=6)}
    applied: dict[str, list[int]] = {name: [] for name in models}
    for name, scheme in schemes.items():
        scheme.init_on_worker(name, pipe=pipes[name], model=models[name])
    ctrl.send(("ready", os.getpid()))
    try:
        while True:
            if ctrl.poll():
                if ctrl.recv() == "stop":
                    break
                ctrl.send({"weights": {n: snapshot(m) for n, m in models.items()}, "applied": applied})
            for name, scheme in schemes.items():
                version = scheme.receive(timeout=0.005)
                if version:
                    applied[name].append(version)
    finally:
        for scheme in schemes.values():
            scheme.shutdown()


def ray_trainer_then_die(address: str, name: str) -> None:
    """A Ray driver that creates a named collector actor, sends it the
    weights once, prints the actor's pid, then kills itself with SIGKILL."""
    import signal

    import ray

    # The tests' directory, where Ray's workers import this module from (as harness.workers).
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(
        address=address,
        namespace="weightsync-tests",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
            }
        },
    )
    actor = ray.remote(num_cpus=0)(RayWorker).options(name=name).remote()
    pid = ray.get(actor.setup.remote(ws.RayWeightSyncScheme(), "policy", "net"))
    scheme = ws.RayWeightSyncScheme(timeout=60)
    scheme.init_on_sender("policy", remote_collectors=[actor], model=build_model("net", seed=7))
    scheme.send()
    print(pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class AsyncActorRegisteringLate:
    """An async actor whose model is registered off its event loop, through
    Ray's ``__ray_call__`` (which runs on a thread of Ray's): weightsync
    cannot find the actor's loop from there and must refuse."""

    def __init__(self) -> None:
        self.model = build_model("net", seed=8)

    async def ping(self) -> bool:
        return True


def register_off_the_loop(actor: AsyncActorRegisteringLate) -> str:
    try:
        ws.RayWeightSyncScheme().init_on_worker("policy", model=actor.model)
    except ws.WeightSyncStateError as exc:
        return str(exc)
    return "registered"


# -- for the tests of the Ray relay's host copy (test_ray.py) ------------------
_APPLIED_WEIGHTS: dict[int, dict[str, torch.Tensor]] = {}


def slow_applies(actor: Any, flag: str, release: str, count: int = 1) -> None:
    """Runs on a Ray actor (through ``__ray_call__``): each of its next
    ``count`` updates touches the file ``flag``, then waits (up to 60 s)
    for the file ``release`` just before it copies into the model (a
    relayed one, inside its lease of the host's copy); every update from
    now on records the weights it left in the model, by version (see
    :func:`applied_weights`)."""
    import pathlib
    import time

    from weightsync._transports._ray import _transport as _ray

    original = getattr(_ray.RayUpdate, "original_apply", _ray.RayUpdate.apply)
    left = [count]

    def apply(self: Any, model: Any, targets: list[torch.Tensor], manifest: Any) -> None:
        if left[0] > 0:
            left[0] -= 1
            pathlib.Path(flag).touch()
            deadline = time.monotonic() + 60
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.02)
        original(self, model, targets, manifest)
        _APPLIED_WEIGHTS[self.version] = snapshot(model)

    _ray.RayUpdate.original_apply = original  # type: ignore[attr-defined]
    _ray.RayUpdate.apply = apply  # type: ignore[method-assign]


def applied_weights(actor: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Runs on a Ray actor: the weights each update recorded since :func:`slow_applies`."""
    return dict(_APPLIED_WEIGHTS)


def undo_slow_applies(actor: Any) -> None:
    """Runs on a Ray actor: updates are applied as ever again."""
    from weightsync._transports._ray import _transport as _ray

    original = getattr(_ray.RayUpdate, "original_apply", None)
    if original is not None:
        _ray.RayUpdate.apply = original  # type: ignore[method-assign]
        del _ray.RayUpdate.original_apply  # type: ignore[attr-defined]
    _APPLIED_WEIGHTS.clear()


def host_copy_state(actor: Any) -> dict[str, Any]:
    """Runs on a Ray actor: its pid and the weightsync segments it maps."""
    return {"pid": os.getpid(), "maps": memfd_maps(), "fds": memfd_fds()}
