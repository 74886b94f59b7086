"""Sync collector processes polling receive() in their loop, and a sync trainer.

Run:  python examples/sync_collectors.py --workers 2 --steps 20

The trainer overlaps each send with its next training step: send_async()
returns once the weights are staged, the trainer computes and steps its
optimizer, wait_async() collects the acks.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from multiprocessing.connection import Connection

import torch
from torch import nn

import weightsync as ws


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))


def collector(scheme: ws.MultiProcessWeightSyncScheme, pipe: Connection, done: Connection, idx: int) -> None:
    policy = make_policy()
    scheme.init_on_worker("policy", pipe=pipe, model=policy)
    frames = 0
    latest = 0
    try:
        while not done.poll():
            with torch.no_grad():
                policy(torch.randn(32, 16))  # collect a batch with the current weights
            frames += 32
            version = scheme.receive()  # does not wait: applies an update if one is pending
            if version:
                latest = version
        scheme.receive(timeout=1.0)  # pick up the trainer's last send, if it is still pending
    except ws.SenderClosedError:
        pass  # the trainer shut down cleanly; a dead trainer's SenderLostError goes on
    finally:
        scheme.shutdown()
    print(f"collector {idx}: {frames} frames, last version {latest}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme()
    pipes, stops, procs = [], [], []
    for idx in range(args.workers):
        ours, theirs = ctx.Pipe()
        stop_w, stop_r = ctx.Pipe()
        proc = ctx.Process(target=collector, args=(scheme, theirs, stop_r, idx))
        proc.start()
        theirs.close()
        pipes.append(ours)
        stops.append(stop_w)
        procs.append(proc)

    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-2)
    scheme.init_on_sender("policy", pipes=pipes, model=policy)
    sender = scheme.get_sender()
    try:
        sender.connect(timeout=60)
        sender.send()  # every collector starts from the trainer's weights
        for step in range(args.steps):
            # send_async() returns once the weights are staged: the next
            # training step may change them at once, while the collectors
            # copy and ack; each gets the weights as they were at the call.
            sender.send_async()
            loss = policy(torch.randn(64, 16)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report = sender.wait_async()
            if step % 5 == 0:
                print(f"step {step}: version {report.version} acked by {report.worker_ids}", flush=True)
        final = sender.send()
        print(f"final version {final.version}", flush=True)
    finally:
        for stop in stops:
            stop.send(True)
        for proc in procs:
            proc.join(30)
        scheme.shutdown()
    print("done", flush=True)


if __name__ == "__main__":
    main()
