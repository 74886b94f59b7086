"""The data of ``weightsync bench``: its constants, errors and records.

What every other module of :mod:`weightsync.bench` shares, and nothing
else: the schemes and alternatives the bench knows (:data:`SCHEMES`,
:data:`ALTERNATIVES`), the element types of the generated model
(:data:`DTYPES`), a run's configuration and cases (:class:`BenchConfig`,
:class:`Case`), their results (:class:`CaseResult`, :class:`BenchRun`,
:class:`PeakMemory`) and the bench's errors. It imports nothing else from
the bench, so every other bench module can import it.
"""

from __future__ import annotations

import importlib
import json
import math
import platform
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import weightsync as ws

__all__ = [
    "ALTERNATIVES",
    "DTYPES",
    "LOCAL_SCHEMES",
    "MAX_ROUNDS_FACTOR",
    "MEMORY_METHOD",
    "MIB",
    "MODEL_ID",
    "RECEIVE_POLL",
    "SCHEMES",
    "STARTUP_TIMEOUT",
    "DEVICE_COPIES",
    "FLOOR_METHOD",
    "AlternativeInfo",
    "BenchConfig",
    "BenchError",
    "BenchRun",
    "Case",
    "CaseResult",
    "FloorSamples",
    "PeakMemory",
    "SchemeInfo",
    "VerificationError",
    "WorkerStartup",
    "itemsize",
    "labels",
    "cuda_ipc_unavailable",
    "cuda_unavailable",
    "parse_device",
    "placement_unavailable",
    "pool_of",
    "unavailable",
]

MIB = 1 << 20
MODEL_ID = "bench"
# How long one receive() of a bench worker waits. An update or the sender's
# shutdown ends the wait at once, so this only bounds an idle loop.
RECEIVE_POLL = 1.0
# Spawned workers import torch: allow for a slow start on a loaded machine.
STARTUP_TIMEOUT = 120.0
# How the peak extra memory of a case is measured (:mod:`weightsync.bench._memory`).
MEMORY_METHOD = "VmHWM after the case minus VmRSS before it, peak reset via /proc/<pid>/clear_refs"
# When the floor is measured (weightsync.bench._run): every row of one size
# and worker count shows the same floor, whatever the machine did meanwhile.
FLOOR_METHOD = (
    "once per size and worker count, in the trainer's process just before the first case of that "
    "size (every row of one size and worker count shows that one floor)"
)


# -- devices ------------------------------------------------------------------


def parse_device(text: str) -> str:
    """``text`` as the bench takes a device: ``cpu``, ``cuda`` or ``cuda:N``
    (``cuda`` means ``cuda:0``, as torch's current device is in a fresh process).

    :raises ValueError: it names another kind of device, or no device.
    """
    name = text.strip().lower()
    if name in ("cpu", "cuda"):
        return "cuda:0" if name == "cuda" else name
    kind, _, index = name.partition(":")
    if kind == "cuda" and index.isdigit():
        return f"cuda:{int(index)}"
    raise ValueError(f"{text!r} is not a device the bench knows: cpu, cuda or cuda:N")


def cuda_unavailable(devices: Sequence[str]) -> str | None:
    """Why the CUDA ones of ``devices`` (as :func:`parse_device` returns
    them) cannot be used here, or None if they can (or none is CUDA). Asks
    torch without creating a CUDA context where no device is visible."""
    wanted = sorted({int(d.partition(":")[2]) for d in devices if d.startswith("cuda:")})
    if not wanted:
        return None
    if not torch.cuda.is_available():
        return f"no CUDA device is visible here (torch {torch.__version__})"
    count = torch.cuda.device_count()
    if wanted[-1] >= count:
        return f"cuda:{wanted[-1]} is not visible here ({count} CUDA device(s))"
    return None


def cuda_ipc_unavailable() -> str | None:
    """Why CUDA tensors cannot be shared between processes here, or None if
    they can: torch shares them by CUDA IPC, which the CUDA driver offers on
    native Linux only (not under WSL2, nor on other systems)."""
    if sys.platform != "linux":
        return f"CUDA IPC is not offered on {sys.platform}, only on native Linux"
    release = platform.release()
    if "microsoft" in release.lower():
        return f"CUDA IPC is not offered under WSL (kernel {release}), only on native Linux"
    return None


