"""The table ``weightsync bench`` prints: one row per case, the medians of
its samples and their ratios to the memcpy references.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._types import MIB, CaseResult, PeakMemory, labels

__all__ = ["format_row", "format_table", "table_header"]

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
    ("stall ms", 8, "s"),
    ("x ref", 5, "s"),
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


# Number columns given as text (they may read "-"): right-aligned.
_RIGHT = {"stall ms", "x ref"}


def table_header() -> str:
    """The table's header line and rule."""
    head = "  ".join(
        f"{name:<{w}}" if fmt == "s" and name not in _RIGHT else f"{name:>{w}}" for name, w, fmt in _COLUMNS
    )
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
        _sent_cell(r),
        "yes" if r.case.verify else "no",
        copy,
        torn,
        r.median_s * 1e3,
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
        _memory_cell(r.memory),
    )
    cells = zip(_COLUMNS, values, strict=True)
    return "  ".join(
        f"{v:>{w}}" if name in _RIGHT else f"{v:<{w}{fmt}}" if fmt == "s" else f"{v:>{w}{fmt}}"
        for (name, w, fmt), v in cells
    )


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


def format_table(results: Sequence[CaseResult]) -> str:
    """The whole table."""
    return "\n".join([table_header(), *(format_row(r) for r in results)])
