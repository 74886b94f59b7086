"""``weightsync bench --plot``: the figure's legend names every kind of
point it draws (fast: results built from samples, no workers started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightsync.bench import MIB, Case, CaseResult, plot_figure, write_plot


def _result(scheme: str, mib: float, workers: int, verify: bool) -> CaseResult:
    result = CaseResult(Case(scheme, mib, workers, 8, verify=verify), int(mib * MIB), 0)
    result.send_s = [mib * workers * (2e-3 if verify else 1e-3)] * 3
    result.memcpy_s = [mib * 1e-4] * 3
    result.floor_serial_s = result.floor_split_s = [mib * (workers + 1) * 1e-4] * 3
    result.chain_serial_s = result.chain_split_s = [mib * 2e-4] * 3
    return result


def test_the_verify_plot_names_both_kinds_of_points_in_its_legend(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    # What `weightsync bench --verify --plot` draws: each of weightsync's
    # cases unchecked and with send(verify=True), and an alternative (unchecked).
    results = [
        _result("multiprocess", mib, workers, verify)
        for mib in (0.25, 1.0)
        for verify in (False, True)
        for workers in (1, 2)
    ] + [_result("bare-shm", mib, 1, False) for mib in (0.25, 1.0)]
    png = tmp_path / "verify.png"
    write_plot(results, str(png))
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    fig = plot_figure(results)
    try:
        scheme, alternative = (ax for ax in fig.axes if ax.get_visible())
        legend = scheme.get_legend()
        assert legend is not None
        texts = [text.get_text() for text in legend.get_texts()]
        for workers in (1, 2):
            assert f"{workers} worker(s), verify=False" in texts
            assert f"{workers} worker(s), verify=True" in texts
            assert f"floor, {workers} worker(s)" in texts
        # One line per entry: the two kinds of sends are not drawn as one line.
        lines = {line.get_label(): line for line in scheme.get_lines()}
        assert set(texts) == set(lines)
        checked, unchecked = lines["1 worker(s), verify=True"], lines["1 worker(s), verify=False"]
        assert checked.get_marker() != unchecked.get_marker()
        assert list(checked.get_xdata()) == list(unchecked.get_xdata()) == [0.25, 1.0]
        legend = alternative.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == [
            "1 worker(s), verify=False",
            "floor, 1 worker(s)",
        ]
    finally:
        plt.close(fig)


def test_a_plot_of_one_kind_of_send_keeps_its_short_labels() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = plot_figure([_result("multiprocess", mib, 1, False) for mib in (0.25, 1.0)])
    try:
        (panel,) = (ax for ax in fig.axes if ax.get_visible())
        legend = panel.get_legend()
        assert legend is not None
        assert [t.get_text() for t in legend.get_texts()] == ["1 worker(s)", "floor, 1 worker(s)"]
    finally:
        plt.close(fig)
