"""What a worker can reach: shared memory that only the owner can open,
with no name in any filesystem, identified by a random token that a worker
checks, mapped read-only by the workers."""

from __future__ import annotations

import os
import stat

import pytest
from harness import Cluster, schemes, shm_entries
from harness.workers import MEMFD_LABEL

from weightsync._memory._segment import HEADER_BYTES, Segment


def _segments(c: Cluster) -> list:
    shared = c.scheme.staging.host  # (the pipe schemes' host staging)
    segment = getattr(shared, "segment", None)  # the multiprocess scheme's staging
    return [segment] if segment is not None else list(shared.slots)  # the shared scheme's slots


def _weightsync_mappings(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as maps:
        return [line for line in maps if MEMFD_LABEL in line]


@pytest.mark.parametrize("scheme_name", schemes(pipes=True))
def test_shared_memory_is_the_owners_only_nameless_and_read_only_for_workers(
    make_cluster, scheme_name: str
) -> None:
    before = shm_entries()
    c: Cluster = make_cluster(["net", "net"])
    c.bump()
    c.sender.send()
    segments = _segments(c)
    assert segments
    tokens = set()
    for segment in segments:
        info = os.fstat(segment.fd)
        assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
        assert info.st_uid == os.getuid()
        # No name anywhere: no directory entry of any filesystem links to it
        # (a file in /dev/shm, /tmp or anywhere else has one until unlinked).
        assert info.st_nlink == 0, f"the segment has {info.st_nlink} name(s)"
        target = os.readlink(f"/proc/self/fd/{segment.fd}")
        assert target.startswith("/memfd:"), target  # an anonymous memfd, not a file
        # The token is carried in the segment itself, where a worker reads it.
        assert len(segment.token) == 16
        with open(f"/proc/self/fd/{segment.fd}", "rb") as raw:
            assert raw.read(HEADER_BYTES)[8:24] == segment.token
        tokens.add(segment.token)
    assert len(tokens) == len(segments)
    assert shm_entries() <= before, "a segment got a name in /dev/shm"
    for pid in c.pids:
        mappings = _weightsync_mappings(pid)
        assert mappings, f"worker {pid} maps no weightsync segment"
        for line in mappings:
            perms = line.split()[1]
            assert perms.startswith("r-"), f"worker {pid} can write a segment: {line.strip()}"


def test_tokens_are_random() -> None:
    """Tokens of 64 segments: all differ, every byte position takes many
    values (a counter, a pid or a time would leave most of them fixed), and
    about half of the 8192 bits are set (a random token is off by more than
    a tenth with a probability below 1e-70)."""
    segments = [Segment.create(1) for _ in range(64)]
    try:
        tokens = [s.token for s in segments]
    finally:
        for s in segments:
            s.close()
    assert all(len(t) == 16 for t in tokens)
    assert len(set(tokens)) == len(tokens)
    for i in range(16):
        assert len({t[i] for t in tokens}) >= 32, f"byte {i} of the token hardly changes"
    ones = sum(bin(byte).count("1") for t in tokens for byte in t)
    assert 0.4 < ones / (len(tokens) * 128) < 0.6, ones


def test_a_worker_refuses_a_descriptor_whose_token_differs() -> None:
    """What the token is for: a descriptor number that now names another
    file (the sender closed the segment and reused the number) is refused."""
    segment = Segment.create(64)
    try:
        Segment.attach(os.getpid(), segment.fd, 64, segment.token).close()
        forged = bytes(b ^ 0xFF for b in segment.token)
        with pytest.raises(ValueError, match="no longer names"):
            Segment.attach(os.getpid(), segment.fd, 64, forged)
    finally:
        segment.close()
