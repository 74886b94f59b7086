"""A sharded trainer across hosts, on an emulated cluster (network
namespaces with 1 Gbit/s NICs): four FSDP2 ranks on two hosts, each sending
its own part to a whole-copy worker on each of two other hosts
(``weightsync.bench.run_sharded``, as ``weightsync bench
--sharded-trainer 2x2`` runs it). Every send is checked bit for bit on
every worker against every rank's shards (a mismatch ends the run), and
no rank's peak RSS grows by more than its shard and the chunks in flight.
The same trainer also sends to two tensor-parallel replicas (two members
each, one per host), each member checked against its own shards.

Needs root and iproute2 (skipped otherwise); ``pytest -m cluster``.
"""

from __future__ import annotations

import pytest

from weightsync.bench import emulation_unavailable_reason, format_sharded_table, run_sharded

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        emulation_unavailable_reason() is not None, reason=str(emulation_unavailable_reason())
    ),
]


def test_every_rank_sends_its_part_across_hosts_and_holds_only_its_shard() -> None:
    result = run_sharded(trainer_hosts=2, ranks_per_host=2, hosts=2, mib=32, repeats=2)
    row = result["row"]
    assert len(row["weightsync"]) == 2 and len(row["gather"]) == 2, row
    shard_mib = row["bytes"] / row["ranks"] / (1 << 20)
    growth = [b - a for a, b in zip(row["rss_start_mib"], row["rss_after_sharded_mib"], strict=True)]
    # Its staging copy of its shard, and the frames in flight (a few MiB).
    assert all(g <= shard_mib + 8 for g in growth), format_sharded_table(result)


def test_tensor_parallel_replicas_across_hosts_each_take_their_own_shards() -> None:
    # Two replicas of two tensor-parallel members, each member on a host of
    # its own, every tensor sharded over its replica by rows or by columns.
    # Each member answers the checks of its own boxes only: a member whose
    # shard differs from the trainer's ends the run.
    result = run_sharded(trainer_hosts=2, ranks_per_host=2, hosts=4, mib=16, repeats=2, worker_tp=2)
    row = result["row"]
    assert row["tp"] == 2 and len(row["weightsync"]) == 2 and row["gather"] == [], row
    print(format_sharded_table(result))
