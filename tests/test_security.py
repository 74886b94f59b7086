"""What a worker can reach: shared memory that only the owner can open,
with no name to guess, mapped read-only by the workers."""

from __future__ import annotations

import os
import stat

import pytest
from conftest import PIPE_SCHEMES, Cluster, shm_entries


def _segments(c: Cluster) -> list:
    shared = c.scheme.staging
    segment = getattr(shared, "segment", None)  # the multiprocess scheme's staging
    return [segment] if segment is not None else list(shared.slots)  # the shared scheme's slots


def _weightsync_mappings(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return [line for line in maps if "memfd:weightsync" in line]


@pytest.mark.parametrize("scheme_name", PIPE_SCHEMES)
def test_shared_memory_is_the_owners_only_nameless_and_read_only_for_workers(
    make_cluster, scheme_name: str
) -> None:
    before = shm_entries()
    c: Cluster = make_cluster(["net", "net"])
    c.bump()
    c.sender.send()
    assert shm_entries() <= before, "a segment got a name in /dev/shm"
    segments = _segments(c)
    assert segments
    tokens = set()
    for segment in segments:
        mode = os.fstat(segment.fd).st_mode
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
        assert len(segment.token) == 16
        tokens.add(segment.token)
    assert len(tokens) == len(segments)
    for pid in c.pids:
        mappings = _weightsync_mappings(pid)
        assert mappings, f"worker {pid} maps no weightsync segment"
        for line in mappings:
            perms = line.split()[1]
            assert perms.startswith("r-"), f"worker {pid} can write a segment: {line.strip()}"
