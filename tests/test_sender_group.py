"""A sharded trainer sends from every rank: two FSDP2 ranks on gloo (uneven
shards), each sending its own part through ``DistributedWeightSyncScheme``,
to worker processes that hold whole copies (``harness/sender_group.py``).

Every worker ends holding exactly the trainer's ``full_tensor()`` of each
weight (computed outside the sends), having applied only whole versions;
every rank returns the same report, or raises the same error; a rank that
dies is named on the other within the send's deadline and 3 s."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from harness.programs import TESTS_DIR, program

pytest.importorskip("torch.distributed.fsdp")


def _run(tmp_path: Path, case: str) -> tuple[list[dict[str, Any]], dict[int, dict[str, Any]]]:
    done = subprocess.run(
        program("sender_group", str(tmp_path), case),
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert "crash" not in rank, rank["crash"]
    workers = {r: torch.load(tmp_path / f"worker{r}.pt") for r in (1, 2)}
    return ranks, workers


# (Four processes that import torch, about 17 s a case: in the extended run,
# which CI runs, keeping the default run short; tests/test_shards.py checks
# the parts in the default run.)
@pytest.mark.extended
@pytest.mark.parametrize("case", ["sends", "verify", "delta", "applier", "async"])
def test_every_rank_sends_its_part_and_every_worker_holds_the_full_tensors(tmp_path: Path, case: str) -> None:
    ranks, workers = _run(tmp_path, case)
    # connect() and three sends: the same report on both ranks, every
    # worker in it; the bytes are both ranks' parts together.
    assert ranks[0]["reports"] == ranks[1]["reports"], ranks
    assert [r["version"] for r in ranks[0]["reports"]] == [1, 2, 3, 4]
    assert all(r["worker_ids"] == [0, 1] for r in ranks[0]["reports"])
    # The ranks and workers share a host: each rank writes its part into
    # one buffer, and rank 0 alone sends from it (one route), but with
    # delta (each rank's part against the base its workers hold).
    assert all(r["routes"] == (2 if case == "delta" else 1) for r in ranks[0]["reports"]), ranks[0]
    # Every rank says where the group's store is, as a single sender does.
    assert ranks[0]["store_info"] == ranks[1]["store_info"] and ranks[0]["store_info"]["port"] > 0, ranks
    # A rank's sender is the group's: its calls are collective (a class's
    # sender alone would send its part only).
    assert ranks[0]["get_sender"] == "GroupSender", ranks[0]
    assert "wait_for_workers(): this trainer is sharded" in ranks[0]["wait_for_workers"], ranks[0]
    if case == "delta":
        # Each rank's last part went as a delta against the one the workers held.
        assert ranks[0]["delta"] == [True] and ranks[1]["delta"] == [True], ranks
    full = torch.load(tmp_path / "full.pt")
    for rank, worker in workers.items():
        assert worker["error"] is None, (rank, worker["error"])
        assert worker["versions"][-1] == 4 and worker["versions"] == sorted(set(worker["versions"])), worker
        for name, tensor in full.items():
            assert torch.equal(worker["state"][name], tensor), (rank, name)


@pytest.mark.extended
def test_a_rank_whose_part_does_not_fit_the_host_buffer_fails_the_send_on_every_rank_and_none_applies_it(
    tmp_path: Path,
) -> None:
    ranks, workers = _run(tmp_path, "bad_part")
    # The same error on both ranks, naming rank 1 and what it raised.
    assert ranks[0]["error"] == ranks[1]["error"], ranks
    kind, text = ranks[0]["error"]
    assert kind == "SenderGroupError", text
    said = "rank 1 raised InvalidWeightsError: weight '0.weight': this rank's shard is float32[2, 2]"
    assert said in text, text
    assert "did not write their part into the host's buffer" in text, text
    # Version 3 failed before any worker was told; the next send reached both.
    assert [r["version"] for r in ranks[0]["reports"]] == [1, 2, 4], ranks
    full = torch.load(tmp_path / "full.pt")
    for rank, worker in workers.items():
        assert worker["error"] is None, (rank, worker["error"])
        assert worker["versions"] == [1, 2, 4], worker
        for name, tensor in full.items():
            assert torch.equal(worker["state"][name], tensor), (rank, name)


@pytest.mark.extended
def test_a_worker_whose_model_does_not_fit_is_refused_alike_on_every_rank(tmp_path: Path) -> None:
    ranks, workers = _run(tmp_path, "mismatch")
    # Worker 2 (id 1) has a last layer of 4 rows where the trainer's has 3.
    assert workers[2]["error"].startswith(
        "WeightMismatchError: this worker's model does not fit the trainer's"
    )
    assert "'2.weight' is (4, 5) float32, the trainer's (3, 5) float32" in workers[2]["error"]
    assert workers[2]["versions"] == []
    # Both ranks raise the same error, naming it (refused, or gone once it
    # raised and ended, whichever a rank saw first).
    assert ranks[0]["error"] == ranks[1]["error"], ranks
    text = ranks[0]["error"][1]
    assert "worker 1" in text, text


@pytest.mark.extended
def test_a_rank_that_dies_is_named_on_the_other_and_no_worker_holds_a_mix(tmp_path: Path) -> None:
    done = subprocess.run(
        program("sender_group", str(tmp_path), "rank_dies"), cwd=TESTS_DIR, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert [r["version"] for r in rank0["reports"]] == [1, 2]
    kind, text = rank0["error"]
    assert kind == "SenderGroupError", text
    assert "rank 1 died during it (its process is gone)" in text, text
    # Before the send's deadline (6 s): the workers that lost rank 1's
    # part tell rank 0 at once, and rank 0 finds rank 1's beacon refused.
    assert rank0["seconds"] < 6.0, rank0
    for rank in (1, 2):
        worker = torch.load(tmp_path / f"worker{rank}.pt")
        # Version 3 never came whole: each worker stayed on version 2.
        assert worker["versions"] == [1, 2], worker


# The tensor-parallel worker's shard of each weight: the first layer is
# column-sharded (rows of its weight and bias), the second row-sharded
# (columns of its weight), its bias replicated.
_TP_SHARDS = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}


@pytest.mark.extended
@pytest.mark.parametrize("case", ["tp", "tp_missing"])
def test_tensor_parallel_workers_take_their_shards_and_a_group_never_runs_two_versions(
    tmp_path: Path, case: str
) -> None:
    done = subprocess.run(
        program("sender_group", str(tmp_path), case), cwd=TESTS_DIR, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert "crash" not in rank, rank["crash"]
    assert ranks[0]["reports"] == ranks[1]["reports"], ranks
    assert [r["version"] for r in ranks[0]["reports"]] == [1, 2, 3, 4]
    assert all(r["worker_ids"] == [0, 1, 2, 3] for r in ranks[0]["reports"])
    full = torch.load(tmp_path / "full.pt")
    workers = {r: torch.load(tmp_path / f"worker{r}.pt") for r in (1, 2, 3, 4)}
    for rank, worker in workers.items():
        assert worker["error"] is None, (rank, worker["error"])
        # Each holds exactly its shard of the trainer's full tensors.
        for name, dim in _TP_SHARDS.items():
            expected = full[name] if dim is None else torch.chunk(full[name], 2, dim)[worker["index"]]
            assert torch.equal(worker["local"][name], expected), (rank, name)
        assert worker["steps"] == sorted(worker["steps"]) and worker["steps"][-1] == 4, worker["steps"]
        assert "a background applier has no point shared by the members" in worker["background"], worker
    # The members of a replica ran every step on one version: the same
    # steps, each on the same version.
    for first, second in ((1, 2), (3, 4)):
        assert workers[first]["steps"] == workers[second]["steps"], (first, second)
    if case == "tp_missing":
        # Worker 4 held back its first receive() after version 1 for 3 s,
        # while version 2 came: its replica went on to version 2 together.
        assert 2 in workers[3]["steps"], workers[3]["steps"]


@pytest.mark.extended
def test_a_rank_that_dies_leaves_every_tensor_parallel_replica_on_one_version(tmp_path: Path) -> None:
    done = subprocess.run(
        program("sender_group", str(tmp_path), "tp_rank_dies"), cwd=TESTS_DIR, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert "crash" not in rank0, rank0["crash"]
    kind, text = rank0["error"]
    assert kind == "SenderGroupError" and "rank 1 died during it (its process is gone)" in text, text
    assert rank0["seconds"] < 6.0, rank0
    workers = {r: torch.load(tmp_path / f"worker{r}.pt") for r in (1, 2, 3, 4)}
    for rank, worker in workers.items():
        # Rank 0's part of version 3 came, rank 1's never did: every member
        # stayed on version 2, and heard the sender group is gone.
        assert worker["steps"][-1] == 2, (rank, worker["steps"])
        assert worker["error"] is not None and worker["error"].startswith("lost: Sender"), worker["error"]
    for first, second in ((1, 2), (3, 4)):
        assert workers[first]["steps"] == workers[second]["steps"], (first, second)
