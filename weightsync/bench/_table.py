"""The table ``weightsync bench`` prints: one row per case, the medians of
its samples and their ratios to the memcpy references, and what is printed
under it: the workers' start-up times, the meaning of the floor and a
legend of the columns.

The default table keeps to the columns a reader compares (within 100
characters); ``--wide`` prints every column. The ``--json`` file always
holds everything.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence

from ._types import FLOOR_METHOD, MIB, CaseResult, PeakMemory, WorkerStartup, labels, pool_of

__all__ = [
    "ALL_COLUMNS",
    "DEFAULT_COLUMNS",
    "DEVICE_FLOOR_NOTE",
    "FLOOR_NOTE",
    "WIDTH",
    "columns_for",
    "format_row",
    "format_table",
    "legend",
    "device_copy_lines",
    "startup_lines",
    "table_header",
]

#: The widest line of the default output.
WIDTH = 100

_COLUMNS = (
    ("scheme", 14, "s"),
    ("MiB", 7, ".2f"),
    ("workers", 7, "d"),
    ("tensors", 7, "d"),
    ("sent", 5, "s"),
    ("verify", 6, "s"),
    ("copy", 7, "s"),
    ("torn", 4, "s"),
    ("median ms", 9, ".3f"),
    ("cpu us", 7, "s"),
    ("wkr cpu us", 10, "s"),
    ("stall ms", 8, "s"),
    ("x ref", 6, "s"),
    ("p10 ms", 8, ".3f"),
    ("p90 ms", 8, ".3f"),
    ("max ms", 8, ".3f"),
    ("GB/s/wkr", 8, ".2f"),
    ("GB/s all", 8, ".2f"),
    ("memcpy ms", 9, ".3f"),
    ("x memcpy", 8, ".2f"),
    ("floor ms", 8, ".3f"),
    ("x floor", 7, ".2f"),
    ("d2d ms", 8, "s"),
    ("d2h ms", 8, "s"),
    ("h2d ms", 8, "s"),
    ("+MiB T/W", 11, "s"),
)

#: The columns of the copies timed on a GPU: in ``--wide`` tables of runs
#: where a CUDA device is involved only.
_DEVICE_COLUMNS = ("d2d ms", "d2h ms", "h2d ms")


#: Every column, in order (``--wide``).
ALL_COLUMNS: tuple[str, ...] = tuple(name for name, _, _ in _COLUMNS)
#: The columns of the default table; ``tensors``, ``sent`` and ``verify``
#: join them when a run has several tensor counts, partial or verified cases
#: (see :func:`columns_for`).
DEFAULT_COLUMNS: tuple[str, ...] = (
    "scheme", "MiB", "workers", "copy", "median ms", "p90 ms", "stall ms", "x ref", "floor ms", "x floor",
)  # fmt: skip

_MEANING = {
    "scheme": "weightsync's scheme, or an alternative run with the same model (--compare)",
    "MiB": "bytes of weights per send",
    "workers": "worker processes (Ray actors for the Ray cases)",
    "tensors": "tensors the bytes are split into",
    "sent": "share of the model's bytes each send moved (all, or a partial update's share)",
    "verify": "yes: send(verify=True), every tensor digested and checked by each worker",
    "copy": "private: each worker holds its own copy; shared: workers read one shared buffer",
    "torn": "whether a worker can read a mix of two versions",
    "median ms": "median time of a whole send: from send_async() until wait_async() returned "
    "(every worker applied and acked; --blocking: one send())",
    "cpu us": "median CPU time of the trainer's sending thread per send (user and system), in "
    "microseconds: what a send costs the trainer beyond waiting (weightsync and bare-tight)",
    "wkr cpu us": "median CPU time a worker spent to take one send (its receive() that applied it; "
    "bare-tight's read, copy and echo), over every worker, in microseconds",
    "stall ms": "median time until send_async() returned: how long the trainer's weights are held",
    "x ref": "stall / one memcpy of the model (one ray.put for Ray); at a few MiB the fixed cost of a "
    "send dominates and this ratio is large: its 1.15x target is for models of 128 MiB and more",
    "p10 ms": "10th percentile of whole sends",
    "p90 ms": "90th percentile of whole sends",
    "max ms": "slowest whole send",
    "GB/s/wkr": "bytes / median",
    "GB/s all": "workers x bytes / median",
    "memcpy ms": "one single-threaded memcpy of the same bytes, measured in the same run",
    "x memcpy": "median / memcpy ms",
    "floor ms": "the floor: (workers + 1) memcpys of the same bytes in the trainer's process, at its "
    "memory bandwidth or as a chain of two, whichever is larger, measured once per size and worker "
    "count in the same run (see the note above)",
    "x floor": "median / floor ms (the shared scheme can go below 1: see the note above)",
    "d2d ms": "one device-to-device copy of the same bytes on the GPU, measured in the same run",
    "d2h ms": "one page-locked device-to-host copy of the same bytes, measured in the same run",
    "h2d ms": "one page-locked host-to-device copy of the same bytes, measured in the same run",
    "+MiB T/W": "peak extra memory of the trainer / of the worker that grew most, in MiB",
}


#: What the floor is, printed under every table that shows it.
FLOOR_NOTE = (
    "floor: (workers + 1) memcpys of the same bytes, the copies of a send whose every worker keeps a "
    "private copy (the trainer's copy into the staging, each worker's copy out of it), bounded two "
    "ways, the larger taken: all their bytes at this machine's memory bandwidth (the copies timed on "
    "one thread and split across every core, the faster), and the chain of two copies that must "
    "follow one another (into the staging, then out of it), each as fast. Timed in the same run "
    f"{FLOOR_METHOD}. The shared scheme can beat it (x floor below 1): its workers view the "
    "staged bytes in shared memory instead of copying them."
)


#: What the floor is where a CUDA device is involved, printed under the table instead.
DEVICE_FLOOR_NOTE = (
    "floor (a CUDA device involved): the copies of a send whose every worker keeps a private copy, "
    f"each at the median of the same bytes copied in the same run {FLOOR_METHOD}: GPU to "
    "GPU, (workers + 1) D2D copies; GPU trainer to CPU workers, one page-locked D2H, then the "
    "workers' memcpys, which run in parallel, at this machine's memory bandwidth (at least one "
    "memcpy); CPU trainer to GPU workers, one memcpy and one page-locked H2D per worker. The "
    "shared scheme can beat it (x floor below 1)."
)


def columns_for(
    results_have_partial: bool,
    results_have_verify: bool,
    wide: bool = False,
    several_tensor_counts: bool = False,
    cuda: bool = False,
) -> tuple[str, ...]:
    """The columns to print: every one if ``wide`` (the copies timed on a
    GPU only if ``cuda``: a CUDA device is involved), else the default ones,
    with ``tensors`` / ``sent`` / ``verify`` when the run has such cases."""
    if wide:
        return tuple(name for name in ALL_COLUMNS if cuda or name not in _DEVICE_COLUMNS)
    chosen = set(DEFAULT_COLUMNS)
    if several_tensor_counts:
        chosen.add("tensors")
    if results_have_partial:
        chosen.add("sent")
    if results_have_verify:
        chosen.add("verify")
    return tuple(name for name in ALL_COLUMNS if name in chosen)


def legend(columns: Sequence[str] = DEFAULT_COLUMNS, cuda: bool = False) -> str:
    """What each of ``columns`` means, one line each (wrapped within
    :data:`WIDTH`); ``cuda``: for a run where a CUDA device is involved."""
    width = max(len(name) for name in columns)
    indent = " " * (width + 4)
    meaning = dict(_MEANING)
    if cuda:
        meaning["floor ms"] = (
            "the floor of the placement: the copies of a send that gives each worker a private copy, "
            "each timed on the same bytes once per size and worker count in the same run (see the note "
            "above)"
        )
    return "\n".join(
        textwrap.fill(meaning[name], WIDTH, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent)
        for name in columns
    )


def startup_lines(startups: Sequence[WorkerStartup], results: Sequence[CaseResult]) -> list[str]:
    """How long each scheme's workers took to start, within :data:`WIDTH`:
    the pool's workers from their start until every one announced itself
    (once per run, shared by the schemes of a pool), then the median of the
    scheme's cases from ``init_on_sender()`` until ``connect()`` returned."""
    pools = {startup.kind: startup for startup in startups}
    connects: dict[str, list[float]] = {}
    for result in results:
        if result.connect_s is not None:
            connects.setdefault(result.case.scheme, []).append(result.connect_s)
    if not connects:
        return []
    width = max(len(name) for name in connects)
    lines = [
        "worker start-up: the workers from their start until every one announced itself (each",
        "imports torch and weightsync; once per run), then each case's init_on_sender() until the",
        "sender's connect() returned (its workers initialised the scheme and hold the first weights):",
    ]
    for name, seconds in connects.items():
        startup = pools.get(pool_of(name))
        if startup is None:
            started = "workers already running"
        elif startup.kind == "ray":
            started = (
                "" if startup.ray_init_s is None else f"ray.init() {startup.ray_init_s:.2f} s, then "
            ) + f"{startup.workers} Ray actors up in {startup.seconds:.2f} s"
        else:
            started = f"{startup.workers} processes up in {startup.seconds:.2f} s"
        lines.append(f"  {name:<{width}}  {started}; connect() {statistics.median(seconds) * 1e3:.1f} ms")
    return lines