def placement_unavailable(needs: str, trainer_device: str, worker_device: str) -> str | None:
    """Why something that runs on ``needs`` devices cannot run with this
    placement, or None if it can. ``needs``: ``"any"``; ``"cpu"``: trainer
    and workers on the CPU only; ``"cuda"``: a CUDA device on either side,
    and visible; ``"ipc"``: any placement, one with a CUDA device only where
    CUDA tensors can be shared between processes
    (:func:`cuda_ipc_unavailable`)."""
    on_cuda = (trainer_device, worker_device) != ("cpu", "cpu")
    if needs == "cpu" and on_cuda:
        return "the bench runs it with --trainer-device cpu --worker-device cpu only"
    if needs == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is visible here"
        if not on_cuda:
            return "it needs a CUDA device: --trainer-device or --worker-device cuda"
    if needs == "ipc" and on_cuda:
        why = cuda_ipc_unavailable()
        if why is not None:
            return f"it shares CUDA tensors between processes, and {why}"
    return None


#: The copies of a case's bytes timed in the same run where a CUDA device is
#: involved (:mod:`weightsync.bench._memcpy`): key -> what it is.
DEVICE_COPIES: dict[str, str] = {
    "d2d": "one device-to-device copy on the GPU",
    "d2h": "one page-locked device-to-host copy",
    "h2d": "one page-locked host-to-device copy",
}


# -- schemes ------------------------------------------------------------------


def unavailable(module: str | None) -> str | None:
    """Why ``module`` (a package a scheme or alternative needs) cannot be
    imported here, or None if it can (or ``module`` is None)."""
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return f"{module} is not importable ({exc})"
    return None


@dataclass(frozen=True)
class SchemeCapabilities:
    """What a scheme of weightsync can do, and how its workers are reached:
    the one description of it, for the bench (:class:`SchemeInfo`) and for
    whatever else picks schemes by what they can do (weightsync's tests).

    ``workers`` is what a worker is: ``"processes"``, ``"actors"`` (Ray's:
    Ray owns their processes) or ``"threads"`` (of the trainer's process).
    ``reach`` is how the trainer is given its workers: ``"pipe"`` (the
    user's pipes: ``pipes=`` / ``pipe=``), ``"rank"`` (``num_workers=`` on
    the trainer, ``worker_idx=rank`` on a worker, through the store the
    pickled scheme names), ``"actor"`` (``remote_collectors=``, and
    ``init_on_worker`` inside each actor) or ``"index"`` (``num_workers=``,
    and ``worker_idx=i`` on a copy of the scheme). ``copy`` is
    ``"private"`` (each worker holds its own copy, its tensors keep their
    ``data_ptr()``) or ``"shared"`` (zero-copy: a worker's tensors run on
    the trainer's shared memory after an update). ``cross_host``: its
    workers may be on other hosts than the trainer."""

    cls: type[ws.WeightSyncScheme]
    workers: str
    reach: str
    copy: str
    cross_host: bool


#: Every scheme of weightsync, by the name the bench and the tests give it.
#: A new scheme is described here once.
SCHEME_CAPABILITIES: dict[str, SchemeCapabilities] = {
    "multiprocess": SchemeCapabilities(
        ws.MultiProcessWeightSyncScheme, workers="processes", reach="pipe", copy="private", cross_host=False
    ),
    "shared": SchemeCapabilities(
        ws.SharedMemWeightSyncScheme, workers="processes", reach="pipe", copy="shared", cross_host=False
    ),
    "inprocess": SchemeCapabilities(
        ws.InProcessWeightSyncScheme, workers="threads", reach="index", copy="private", cross_host=False
    ),
    # An actor applies each update between its method calls, from an
    # immutable object in Ray's store, into its own model: a private copy.
    "ray": SchemeCapabilities(
        ws.RayWeightSyncScheme, workers="actors", reach="actor", copy="private", cross_host=True
    ),
    # Each worker's relay thread takes the bytes into a buffer of its own;
    # receive() copies one whole version from it: a private copy.
    "distributed": SchemeCapabilities(
        ws.DistributedWeightSyncScheme, workers="processes", reach="rank", copy="private", cross_host=True
    ),
}


