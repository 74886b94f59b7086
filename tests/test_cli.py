"""``weightsync bench``: end to end on tiny sizes, and its verification."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from weightsync._bench import MIB, mlp_shapes, model_nbytes
from weightsync._cli import main


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def test_bench_prints_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    shm_before = _shm()
    args = ["--size", "0.25", "--workers", "1", "2", "--repeats", "3", "--warmup", "1", "--json", str(out)]
    code = main(["bench", *args])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    for column in ("median ms", "p90 ms", "GB/s/wkr", "memcpy ms", "x memcpy", "x floor"):
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [(row[0], row[2], row[3]) for row in rows] == [
        ("multiprocess", "1", "8"),
        ("multiprocess", "2", "8"),
    ]

    report = json.loads(out.read_text())
    assert {"cpu_model", "cpu_count", "memory_bytes", "python", "torch"} <= set(report["machine"])
    assert [case["workers"] for case in report["cases"]] == [1, 2]
    for case in report["cases"]:
        assert case["tensors"] == 8
        assert len(case["samples"]["send_s"]) == 3
        assert all(s > 0 for s in case["samples"]["send_s"])
        assert case["samples"]["memcpy_s"] and case["samples"]["floor_split_s"]
        assert case["median_ms"] > 0 and case["vs_memcpy"] > 0

    # Nothing is left running or mapped.
    assert mp.active_children() == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("weightsync", "AnyIO", "bench"))]
    assert _shm() <= shm_before


def test_bench_fails_when_a_worker_holds_other_weights() -> None:
    # Through ``python -m weightsync`` too: the hidden hook makes worker 0
    # change its model after applying, so the first verification must fail.
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "bench", "--size", "0.25", "--workers", "1",
         "--repeats", "2", "--warmup", "0", "--corrupt-worker", "0"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verification failed" in proc.stderr
    assert "worker 0 does not hold the trainer's weights after version 1" in proc.stderr


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workers", "0"])
    assert exc.value.code == 2
    assert "worker counts must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--scheme", "carrier-pigeon"])
    assert exc.value.code == 2


def test_bench_help_lists_known_schemes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "multiprocess" in capsys.readouterr().out


@pytest.mark.parametrize(("mib", "tensors"), [(0.25, 8), (1, 1), (16, 128), (128, 8), (0.001, 3)])
def test_generated_model_has_the_asked_layout(mib: float, tensors: int) -> None:
    shapes = mlp_shapes(int(mib * MIB), tensors)
    assert len(shapes) == tensors
    nbytes = model_nbytes(shapes)
    assert abs(nbytes - mib * MIB) <= max(0.02 * mib * MIB, 64 * tensors)