# Number columns given as text (they may read "-"): right-aligned.
_RIGHT = {"cpu us", "wkr cpu us", "stall ms", "x ref", *_DEVICE_COLUMNS}


def table_header(columns: Sequence[str] = DEFAULT_COLUMNS) -> str:
    """The table's header line and rule."""
    head = "  ".join(
        f"{name:<{w}}" if fmt == "s" and name not in _RIGHT else f"{name:>{w}}"
        for name, w, fmt in _COLUMNS
        if name in columns
    )
    return head + "\n" + "-" * len(head)


def format_row(result: CaseResult, columns: Sequence[str] = DEFAULT_COLUMNS) -> str:
    """One case as a table row: medians of its samples and their ratios."""
    r = result
    copy, torn = labels(r.case.scheme)
    values = (
        r.case.scheme,
        r.nbytes / MIB,
        r.case.workers,
        r.case.tensors,
        _sent_cell(r),
        "yes" if r.case.verify else "no",
        copy,
        torn,
        r.median_s * 1e3,
        f"{statistics.median(r.cpu_s) * 1e6:.0f}" if r.cpu_s else "-",
        f"{statistics.median(r.worker_cpu_s) * 1e6:.0f}" if r.worker_cpu_s else "-",
        "-" if r.stall_median_s is None else f"{r.stall_median_s * 1e3:.3f}",
        "-" if r.stall_vs_reference is None else f"{r.stall_vs_reference:.2f}",
        r.p10_s * 1e3,
        r.p90_s * 1e3,
        r.max_s * 1e3,
        r.gbps,
        r.gbps_aggregate,
        r.memcpy_median_s * 1e3,
        r.vs_memcpy,
        r.floor_median_s * 1e3,
        r.vs_floor,
        *(_ms_cell(r.device_copy_median_s(kind)) for kind in ("d2d", "d2h", "h2d")),
        _memory_cell(r.memory),
    )
    cells = zip(_COLUMNS, values, strict=True)
    return "  ".join(
        f"{v:>{w}}" if name in _RIGHT else f"{v:<{w}{fmt}}" if fmt == "s" else f"{v:>{w}{fmt}}"
        for (name, w, fmt), v in cells
        if name in columns
    )


