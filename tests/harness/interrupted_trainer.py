"""A trainer that the test interrupts with SIGINT (a terminal's Ctrl-C) while
it sends. Run as a script:
``python -m harness.interrupted_trainer SCHEME[,SCHEME...] ROUNDS MIB``
(:mod:`.programs`).

For each scheme in turn, with its own workers: each round it sends back to
back until a SIGINT stops it, catches the KeyboardInterrupt, sends new
weights once and checks that every worker holds exactly them; then it shuts
the scheme down ("next"). After the last scheme's rounds it sends until the
final SIGINT, which it lets propagate through ``finally: scheme.shutdown()``,
then reports what is left in the process (threads, descriptors, mappings,
children) on stdout and exits with status 3.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

import torch

import weightsync as ws

from .checksums import weight_checksums

WORKERS = 3
SCHEMES = {"multiprocess": ws.MultiProcessWeightSyncScheme, "shared": ws.SharedMemWeightSyncScheme}


def make_weights(mib: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    numel = (mib << 20) // 4 // 4
    return {f"w{i}": torch.randn(numel, generator=generator) for i in range(4)}


def worker(scheme: ws.WeightSyncScheme, pipe: Connection, ctrl: Connection, mib: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the trainer is interrupted
    weights = make_weights(mib, seed=999)
    scheme.init_on_worker("policy", pipe=pipe, model=weights)
    try:
        while True:
            scheme.receive(timeout=0.01)
            if ctrl.poll():
                if ctrl.recv() == "stop":
                    return
                ctrl.send(weight_checksums(weights))
    except ws.SenderLostError:
        return
    finally:
        scheme.shutdown()


def leftovers() -> dict[str, object]:
    with open("/proc/self/maps") as maps:
        mapped = [line.strip() for line in maps if "memfd:weightsync" in line]
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "weightsync" in target:
            fds.append(target)
    threads = [t.name for t in threading.enumerate() if t.name.startswith(("weightsync", "AnyIO"))]
    return {
        "mapped": mapped,
        "fds": fds,
        "threads": threads,
        "children": [p.pid for p in mp.active_children()],
    }


def main(scheme_names: list[str], rounds: int, mib: int) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "weightsync"])
    for i, name in enumerate(scheme_names):
        run_scheme(ctx, name, rounds, mib, final=i == len(scheme_names) - 1)


def run_scheme(ctx: mp.context.BaseContext, scheme_name: str, rounds: int, mib: int, *, final: bool) -> None:
    scheme = SCHEMES[scheme_name](timeout=30)
    weights = make_weights(mib, seed=0)
    pipes, ctrls, procs = [], [], []
    for _ in range(WORKERS):
        ours, theirs = ctx.Pipe()
        ctrl, ctrl_child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(scheme, theirs, ctrl_child, mib), daemon=True)
        proc.start()
        theirs.close()
        ctrl_child.close()
        pipes.append(ours)
        ctrls.append(ctrl)
        procs.append(proc)
    scheme.init_on_sender("policy", pipes=pipes, model=weights)
    try:
        scheme.send()
        print("ready", flush=True)
        for r in range(rounds):
            try:
                print(f"sending {r}", flush=True)
                while True:
                    scheme.send()
            except KeyboardInterrupt:
                pass
            # New weights, one clean send: every worker must hold exactly them.
            fresh = make_weights(mib, seed=1000 + r)
            for name, tensor in weights.items():
                tensor.copy_(fresh[name])
            scheme.send()
            expected = weight_checksums(weights)
            for i, ctrl in enumerate(ctrls):
                ctrl.send("crc")
                got = ctrl.recv() if ctrl.poll(30) else {}
                if got != expected:
                    wrong = sorted(k for k in expected if got.get(k) != expected[k])
                    print(f"worker {i} does not hold the weights sent after round {r}: {wrong}", flush=True)
                    sys.exit(4)
            print(f"verified {r}", flush=True)
        if not final:
            print("next", flush=True)
            return
        print("sending final", flush=True)
        while True:
            scheme.send()
    finally:
        scheme.shutdown()
        for ctrl in ctrls:
            with contextlib.suppress(OSError):  # a worker that saw the shutdown has gone already
                ctrl.send("stop")
        for proc in procs:
            proc.join(30)
        for conn in pipes + ctrls:
            conn.close()


if __name__ == "__main__":
    try:
        main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]))
    except KeyboardInterrupt:
        print("left " + json.dumps(leftovers()), flush=True)
        sys.exit(3)
