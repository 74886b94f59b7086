"""``weightsync bench --plot``: latency against size, one panel per scheme or
alternative, one line per worker count (and tensor count, when several), the
floor of the same case drawn dashed in the same colour. matplotlib (the
``plot`` extra) is imported only here, with the non-interactive Agg backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._types import MIB, CaseResult, labels

__all__ = ["PlotUnavailableError", "require_matplotlib", "write_plot"]


class PlotUnavailableError(RuntimeError):
    """matplotlib cannot be imported."""


def require_matplotlib() -> Any:
    """matplotlib's ``pyplot`` on the Agg backend.

    :raises PlotUnavailableError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed: "
            "pip install 'weightsync[plot]' (or pip install matplotlib)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plot(results: Sequence[CaseResult], path: str, title: str = "") -> None:
    """Write a PNG of ``results`` to ``path``.

    :raises PlotUnavailableError: matplotlib is not installed.
    :raises OSError: ``path`` cannot be written.
    """
    plt = require_matplotlib()
    names = list(dict.fromkeys(r.case.scheme for r in results))
    columns = min(len(names), 3)
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    several_tensor_counts = len({r.case.tensors for r in results}) > 1
    for panel, name in zip(axes.flat, names, strict=False):
        mine = [r for r in results if r.case.scheme == name]
        lines = sorted({(r.case.workers, r.case.tensors) for r in mine})
        for number, (workers, tensors) in enumerate(lines):
            points = sorted(
                (r for r in mine if (r.case.workers, r.case.tensors) == (workers, tensors)),
                key=lambda r: r.nbytes,
            )
            sizes = [r.nbytes / MIB for r in points]
            label = f"{workers} worker(s)" + (f", {tensors} tensors" if several_tensor_counts else "")
            color = f"C{number % 10}"
            panel.plot(sizes, [r.median_s * 1e3 for r in points], "o-", color=color, label=label)
            panel.plot(
                sizes,
                [r.floor_median_s * 1e3 for r in points],
                "x--",
                color=color,
                alpha=0.6,
                label=f"floor, {workers} worker(s)",
            )
        copy, torn = labels(name)
        panel.set_title(f"{name} (copy: {copy}, torn reads: {torn})", fontsize=9)
        panel.set_xscale("log", base=2)
        panel.set_yscale("log")
        panel.set_xlabel("MiB of weights")
        panel.set_ylabel("median send ms (every worker applied)")
        panel.grid(True, which="both", alpha=0.3)
        panel.legend(fontsize=7)
    for panel in list(axes.flat)[len(names) :]:
        panel.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
