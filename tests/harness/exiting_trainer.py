"""A trainer that ends without ``shutdown()``, for tests/test_exit.py.

``python -m harness.exiting_trainer MODE``, MODE one of:

- ``raise``: an exception escapes after a send;
- ``sigint``: it sends in a loop until SIGINT (sent by the test to this
  process alone) interrupts it;
- ``pending``: a ``send_async()`` is still gathering acks (its worker
  sleeps before its next ``receive()``) when an exception escapes;
- ``async``: an asyncio trainer awaits ``get_async_sender().send()`` and
  returns from ``asyncio.run`` without closing its sender;
- ``dropped``: a function makes the scheme, sends, and returns: nothing
  refers to the scheme any more when the interpreter exits (its channels
  may still be held by a reference cycle).

Two collector processes run the quickstart's ``receive()`` loop and end on
``SenderClosedError``. Once the trainer is where it ends, it prints
``ending <worker pids>``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time

import torch
from torch import nn

import weightsync as ws


def make_policy() -> nn.Module:
    return nn.Linear(8, 2)


def collector(scheme: ws.MultiProcessWeightSyncScheme, pipe: object, nap: float) -> None:
    policy = make_policy()
    scheme.init_on_worker("policy", pipe=pipe, model=policy)
    try:
        while True:
            if scheme.receive(timeout=0.1) is not None and nap:
                time.sleep(nap)  # (busy elsewhere: the next update waits)
    except ws.SenderClosedError:
        pass
    finally:
        scheme.shutdown()


def _ending(procs: list[mp.process.BaseProcess]) -> None:
    print("ending", *[p.pid for p in procs], flush=True)


def main(mode: str) -> None:
    ctx = mp.get_context("spawn")
    scheme = ws.MultiProcessWeightSyncScheme(timeout=60)
    pipes, procs = [], []
    for _ in range(2):
        ours, theirs = ctx.Pipe()
        nap = 1.0 if mode == "pending" else 0.0
        procs.append(ctx.Process(target=collector, args=(scheme, theirs, nap)))
        procs[-1].start()
        pipes.append(ours)
    policy = make_policy()
    scheme.init_on_sender("policy", pipes=pipes, model=policy)
    if mode == "dropped":

        def train(scheme: ws.MultiProcessWeightSyncScheme) -> None:
            scheme.get_sender().send()

        train(scheme)
        del scheme, pipes, policy
        _ending(procs)
        return
    if mode == "async":

        async def train() -> None:
            sender = scheme.get_async_sender()
            await sender.send()
            _ending(procs)  # returns with the sender open

        asyncio.run(train())
        return
    sender = scheme.get_sender()
    sender.send()
    if mode == "raise":
        _ending(procs)
        raise RuntimeError("the trainer failed")
    if mode == "pending":
        with torch.no_grad():
            policy.weight.add_(1)
        sender.send_async()  # its workers nap before they take it
        _ending(procs)
        raise RuntimeError("the trainer failed with a send under way")
    if mode == "sigint":
        _ending(procs)
        while True:
            sender.send()
            time.sleep(0.01)
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1])