@dataclass(frozen=True)
class SchemeInfo:
    """A scheme the bench knows: its name on the command line, a one-line
    summary for ``--help``, how to build it with a send deadline, and what it
    guarantees: ``copy`` is ``"private"`` (each worker holds its own copy) or
    ``"shared"`` (workers read one shared buffer); ``torn`` says whether a
    worker can read a mix of two versions (``"no"`` or ``"yes"``).

    ``pool`` is what its workers are: ``"processes"``
    (:class:`weightsync.bench._pools.WorkerPool`; ``pipes=`` on the trainer,
    ``pipe=`` on a worker) or ``"ray"``
    (:class:`weightsync.bench._ray_pool.RayActorPool`; ``remote_collectors=`` on
    the trainer, ``init_on_worker`` inside each actor). ``reach`` is how a
    worker process is reached: ``"pipe"`` (``pipes=`` / ``pipe=``) or
    ``"rank"`` (``num_workers=`` on the trainer, ``worker_idx=rank`` on
    worker ``rank - 1``, through the store the pickled scheme names).
    ``copy``, ``pool`` and ``reach`` are read from the scheme's
    :data:`SCHEME_CAPABILITIES`. ``requires`` names the module it needs that
    may be missing, if any; ``devices`` where the bench can place its
    trainer and workers (:func:`placement_unavailable`)."""

    name: str
    summary: str
    factory: Callable[[float], ws.WeightSyncScheme]
    torn: str = "no"
    requires: str | None = None
    devices: str = "any"

    @property
    def capabilities(self) -> SchemeCapabilities:
        return SCHEME_CAPABILITIES[self.name]

    @property
    def copy(self) -> str:
        return self.capabilities.copy

    @property
    def pool(self) -> str:
        return "ray" if self.capabilities.workers == "actors" else "processes"

    @property
    def reach(self) -> str:
        return self.capabilities.reach

    def unavailable(self) -> str | None:
        """Why it cannot run here, or None if it can."""
        return unavailable(self.requires)


def _multiprocess(timeout: float) -> ws.WeightSyncScheme:
    return ws.MultiProcessWeightSyncScheme(timeout=timeout)


def _shared(timeout: float) -> ws.WeightSyncScheme:
    return ws.SharedMemWeightSyncScheme(timeout=timeout)


def _distributed(timeout: float) -> ws.WeightSyncScheme:
    return ws.DistributedWeightSyncScheme(timeout=timeout)


def _ray(timeout: float) -> ws.WeightSyncScheme:
    return ws.RayWeightSyncScheme(timeout=timeout)


# A new scheme joins the bench here, once its capabilities are described
# (:data:`SCHEME_CAPABILITIES`). Its pool says how it is initialised
# (``pipes=`` / ``pipe=`` in processes, ``remote_collectors=`` / inside the
# actor on Ray); one that needs more should grow this record rather than
# special-case the engine.
SCHEMES: dict[str, SchemeInfo] = {
    "multiprocess": SchemeInfo(
        "multiprocess",
        "MultiProcessWeightSyncScheme: control over pipes, bytes through one shared staging segment",
        _multiprocess,
    ),
    "shared": SchemeInfo(
        "shared",
        "SharedMemWeightSyncScheme: zero-copy, workers re-point to versioned shared-memory slots",
        _shared,
    ),
    "distributed": SchemeInfo(
        "distributed",
        "DistributedWeightSyncScheme: a pipelined gloo chain of the workers, control over a TCPStore",
        _distributed,
    ),
    "ray": SchemeInfo(
        "ray",
        "RayWeightSyncScheme: one object-store put per send, one call per Ray actor, copied in place",
        _ray,
        requires="ray",
        # The bench's Ray actors are given no GPU.
        devices="cpu",
    ),
}


# What ``weightsync bench`` runs when no ``--scheme`` is given: every scheme
# whose workers run on this machine without a launcher (each one whose
# package is missing is left out, with a note).
LOCAL_SCHEMES: tuple[str, ...] = ("multiprocess", "shared", "ray")


# Element types of the generated model (``--dtype``); checksums are over raw bytes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of the dtype named ``dtype`` (a key of :data:`DTYPES`)."""
    return DTYPES[dtype].itemsize


# -- errors -------------------------------------------------------------------


class BenchError(RuntimeError):
    """The benchmark could not complete: a worker died, failed or timed out,
    or a send raised."""


class VerificationError(BenchError):
    """A worker's weights differ from the trainer's after a send."""


# -- alternatives to weightsync ----------------------------------------------------


@dataclass(frozen=True)
class AlternativeInfo:
    """An alternative to weightsync: its name, a one-line summary, what it
    guarantees and which pool runs it (as
    :class:`SchemeInfo`), and, for one that needs a
    package, that package's module; ``devices`` as in :class:`SchemeInfo`."""

    name: str
    summary: str
    copy: str = "private"
    torn: str = "no"
    requires: str | tuple[str, ...] | None = None
    pool: str = "processes"
    devices: str = "any"

    def unavailable(self) -> str | None:
        """Why it cannot run here, or None if it can."""
        modules = (self.requires,) if isinstance(self.requires, str) else self.requires or ()
        for module in modules:
            why = unavailable(module)
            if why is not None:
                return why
        return None