def _ms_cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def device_copy_lines(results: Sequence[CaseResult]) -> list[str]:
    """The copies timed on a GPU, per size (medians over the size's cases),
    within :data:`WIDTH`; none where no case involved a CUDA device."""
    sizes: dict[tuple[int, str], dict[str, list[float]]] = {}
    for r in results:
        if r.case.gpu is None:
            continue
        merged = sizes.setdefault((r.nbytes, r.case.gpu), {})
        for kind, samples in r.device_copy_s.items():
            merged.setdefault(kind, []).extend(samples)
    if not sizes:
        return []
    lines = ["copies of the same bytes on the GPU, same run (medians; page-locked host memory):"]
    for (nbytes, gpu), kinds in sizes.items():
        d2d, d2h, h2d = (statistics.median(kinds[k]) * 1e3 if kinds.get(k) else float("nan") for k in _KINDS)
        lines.append(
            f"  {nbytes / MIB:9.2f} MiB on {gpu}:  D2D {d2d:.3f} ms,  D2H {d2h:.3f} ms,  H2D {h2d:.3f} ms"
        )
    return lines


_KINDS = ("d2d", "d2h", "h2d")


def _sent_cell(result: CaseResult) -> str:
    """The share of the model's bytes each send moved: "all", or a percentage
    for a partial update (``--partial``)."""
    if result.case.partial >= 1.0 or not result.nbytes:
        return "all"
    return f"{100 * result.packet_nbytes / result.nbytes:.0f}%"


def _memory_cell(memory: PeakMemory | None) -> str:
    """Peak extra MiB of the trainer / of the worker that grew most."""
    if memory is None or memory.trainer_bytes is None:
        return "-"
    workers = [b for b in memory.worker_bytes if b is not None]
    most = f"{max(workers) / MIB:.0f}" if workers else "-"
    return f"{memory.trainer_bytes / MIB:.0f}/{most}"


def format_table(results: Sequence[CaseResult], columns: Sequence[str] = DEFAULT_COLUMNS) -> str:
    """The whole table."""
    return "\n".join([table_header(columns), *(format_row(r, columns) for r in results)])
