"""Check an installed weightsync (a wheel, not the source tree).

Run from outside the repository, in a venv where only the wheel (and torch)
is installed:  python /path/to/scripts/wheel_smoke.py

It imports every public name, then runs one send through a real scheme: two
spawned worker processes over pipes, each checked bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import pathlib
import sys
from multiprocessing.connection import Connection

import torch
from torch import nn

import weightsync as ws


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


def worker(scheme: ws.MultiProcessWeightSyncScheme, pipe: Connection, out: Connection) -> None:
    policy = make_policy()
    scheme.init_on_worker("policy", pipe=pipe, model=policy)
    try:
        version = scheme.receive(timeout=60.0)
        # numpy arrays, not tensors: torch would pass tensors by shared memory.
        out.send((version, {k: v.numpy().copy() for k, v in policy.state_dict().items()}))
    finally:
        scheme.shutdown()


def main() -> None:
    here = pathlib.Path(ws.__file__).resolve()
    source_tree = pathlib.Path(__file__).resolve().parents[1]
    if source_tree / "weightsync" in here.parents:
        sys.exit(f"weightsync was imported from the source tree ({here}), not from an installed wheel")
    missing = [name for name in ws.__all__ if not hasattr(ws, name)]
    if missing:
        sys.exit(f"names in weightsync.__all__ that do not import: {missing}")

    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme()
    pipes, results, procs = [], [], []
    for _ in range(2):
        ours, theirs = ctx.Pipe()
        res_r, res_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=worker, args=(scheme, theirs, res_w))
        proc.start()
        theirs.close()
        res_w.close()
        pipes.append(ours)
        results.append(res_r)
        procs.append(proc)

    policy = make_policy()
    scheme.init_on_sender("policy", pipes=pipes, model=policy)
    try:
        report = scheme.get_sender().send(timeout=60.0)
        expected = policy.state_dict()
        for idx, res in enumerate(results):
            version, got = res.recv()
            if version != report.version:
                sys.exit(f"worker {idx} applied version {version}, the send was version {report.version}")
            for name, tensor in expected.items():
                if not torch.equal(torch.from_numpy(got[name]), tensor):
                    sys.exit(f"worker {idx}: {name} differs from the trainer's after the send")
    finally:
        scheme.shutdown()
        for proc in procs:
            proc.join(timeout=30)
    print(f"weightsync {ws.__version__} from {here.parent}: {len(ws.__all__)} public names, "
          f"one send to 2 workers applied and exact ({report})")


if __name__ == "__main__":
    main()