# What each alternative does, and why it is labelled so: :mod:`weightsync.bench._compare`.
ALTERNATIVES: dict[str, AlternativeInfo] = {
    info.name: info
    for info in (
        AlternativeInfo("pickle-pipe", "pickle.dumps(state_dict) over each pipe; worker load_state_dict"),
        AlternativeInfo(
            "torch-mp", "torch.multiprocessing reductions: shared-memory fds over the pipe; worker copies"
        ),
        AlternativeInfo("bare-shm", "bare loop: copy into one shared buffer, notify, workers copy out"),
        AlternativeInfo(
            "bare-tight",
            "the tightest bare loop: copy into one shared buffer, one byte to each worker, which copies "
            "out and writes one byte back; checked once, after the last round",
            devices="cpu",
        ),
        AlternativeInfo(
            "ray-put",
            "one ray.put of numpy arrays, one call per Ray actor copying them in; ray.get the calls",
            requires="ray",
            pool="ray",
            devices="cpu",
        ),
        AlternativeInfo(
            "torchrl-mp",
            "torchrl MultiProcessWeightSyncScheme: weights through an mp.Queue per worker; "
            "workers alias the trainer's tensors (or its one copy on their device)",
            copy="shared",
            torn="yes",
            requires="torchrl",
            # On a GPU, torchrl shares CUDA tensors by CUDA IPC; without it,
            # it would stage them on the CPU and the workers' models would
            # leave their device.
            devices="ipc",
        ),
        AlternativeInfo(
            "torchrl-shared",
            "torchrl SharedMemWeightSyncScheme: in-place update of the trainer's shared tensors "
            "(or its one copy on the workers' device), notify over mp.Queues",
            copy="shared",
            torn="yes",
            requires="torchrl",
            devices="ipc",
        ),
        AlternativeInfo(
            "torchrl-ray",
            "torchrl RayWeightSyncScheme: one call per Ray actor, tensors over gloo into its live parameters",
            torn="yes",
            requires=("torchrl", "ray"),
            pool="ray",
            devices="cpu",
        ),
        AlternativeInfo(
            "cuda-ipc",
            "one staging tensor on the GPU shared once by CUDA IPC; the trainer copies into it, "
            "notifies; each worker copies out into its model",
            devices="cuda",
        ),
        AlternativeInfo(
            "pinned-shm",
            "one page-locked shared host buffer: the trainer copies into it (D2H), notifies; "
            "each worker copies out into its model (H2D)",
            devices="cuda",
        ),
    )
}


# -- memory ------------------------------------------------------------------------


@dataclass
class PeakMemory:
    """Extra bytes at the peak, per process, and how they were measured
    (:class:`weightsync.bench._memory.PeakMemoryProbe`)."""

    method: str  # "vmhwm-reset", "vmhwm-lifetime" or "unavailable"
    trainer_bytes: int | None
    worker_bytes: list[int | None] = field(default_factory=list)

    def total_bytes(self) -> int | None:
        """Trainer and workers together; None if any figure is missing."""
        parts = [self.trainer_bytes, *self.worker_bytes]
        if any(p is None for p in parts):
            return None
        return sum(p for p in parts if p is not None)


# -- cases and results ----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    scheme: str  # a key of SCHEMES, or of ALTERNATIVES
    size_mib: float
    workers: int
    tensors: int
    dtype: str = "float32"
    # The fraction of the model's bytes each send writes (1.0: all of it; less:
    # a partial update of the first tensors by name that hold that much).
    partial: float = 1.0
    # Whether each send is checked end to end (send(verify=True)).
    verify: bool = False
    # Where the trainer's model and each worker's model live (parse_device).
    trainer_device: str = "cpu"
    worker_device: str = "cpu"

    @property
    def nbytes(self) -> int:
        return int(self.size_mib * MIB)

    @property
    def on_cuda(self) -> bool:
        """Whether the trainer's or the workers' model lives on a CUDA device."""
        return (self.trainer_device, self.worker_device) != ("cpu", "cpu")

    @property
    def gpu(self) -> str | None:
        """The CUDA device the case's device copies are timed on: the
        trainer's if it is one, else the workers' (None: all on the CPU)."""
        if self.trainer_device != "cpu":
            return self.trainer_device
        return None if self.worker_device == "cpu" else self.worker_device


#: A case's timed sends past ``repeats`` (``min_seconds``) stop at this many times ``repeats``.
MAX_ROUNDS_FACTOR = 10


