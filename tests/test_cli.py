"""``weightsync bench``: end to end on tiny sizes, and its verification."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from harness import shm_entries

from weightsync.bench import LOCAL_SCHEMES, MIB, main, mlp_shapes, model_nbytes

# End-to-end runs of weightsync bench (about a minute in all): not in the
# default run; CI runs them as a step of their own (pytest -m cli).
pytestmark = pytest.mark.cli


def test_bench_prints_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The results go where --json says.
    monkeypatch.chdir(tmp_path)
    shm_before = shm_entries()
    args = ["--scheme", "multiprocess", "--size", "0.25", "--workers", "1", "2", "--repeats", "3"]
    args += ["--min-time", "0", "--json", "results.json"]
    code = main(["bench", *args, "--warmup", "1"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    columns = ("median ms", "stall ms", "x ref", "p90 ms", "floor ms", "x floor")
    for column in columns:
        assert column in lines[header]
    # The default table fits a terminal; --wide has the rest.
    assert len(lines[header]) <= 100 and "memcpy ms" not in lines[header]
    # One tensor count: said once above the table, not in a column of its own.
    assert "tensors" not in lines[header] and "8 float32 tensors" in printed.out
    # A legend under the table says what each column means, x ref's target included.
    legend = " ".join(" ".join(lines[header + 4 :]).split())
    assert "x floor" in legend and "1.15x target is for models of 128 MiB" in legend
    (out,) = tmp_path.glob("*.json")
    assert out.name == "results.json"
    rows = [line.split() for line in lines[header + 2 : header + 4]]
    assert [(row[0], row[2]) for row in rows] == [("multiprocess", "1"), ("multiprocess", "2")]

    report = json.loads(out.read_text())
    assert {"cpu_model", "cpu_count", "memory_bytes", "python", "torch"} <= set(report["machine"])
    assert [case["workers"] for case in report["cases"]] == [1, 2]
    for case in report["cases"]:
        assert case["tensors"] == 8
        assert len(case["samples"]["send_s"]) == 3
        assert all(s > 0 for s in case["samples"]["send_s"])
        assert case["samples"]["memcpy_s"] and case["samples"]["floor_split_s"]
        assert case["median_ms"] > 0 and case["vs_memcpy"] > 0
        # The stall: until send_async() returned, within each whole send.
        assert len(case["samples"]["stall_s"]) == 3
        stalls = zip(case["samples"]["stall_s"], case["samples"]["send_s"], strict=True)
        assert all(0 < stall < send for stall, send in stalls)
        assert case["stall_reference"] == "memcpy" and case["stall_vs_reference"] > 0
    assert report["config"]["schemes"] == ["multiprocess"]
    (startup,) = report["worker_startup"]
    assert startup["kind"] == "processes" and startup["workers"] == 2 and startup["seconds"] > 0
    assert all(case["connect_ms"] > 0 for case in report["cases"])

    # Nothing is left running or mapped.
    assert mp.active_children() == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("weightsync", "AnyIO", "bench"))]
    assert shm_entries() <= shm_before


def test_a_case_sends_past_repeats_until_its_sends_took_min_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default a small case goes on past --repeats until its timed sends
    took --min-time in all (at most 10x --repeats), so its median stands on
    enough sends; every count that follows (each worker's CPU per update)
    is of the sends made."""
    out = tmp_path / "results.json"
    args = ["--scheme", "multiprocess", "--size", "0.25", "--workers", "2", "--repeats", "2"]
    assert main(["bench", *args, "--min-time", "0.05", "--json", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "2 timed sends per case or more, until they took 0.05 s (at most 20), after 1 untimed" in said
    (case,) = json.loads(out.read_text())["cases"]
    sends = case["samples"]["send_s"]
    assert 2 < len(sends) <= 20 and (sum(sends) >= 0.05 or len(sends) == 20)
    assert sum(sends[:-1]) < 0.05  # (it stopped at the first send that reached it)
    assert len(case["samples"]["stall_s"]) == len(sends)
    assert len(case["samples"]["worker_cpu_s"]) == 2 * len(sends)


def test_a_configs_rounds_are_its_repeats_then_more_until_min_seconds() -> None:
    from weightsync.bench import BenchConfig

    exact = BenchConfig(repeats=3, warmup=1)
    timed: list[float] = []
    assert list(exact.rounds(timed)) == [0, 1, 2, 3]  # (nothing timed, min_seconds 0: exactly)
    timed_config = BenchConfig(repeats=3, warmup=1, min_seconds=1.0)
    steps = []
    for step in timed_config.rounds(timed):
        steps.append(step)
        if step >= 1:
            timed.append(0.3)
    assert steps == [0, 1, 2, 3, 4] and sum(timed) >= 1.0  # 4 timed sends of 0.3 s
    timed.clear()
    assert len(list(BenchConfig(repeats=3, warmup=1, min_seconds=1e9).rounds(timed))) == 1 + 30
    with pytest.raises(ValueError, match="min_seconds must not be negative"):
        BenchConfig(min_seconds=-1)


def _check_default_output(text: str, schemes: list[str]) -> None:
    """What a run without options must print: a row for each of ``schemes``
    at every size and worker count asked, a start-up line for each, the
    floor's column and what it means, every line within 100 columns."""
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    assert "floor ms" in lines[header] and "x floor" in lines[header]
    rows = [line.split() for line in lines[header + 2 :] if line.split(" ", 1)[0] in LOCAL_SCHEMES]
    assert sorted({row[0] for row in rows}) == sorted(schemes)
    assert len(rows) == 2 * len(schemes)  # two worker counts each
    for name in schemes:
        (startup,) = [line for line in lines if line.startswith(f"  {name} ") and "connect()" in line]
        assert " up in " in startup, startup
    # The floor's meaning is stated under the table, the shared scheme's case included.
    note = " ".join(" ".join(lines).split())
    assert "floor: (workers + 1) memcpys of the same bytes" in note
    assert "private copy" in note
    assert "The shared scheme can beat it (x floor below 1): its workers view the staged bytes" in note


def test_bench_without_options_runs_every_local_scheme(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The defaults but the sizes and repeats (kept small here); without ray,
    # the Ray scheme is left out with a note (with it: the test below).
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert LOCAL_SCHEMES == ("multiprocess", "shared", "ray")
    monkeypatch.chdir(tmp_path)  # without --json, nothing is written there
    code = main(["bench", "--size", "0.25", "--repeats", "2"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    _check_default_output(printed.out + printed.err, ["multiprocess", "shared"])
    assert "skipped ray: ray is not importable" in printed.out
    assert list(tmp_path.iterdir()) == [], "a bench without --json wrote a file"
    assert "raw samples and machine facts" not in printed.out


def test_bench_without_options_runs_ray_where_installed() -> None:
    pytest.importorskip("ray")
    proc = _bench_subprocess("--size", "0.25", "--repeats", "2", "--no-json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_default_output(proc.stdout + proc.stderr, ["multiprocess", "shared", "ray"])
    assert "ray.init()" in proc.stdout


def test_bench_partial_and_verified_sends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    args = ["--size", "0.25", "--workers", "2", "--tensors", "20", "--partial", "0.1", "1", "--verify"]
    args += ["--scheme", "multiprocess", "--repeats", "2", "--warmup", "0", "--json", str(out)]
    args += ["--min-time", "0"]
    code = main(["bench", *args])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    assert "sent" in lines[header] and "verify" in lines[header]
    rows = [line.split() for line in lines[header + 2 : header + 6]]
    assert [row[4] for row in rows] == ["no", "yes", "no", "yes"]
    sent = [row[3] for row in rows]
    assert sent[2:] == ["all", "all"] and sent[0] == sent[1] and 5 <= int(sent[0].rstrip("%")) <= 20
    cases = json.loads(out.read_text())["cases"]
    assert [(case["partial"], case["verify"]) for case in cases] == [
        (0.1, False),
        (0.1, True),
        (1.0, False),
        (1.0, True),
    ]
    assert cases[0]["packet_nbytes"] < cases[2]["packet_nbytes"] / 4


def test_rows_of_one_size_and_worker_count_share_one_floor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The floor is the size's and worker count's, measured once: a busy
    # moment during one case must not give its row a floor of its own.
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["--scheme", "multiprocess", "--compare", "bare-shm", "--size", "0.25", "0.5"]
    args += ["--workers", "1", "2", "--verify", "--repeats", "2", "--min-time", "0", "--warmup", "0"]
    code = main(["bench", *args, "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    assert lines[header].split()[-4:] == ["floor", "ms", "x", "floor"]
    table: dict[tuple[str, str], set[str]] = {}
    rows = [line.split() for line in lines[header + 2 :] if line.startswith(("multiprocess", "bare-shm"))]
    assert len(rows) == 2 * (4 + 2)  # per size: 2 worker counts x (unchecked, verified) + bare-shm's 2
    for row in rows:
        table.setdefault((row[1], row[2]), set()).add(row[-2])  # (MiB, workers): floor ms
    assert len(table) == 4 and all(len(cases) == 1 for cases in table.values()), table
    note = " ".join(" ".join(lines).split())
    assert "once per size and worker count" in note

    cases = json.loads(out.read_text())["cases"]
    floors: dict[tuple[int, int], list[dict]] = {}
    for case in cases:
        floors.setdefault((case["nbytes"], case["workers"]), []).append(case)
    assert sorted(len(same) for same in floors.values()) == [3, 3, 3, 3]
    for same in floors.values():
        assert len({case["floor_ms"] for case in same}) == 1, [case["floor_ms"] for case in same]
        assert len({json.dumps(case["samples"]["floor_split_s"]) for case in same}) == 1
    assert png.read_bytes().startswith(_PNG_SIGNATURE)


def test_bench_fails_when_a_worker_holds_other_weights() -> None:
    # Through ``python -m weightsync`` too: the hidden hook makes worker 0
    # change its model after applying, so the first verification must fail.
    argv = [sys.executable, "-m", "weightsync", "bench", "--scheme", "multiprocess", "--size", "0.25"]
    argv += ["--workers", "1", "--repeats", "2", "--min-time", "0", "--warmup", "0", "--corrupt-worker", "0"]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verification failed" in proc.stderr
    assert "worker 0 does not hold the trainer's weights after version 1" in proc.stderr


def test_bench_tight_loop_against_blocking_sends_checked_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What benchmarks/small_vs_bare_loop.py runs: weightsync's blocking send()
    # against bare-tight, alternating, both checked once after their last send.
    out = tmp_path / "bench.json"
    shm_before = shm_entries()
    args = ["--scheme", "multiprocess", "--compare", "bare-tight", "--blocking", "--check-once"]
    args += ["--size", "0.25", "0.25", "--workers", "2", "--repeats", "3", "--min-time", "0", "--warmup", "1"]
    code = main(["bench", *args, "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    report = json.loads(out.read_text())
    assert report["config"]["blocking"] and report["config"]["check_once"]
    names = [case["scheme"] for case in report["cases"]]
    assert names == ["multiprocess", "bare-tight"] * 2
    for case in report["cases"]:
        assert len(case["samples"]["send_s"]) == 3 and all(s > 0 for s in case["samples"]["send_s"])
        # A blocking send() has no stall of its own to time.
        assert case["samples"]["stall_s"] == []
        # What a send cost each side: the trainer's thread, and each worker's
        # update (each of the 2 workers' last 3, the timed sends').
        assert len(case["samples"]["cpu_s"]) == 3 and case["cpu_us"] > 0
        assert len(case["samples"]["worker_cpu_s"]) == 2 * 3, case["scheme"]
        assert all(s > 0 for s in case["samples"]["worker_cpu_s"]) and case["worker_cpu_us"] > 0
    assert "wkr cpu us" not in printed.out  # (the default table: --wide has it)
    assert mp.active_children() == []
    assert shm_entries() <= shm_before


@pytest.mark.parametrize("name", ["multiprocess", "bare-tight"])
def test_a_check_once_still_fails_when_a_worker_holds_other_weights(name: str) -> None:
    from weightsync.bench import BenchConfig, VerificationError, run_bench

    schemes, compare = ((name,), ()) if name == "multiprocess" else ((), (name,))
    config = BenchConfig(
        schemes=schemes,
        compare=compare,
        sizes_mib=(0.25,),
        workers=(2,),
        repeats=2,
        warmup=1,
        blocking=True,
        check_once=True,
    )
    wrong = "worker 1 does not hold the trainer's weights after version 3"
    with pytest.raises(VerificationError, match=wrong):
        run_bench(config, corrupt_worker=1)
    with pytest.raises(ValueError, match="check_once is for worker processes"):
        BenchConfig(schemes=("ray",), check_once=True)


def test_by_default_bare_tight_is_checked_after_every_round_as_weightsync_is() -> None:
    """Like for like: by default both sides check every worker after each
    send, each worker right after its ack (or echo); a wrong worker fails
    the first round, not only the last."""
    from weightsync.bench import BenchConfig, VerificationError, run_bench

    config = BenchConfig(schemes=(), compare=("bare-tight",), sizes_mib=(0.25,), workers=(2,), repeats=2)
    wrong = "worker 1 does not hold the trainer's weights after version 1"
    with pytest.raises(VerificationError, match=wrong):
        run_bench(config, corrupt_worker=1)
    result = run_bench(dataclasses.replace(config, repeats=3))
    assert [len(r.send_s) for r in result.results] == [3]


def test_bench_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--workers", "0"])
    assert exc.value.code == 2
    assert "worker counts must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--scheme", "carrier-pigeon"])
    assert exc.value.code == 2


def test_bench_sharded_trainer_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    """``--sharded-trainer TxR`` is checked before any host is made."""
    cases = [
        (["--sharded-trainer", "2y2", "--emulate-hosts", "6"], "takes TxR (trainer hosts x ranks per host)"),
        (["--sharded-trainer", "2x2"], "runs 2 or more ranks on an emulated cluster (--emulate-hosts N)"),
        (["--sharded-trainer", "2x2", "--emulate-hosts", "2"], "need --emulate-hosts 3 or more"),
        (
            ["--sharded-trainer", "2x2", "--emulate-hosts", "5", "--worker-tp", "2"],
            "the 3 workers make no replicas of 2",
        ),
        (
            ["--sharded-trainer", "2x2", "--emulate-hosts", "4", "--soak", "5", "--kill-rank", "1"],
            "--kill-rank, --stop-rank and --soak: one of them per run",
        ),
        (["--sharded-trainer", "2x2", "--emulate-hosts", "4", "--soak", "0"], "--soak 0: one send or more"),
    ]
    for args, said in cases:
        with pytest.raises(SystemExit) as exc:
            main(["bench", *args])
        assert exc.value.code == 2
        assert said in capsys.readouterr().err, args


def test_bench_help_lists_known_schemes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    printed = capsys.readouterr().out
    assert "multiprocess" in printed
    for name in ("bare-shm", "bare-tight", "--blocking", "--check-once"):
        assert name in printed


@pytest.mark.parametrize(("mib", "tensors"), [(0.25, 8), (1, 1), (16, 128), (128, 8), (0.001, 3)])
def test_generated_model_has_the_asked_layout(mib: float, tensors: int) -> None:
    shapes = mlp_shapes(int(mib * MIB), tensors)
    assert len(shapes) == tensors
    nbytes = model_nbytes(shapes)
    assert abs(nbytes - mib * MIB) <= max(0.02 * mib * MIB, 64 * tensors)


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bench_all_schemes_with_alternatives_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    # A Ray case would start Ray in this process, beside the session's: Ray
    # cases run in a subprocess (test_bench_ray_scheme_and_ray_put_on_ray_actors).
    # Without ray, all leaves the ray scheme out, with a note.
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    shm_before = shm_entries()
    args = [
        "--size",
        "0.25",
        "--workers",
        "1",
        "--repeats",
        "2",
        "--min-time",
        "0",
        "--warmup",
        "1",
        "--scheme",
        "all",
        "--compare",
        "pickle-pipe",
        "bare-shm",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--wide",
    ]
    code = main(["bench", *args])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "weightsync bench: skipping ray: ray is not importable" in printed.err
    lines = printed.out.splitlines()
    header = next(line for line in lines if line.startswith("scheme"))
    for column in ("copy", "torn", "p10 ms", "max ms", "GB/s all", "+MiB T/W"):
        assert column in header
    rows = {
        line.split()[0]: line.split()
        for line in lines  # table rows; the start-up lines under the table are indented
        if line.split(" ", 1)[0] in ("multiprocess", "shared", "distributed", "pickle-pipe", "bare-shm")
    }
    assert {name: row[6] for name, row in rows.items()} == {
        "multiprocess": "private",
        "shared": "shared",
        "distributed": "private",
        "pickle-pipe": "private",
        "bare-shm": "private",
    }

    report = json.loads(out.read_text())
    cases = {case["scheme"]: case for case in report["cases"]}
    assert set(cases) == {"multiprocess", "shared", "distributed", "pickle-pipe", "bare-shm"}
    assert report["config"]["compare"] == ["pickle-pipe", "bare-shm"]
    assert list(report["skipped"]) == ["ray"]
    for name, case in cases.items():
        schemes = ("multiprocess", "shared", "distributed")
        assert case["kind"] == ("scheme" if name in schemes else "alternative")
        assert case["torn"] == "no"
        assert len(case["samples"]["send_s"]) == 2
        assert all(s > 0 for s in case["samples"]["send_s"])
        assert case["p10_ms"] <= case["median_ms"] <= case["max_ms"]
        assert case["gbps_aggregate"] == pytest.approx(case["gbps_per_worker"] * case["workers"])
        memory = case["peak_memory"]
        assert memory["method"] in ("vmhwm-reset", "vmhwm-lifetime", "unavailable")
        assert len(memory["worker_extra_bytes"]) == case["workers"]

    data = png.read_bytes()
    assert data.startswith(_PNG_SIGNATURE) and len(data) > len(_PNG_SIGNATURE)

    assert mp.active_children() == []
    assert shm_entries() <= shm_before


def test_bench_bfloat16_with_torch_mp_and_progress(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = [
        "--scheme",
        "multiprocess",
        "--size",
        "0.25",
        "--workers",
        "2",
        "--repeats",
        "2",
        "--min-time",
        "0",
        "--warmup",
        "1",
        "--dtype",
        "bfloat16",
        "--compare",
        "torch-mp",
        "--progress",
        "--json",
        str(out),
    ]
    code = main(["bench", *args])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "[0/2 done] multiprocess 0.25 MiB, 2 worker(s)" in printed.err
    assert "[1/2 done] torch-mp" in printed.err
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == "bfloat16"
    assert [case["scheme"] for case in report["cases"]] == ["multiprocess", "torch-mp"]
    for case in report["cases"]:
        assert case["dtype"] == "bfloat16"
        # 2 bytes per element: 0.25 MiB of weights, whatever the dtype.
        assert abs(case["nbytes"] - 0.25 * MIB) <= 0.02 * MIB
        assert len(case["samples"]["send_s"]) == 2


def test_bench_plot_without_matplotlib_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code = main(["bench", "--size", "0.25", "--workers", "1", "--plot", str(tmp_path / "x.png")])
    assert code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_an_alternative_whose_package_is_missing_is_skipped_with_a_note() -> None:
    from weightsync.bench import AlternativeInfo

    missing = AlternativeInfo("x", "needs a package that is not installed", requires="no_such_package_here")
    assert "no_such_package_here" in (missing.unavailable() or "")
    assert AlternativeInfo("y", "needs nothing").unavailable() is None


def test_torchrls_process_schemes_take_every_placement_where_cuda_ipc_is_offered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import platform
    import types

    from weightsync.bench import ALTERNATIVES, placement_unavailable, resolve

    # Placement alone: as if torchrl were importable here (it is not in the repository's own venv).
    monkeypatch.setitem(sys.modules, "torchrl", types.ModuleType("torchrl"))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(platform, "release", lambda: "6.8.0-1015-gcp")
    on_cuda = [("cuda:0", "cuda:0"), ("cuda:0", "cpu"), ("cpu", "cuda:0"), ("cuda:0", "cuda:1")]
    for devices in [("cpu", "cpu"), *on_cuda]:
        for name in ("torchrl-mp", "torchrl-shared"):
            assert placement_unavailable(ALTERNATIVES[name].devices, *devices) is None, (name, devices)
        # torchrl's Ray scheme stays on the CPU: the bench's Ray actors have no GPU.
        why = placement_unavailable(ALTERNATIVES["torchrl-ray"].devices, *devices)
        assert (why is None) == (devices == ("cpu", "cpu")), (devices, why)
    runnable, skipped = resolve(["torchrl-mp", "torchrl-shared", "torchrl-ray"], ("cuda:0", "cpu"))
    assert runnable == ["torchrl-mp", "torchrl-shared"]
    assert skipped == {"torchrl-ray": "the bench runs it with --trainer-device cpu --worker-device cpu only"}

    # Under WSL (or off Linux) CUDA tensors cannot go to another process: torchrl
    # would stage them on the CPU, and the workers' models would leave the GPU.
    monkeypatch.setattr(platform, "release", lambda: "5.15.153.1-microsoft-standard-WSL2")
    assert placement_unavailable(ALTERNATIVES["torchrl-mp"].devices, "cpu", "cpu") is None
    shares = "it shares CUDA tensors between processes, and CUDA IPC is not offered"
    wsl = f"{shares} under WSL (kernel 5.15.153.1-microsoft-standard-WSL2), only on native Linux"
    for devices in on_cuda:
        runnable, skipped = resolve(["torchrl-mp", "torchrl-shared", "bare-shm"], devices)
        assert runnable == ["bare-shm"]
        assert skipped == {"torchrl-mp": wsl, "torchrl-shared": wsl}
    monkeypatch.setattr(sys, "platform", "darwin")
    why = placement_unavailable(ALTERNATIVES["torchrl-shared"].devices, "cuda:0", "cuda:0")
    assert why == f"{shares} on darwin, only on native Linux"


def test_a_torchrl_worker_whose_model_left_its_device_fails_the_case() -> None:
    from weightsync.bench import BenchError, GeneratedMLP, check_on_device

    tensors = GeneratedMLP({"layers.0.weight": (4, 4), "layers.0.bias": (4,)}).state_dict()
    what = "torchrl-mp worker 0, after connect()"
    check_on_device(tensors, "cpu", what)
    # What a worker that asked for a GPU would hold, had torchrl staged the weights on the CPU.
    with pytest.raises(BenchError) as exc:
        check_on_device(tensors, "cuda:0", what)
    assert str(exc.value) == f"{what}: the worker's model is on cpu, not on the worker device cuda:0"


def _bench_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m weightsync bench ARGS``: a process of its own, so a Ray case
    starts (and stops) its own local Ray, apart from this session's."""
    return subprocess.run(
        [sys.executable, "-m", "weightsync", "bench", *args], capture_output=True, text=True, timeout=120
    )


def test_bench_ray_scheme_and_ray_put_on_ray_actors(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "bench.json"
    proc = _bench_subprocess(
        *("--scheme", "ray", "--compare", "ray-put", "--size", "1", "--workers", "2"),
        *("--repeats", "3", "--min-time", "0", "--warmup", "1", "--json", str(out), "--wide"),
    )
    # Exit 0: every send of both cases passed verification.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("ray")]
    assert [(row[0], row[2], row[6], row[7]) for row in rows] == [
        ("ray", "2", "private", "no"),
        ("ray-put", "2", "private", "no"),
    ]

    report = json.loads(out.read_text())
    assert report["skipped"] == {}
    assert report["machine"]["ray"]
    cases = {case["scheme"]: case for case in report["cases"]}
    assert set(cases) == {"ray", "ray-put"}
    for name, case in cases.items():
        assert case["kind"] == ("scheme" if name == "ray" else "alternative")
        assert case["workers"] == 2
        assert case["packet_nbytes"] >= case["nbytes"] > 0
        assert len(case["samples"]["send_s"]) == 3
        assert all(s > 0 for s in case["samples"]["send_s"])
        assert case["samples"]["memcpy_s"] and case["samples"]["floor_split_s"]
        assert case["floor_copies"] == 3
        if name == "ray":  # its stall is compared with a ray.put of the same bytes
            assert case["stall_reference"] == "ray.put" and len(case["samples"]["put_s"]) == 3
            assert 0 < case["stall_ms"] < case["median_ms"]
        # The actors are processes of this machine: their memory is measured.
        assert len(case["peak_memory"]["worker_extra_bytes"]) == 2
    assert len(cases["ray"]["samples"]["report_s"]) == 3


def test_bench_fails_when_a_ray_actor_holds_other_weights(ray_runtime) -> None:
    # In this process, on the session's Ray cluster (the bench uses a Ray
    # that is already initialised, and leaves it running): the CLI path
    # itself is covered by the test above.
    from weightsync.bench import BenchConfig, VerificationError, run_bench

    config = BenchConfig(schemes=("ray",), sizes_mib=(0.25,), workers=(1,), repeats=2, warmup=0)
    wrong = "worker 0 does not hold the trainer's weights after version 1"
    with pytest.raises(VerificationError, match=wrong):
        run_bench(config, corrupt_worker=0)


def test_bench_ray_without_ray_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    # Named on the command line: a one-line error, and nothing runs.
    assert main(["bench", "--scheme", "ray", "--size", "0.25", "--workers", "1"]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith("weightsync bench: --scheme ray cannot run here: ray is not importable")
    assert len(printed.err.splitlines()) == 1
    assert printed.out == ""
    # An alternative is skipped with a note, as when it needs any other package.
    from weightsync.bench import resolve

    assert resolve(["ray-put", "bare-shm"])[0] == ["bare-shm"]


def test_bench_compares_torchrls_schemes(tmp_path: Path) -> None:
    # Only where torchrl is importable (not in the repository's own venv).
    pytest.importorskip("torchrl")
    pytest.importorskip("ray")
    out = tmp_path / "bench.json"
    proc = _bench_subprocess(
        *("--compare", "torchrl-mp", "torchrl-shared", "torchrl-ray", "--scheme", "ray"),
        *("--size", "1", "--workers", "2", "--repeats", "2", "--warmup", "1", "--json", str(out)),
        *("--min-time", "0"),
    )
    # Exit 0: every send of every case passed verification.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = {case["scheme"]: case for case in json.loads(out.read_text())["cases"]}
    assert set(cases) == {"ray", "torchrl-mp", "torchrl-shared", "torchrl-ray"}
    for name, case in cases.items():
        assert case["kind"] == ("scheme" if name == "ray" else "alternative")
        assert case["workers"] == 2
        assert len(case["samples"]["send_s"]) == 2
        assert all(s > 0 for s in case["samples"]["send_s"])
    assert [cases[name]["copy"] for name in ("torchrl-mp", "torchrl-shared", "torchrl-ray")] == [
        "shared",
        "shared",
        "private",
    ]


def test_bench_delta_on_one_host(tmp_path: Path) -> None:
    from weightsync.bench import emulation_unavailable_reason as unavailable_reason

    pytest.importorskip("blosc2")
    why = unavailable_reason()
    if why is not None:
        pytest.skip(f"--delta runs in a network namespace: {why}")
    out = tmp_path / "delta.json"
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "bench", "--delta", "--size", "0.25", "--steps", "2",
         "--trajectory", "bf16-lr3e-6", "random", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # Exit 0: every send of both schemes was checked on the worker.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = lines.index("all cases:") + 1
    assert lines[header].split()[:6] == ["trajectory", "hosts", "rate", "MiB", "chg", "idx/val"]
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 3]}
    assert set(rows) == {"bf16-lr3e-6", "random"}
    for row in rows.values():
        assert row[1] == "0" and row[-1] == "4/4"  # one host; 2 steps x 2 schemes, all exact
    report = json.loads(out.read_text())
    for row in report["rows"]:
        assert row["checked"] == 4 and row["workers"] == 1
        delta, full = row["delta"], row["full"]
        assert len(delta["time"]) == len(full["time"]) == 2
        assert not any(full["delta"])
        # delta=True weighs each send: random bytes never pay and go whole;
        # a bf16 update that went as a delta is far smaller on the NIC.
        if row["name"] == "bf16-lr3e-6":
            for went, nic in zip(delta["delta"], delta["nic"], strict=True):
                assert not went or nic < 0.5 * min(full["nic"])
        else:
            assert not any(delta["delta"]) and min(delta["nic"]) > 0.9 * row["bytes"]
        assert all(n >= row["bytes"] for n in full["nic"])
        assert len(row["encode_ms"]) == len(row["decode_ms"]) == 2


# -- models on devices (--trainer-device / --worker-device) ---------------------

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is visible here")
@pytest.mark.parametrize("option", ["--worker-device", "--trainer-device"])
def test_bench_on_cuda_without_cuda_fails_fast_and_starts_no_worker(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    code = main(["bench", option, "cuda", "--size", "0.25", "--workers", "1"])
    printed = capsys.readouterr()
    assert code == 2
    # One clear line, naming the option and the device, before any case or worker.
    assert printed.err.splitlines() == [
        f"weightsync bench: {option} cuda:0: no CUDA device is visible here (torch {torch.__version__})"
    ]
    assert printed.out == ""
    assert time.monotonic() - started < 5
    assert mp.active_children() == []
    assert list(tmp_path.iterdir()) == []  # no results file either


def test_bench_device_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--worker-device", "gpu"])
    assert exc.value.code == 2
    assert "'gpu' is not a device the bench knows: cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--trainer-device", "cuda", "--delta"])
    assert exc.value.code == 2
    assert "place the models of the bench on one host" in capsys.readouterr().err


def test_bench_on_cpu_devices_runs_as_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    args = ["--scheme", "multiprocess", "--size", "0.25", "--workers", "1"]
    args += ["--repeats", "2", "--min-time", "0"]
    devices = ["--trainer-device", "cpu", "--worker-device", "cpu"]
    code = main(["bench", *args, *devices, "--compare", "bare-shm", "cuda-ipc", "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    lines = printed.out.splitlines()
    # Every line within 100 columns, but the one naming the results file (a temporary path here).
    longest = max((line for line in lines if not line.startswith("raw samples")), key=len)
    assert len(longest) <= 100, longest
    header = next(i for i, line in enumerate(lines) if line.startswith("scheme"))
    assert [line.split()[0] for line in lines[header + 2 : header + 4]] == ["multiprocess", "bare-shm"]
    # The CPU floor, and no GPU copies: what a run without the options prints.
    assert "floor: (workers + 1) memcpys" in printed.out and "D2D" not in printed.out
    if not HAS_CUDA:
        assert "skipping cuda-ipc: no CUDA device is visible here" in printed.err
    report = json.loads(out.read_text())
    assert (report["config"]["trainer_device"], report["config"]["worker_device"]) == ("cpu", "cpu")
    assert "cuda" not in report["machine"]
    for case in report["cases"]:
        assert (case["trainer_device"], case["worker_device"]) == ("cpu", "cpu")
        assert case["floor_kind"] == "(workers + 1) memcpys" and case["floor_ms"] == case["host_floor_ms"]
        assert case["d2d_ms"] is None and case["samples"]["device_copy_s"] == {}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device is visible")
@pytest.mark.parametrize(("trainer", "worker"), [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_bench_compares_torchrls_process_schemes_on_cuda_placements(
    trainer: str, worker: str, tmp_path: Path
) -> None:
    # Where torchrl is importable too (not in the repository's own venv).
    pytest.importorskip("torchrl")
    out = tmp_path / "bench.json"
    proc = _bench_subprocess(
        *("--scheme", "multiprocess", "--compare", "torchrl-mp", "torchrl-shared"),
        *("--trainer-device", trainer, "--worker-device", worker, "--size", "1", "--workers", "2"),
        *("--repeats", "2", "--min-time", "0", "--warmup", "1", "--json", str(out)),
    )
    # Exit 0: every send verified bit-exactly on every worker, each worker's
    # model still on the worker device after torchrl's connect().
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [case["scheme"] for case in cases] == ["multiprocess", "torchrl-mp", "torchrl-shared"]
    for case in cases:
        assert (case["trainer_device"], case["worker_device"]) == (
            "cpu" if trainer == "cpu" else "cuda:0",
            "cpu" if worker == "cpu" else "cuda:0",
        )
        assert len(case["samples"]["send_s"]) == 2 and case["d2d_ms"] > 0
    assert [case["copy"] for case in cases] == ["private", "shared", "shared"]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device is visible")
@pytest.mark.parametrize(
    ("trainer", "worker", "floor"),
    [
        ("cuda", "cuda", "(workers + 1) x D2D"),
        ("cuda", "cpu", "one page-locked D2H + workers' memcpys in parallel"),
        ("cpu", "cuda", "one memcpy + workers x page-locked H2D"),
    ],
)
def test_bench_on_cuda_placements(
    trainer: str, worker: str, floor: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = ["--scheme", "multiprocess", "shared", "--size", "1", "--workers", "2", "--repeats", "2"]
    args += ["--min-time", "0"]
    compare = ["--compare", "bare-shm", "torch-mp", "cuda-ipc", "pinned-shm"]
    devices = ["--trainer-device", trainer, "--worker-device", worker]
    code = main(["bench", *args, *compare, *devices, "--json", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err  # every send verified bit-exactly on every worker
    longest = max((line for line in printed.out.splitlines() if not line.startswith("raw samples")), key=len)
    assert len(longest) <= 100, longest
    assert "copies of the same bytes on the GPU" in printed.out
    report = json.loads(out.read_text())
    assert report["machine"]["cuda"]["devices"]["cuda:0"]["name"]
    names = [case["scheme"] for case in report["cases"]]
    assert names == ["multiprocess", "shared", "bare-shm", "torch-mp", "cuda-ipc", "pinned-shm"]
    for case in report["cases"]:
        assert case["floor_kind"] == floor
        assert case["d2d_ms"] > 0 and case["d2h_pinned_ms"] > 0 and case["h2d_pinned_ms"] > 0
