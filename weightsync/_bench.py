"""The engine of ``weightsync bench``: time full sends, verify every one, and
measure memcpy references of the same bytes in the same run.

A run starts one pool of worker processes (spawn) and reuses it for every
case: starting a process that imports torch costs seconds on a small machine,
more than most cases. Each case still gets its own scheme, its own pipes and
freshly built models, so no weightsync state crosses cases. Ray cases (the
``ray`` scheme, the ``ray-put`` alternative) run the same way on a pool of
Ray actors instead (:mod:`weightsync._bench_ray`), started only when the run
has a Ray case.

For each case the trainer

1. builds a generated MLP-like model of tensors of the run's dtype (float32
   unless asked); each worker builds one of the same layout holding zeros;
2. warms up, then times ``scheme.send()``: the whole send, from the call until
   every worker applied the version and its ack is in;
3. after every send, outside the timed region, compares a CRC32 per tensor
   that each worker computed over its own model with the trainer's; a
   mismatch raises :class:`VerificationError`;
4. changes one tensor of its model, so every send carries different bytes;
5. times, half before the sends and half after, a single-threaded memcpy of
   the same bytes and the floor of the scheme's work: ``workers + 1`` memcpys
   (one into staging, one out per worker) on up to two threads.

Alternatives to weightsync (``--compare``, :mod:`weightsync._bench_compare`)
run in the same pool with the same model and sizes, timed and verified the
same way. During each case the peak extra memory of the trainer and of each
worker (process or Ray actor) is measured (:mod:`weightsync._bench_memory`).

Worker processes run torch single-threaded by default (``worker_threads``):
several workers share the cores, and oversubscribed OpenMP threads measure the
scheduler rather than the transport.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import json
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import signal
import statistics
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import nn

from ._bench_memory import METHOD as MEMORY_METHOD
from ._bench_memory import PeakMemory, PeakMemoryProbe
from ._exceptions import SenderLostError, WeightSyncError
from ._schemes import (
    MultiProcessWeightSyncScheme,
    RayWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
)

if TYPE_CHECKING:
    from ._bench_compare import AlternativeInfo

__all__ = [
    "DTYPES",
    "SCHEMES",
    "BenchConfig",
    "BenchError",
    "BenchRun",
    "Case",
    "CaseResult",
    "GeneratedMLP",
    "Pool",
    "SchemeInfo",
    "VerificationError",
    "WorkerPool",
    "change_model",
    "check_applied",
    "corrupt_model",
    "itemsize",
    "labels",
    "describe_machine",
    "format_row",
    "floor_seconds",
    "format_table",
    "machine_facts",
    "memcpy_floor_seconds",
    "memcpy_seconds",
    "mlp_shapes",
    "model_nbytes",
    "pool_of",
    "run_bench",
    "run_case",
    "table_header",
    "tensor_checksums",
    "unavailable",
]

MIB = 1 << 20
MODEL_ID = "bench"
# How long one receive() of a bench worker waits. An update or the sender's
# shutdown ends the wait at once, so this only bounds an idle loop.
_RECEIVE_POLL = 1.0
# Spawned workers import torch: allow for a slow start on a loaded machine.
_STARTUP_TIMEOUT = 120.0


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
class SchemeInfo:
    """A scheme the bench knows: its name on the command line, a one-line
    summary for ``--help``, how to build it with a send deadline, and what it
    guarantees: ``copy`` is ``"private"`` (each worker holds its own copy) or
    ``"shared"`` (workers read one shared buffer); ``torn`` says whether a
    worker can read a mix of two versions (``"no"`` or ``"yes"``).

    ``pool`` is what its workers are: ``"processes"`` (:class:`WorkerPool`;
    ``pipes=`` on the trainer, ``pipe=`` on a worker) or ``"ray"``
    (:class:`weightsync._bench_ray.RayActorPool`; ``remote_collectors=`` on
    the trainer, ``init_on_worker`` inside each actor). ``requires`` names
    the module it needs that may be missing, if any."""

    name: str
    summary: str
    factory: Callable[[float], WeightSyncScheme]
    copy: str = "private"
    torn: str = "no"
    pool: str = "processes"
    requires: str | None = None

    def unavailable(self) -> str | None:
        """Why it cannot run here, or None if it can."""
        return unavailable(self.requires)


def _multiprocess(timeout: float) -> WeightSyncScheme:
    return MultiProcessWeightSyncScheme(timeout=timeout)


def _shared(timeout: float) -> WeightSyncScheme:
    return SharedMemWeightSyncScheme(timeout=timeout)


def _ray(timeout: float) -> WeightSyncScheme:
    return RayWeightSyncScheme(timeout=timeout)


# A new scheme joins the bench here. Its ``pool`` says how it is initialised
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
        copy="shared",
    ),
    # An actor applies each update between its method calls, from an
    # immutable object in Ray's store, into its own model: a private copy,
    # never torn.
    "ray": SchemeInfo(
        "ray",
        "RayWeightSyncScheme: one object-store put per send, one call per Ray actor, copied in place",
        _ray,
        pool="ray",
        requires="ray",
    ),
}


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


# -- the model ----------------------------------------------------------------


def mlp_shapes(nbytes: int, tensors: int, item: int = 4) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an MLP of tensors of ``item`` bytes per element
    (4: float32) holding about ``nbytes`` in exactly ``tensors`` tensors.

    Layers are Linear-like pairs (``weight [out, in]``, ``bias [out]``); an
    odd count ends with a weight alone. Row counts are powers of two, so a
    power-of-two size comes out exact; otherwise the total is within a few
    rows of ``nbytes`` (use :func:`model_nbytes` for the exact figure).

    :raises ValueError: ``nbytes`` or ``tensors`` is not positive.
    """
    if nbytes <= 0 or tensors <= 0:
        raise ValueError(f"nbytes and tensors must be positive, got {nbytes} and {tensors}")
    pairs, lone = divmod(tensors, 2)
    matrices = pairs + lone
    per_matrix = max(nbytes // item // matrices, 2)  # elements per weight (+ its bias)
    rows = 1 << (max(math.isqrt(per_matrix), 1).bit_length() - 1)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(pairs):
        shapes[f"layers.{i}.weight"] = (rows, max((per_matrix - rows) // rows, 1))
        shapes[f"layers.{i}.bias"] = (rows,)
    if lone:
        shapes[f"layers.{pairs}.weight"] = (rows, max(per_matrix // rows, 1))
    return shapes


def model_nbytes(shapes: Mapping[str, tuple[int, ...]], item: int = 4) -> int:
    """Bytes of tensors of these shapes, ``item`` bytes per element."""
    return sum(math.prod(shape) for shape in shapes.values()) * item


class _Layer(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None


_FILL_CHUNK = 1 << 20  # elements: bounds the temporaries of a fill, which the memory probe sees


def _fill_pattern(flat: torch.Tensor, index: int) -> None:
    """A ramp from -1 to 1 plus ``index`` (integer dtypes: a sawtooth from
    ``index``), written in chunks."""
    count = flat.numel()
    step = 2.0 / max(count - 1, 1)
    for lo in range(0, count, _FILL_CHUNK):
        hi = min(lo + _FILL_CHUNK, count)
        positions = torch.arange(lo, hi, dtype=torch.float64)
        if flat.is_floating_point():
            flat[lo:hi].copy_(positions.mul_(step).add_(index - 1.0))
        else:
            flat[lo:hi].copy_(positions.add_(index).remainder_(97))


class GeneratedMLP(nn.Module):
    """A model with the tensors of :func:`mlp_shapes`.

    ``fill="zeros"`` (a worker) or ``"pattern"`` (the trainer: a ramp per
    tensor, offset by its index, so a tensor read from the wrong place or
    shifted within itself changes the checksum). ``dtype`` names a key of
    :data:`DTYPES`; integer dtypes get a sawtooth instead of the ramp.
    """

    def __init__(
        self, shapes: Mapping[str, tuple[int, ...]], fill: str = "zeros", dtype: str = "float32"
    ) -> None:
        super().__init__()
        count = len({name.split(".")[1] for name in shapes})
        made: list[torch.Tensor] = []

        def tensor(name: str) -> torch.Tensor | None:
            shape = shapes.get(name)
            if shape is None:
                return None
            # zeros, not empty: every page is touched now, not inside a timed send.
            t = torch.zeros(shape, dtype=DTYPES[dtype])
            if fill == "pattern":
                _fill_pattern(t.view(-1), len(made))
            made.append(t)
            return t

        layers = []
        for i in range(count):
            weight = tensor(f"layers.{i}.weight")
            assert weight is not None, "mlp_shapes names every layer's weight"
            layers.append(_Layer(weight, tensor(f"layers.{i}.bias")))
        self.layers = nn.ModuleList(layers)


def tensor_checksums(tensors: Mapping[str, torch.Tensor]) -> list[int]:
    """CRC32 of the bytes of each tensor, in name order.

    Position-sensitive, so a shifted, swapped, torn or stale tensor is caught,
    and several GB/s, so verifying every send stays cheap.
    """
    sums = []
    for name in sorted(tensors):
        flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
        sums.append(zlib.crc32(flat.numpy().data))
    return sums


# -- memcpy references --------------------------------------------------------


@contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` single-threaded ``copy_`` of ``nbytes``
    between two preallocated ``uint8`` tensors (after one untimed copy).
    Blocks for the copies; allocates ``2 * nbytes`` for the duration."""
    return _timed_copies(nbytes, 1, repeats)


def _timed_copies(nbytes: int, copies: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``copies`` single-threaded
    ``copy_`` of ``nbytes`` between two preallocated tensors (after one
    untimed copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    with _torch_threads(1):
        dst.copy_(src)
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(copies):
                dst.copy_(src)
            times.append(time.perf_counter() - start)
    return times


def memcpy_floor_seconds(nbytes: int, copies: int, repeats: int, threads: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` rounds of ``copies`` memcpys of ``nbytes``,
    the bytes split evenly across ``threads`` threads (torch single-threaded in
    each). With ``copies = workers + 1`` this is the least work a send through
    one staging buffer can do on this machine. Blocks for the copies.

    Each round hands work to the threads, which costs tens of microseconds:
    for small buffers :func:`floor_seconds` is the fairer floor.
    """
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    halves = [(src[a:b], dst[a:b]) for a, b in itertools.pairwise(bounds)]

    def work(part: int) -> None:
        source, target = halves[part]
        for _ in range(copies):
            target.copy_(source)

    times = []
    with _torch_threads(1), ThreadPoolExecutor(threads, thread_name_prefix="bench-memcpy") as pool:
        list(pool.map(work, range(threads)))
        for _ in range(repeats):
            start = time.perf_counter()
            for future in [pool.submit(work, part) for part in range(threads)]:
                future.result()
            times.append(time.perf_counter() - start)
    return times


def floor_seconds(
    nbytes: int, copies: int, repeats: int, threads: int = 2
) -> tuple[list[float], list[float]]:
    """The floor of a send's work: ``copies`` memcpys of ``nbytes`` on up to
    ``threads`` threads, measured both ways: all on one thread, and split across
    ``threads`` threads (:func:`memcpy_floor_seconds`). Returns both sample
    lists; the floor is the smaller median, because handing a small buffer to
    a second thread costs more than copying it. Blocks for the copies."""
    serial = _timed_copies(nbytes, copies, repeats)
    return serial, memcpy_floor_seconds(nbytes, copies, repeats, threads)


# -- cases and results ----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    scheme: str  # a key of SCHEMES, or of weightsync._bench_compare.ALTERNATIVES
    size_mib: float
    workers: int
    tensors: int
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return int(self.size_mib * MIB)


@dataclass(frozen=True)
class BenchConfig:
    """What to run: every combination of schemes, sizes, worker counts and
    tensor counts, each with ``warmup`` untimed and ``repeats`` timed sends.

    ``timeout`` is each send's deadline (and how long to wait for a worker);
    ``worker_threads`` is torch's thread count in the workers (None: torch's
    default). ``dtype`` is the generated model's element type (a key of
    :data:`DTYPES`); ``compare`` names alternatives to weightsync
    (:data:`weightsync._bench_compare.ALTERNATIVES`) run like the schemes.
    """

    schemes: tuple[str, ...] = ("multiprocess",)
    sizes_mib: tuple[float, ...] = (1.0, 16.0, 128.0)
    workers: tuple[int, ...] = (1, 2, 4)
    tensors: tuple[int, ...] = (8,)
    repeats: int = 10
    warmup: int = 2
    timeout: float = 60.0
    worker_threads: int | None = 1
    dtype: str = "float32"
    compare: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from ._bench_compare import ALTERNATIVES

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
            (self.repeats >= 1, "repeats must be at least 1"),
            (self.warmup >= 0, "warmup must not be negative"),
            (self.timeout > 0, "timeout must be positive"),
            (self.worker_threads is None or self.worker_threads >= 1, "worker threads must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if not (self.schemes and self.sizes_mib and self.workers and self.tensors):
            raise ValueError("every list of schemes, sizes, workers and tensors needs a value")

    def cases(self) -> list[Case]:
        """Every combination, sizes outermost, so the big cases come last;
        at each size the schemes first, then the alternatives."""
        return [
            Case(scheme, size, workers, tensors, self.dtype)
            for size in self.sizes_mib
            for scheme in (*self.schemes, *self.compare)
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


def _info(name: str) -> SchemeInfo | AlternativeInfo:
    """The :class:`SchemeInfo` or ``AlternativeInfo`` of ``name``."""
    from ._bench_compare import ALTERNATIVES

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
class CaseResult:
    """The raw samples of one case, in seconds, and what they mean."""

    case: Case
    nbytes: int  # bytes of the model's tensors
    packet_nbytes: int  # bytes a send moves, with alignment padding
    send_s: list[float] = field(default_factory=list)  # timed around scheme.send()
    report_s: list[float] = field(default_factory=list)  # SendReport.seconds of the same sends
    memcpy_s: list[float] = field(default_factory=list)
    floor_serial_s: list[float] = field(default_factory=list)  # workers + 1 copies, one thread
    floor_split_s: list[float] = field(default_factory=list)  # the same, split across two threads
    memory: PeakMemory | None = None  # peak extra memory during the case

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
    def gbps_aggregate(self) -> float:
        """Bytes per second (1e9) all workers together receive at the median."""
        return self.case.workers * self.nbytes / self.median_s / 1e9

    @property
    def median_s(self) -> float:
        return statistics.median(self.send_s)

    @property
    def p90_s(self) -> float:
        return _p90(self.send_s)

    @property
    def gbps(self) -> float:
        """Bytes per second (1e9) each worker receives at the median."""
        return self.nbytes / self.median_s / 1e9

    @property
    def memcpy_median_s(self) -> float:
        return statistics.median(self.memcpy_s)

    @property
    def floor_median_s(self) -> float:
        """The floor: the faster median of the serial and the split copies."""
        return min(statistics.median(self.floor_serial_s), statistics.median(self.floor_split_s))

    @property
    def vs_memcpy(self) -> float:
        return self.median_s / self.memcpy_median_s

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
            "memcpy_ms": self.memcpy_median_s * 1e3,
            "floor_ms": self.floor_median_s * 1e3,
            "vs_memcpy": self.vs_memcpy,
            "vs_floor": self.vs_floor,
        }


@dataclass
class BenchRun:
    """A whole run: the configuration, the machine, and one result per case."""

    config: BenchConfig
    machine: dict[str, Any]
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)  # scheme or alternative -> why it did not run

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "machine": self.machine,
            "seconds": self.seconds,
            "skipped": self.skipped,
            "peak_memory_method": MEMORY_METHOD,
            "cases": [
                {**asdict(r.case), "nbytes": r.nbytes, "packet_nbytes": r.packet_nbytes}
                | r.summary()
                | {
                    "floor_copies": r.case.workers + 1,
                    "samples": {
                        "send_s": r.send_s,
                        "report_s": r.report_s,
                        "memcpy_s": r.memcpy_s,
                        "floor_serial_s": r.floor_serial_s,
                        "floor_split_s": r.floor_split_s,
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


# -- the machine --------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _uvloop_installed() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def _installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, or None; without importing it."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_facts() -> dict[str, Any]:
    """What the numbers depend on: CPU, cores, memory, versions, and the load
    when called (other processes on the machine skew every timing)."""
    from . import __version__

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "weightsync": __version__,
        "ray": _installed_version("ray"),
        "torch_threads": torch.get_num_threads(),
        # Which event loop runs a send depends on these; the facade decides.
        "uvloop_installed": _uvloop_installed(),
        "weightsync_env": {k: v for k, v in os.environ.items() if k.startswith("WEIGHTSYNC_")},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# -- pools of workers -------------------------------------------------------------


_PoolT = TypeVar("_PoolT", bound="Pool")


class Pool(Protocol):
    """What running a case needs of the workers: :class:`WorkerPool`
    (processes joined by pipes) or :class:`weightsync._bench_ray.RayActorPool`
    (Ray actors). ``cases`` is the whole run's, so a case's index is the same
    in every pool; a pool starts workers only for the cases it runs
    (:func:`pool_of`). Both pools subclass it: entering one starts it (and
    closes what started if that fails), leaving closes it."""

    cases: list[Case]

    def start(self) -> None:
        """Start the workers; block until each is up."""
        ...

    def close(self) -> None:
        """Stop every worker. Idempotent."""
        ...

    def __enter__(self: _PoolT) -> _PoolT:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def worker_pids(self, count: int) -> Sequence[int | None]:
        """Process ids of the first ``count`` workers (None: not on this machine)."""
        ...

    def sender_args(self, index: int) -> dict[str, Any]:
        """What ``init_on_sender`` needs, besides the model, to reach case ``index``'s workers."""
        ...

    def start_case(self, index: int, scheme: WeightSyncScheme, shapes: dict[str, tuple[int, ...]]) -> None:
        """Have the case's workers build their models and initialise ``scheme``."""
        ...

    def verify(self, version: int, names: Sequence[str], expected: Sequence[int]) -> None:
        """Compare every worker's checksums after ``version`` with ``expected``."""
        ...

    def end_case(self, index: int) -> None:
        """After the trainer's scheme is shut down: end the workers' side of the case."""
        ...


def check_applied(
    slot: int,
    version: int,
    got_version: int | None,
    got: Sequence[int],
    names: Sequence[str],
    expected: Sequence[int],
) -> None:
    """Check what worker ``slot`` reported after send ``version``: the
    version it applied and its checksums, against the trainer's ``expected``.

    :raises VerificationError: it holds other weights, or another version.
    """
    if got_version != version:
        raise VerificationError(f"worker {slot} reported applying version {got_version} after send {version}")
    if list(got) != list(expected):
        wrong = [n for n, a, b in zip(names, got, expected, strict=True) if a != b]
        raise VerificationError(
            f"worker {slot} does not hold the trainer's weights after version {version}: "
            f"{len(wrong)} of {len(names)} tensors differ (first: {wrong[0]!r}, "
            f"crc32 {got[names.index(wrong[0])]:#010x} != {expected[names.index(wrong[0])]:#010x})"
        )


# -- worker processes -----------------------------------------------------------


def _worker_main(slot: int, ctrl: Connection, pipes: dict[int, Connection], threads: int | None) -> None:
    """A bench worker: serves the cases the trainer starts over ``ctrl``.

    Messages to the trainer: ("up", pid), ("ready",), ("applied", version,
    checksums), ("ended",), ("failed", traceback).
    """
    # Ctrl-C reaches the whole process group; the trainer decides when the
    # workers stop, so they finish cleanly instead of dying mid-case.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ctrl.send(("up", os.getpid()))
        while True:
            try:
                command = ctrl.recv()
            except EOFError:
                return  # the trainer is gone
            if command[0] == "stop":
                return
            pipe = pipes.pop(command[1])
            try:
                if command[0] == "case":
                    _, _, scheme, shapes, dtype, corrupt = command
                    _serve_case(ctrl, pipe, scheme, shapes, dtype, corrupt)
                else:  # "alt": an alternative to weightsync
                    from ._bench_compare import serve_alternative

                    _, _, name, shapes, dtype, payload, corrupt = command
                    serve_alternative(ctrl, pipe, name, shapes, dtype, payload, corrupt)
            finally:
                pipe.close()
    except BaseException:
        with suppress(OSError):
            ctrl.send(("failed", traceback.format_exc()))
        raise
    finally:
        for pipe in pipes.values():
            pipe.close()


def _serve_case(
    ctrl: Connection,
    pipe: Connection,
    scheme: WeightSyncScheme,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    corrupt: bool,
) -> None:
    model = GeneratedMLP(shapes, dtype=dtype)
    try:
        scheme.init_on_worker(MODEL_ID, pipe=pipe, model=model)
        ctrl.send(("ready",))
        while True:
            try:
                version = scheme.receive(timeout=_RECEIVE_POLL)
            except SenderLostError:
                return  # the trainer shut its sender down: the case is over
            if version is None:
                continue
            # Looked up after every update: a zero-copy scheme re-points the
            # model's tensors, so views taken before would show old memory.
            tensors = model.state_dict()
            if corrupt:
                corrupt_model(tensors)
            ctrl.send(("applied", version, tensor_checksums(tensors)))
    finally:
        scheme.shutdown()
        ctrl.send(("ended",))


def corrupt_model(tensors: Mapping[str, torch.Tensor]) -> None:
    """The testing hook: make a worker's model differ from what it applied."""
    with torch.no_grad():
        next(iter(tensors.values())).view(-1)[0] += 1


class WorkerPool(Pool):
    """The bench's worker processes, started once and reused by every case
    of ``cases`` that runs in processes (:func:`pool_of`); none are started
    if no case does.

    Each case gets its own pipes, created with the pool (a spawned process
    receives pipes only at start). Use as a context manager: leaving it stops
    and joins every worker, also after an error or Ctrl-C, killing any that
    does not exit in time.
    """

    def __init__(
        self,
        cases: Sequence[Case],
        *,
        timeout: float,
        worker_threads: int | None = 1,
        corrupt_worker: int | None = None,
    ) -> None:
        self.cases = list(cases)
        self.timeout = timeout
        self.worker_threads = worker_threads
        self.corrupt_worker = corrupt_worker
        self._mine = [i for i, case in enumerate(self.cases) if pool_of(case.scheme) == "processes"]
        self.size = max((self.cases[i].workers for i in self._mine), default=0)
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._ctrls: list[Connection] = []
        self._case_pipes: dict[int, list[Connection]] = {}
        self._in_case: list[int] = []
        self._broken = False

    def start(self) -> None:
        """Spawn the workers and block until each is up.

        :raises BenchError: a worker died or did not start in time.
        """
        theirs: list[dict[int, Connection]] = [{} for _ in range(self.size)]
        for index in self._mine:
            ours = []
            for slot in range(self.cases[index].workers):
                mine, other = self._ctx.Pipe()
                ours.append(mine)
                theirs[slot][index] = other
            self._case_pipes[index] = ours
        try:
            for slot in range(self.size):
                ctrl, child_ctrl = self._ctx.Pipe()
                self._ctrls.append(ctrl)
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(slot, child_ctrl, theirs[slot], self.worker_threads),
                    name=f"weightsync-bench-worker-{slot}",
                    daemon=True,  # a safety net: never outlive the trainer
                )
                try:
                    proc.start()
                finally:
                    child_ctrl.close()
                self._procs.append(proc)
        finally:
            # The workers hold their own ends now (or never will).
            for pipes in theirs:
                for conn in pipes.values():
                    conn.close()
        deadline = time.monotonic() + max(self.timeout, _STARTUP_TIMEOUT)
        for slot in range(self.size):
            self._expect(slot, "up", deadline)

    def pipes(self, index: int) -> list[Connection]:
        """The trainer's ends of case ``index``'s pipes, one per worker."""
        return self._case_pipes[index]

    def sender_args(self, index: int) -> dict[str, Any]:
        """``pipes=``: the trainer's ends of case ``index``'s pipes."""
        return {"pipes": self.pipes(index)}

    def _expect(self, slot: int, kind: str, deadline: float) -> tuple[Any, ...]:
        """The next message of ``kind`` from worker ``slot``, skipping older ones.

        :raises BenchError: the worker failed, died or was silent until the deadline.
        """
        ctrl, proc = self._ctrls[slot], self._procs[slot]
        while True:
            ready = mp.connection.wait([ctrl, proc.sentinel], timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                self._broken = True
                raise BenchError(f"bench worker {slot} (pid {proc.pid}) sent no {kind!r} before the deadline")
            # A worker's last words arrive with its exit: read the pipe first.
            if ctrl in ready:
                try:
                    message = ctrl.recv()
                except (EOFError, OSError):
                    pass  # it exited; its exit code says more
                else:
                    if message[0] == "failed":
                        self._broken = True
                        raise BenchError(f"bench worker {slot} failed:\n{message[1]}")
                    if message[0] == kind:
                        return tuple(message)
                    continue
            self._broken = True
            proc.join(5)
            raise BenchError(f"bench worker {slot} (pid {proc.pid}) exited with code {proc.exitcode}")

    def start_case(self, index: int, scheme: WeightSyncScheme, shapes: dict[str, tuple[int, ...]]) -> None:
        """Have the case's workers build their models and initialise ``scheme``;
        block until each is ready.

        :raises BenchError: a worker failed, died or did not get ready in time.
        """
        case = self.cases[index]
        self._start(index, lambda corrupt: ("case", index, scheme, shapes, case.dtype, corrupt))

    def start_alternative(
        self, index: int, name: str, shapes: dict[str, tuple[int, ...]], payload: Any
    ) -> None:
        """Like :meth:`start_case`, for alternative ``name`` to weightsync;
        ``payload`` (pickled with torch's reductions) goes to every worker."""
        case = self.cases[index]
        self._start(index, lambda corrupt: ("alt", index, name, shapes, case.dtype, payload, corrupt))

    def worker_pids(self, count: int) -> list[int]:
        """Process ids of the first ``count`` workers."""
        return [proc.pid for proc in self._procs[:count]]

    def _start(self, index: int, message: Callable[[bool], tuple[Any, ...]]) -> None:
        workers = self.cases[index].workers
        for slot in range(workers):
            self._ctrls[slot].send(message(slot == self.corrupt_worker))
            self._in_case.append(slot)
        deadline = time.monotonic() + self.timeout
        for slot in range(workers):
            self._expect(slot, "ready", deadline)

    def verify(self, version: int, names: Sequence[str], expected: Sequence[int]) -> None:
        """Block until every worker of the case reported its checksums after
        ``version``, and compare them with ``expected`` (the trainer's).

        :raises VerificationError: a worker holds other weights, or another version.
        :raises BenchError: a worker failed, died or did not report in time.
        """
        deadline = time.monotonic() + self.timeout
        for slot in self._in_case:
            _, got_version, got = self._expect(slot, "applied", deadline)
            check_applied(slot, version, got_version, got, names, expected)

    def end_case(self, index: int) -> None:
        """After the trainer's scheme is shut down: block until the case's
        workers closed their side, then close the case's pipes (also when
        that fails).

        :raises BenchError: a worker failed, died or did not end in time.
        """
        slots, self._in_case = self._in_case, []
        deadline = time.monotonic() + self.timeout
        try:
            for slot in slots:
                self._expect(slot, "ended", deadline)
        finally:
            self.close_pipes(index)

    def close_pipes(self, index: int) -> None:
        for conn in self._case_pipes.pop(index, []):
            conn.close()

    def close(self) -> None:
        """Stop and join every worker, killing those that do not exit in
        time; close every pipe. Idempotent; blocks at most a few seconds
        per worker."""
        for ctrl, proc in zip(self._ctrls, self._procs, strict=False):
            if proc.is_alive():
                with suppress(OSError):
                    ctrl.send(("stop",))
        grace = 1.0 if self._broken else 10.0
        for proc in self._procs:
            proc.join(grace)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
            if proc.exitcode is not None:
                proc.close()
        self._procs = []
        for ctrl in self._ctrls:
            ctrl.close()
        self._ctrls = []
        for index in list(self._case_pipes):
            self.close_pipes(index)


# -- running --------------------------------------------------------------------


def change_model(tensors: Sequence[torch.Tensor], step: int) -> None:
    """Make the next send carry new bytes: add 1 to one tensor, a different
    one each time."""
    with torch.no_grad():
        tensors[step % len(tensors)].add_(1)


def run_case(pool: Pool, index: int, config: BenchConfig) -> CaseResult:
    """Run case ``index`` on ``pool``, the pool its scheme or alternative
    runs on (:func:`pool_of`; see the module docstring). Blocks for the whole
    case; the scheme is shut down and the workers' side closed before it
    returns or raises.

    :raises VerificationError: a worker's weights differ from the trainer's.
    :raises BenchError: a send failed, or a worker failed, died or timed out.
    """
    case = pool.cases[index]
    item = itemsize(case.dtype)
    shapes = mlp_shapes(case.nbytes, case.tensors, item)
    result = CaseResult(case, model_nbytes(shapes, item), 0)
    refs = max(config.repeats, 6)
    # Half the references before the case and half after, so a change in the
    # machine's load meanwhile hits sends and references alike; both halves
    # outside the memory probe, which sees only the case's own allocations.
    _measure_references(result, refs // 2)
    probe = PeakMemoryProbe([os.getpid(), *pool.worker_pids(case.workers)])
    probe.start()
    if case.scheme not in SCHEMES:
        from ._bench_compare import run_alternative

        run_alternative(pool, index, config, shapes, result)
    else:
        _run_scheme(pool, index, config, shapes, result)
    result.memory = probe.stop()
    _measure_references(result, refs - refs // 2)
    return result


def _run_scheme(
    pool: Pool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    result: CaseResult,
) -> None:
    case = pool.cases[index]
    model = GeneratedMLP(shapes, fill="pattern", dtype=case.dtype)
    named = dict(sorted(model.state_dict().items()))
    names = list(named)
    tensors = list(named.values())
    scheme = SCHEMES[case.scheme].factory(config.timeout)
    try:
        scheme.init_on_sender(MODEL_ID, model=model, **pool.sender_args(index))
        pool.start_case(index, scheme, shapes)
        sender = scheme.get_sender()
        sender.connect(timeout=config.timeout)
        for step in range(config.warmup + config.repeats):
            change_model(tensors, step)
            start = time.perf_counter()
            report = sender.send()
            elapsed = time.perf_counter() - start
            pool.verify(report.version, names, tensor_checksums(named))
            if step >= config.warmup:
                result.send_s.append(elapsed)
                result.report_s.append(report.seconds)
            result.packet_nbytes = report.nbytes
    except WeightSyncError as exc:
        raise BenchError(
            f"{case.scheme} send of {case.size_mib:g} MiB to {case.workers} worker(s): {exc}"
        ) from exc
    finally:
        try:
            scheme.shutdown()
        finally:
            pool.end_case(index)


def _measure_references(result: CaseResult, repeats: int) -> None:
    """Add ``repeats`` samples of each memcpy reference of ``result``'s case.
    They run in the trainer process while the workers wait for an update."""
    if repeats <= 0:
        return
    result.memcpy_s += memcpy_seconds(result.nbytes, repeats)
    serial, split = floor_seconds(result.nbytes, result.case.workers + 1, repeats)
    result.floor_serial_s += serial
    result.floor_split_s += split


def run_bench(
    config: BenchConfig,
    *,
    on_result: Callable[[CaseResult], None] | None = None,
    on_start: Callable[[int, Case], None] | None = None,
    corrupt_worker: int | None = None,
) -> BenchRun:
    """Run every case of ``config`` with one pool of worker processes and,
    if a case runs on Ray, one pool of Ray actors (starting Ray if it is not
    initialised, and shutting down only a Ray it started). Blocks for the
    whole run; every worker is joined and every scheme shut down before it
    returns or raises (Ctrl-C included).

    ``on_start`` is called with its index before each case, ``on_result``
    after it. ``corrupt_worker`` is a testing
    hook: that worker changes its model after each update it applies, so
    verification must fail.

    :raises VerificationError: a worker's weights differ from the trainer's.
    :raises BenchError: a send failed, or a worker failed, died or timed out.
    """
    from ._bench_ray import RayActorPool

    started = time.perf_counter()
    run = BenchRun(config, machine_facts())
    cases = config.cases()
    timeout, threads, corrupt = config.timeout, config.worker_threads, corrupt_worker
    # Each pool starts workers only for its own cases, if it has any.
    with (
        WorkerPool(cases, timeout=timeout, worker_threads=threads, corrupt_worker=corrupt) as processes,
        RayActorPool(cases, timeout=timeout, worker_threads=threads, corrupt_worker=corrupt) as actors,
    ):
        pools: dict[str, Pool] = {"processes": processes, "ray": actors}
        for index in range(len(cases)):
            if on_start is not None:
                on_start(index, cases[index])
            result = run_case(pools[pool_of(cases[index].scheme)], index, config)
            run.results.append(result)
            if on_result is not None:
                on_result(result)
    run.seconds = time.perf_counter() - started
    run.machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return run


# -- the table ------------------------------------------------------------------

_COLUMNS = (
    ("scheme", 14, "s"),
    ("MiB", 7, ".2f"),
    ("workers", 7, "d"),
    ("tensors", 7, "d"),
    ("copy", 7, "s"),
    ("torn", 4, "s"),
    ("median ms", 9, ".3f"),
    ("p10 ms", 8, ".3f"),
    ("p90 ms", 8, ".3f"),
    ("max ms", 8, ".3f"),
    ("GB/s/wkr", 8, ".2f"),
    ("GB/s all", 8, ".2f"),
    ("memcpy ms", 9, ".3f"),
    ("x memcpy", 8, ".2f"),
    ("floor ms", 8, ".3f"),
    ("x floor", 7, ".2f"),
    ("+MiB T/W", 11, "s"),
)


def table_header() -> str:
    """The table's header line and rule."""
    head = "  ".join(f"{name:<{w}}" if fmt == "s" else f"{name:>{w}}" for name, w, fmt in _COLUMNS)
    return head + "\n" + "-" * len(head)


def format_row(result: CaseResult) -> str:
    """One case as a table row: medians of its samples and their ratios."""
    r = result
    copy, torn = labels(r.case.scheme)
    values = (
        r.case.scheme,
        r.nbytes / MIB,
        r.case.workers,
        r.case.tensors,
        copy,
        torn,
        r.median_s * 1e3,
        r.p10_s * 1e3,
        r.p90_s * 1e3,
        r.max_s * 1e3,
        r.gbps,
        r.gbps_aggregate,
        r.memcpy_median_s * 1e3,
        r.vs_memcpy,
        r.floor_median_s * 1e3,
        r.vs_floor,
        _memory_cell(r.memory),
    )
    cells = zip(_COLUMNS, values, strict=True)
    return "  ".join(f"{v:<{w}{fmt}}" if fmt == "s" else f"{v:>{w}{fmt}}" for (_, w, fmt), v in cells)


def _memory_cell(memory: PeakMemory | None) -> str:
    """Peak extra MiB of the trainer / of the worker that grew most."""
    if memory is None or memory.trainer_bytes is None:
        return "-"
    workers = [b for b in memory.worker_bytes if b is not None]
    most = f"{max(workers) / MIB:.0f}" if workers else "-"
    return f"{memory.trainer_bytes / MIB:.0f}/{most}"


def format_table(results: Sequence[CaseResult]) -> str:
    """The whole table."""
    return "\n".join([table_header(), *(format_row(r) for r in results)])


def describe_machine(facts: Mapping[str, Any]) -> str:
    """One line of the facts that matter when reading the table."""
    load = facts.get("loadavg")
    return (
        f"{facts['cpu_model']}, {facts['cpus_usable']} cpus, {facts['memory_bytes'] / 2**30:.1f} GiB; "
        f"python {facts['python']}, torch {facts['torch']}, weightsync {facts['weightsync']}"
        + (f", ray {facts['ray']}" if facts.get("ray") else "")
        + ("" if facts["uvloop_installed"] else ", no uvloop")
        + "".join(f", {k}={v}" for k, v in facts["weightsync_env"].items())
        + (f"; load {load[0]:.2f}" if load else "")
    )
