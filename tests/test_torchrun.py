"""DistributedWeightSyncScheme with its ranks started by ``torchrun``: the
scheme finds torchrun's store, its rank and the number of workers in the
environment. ``torchrun ... -m weightsync bench --scheme distributed`` runs
the benchmark on such a job (rank 0 the trainer), every send checked bit
for bit on every rank; here on this host, and across the hosts of an
emulated cluster (one torchrun per host, static rendezvous), where the
chain visits one rank per host and that rank feeds its host's other one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.bench import EmulatedCluster, emulation_unavailable_reason


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _bench(out: Path) -> list[str]:
    return [
        "-m",
        "weightsync",
        "bench",
        "--scheme",
        "distributed",
        "--size",
        "1",
        "--repeats",
        "2",
        "--json",
        str(out),
    ]


@pytest.mark.cli
@pytest.mark.timeout(300)
def test_bench_under_torchrun_on_one_host(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = _torchrun("--standalone", "--nproc-per-node", "3", *_bench(out))
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "all cases:" in result.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workers"] == 2
    # One host: ranks 1 and 2 copy from the trainer's (rank 0's) shared memory, with no chain.
    assert (row["chain"], row["fed"]) == ([], {"0": [1, 2]})
    for way in ("weightsync", "gloo_bcast", "gloo_star"):
        assert len(row[way]) == 2 and all(s > 0 for s in row[way])


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.skipif(emulation_unavailable_reason() is not None, reason=str(emulation_unavailable_reason()))
def test_bench_under_torchrun_across_emulated_hosts(tmp_path: Path) -> None:
    """Three hosts, two ranks each (ranks 0, 1 on host 0; 2, 3 on host 1;
    4, 5 on host 2), one torchrun per host."""
    out = tmp_path / "bench.json"
    with EmulatedCluster(3, "1gbit") as cluster:
        master = cluster.addresses[0]
        procs = []
        for node in range(3):
            argv = _torchrun(
                "--nnodes", "3", "--node-rank", str(node), "--nproc-per-node", "2",
                "--master-addr", master, "--master-port", "29531", *_bench(out),
            )  # fmt: skip
            # GLOO_SOCKET_IFNAME: the bench's gloo peers run in the world group, whose
            # sockets otherwise bind to the address of the host's name (here 127.0.0.1).
            quiet = {"TORCH_CPP_LOG_LEVEL": "ERROR", "GLOO_SOCKET_IFNAME": "eth0"}
            pipes = subprocess.PIPE
            procs.append(cluster.popen(node, argv, env=quiet, stdout=pipes, stderr=pipes, text=True))
        outputs = [proc.communicate(timeout=180) for proc in procs]
        codes = [proc.returncode for proc in procs]
    assert codes == [0, 0, 0], [o[0][-2000:] + o[1][-2000:] for o in outputs]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workers"] == 5
    # Rank 1 shares the trainer's host: it copies from the trainer's shared memory.
    assert (row["chain"], row["fed"]) == ([2, 4], {"0": [1], "2": [3], "4": [5]})
    for way in ("weightsync", "gloo_bcast", "gloo_star"):
        assert len(row[way]) == 2 and all(s > 0 for s in row[way])
