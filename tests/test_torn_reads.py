"""No torn reads: between two receive() calls a worker's weights all belong
to one version, while the trainer sends as fast as it can (every scheme).

The same probe shows torn reads with the legacy updater (test_legacy.py).
"""

from __future__ import annotations

import time

import _probe
import pytest
import torch
from conftest import PIPE_SCHEMES, PROCS, SCHEMES, reap
from tensordict import TensorDict

SHAPES = {f"w{i}": 4 * 1024 * 1024 for i in range(4)}  # 4 x 16 MiB of float32
SEND_SECONDS = 2.0


@pytest.mark.parametrize("scheme_name", PIPE_SCHEMES)
def test_workers_never_see_a_mix_of_versions(scheme_name: str) -> None:
    scheme = SCHEMES[scheme_name]()
    trainer = TensorDict({name: torch.zeros(numel) for name, numel in SHAPES.items()}, batch_size=[])
    conns, pipes, procs = [], [], []
    try:
        for _ in range(2):
            ours, theirs = PROCS.Pipe()
            ctrl, ctrl_child = PROCS.Pipe()
            proc = PROCS.Process(
                target=_probe.scheme_probe,
                args=(scheme, "policy", theirs, ctrl_child, SHAPES, 60.0),
                daemon=True,
            )
            proc.start()
            theirs.close()
            ctrl_child.close()
            pipes.append(ours)
            conns.append(ctrl)
            procs.append(proc)
        scheme.init_on_sender("policy", pipes=pipes, model=trainer)
        _probe.start(conns)
        sends = 0
        deadline = time.monotonic() + SEND_SECONDS
        while time.monotonic() < deadline:
            sends += 1
            _probe.fill(trainer, sends)
            scheme.send(timeout=30)
        reports = _probe.stop(conns)
    finally:
        reap(procs)
        scheme.shutdown()
        for conn in conns + pipes:
            conn.close()
    for report in reports:
        print(
            f"{scheme_name} probe {report.pid}: {report.reads} reads, {report.consistent} consistent, "
            f"{report.mixed} mixed, {len(report.versions)} versions seen whole; {sends} sends"
        )
        assert report.mixed == 0
        assert report.reads > 0
        assert len(report.versions) > 1  # updates landed while it read
