"""Collectors that stamp each batch with the policy version that produced it.

Run:  python examples/versioned_batches.py --workers 2 --steps 20

Each collector calls connect() once and never receive(): weightsync applies
updates in the background, between two forward calls of the policy. Reading
the version inside ``receiver.step()``, together with the forward calls of
the batch, ties the stamp to the weights that produced it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
from multiprocessing.connection import Connection

import torch
from torch import nn

import weightsync as ws

BATCH_STEPS = 8


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def collector(scheme: ws.MultiProcessWeightSyncScheme, pipe: Connection, batches: mp.Queue, idx: int) -> None:
    policy = make_policy()
    scheme.init_on_worker("policy", pipe=pipe, model=policy)
    receiver = scheme.get_receiver()
    try:
        scheme.connect()  # the trainer's initial weights; then updates arrive in the background
        while True:
            with receiver.step():  # no update lands until the batch is done
                with torch.no_grad():
                    for _ in range(BATCH_STEPS):
                        policy(torch.randn(32, 16))
                version = receiver.version
            batches.put((idx, version))
            receiver.wait_for_version(version + 1, timeout=60)  # one batch per version, for the demo
    except ws.SenderLostError:
        pass  # the trainer shut down (cleanly or not): stop collecting
    finally:
        scheme.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme()
    batches: mp.Queue = ctx.Queue()
    pipes, procs = [], []
    for idx in range(args.workers):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=collector, args=(scheme, theirs, batches, idx))
        proc.start()
        theirs.close()
        pipes.append(ours)
        procs.append(proc)

    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    scheme.init_on_sender("policy", pipes=pipes, model=policy)
    sent = [scheme.connect().version]
    try:
        for _ in range(args.steps):
            loss = policy(torch.randn(64, 16)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sent.append(scheme.send().version)
            while True:
                try:
                    idx, version = batches.get(timeout=0.05)
                except queue.Empty:
                    break
                print(f"collector {idx}: batch of version {version}", flush=True)
        print(f"sent versions {sent}", flush=True)
    finally:
        scheme.shutdown()
        for proc in procs:
            proc.join(30)
    print("done", flush=True)


if __name__ == "__main__":
    main()
