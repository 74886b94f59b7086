"""``weightsync bench --plot``: latency against size, one panel per scheme or
alternative, one line per worker count (and tensor count, partial fraction
and verify setting, when several: ``--verify`` draws unchecked sends with
filled circles, verified ones with open squares, each named in the legend),
the floor of the same size and worker count drawn dashed in the same colour.
matplotlib (the ``plot`` extra) is imported only here, with the
non-interactive Agg backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._types import MIB, CaseResult, labels

__all__ = ["PlotUnavailableError", "plot_figure", "require_matplotlib", "write_plot"]


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


def plot_figure(results: Sequence[CaseResult], title: str = "") -> Any:
    """The figure of ``results`` (a matplotlib ``Figure``; the caller closes
    it): one panel per scheme or alternative, one line per worker count,
    tensor count, partial fraction and verify setting, each named in the
    panel's legend, and the floor of each worker count dashed.

    :raises PlotUnavailableError: matplotlib is not installed.
    """
    plt = require_matplotlib()
    names = list(dict.fromkeys(r.case.scheme for r in results))
    columns = min(len(names), 3)
    rows = math.ceil(len(names) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    several_tensor_counts = len({r.case.tensors for r in results}) > 1
    several_partials = len({r.case.partial for r in results}) > 1
    several_verify = len({r.case.verify for r in results}) > 1
    for panel, name in zip(axes.flat, names, strict=False):
        mine = [r for r in results if r.case.scheme == name]
        counts = sorted({(r.case.workers, r.case.tensors) for r in mine})
        kinds = sorted({(r.case.partial, r.case.verify) for r in mine}, key=lambda k: (-k[0], k[1]))
        for number, (workers, tensors) in enumerate(counts):
            color = f"C{number % 10}"
            label = f"{workers} worker(s)" + (f", {tensors} tensors" if several_tensor_counts else "")
            same = [r for r in mine if (r.case.workers, r.case.tensors) == (workers, tensors)]
            for partial, verify in kinds:
                points = sorted(
                    (r for r in same if (r.case.partial, r.case.verify) == (partial, verify)),
                    key=lambda r: r.nbytes,
                )
                if not points:
                    continue
                kind = (f", {partial:g} of the model" if several_partials else "") + (
                    f", verify={verify}" if several_verify else ""
                )
                panel.plot(
                    [r.nbytes / MIB for r in points],
                    [r.median_s * 1e3 for r in points],
                    "s-" if verify else "^-" if partial < 1.0 else "o-",
                    color=color,
                    markerfacecolor="none" if verify else color,
                    label=label + kind,
                )
            # The floor is the size's and worker count's, whatever the kind of send.
            floors = {r.nbytes: r.floor_median_s for r in sorted(same, key=lambda r: r.nbytes)}
            panel.plot(
                [nbytes / MIB for nbytes in floors],
                [seconds * 1e3 for seconds in floors.values()],
                "x--",
                color=color,
                alpha=0.6,
                label=f"floor, {label}",
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
    return fig


def write_plot(results: Sequence[CaseResult], path: str, title: str = "") -> None:
    """Write a PNG of ``results`` (:func:`plot_figure`) to ``path``.

    :raises PlotUnavailableError: matplotlib is not installed.
    :raises OSError: ``path`` cannot be written.
    """
    plt = require_matplotlib()
    fig = plot_figure(results, title)
    try:
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