@dataclass(frozen=True)
class BenchConfig:
    """What to run: every combination of schemes, sizes, worker counts and
    tensor counts, each with ``warmup`` untimed and ``repeats`` timed sends,
    and more timed sends (up to ``MAX_ROUNDS_FACTOR`` times ``repeats``)
    while those took less than ``min_seconds`` in all (:meth:`rounds`).

    ``timeout`` is each send's deadline (and how long to wait for a worker);
    ``worker_threads`` is torch's thread count in the workers (None: torch's
    default). ``dtype`` is the generated model's element type (a key of
    :data:`DTYPES`); ``compare`` names alternatives to weightsync
    (:data:`ALTERNATIVES`) run like the schemes. ``trainer_device`` and
    ``worker_device`` say where the trainer's model and every worker's
    model live (``cpu`` or ``cuda:N``, :func:`parse_device`). ``blocking``
    times weightsync's sends as one blocking ``send()`` each;
    ``check_once`` checks each worker of a weightsync case once, after the
    last send, instead of after every send (not for the Ray schemes);
    ``ray_mixin`` makes the bench's Ray actors subclass
    :class:`weightsync.RayWeightSyncMixin`.
    """

    schemes: tuple[str, ...] = ("multiprocess", "shared")
    sizes_mib: tuple[float, ...] = (1.0, 16.0, 128.0)
    workers: tuple[int, ...] = (1, 4)
    tensors: tuple[int, ...] = (8,)
    repeats: int = 8
    warmup: int = 1
    # Timed sends go on past ``repeats`` until they took this long in all
    # (0: exactly ``repeats``): a small case's median then stands on enough
    # sends that one run's scheduling does not decide it.
    min_seconds: float = 0.0
    timeout: float = 60.0
    worker_threads: int | None = 1
    dtype: str = "float32"
    compare: tuple[str, ...] = ()
    partials: tuple[float, ...] = (1.0,)
    verify: tuple[bool, ...] = (False,)
    trainer_device: str = "cpu"
    worker_device: str = "cpu"
    # Time the blocking send() (as the README's trainer calls it) instead
    # of send_async() then wait_async(); no stall is measured then.
    blocking: bool = False
    # Check every worker of a weightsync case once, after its last send,
    # instead of after every send: no worker's check then runs while
    # another still applies the send (as bare-tight checks). Worker
    # processes only.
    check_once: bool = False
    # The Ray actors subclass weightsync.RayWeightSyncMixin.
    ray_mixin: bool = False

    def __post_init__(self) -> None:
        for device in (self.trainer_device, self.worker_device):
            if parse_device(device) != device:
                raise ValueError(f"device {device!r} is not cpu or cuda:N")
        unknown = [s for s in self.schemes if s not in SCHEMES]
        if unknown:
            raise ValueError(f"unknown scheme(s) {unknown}; known: {sorted(SCHEMES)}")
        unknown = [s for s in self.compare if s not in ALTERNATIVES]
        if unknown:
            raise ValueError(f"unknown alternative(s) {unknown}; known: {sorted(ALTERNATIVES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        checks = [
            (all(s > 0 for s in self.sizes_mib), "sizes must be positive"),
            (all(w >= 1 for w in self.workers), "worker counts must be at least 1"),
            (all(t >= 1 for t in self.tensors), "tensor counts must be at least 1"),
            (
                bool(self.partials) and all(0 < f <= 1 for f in self.partials),
                "partial fractions must be in (0, 1]",
            ),
            (self.repeats >= 1, "repeats must be at least 1"),
            (self.warmup >= 0, "warmup must not be negative"),
            (self.min_seconds >= 0, "min_seconds must not be negative"),
            (self.timeout > 0, "timeout must be positive"),
            (self.worker_threads is None or self.worker_threads >= 1, "worker threads must be at least 1"),
        ]
        on_ray = [s for s in self.schemes if SCHEMES[s].pool == "ray"]
        checks.append((not (self.check_once and on_ray), f"check_once is for worker processes, not {on_ray}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        # (An alternative alone is a run too: the reference of a script that
        # times weightsync in a run of its own.)
        if not ((self.schemes or self.compare) and self.sizes_mib and self.workers and self.tensors):
            raise ValueError(
                "every list of schemes (or alternatives), sizes, workers and tensors needs a value"
            )

    def rounds(self, timed: list[float]) -> Iterator[int]:
        """The steps of one case, from 0: ``warmup`` untimed, then timed
        ones, whose seconds the caller appends to ``timed`` as each ends:
        ``repeats`` of them, then more while ``timed`` sums to less than
        ``min_seconds``, up to ``MAX_ROUNDS_FACTOR * repeats`` in all."""
        step, most = 0, self.warmup + MAX_ROUNDS_FACTOR * self.repeats
        while step < self.warmup + self.repeats or (step < most and sum(timed) < self.min_seconds):
            yield step
            step += 1

    @property
    def devices(self) -> tuple[str, str]:
        """(trainer's device, workers' device)."""
        return self.trainer_device, self.worker_device

    def cases(self) -> list[Case]:
        """Every combination, sizes outermost, so the big cases come last;
        at each size the schemes first, then the alternatives."""
        return [
            Case(scheme, size, workers, tensors, self.dtype, partial, verify, *self.devices)
            for size in self.sizes_mib
            for scheme in (*self.schemes, *self.compare)
            # Partial and verified updates are weightsync's: the alternatives
            # send whole models, unchecked.
            for partial in (self.partials if scheme in SCHEMES else (1.0,))
            for verify in (self.verify if scheme in SCHEMES else (False,))
            for tensors in self.tensors
            for workers in self.workers
        ]


def _percentile(samples: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest sample with at least
    ``fraction`` of the samples at or below it."""
    ordered = sorted(samples)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def _p90(samples: Sequence[float]) -> float:
    return _percentile(samples, 0.9)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _info(name: str) -> SchemeInfo | AlternativeInfo:
    """The :class:`SchemeInfo` or :class:`AlternativeInfo` of ``name``."""
    return SCHEMES.get(name) or ALTERNATIVES[name]


def labels(name: str) -> tuple[str, str]:
    """What scheme or alternative ``name`` guarantees: (copy, torn), as in
    :class:`SchemeInfo`."""
    info = _info(name)
    return info.copy, info.torn


def pool_of(name: str) -> str:
    """Which pool runs scheme or alternative ``name``: ``"processes"`` or
    ``"ray"``, as in :class:`SchemeInfo`."""
    return _info(name).pool


@dataclass
class FloorSamples:
    """The copies a floor is made of, timed once for every case of one size
    (``nbytes``, the model's bytes) and worker count
    (:func:`weightsync.bench._run.measure_floors`): ``workers + 1`` memcpys
    on one thread (``serial_s``) and split across every core (``split_s``);
    the chain of two memcpys, each way; and where a CUDA device is involved,
    one copy of each kind of :data:`DEVICE_COPIES` on ``gpu``. Shared by the
    size's worker counts but for ``serial_s`` / ``split_s``."""

    nbytes: int
    workers: int
    gpu: str | None
    serial_s: list[float] = field(default_factory=list)
    split_s: list[float] = field(default_factory=list)
    chain_serial_s: list[float] = field(default_factory=list)
    chain_split_s: list[float] = field(default_factory=list)
    device_copy_s: dict[str, list[float]] = field(default_factory=dict)

    def apply(self, result: CaseResult) -> None:
        """Give ``result`` these samples (copies of the lists), so that its
        floor is this one."""
        result.floor_serial_s = list(self.serial_s)
        result.floor_split_s = list(self.split_s)
        result.chain_serial_s = list(self.chain_serial_s)
        result.chain_split_s = list(self.chain_split_s)
        result.device_copy_s = {kind: list(samples) for kind, samples in self.device_copy_s.items()}


@dataclass
class CaseResult:
    """The raw samples of one case, in seconds, and what they mean."""

    case: Case
    nbytes: int  # bytes of the model's tensors
    packet_nbytes: int  # bytes a send moves, with alignment padding
    # Timed from send_async() until wait_async() returned (a scheme), or
    # around one round of an alternative.
    send_s: list[float] = field(default_factory=list)
    report_s: list[float] = field(default_factory=list)  # SendReport.seconds of the same sends
    # The trainer's thread's CPU time (user and system: time.thread_time) of
    # each timed send (weightsync's schemes and bare-tight): what a send
    # costs the trainer beyond waiting.
    cpu_s: list[float] = field(default_factory=list)
    # Each worker's CPU time (time.thread_time) of the call that took each
    # timed send's update (weightsync's receive(), bare-tight's read, copy
    # and echo), every worker's together: what a send costs a worker.
    worker_cpu_s: list[float] = field(default_factory=list)
    # How long each send held the trainer's weights: until send_async() returned.
    stall_s: list[float] = field(default_factory=list)
    # One ray.put of the model's bytes after each send (Ray cases): the
    # stall's reference there, as memcpy is elsewhere.
    put_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    # The floor's copies (and the GPU's) are those of the case's size and
    # worker count, measured once for all its cases (FloorSamples).
    floor_serial_s: list[float] = field(default_factory=list)  # workers + 1 copies, one thread
    floor_split_s: list[float] = field(default_factory=list)  # the same, split across every core
    chain_serial_s: list[float] = field(default_factory=list)  # 2 copies one after the other, one thread
    chain_split_s: list[float] = field(default_factory=list)  # the same, split across every core
    # Where a CUDA device is involved: one copy of the same bytes of each
    # kind of DEVICE_COPIES (d2d, d2h, h2d), on the case's GPU, same run.
    device_copy_s: dict[str, list[float]] = field(default_factory=dict)
    memory: PeakMemory | None = None  # peak extra memory during the case
    # A scheme's case: from init_on_sender until the sender's connect()
    # returned (the workers initialised the scheme, announced themselves and
    # hold the initial weights), on workers already started.
    connect_s: float | None = None

    @property
    def kind(self) -> str:
        """``"scheme"`` (weightsync) or ``"alternative"`` (``--compare``)."""
        return "scheme" if self.case.scheme in SCHEMES else "alternative"

    @property
    def p10_s(self) -> float:
        return _percentile(self.send_s, 0.1)

    @property
    def max_s(self) -> float:
        return max(self.send_s)

    @property
    def moved_nbytes(self) -> int:
        """Bytes each send moves: the model's, or a partial update's."""
        return self.nbytes if self.case.partial >= 1.0 else self.packet_nbytes

    @property
    def gbps_aggregate(self) -> float:
        """Bytes per second (1e9) all workers together receive at the median."""
        return self.case.workers * self.moved_nbytes / self.median_s / 1e9

    @property
    def median_s(self) -> float:
        return statistics.median(self.send_s)

    @property
    def p90_s(self) -> float:
        return _p90(self.send_s)

    @property
    def gbps(self) -> float:
        """Bytes per second (1e9) each worker receives at the median."""
        return self.moved_nbytes / self.median_s / 1e9

    @property
    def memcpy_median_s(self) -> float:
        return statistics.median(self.memcpy_s)

    @staticmethod
    def _faster(serial: list[float], split: list[float]) -> float:
        return min(statistics.median(serial), statistics.median(split))

    @property
    def host_bandwidth_floor_s(self) -> float:
        """(workers + 1) memcpys' bytes at this machine's memory bandwidth:
        the faster median of those copies on one thread and split across
        every core (copies run in parallel cannot beat it)."""
        return self._faster(self.floor_serial_s, self.floor_split_s)

    @property
    def host_chain_floor_s(self) -> float:
        """Two memcpys that must follow one another (the trainer's copy into
        the staging, then a worker's out of it), each as fast as this
        machine copies (0 where not measured)."""
        if not self.chain_serial_s:
            return 0.0
        return self._faster(self.chain_serial_s, self.chain_split_s)

    @property
    def host_floor_median_s(self) -> float:
        """The host floor: the larger of the chain and the bandwidth bound."""
        return max(self.host_chain_floor_s, self.host_bandwidth_floor_s)

    @property
    def floor_bound(self) -> str:
        """Which bound the floor is: ``"chain"`` or ``"bandwidth"`` (of
        the host copies; a GPU's copies are summed as they are)."""
        return "chain" if self.host_chain_floor_s > self.host_bandwidth_floor_s else "bandwidth"

    def device_copy_median_s(self, kind: str) -> float | None:
        """The median of one copy of kind ``kind`` (a key of
        :data:`DEVICE_COPIES`), or None where it was not measured."""
        samples = self.device_copy_s.get(kind)
        return statistics.median(samples) if samples else None

    @property
    def floor_kind(self) -> str:
        """What the floor adds up, for this case's placement."""
        case = self.case
        if not case.on_cuda:
            return "(workers + 1) memcpys"
        if case.trainer_device == "cpu":
            return "one memcpy + workers x page-locked H2D"
        if case.worker_device == "cpu":
            return "one page-locked D2H + workers' memcpys in parallel"
        return "(workers + 1) x D2D"

    @property
    def floor_median_s(self) -> float:
        """The floor of the case's placement: the copies a send that gives
        every worker a private copy through one staging must do (into the
        staging, then out of it per worker), each at its median in the same
        run: memcpys on the CPU (:attr:`host_floor_median_s`), D2D copies on
        one GPU, a page-locked D2H or H2D where the bytes change sides."""
        case = self.case
        d2d, d2h, h2d = (self.device_copy_median_s(kind) for kind in DEVICE_COPIES)
        if not case.on_cuda or None in (d2d, d2h, h2d):
            return self.host_floor_median_s
        assert d2d is not None and d2h is not None and h2d is not None
        # One host copy, as fast as this machine makes it; the workers' host
        # copies, which run in parallel, at its memory bandwidth.
        one_copy = self.host_chain_floor_s / 2 or self.memcpy_median_s
        if case.trainer_device == "cpu":
            return one_copy + case.workers * h2d
        if case.worker_device == "cpu":
            per_copy = self.host_bandwidth_floor_s / (case.workers + 1)
            return d2h + max(one_copy, case.workers * per_copy)
        return (case.workers + 1) * d2d

    @property
    def vs_memcpy(self) -> float:
        return self.median_s / self.memcpy_median_s

    @property
    def stall_median_s(self) -> float | None:
        """The median time the trainer's weights were held (None: not measured)."""
        return statistics.median(self.stall_s) if self.stall_s else None

    @property
    def stall_reference(self) -> str:
        """What the stall is compared with: one ``ray.put`` of the model's
        bytes for a Ray case, else one memcpy of them."""
        return "ray.put" if self.put_s else "memcpy"

    @property
    def stall_vs_reference(self) -> float | None:
        stall = self.stall_median_s
        if stall is None:
            return None
        reference = statistics.median(self.put_s) if self.put_s else self.memcpy_median_s
        return stall / reference

    @property
    def vs_floor(self) -> float:
        return self.median_s / self.floor_median_s

    def summary(self) -> dict[str, Any]:
        copy, torn = labels(self.case.scheme)
        memory = self.memory
        return {
            "kind": self.kind,
            "copy": copy,
            "torn": torn,
            "median_ms": self.median_s * 1e3,
            "cpu_us": statistics.median(self.cpu_s) * 1e6 if self.cpu_s else None,
            "worker_cpu_us": statistics.median(self.worker_cpu_s) * 1e6 if self.worker_cpu_s else None,
            "p10_ms": self.p10_s * 1e3,
            "p90_ms": self.p90_s * 1e3,
            "max_ms": self.max_s * 1e3,
            "gbps_per_worker": self.gbps,
            "gbps_aggregate": self.gbps_aggregate,
            "peak_memory": None
            if memory is None
            else {
                "method": memory.method,
                "definition": MEMORY_METHOD,
                "trainer_extra_bytes": memory.trainer_bytes,
                "worker_extra_bytes": memory.worker_bytes,
                "total_extra_bytes": memory.total_bytes(),
            },
            "stall_ms": None if self.stall_median_s is None else self.stall_median_s * 1e3,
            "stall_reference": self.stall_reference,
            "stall_reference_ms": (statistics.median(self.put_s) if self.put_s else self.memcpy_median_s)
            * 1e3,
            "stall_vs_reference": self.stall_vs_reference,
            "connect_ms": None if self.connect_s is None else self.connect_s * 1e3,
            "memcpy_ms": self.memcpy_median_s * 1e3,
            "floor_ms": self.floor_median_s * 1e3,
            "floor_kind": self.floor_kind,
            "floor_bound": self.floor_bound,
            "host_floor_ms": self.host_floor_median_s * 1e3,
            **{
                f"{kind}_pinned_ms" if kind != "d2d" else "d2d_ms": _ms(self.device_copy_median_s(kind))
                for kind in DEVICE_COPIES
            },
            "vs_memcpy": self.vs_memcpy,
            "vs_floor": self.vs_floor,
        }


@dataclass(frozen=True)
class WorkerStartup:
    """How long a pool's workers took to start: ``seconds`` from starting
    ``workers`` processes (``kind`` ``"processes"``) or Ray actors
    (``"ray"``) until every one announced itself, having imported torch and
    weightsync; for Ray, ``ray_init_s`` is the ``ray.init()`` before them
    (None: Ray was already running)."""

    kind: str
    workers: int
    seconds: float
    ray_init_s: float | None = None


@dataclass
class BenchRun:
    """A whole run: the configuration, the machine, how long its workers
    took to start, and one result per case."""

    config: BenchConfig
    machine: dict[str, Any]
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)  # scheme or alternative -> why it did not run
    startup: list[WorkerStartup] = field(default_factory=list)  # one per pool that started workers

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "machine": self.machine,
            "seconds": self.seconds,
            "skipped": self.skipped,
            "worker_startup": [asdict(s) for s in self.startup],
            "peak_memory_method": MEMORY_METHOD,
            "floor_measured": FLOOR_METHOD,
            "cases": [
                {**asdict(r.case), "nbytes": r.nbytes, "packet_nbytes": r.packet_nbytes}
                | r.summary()
                | {
                    "floor_copies": r.case.workers + 1,
                    "samples": {
                        "send_s": r.send_s,
                        "report_s": r.report_s,
                        "cpu_s": r.cpu_s,
                        "worker_cpu_s": r.worker_cpu_s,
                        "stall_s": r.stall_s,
                        "put_s": r.put_s,
                        "memcpy_s": r.memcpy_s,
                        "floor_serial_s": r.floor_serial_s,
                        "floor_split_s": r.floor_split_s,
                        "chain_serial_s": r.chain_serial_s,
                        "chain_split_s": r.chain_split_s,
                        "device_copy_s": r.device_copy_s,
                    },
                }
                for r in self.results
            ],
        }

    def write_json(self, path: str) -> None:
        """Write :meth:`to_json` to ``path``. :raises OSError: it cannot be written."""
        with open(path, "w", encoding="utf-8") as out:
            json.dump(self.to_json(), out, indent=1)
            out.write("\n")
