"""An asyncio trainer that awaits weight sends to several worker processes.

Run:  python examples/async_trainer.py --workers 2 --steps 20

Each worker runs a policy in its own process and picks up new weights at its
safe point (between two rollouts); the trainer trains, then awaits a send that
returns once every worker has applied the new version.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from multiprocessing.connection import Connection

import anyio
import torch
from torch import nn

import weightsync as ws


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def worker(scheme: ws.MultiProcessWeightSyncScheme, pipe: Connection, idx: int) -> None:
    policy = make_policy()
    scheme.init_on_worker("policy", pipe=pipe, model=policy)
    versions = 0
    try:
        while True:
            with torch.no_grad():
                policy(torch.randn(32, 16))  # a "rollout" with the current weights
            try:
                if scheme.receive(timeout=0.05):
                    versions += 1
            except ws.SenderClosedError:
                break  # the trainer finished and shut down its side (a dead one raises SenderLostError)
    finally:
        scheme.shutdown()
    print(f"worker {idx}: applied {versions} updates", flush=True)


async def train(scheme: ws.MultiProcessWeightSyncScheme, policy: nn.Module, steps: int) -> None:
    # Leaving the block closes the sender's side (aclose()): every worker's
    # next receive() raises SenderClosedError, and the workers exit.
    async with scheme.get_async_sender() as sender:
        # The workers are starting (each imports torch): wait for them here,
        # so that the first send is not taken up by their start.
        started = await sender.wait_for_workers(timeout=120)
        print(f"{len(started)} workers ready after {max(started.values()):.1f} s", flush=True)
        optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
        for step in range(steps):
            loss = policy(torch.randn(64, 16)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report = await sender.send()  # returns when every worker applied it
            if step % 5 == 0:
                print(
                    f"step {step}: version {report.version} on workers {report.worker_ids} "
                    f"in {report.seconds * 1e3:.2f} ms",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme()
    pipes, procs = [], []
    for idx in range(args.workers):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(scheme, theirs, idx))
        proc.start()
        theirs.close()
        pipes.append(ours)
        procs.append(proc)

    policy = make_policy()
    scheme.init_on_sender("policy", pipes=pipes, model=policy)
    try:
        anyio.run(train, scheme, policy, args.steps)
    finally:
        # Nothing left to close after train() returned; this covers a
        # train() that failed before its async with block.
        scheme.shutdown()
        for proc in procs:
            proc.join(30)
    print("done", flush=True)


if __name__ == "__main__":
    main()
