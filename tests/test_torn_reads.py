"""No torn reads: between two receive() calls a worker's weights all belong
to one version, while the trainer sends as fast as it can.

Covers every scheme whose workers are processes of the test's own: the
two pipe-based schemes and DistributedWeightSyncScheme (its workers on one
host: the host leader receives along the chain, the other copies from its
shared memory). The Ray scheme's actors are probed in test_ray.py; the
in-process scheme shares the multiprocess scheme's staging and receiver.
Each runs at two paces:

- ``acked``: every send waits for every ack, so the trainer never rewrites
  its staging while a worker reads it.
- ``overlapping``: the probes wait for each update and apply it as soon as it
  is announced, while most sends get a deadline of a millisecond (their
  ``AckTimeoutError`` is caught) and the next one is written at once, from
  weights filled beforehand. Under the multiprocess scheme that overwrites
  the one staging segment during the workers' copies: only the receiver's
  check of the segment's version around its copy keeps the mix out of the
  model (with that check removed, this run sees mixed reads). Under the
  shared scheme it checks that a slot a worker was told about and has not
  answered for is never rewritten, even once its send timed out.

The same probe shows torn reads with the legacy updater (test_legacy.py).
"""

from __future__ import annotations

import time

import pytest
import torch
from harness import make_scheme, reap, schemes, spec, start_pipe_worker, start_worker, torn_read_probe
from tensordict import TensorDict

import weightsync as ws

SHAPES = {f"w{i}": 4 * 1024 * 1024 for i in range(4)}  # 4 x 16 MiB of float32
SEND_SECONDS = {"acked": 2.0, "overlapping": 1.5}
# Overlapping pace: this many sends with a deadline of TINY_DEADLINE seconds,
# then one that waits for every ack (so every worker ends some copies whole,
# and the trainer reads the acks that free the shared scheme's slots).
TINY_DEADLINE = 0.001
OVERLAPPED_IN_A_ROW = 3
# The weights the overlapping sends cycle through (every element of one is
# one value, none of them a version number): nothing to fill between two.
ROTATION = (-1, -2, -3)


@pytest.mark.parametrize("pace", ["acked", "overlapping"])
@pytest.mark.parametrize("scheme_name", schemes(processes=True, actors=False, extended=("shared",)))
def test_workers_never_see_a_mix_of_versions(scheme_name: str, pace: str) -> None:
    scheme = make_scheme(scheme_name)
    trainer = TensorDict({name: torch.zeros(numel) for name, numel in SHAPES.items()}, batch_size=[])
    rotation = []
    if pace == "overlapping":
        for value in ROTATION:
            weights = trainer.clone()
            torn_read_probe.fill(weights, value)
            rotation.append(weights)
    receive_timeout = 0.05 if pace == "overlapping" else 0.0
    conns, pipes, procs = [], [], []
    sends = timed_out = 0
    by_rank = not spec(scheme_name).pipes
    try:
        if by_rank:  # its workers join by rank, through the trainer's store
            scheme.init_on_sender("policy", num_workers=2, model=trainer, host="127.0.0.1")
        for rank in (1, 2):
            if by_rank:
                proc, ctrl = start_worker(
                    torn_read_probe.scheme_probe,
                    lambda ctrl: (scheme, "policy", None, ctrl, SHAPES, 60.0, receive_timeout),
                    worker_idx=rank,
                )
            else:
                proc, ours, ctrl = start_pipe_worker(
                    torn_read_probe.scheme_probe,
                    lambda pipe, ctrl: (scheme, "policy", pipe, ctrl, SHAPES, 60.0, receive_timeout),
                )
                pipes.append(ours)
            conns.append(ctrl)
            procs.append(proc)
        if not by_rank:
            scheme.init_on_sender("policy", pipes=pipes, model=trainer)
        torn_read_probe.start(conns)
        deadline = time.monotonic() + SEND_SECONDS[pace]
        while time.monotonic() < deadline:
            sends += 1
            if pace == "overlapping" and sends % (OVERLAPPED_IN_A_ROW + 1) != 0:
                try:
                    scheme.send(rotation[sends % len(rotation)], timeout=TINY_DEADLINE)
                except ws.AckTimeoutError:
                    timed_out += 1
                continue
            torn_read_probe.fill(trainer, sends)
            scheme.send(timeout=30)
        if pace == "overlapping":
            # A worker whose copy was overwritten waits for a newer version:
            # the last one reaches every worker whole.
            sends += 1
            torn_read_probe.fill(trainer, sends)
            scheme.send(timeout=30)
        reports = torn_read_probe.stop(conns)
    finally:
        reap(procs)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    for report in reports:
        print(
            f"{scheme_name} {pace} probe {report.pid}: {report.reads} reads, {report.consistent} consistent, "
            f"{report.mixed} mixed, {len(report.versions)} values seen whole; {sends} sends, "
            f"{timed_out} timed out"
        )
        assert report.mixed == 0, f"{report.mixed} of {report.reads} reads saw two versions mixed"
        assert report.reads > 0
        assert len(report.versions) > 1  # updates landed while it read
    if pace == "overlapping":
        # Many sends ended before their workers had applied them: 3 in 4 get
        # a 1 ms deadline. The shared scheme's workers copy nothing: on 2
        # cores the posts wake them before the trainer looks for acks, and
        # they make half to three quarters of those deadlines (a sixth to a
        # half of all sends time out); the copying schemes' workers make
        # about a quarter.
        least = sends // 6 if scheme_name == "shared" else sends // 3
        assert timed_out >= least, (timed_out, sends)
