"""The sharded bench's table (``weightsync.bench.format_sharded_table``) of
a run whose rank was killed or stopped: a pure function of the run's
record, checked with no process."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.bench import format_sharded_table


def _result(kind: str) -> dict[str, Any]:
    outcomes = {"0": ["SenderGroupError", "send 4 failed: rank 3 died during it. More", 0.4]}
    fault = {"kind": kind, "rank": 3, "after_s": 0.044, "deadline_s": 10.0, "outcomes": outcomes,
             "workers": ["old", "old"]}  # fmt: skip
    row = {"ranks": 4, "workers": 2, "tp": 1, "mib": 16, "bytes": 16 << 20, "weightsync": [0.2, 0.3],
           "gather": [], "rss_start_mib": [1] * 4, "rss_after_sharded_mib": [18] * 4,
           "fault": fault}  # fmt: skip
    return {"row": row, "bytes_per_second": 125e6}


@pytest.mark.parametrize(
    ("kind", "said"), [("kill-rank", "killed (SIGKILL)"), ("stop-rank", "stopped (SIGSTOP")]
)
def test_the_table_says_whether_the_rank_was_killed_or_stopped(kind: str, said: str) -> None:
    table = format_sharded_table(_result(kind))
    assert f"rank 3 {said}" in table and "44 ms into a send of deadline 10 s" in table, table
    assert "rank 0: SenderGroupError after 0.40 s: send 4 failed: rank 3 died during it" in table, table
    assert "workers: 2 on the version before, 0 on the new one, 0 holding a mix" in table, table


def test_the_table_says_when_a_fault_missed_sends_and_they_were_sent_again() -> None:
    result = _result("stop-rank")
    result["row"]["fault"] |= {"tries": 3, "missed": False}
    table = format_sharded_table(result)
    assert "(2 send(s) before it ended before the fault fired; each was sent again)" in table, table
    result["row"]["fault"] |= {"tries": 4, "missed": True}
    table = format_sharded_table(result)
    assert "(every one of 4 sends ended before its fault: nothing was faulted)" in table, table
