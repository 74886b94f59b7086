"""RayWeightSyncScheme across hosts, on an emulated cluster: network
namespaces with 1 Gbit/s NICs, a Ray node in each (weightsync.bench.EmulatedCluster).

The trainer runs on host 0 (tests/harness/ray_cluster_trainer.py); its actors on the
other hosts get each send along the relay chain. Every scenario checks the
weights bit for bit on every actor that should have them. A host is killed
(SIGKILL to every process of its namespace) or stopped (SIGSTOP) in the
middle of a send: the hosts after it in the chain still get the update, and
the send names the one that did not.

Needs root and iproute2 (skipped otherwise); not in the default run:
``pytest -m cluster`` (a CI step of its own).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import TESTS_DIR, program

pytest.importorskip("ray")

from weightsync.bench import (
    EmulatedCluster,
    emulated_namespaces,
    emulation_unavailable_reason,
    namespace_name,
)

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        emulation_unavailable_reason() is not None, reason=str(emulation_unavailable_reason())
    ),
]


@pytest.fixture
def cluster() -> Iterator[EmulatedCluster]:
    """Five hosts (the trainer's and four receiving ones), Ray on each;
    everything removed after the test, whatever happened in it."""
    made = EmulatedCluster(5, "1gbit").start()
    try:
        made.start_ray(cpus=4)
        yield made
    finally:
        made.close()
    left = made.namespaces_left()
    assert not left, f"namespaces left behind: {left}"


def _drive(cluster: EmulatedCluster, scenario: str, during: Any = None, timeout: float = 240) -> dict:
    """Run the driver's ``scenario`` on host 0; call ``during()`` when it
    announces the send to disturb; return its result."""
    proc = cluster.popen(
        0,
        program("ray_cluster_trainer", scenario),
        env={"RAY_ADDRESS": cluster.ray_address or ""},
        cwd=TESTS_DIR,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    result = None
    while result is None:
        ready, _, _ = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("SENDING") and during is not None:
            during()
        elif line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 5))
    except subprocess.TimeoutExpired:
        proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    assert result is not None, f"the driver gave no result (exit {proc.returncode}): {err[-4000:]}"
    assert "crash" not in result, result["crash"]
    return result


def test_relay_is_bit_exact_on_every_actor(cluster: EmulatedCluster) -> None:
    result = _drive(cluster, "exact")
    assert result["bad"] == [[], [], []]
    assert sorted(set(result["hosts"])) == cluster.addresses[1:4]
    # Each send went along one chain over the three hosts.
    assert result["chains"] == [3]
    # A send to actors of two hosts only: one chain over those two.
    assert result["subset_bad"] == []
    assert result["subset_chains"] == [2]


def test_relaying_host_killed_mid_send(cluster: EmulatedCluster) -> None:
    def kill() -> None:
        time.sleep(0.5)
        cluster.kill_host(2)

    result = _drive(cluster, "kill", during=kill)
    error = result["error"]
    assert error is not None and error["worker_ids"] == [1], error
    assert error["failures"] == {"1": "WorkerLostError"}, error
    # The hosts after the dead one were reached by a second chain (or
    # directly, when one was left), within the send's deadline.
    assert result["bad"] == []
    assert result["seconds"] < 30
    assert len(result["chains"]) >= 1


def test_relay_carries_deltas_and_a_host_that_missed_a_send_gets_a_delta_of_what_it_missed(
    cluster: EmulatedCluster,
) -> None:
    """RayWeightSyncScheme(delta=True) to 3 hosts: every send bit-exact on
    every actor; after the first (no base yet), each change of 1% of the
    elements crosses the trainer's NIC as a small fraction of the bytes; a
    host that missed a send gets, in a chain of its own, a delta against
    the version it holds (kept by the trainer: ``delta_history``), and
    deltas in the one chain again after that."""
    pytest.importorskip("blosc2")
    result = _drive(cluster, "delta")
    nbytes, sends = result["nbytes"], result["sends"]
    assert [s["bad"] for s in sends] == [[]] * len(sends), sends
    # connect()'s initial send: no base, the full bytes along one chain (and
    # along a repair of it, when the agents, starting with it, broke it).
    assert not any(sends[0]["delta"]) and sends[0]["chains"][0] == [1, 2, 3], sends[0]
    assert sends[0]["wire"] >= nbytes
    # (Then sends until one reached every host in one chain: the agents start
    # with the first, which may break its chain.)
    assert result["warmup"] <= 2, sends
    sends = sends[result["warmup"] :]
    for send in sends[1:5]:
        assert send["delta"] == [True] and send["chains"] == [[1, 2, 3]], send
        assert send["wire"] < 0.1 * nbytes, send
    # Host 3 missed send 5 (a delta to hosts 1 and 2); send 6 goes as a
    # delta to those, and as a delta against the version before to host 3.
    assert sends[5]["delta"] == [True] and sends[5]["chains"] == [[1, 2]], sends[5]
    assert sends[6]["delta"] == [True, True], sends[6]
    assert sends[6]["chains"] == [[1, 2], [3]], sends[6]
    assert sends[6]["wire"] < 0.2 * nbytes, sends[6]
    for send in sends[7:]:
        assert send["delta"] == [True] and send["chains"] == [[1, 2, 3]], send
        assert send["wire"] < 0.1 * nbytes, send


def _ray_workers(cluster: EmulatedCluster, host: int) -> list[int]:
    """The Ray worker processes (actors, the relay agent) of ``host``: not
    its raylet or other services."""
    pids = []
    for pid in cluster.host_pids(host):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if title.startswith(b"ray::"):
            pids.append(pid)
    return pids


@pytest.mark.parametrize("what", ["workers", "host"])
def test_stopped_host_is_named_and_the_others_are_updated(cluster: EmulatedCluster, what: str) -> None:
    """SIGSTOP on the Ray workers of host 2 (its node still answers Ray's
    health checks): an AckTimeoutError naming its actor at the deadline. On
    the whole host: Ray's health check declares the node dead (within about
    2 s on this cluster), and the send names its actor in a WorkerLostError.
    Either way the hosts after it are updated."""
    stopped: list[int] = []

    def stop() -> None:
        time.sleep(0.5)
        if what == "host":
            cluster.kill_host(2, signal.SIGSTOP)
        else:
            stopped.extend(_ray_workers(cluster, 2))
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)

    try:
        result = _drive(cluster, "stop", during=stop)
    finally:
        cluster.kill_host(2, signal.SIGCONT)
    error = result["error"]
    assert error is not None and error["worker_ids"] == [1], error
    assert result["bad"] == []
    if what == "workers":
        assert stopped, "no Ray worker process found on host 2"
        assert error["type"] == "AckTimeoutError", error
        # It says where the relay's chain broke.
        assert "the chain broke at host" in error["message"], error
        # At the deadline, not long after it.
        assert 14 <= result["seconds"] < 25
    else:
        assert error["type"] in ("WorkerLostError", "AckTimeoutError"), error
        assert result["seconds"] < 25


def test_host_that_joins_later_gets_the_latest_weights(cluster: EmulatedCluster) -> None:
    result = _drive(cluster, "join")
    assert result["new_id"] == 2
    assert result["late_bad"] == []
    assert result["bad"] == []
    assert result["chains"][-1:] == [3]


def test_stale_namespaces_of_a_dead_creator_are_removed() -> None:
    # A namespace named as a cluster of a process that no longer exists.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = namespace_name(dead.pid)
    subprocess.run(["ip", "netns", "add", name], check=True)
    mine = EmulatedCluster(1).start()  # start() removes stale ones first
    try:
        assert name not in emulated_namespaces()
        assert set(mine.namespaces) <= set(emulated_namespaces())
    finally:
        mine.close()
    assert not mine.namespaces_left()


def test_bench_across_emulated_hosts_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    """``weightsync bench --emulate-hosts``, end to end: a cluster of its own,
    the TCP ceiling, every case verified, the table and the JSON; nothing
    left behind."""
    out = tmp_path / "hosts.json"
    argv = [
        *(sys.executable, "-m", "weightsync", "bench", "--emulate-hosts", "3", "--hosts", "1", "2"),
        *("--size", "4", "--repeats", "2", "--json", str(out)),
    ]
    before = set(emulated_namespaces())
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.lstrip().startswith("hosts"))
    columns = ("floor ms", "TCP chain", "weightsync ms", "ray put/get", "gloo bcast", "cluster cpu")
    for column in (*columns, "host core-ms/GiB"):
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 1 :] if line.strip()]
    assert [(row[0], row[1], row[2]) for row in rows] == [("1", "1", "4"), ("2", "1", "4")], done.stdout
    report = json.loads(out.read_text())
    assert report["bytes_per_second"] == 125e6
    assert report["tcp_chain_s"]["4.0"] > 0
    for row in report["rows"]:
        assert len(row["weightsync"]) == len(row["ray_put"]) == len(row["gloo_bcast"]) == 2
        # From clock ticks of 10 ms: a rough share at 4 MiB, but a share.
        assert 0 <= row["cluster_cpu"] < 2, row
        # Per relayed host and GiB: only where the relay ran (2 hosts and more).
        assert ("host_cpu_ms_per_gib" in row) == (row["hosts"] >= 2), row
        assert row.get("host_cpu_ms_per_gib", 0.0) >= 0, row
    assert set(emulated_namespaces()) <= before
