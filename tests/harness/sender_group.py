"""A sender group on one host, for tests/test_sender_group.py: two trainer
ranks of an FSDP2 model (``fully_shard`` on gloo, uneven shards), each
sending its own part through ``DistributedWeightSyncScheme``, to worker
processes that hold whole copies of the model.

``python -m harness.sender_group OUT_DIR CASE [WORKERS]``, CASE one of:

- ``sends``: ``connect()``, then three sends, each after the trainer changed
  every parameter in place; rank r writes ``OUT_DIR/rank<r>.json`` (each
  send's report, as a dict), rank 0 writes ``OUT_DIR/full.pt`` (the
  model's ``full_tensor()`` state after the last send, computed outside
  the sends); each worker writes ``OUT_DIR/worker<rank>.pt`` (its model's
  state and the versions it applied, in order) once the trainer shut down.
- ``verify``: the same, with ``verify=True``.
- ``applier``: the same, the workers applying in the background
  (``sync=False``), each part's update taken as it comes.
- ``delta``: the same, with ``verify=True`` and ``delta="always"`` (each
  rank's part goes as a delta against the part the workers hold).
- ``bad_part``: as ``sends``, but rank 1 gives the second send a shard of
  another shape: every rank writes the error it raised; the third send
  goes on.
- ``mismatch``: worker 2's model has a tensor of another shape: each rank
  writes the error its ``connect()`` raised.
- ``rank_dies``: rank 1 dies (SIGKILL) after the first send; rank 0 writes
  the error its next send (deadline :data:`DIES_TIMEOUT`) raised and how
  long it took.
- ``tp``: the workers are two replicas of a tensor-parallel policy, each two
  processes (worker ranks 1-2 and 3-4) with a gloo group of their own, the
  first layer column-sharded and the second row-sharded
  (``parallelize_module``). Each calls ``receive()`` then the policy's
  forward (a collective of its group) in a loop, until it applied the last
  version; each writes its local shards, its place in the mesh and the
  version it ran each step.
- ``tp_rank_dies``: as ``rank_dies``, to the workers of ``tp``: rank 0's
  part of version 3 comes, rank 1's never does; each member ends when it
  hears the sender group is gone.
- ``tp_missing``: as ``tp``, but worker 4 holds back its first
  ``receive()`` for 3 s after version 2 came: its group applies version 2
  only once it is there, at the same step (the others' rounds wait).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import weightsync as ws

TIMEOUT = 20.0
#: The deadline of the send a rank dies in (``rank_dies``, ``tp_rank_dies``).
DIES_TIMEOUT = 6.0


def plain_mlp(wrong: bool = False, hidden: int = 5) -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes: the two ranks' shards are uneven (5 rows: 3 and 2; 3 rows: 2 and 1).
    return nn.Sequential(nn.Linear(7, hidden), nn.ReLU(), nn.Linear(hidden, 4 if wrong else 3))


#: The tensor-parallel cases' hidden size: even, as a row-sharded layer's
#: forward needs (FSDP2's shards of it are still uneven: 3 rows of the last
#: layer over 2 ranks).
TP_HIDDEN = 6
TP_LAST = 4  # connect() and three sends


def tp_worker_main(rank: int, port: int, out: str, group_port: int, case: str) -> None:
    """Worker ``rank`` (1..4): member ``(rank - 1) % 2`` of replica ``(rank - 1) // 2``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    index = (rank - 1) % 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{group_port}", rank=index, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = plain_mlp(hidden=TP_HIDDEN)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with torch.no_grad():
        # Warmed up first, as a policy is before it serves: a DTensor
        # forward's first call costs seconds of CPU here, and four workers
        # doing it at once on two cores have held their relays back past
        # the trainer's first chain (connect() then named them).
        model(torch.ones(2, 7))
    scheme = ws.DistributedWeightSyncScheme(timeout=TIMEOUT)
    steps: list[int] = []
    error = None
    refused = "not tried"
    version = 0
    try:
        scheme.init_on_worker(
            "policy", model=model, worker_idx=rank, store_info={"host": "127.0.0.1", "port": port}
        )
        try:  # a background applier has no point shared by the members
            scheme.connect(background=True)
            refused = "connected"
        except ws.WeightSyncStateError as exc:
            refused = str(exc)
        held_back = False
        while version < TP_LAST:
            if case == "tp_missing" and rank == 4 and version == 1 and not held_back:
                time.sleep(3.0)  # (its group's others wait in their next round)
                held_back = True
            try:
                got = scheme.receive()  # (a poll: no wait for an update)
            except ws.SenderLostError as exc:
                error = (
                    f"lost: {type(exc).__name__}: {exc}" if case == "tp_rank_dies" else traceback.format_exc()
                )
                break
            version = got if got is not None else version
            with torch.no_grad():
                # A collective of the group, as a tensor-parallel forward is.
                float(model(torch.ones(2, 7)).sum())
            steps.append(version)
            time.sleep(0.01)
    except Exception:
        error = traceback.format_exc()
    finally:
        scheme.shutdown()
    local = {name: t.to_local().detach().clone() for name, t in model.state_dict().items()}
    state = {"local": local, "index": index, "steps": steps, "error": error, "background": refused}
    torch.save(state, Path(out, f"worker{rank}.pt"))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_main(rank: int, port: int, out: str, wrong: bool, applier: bool = False) -> None:
    model = plain_mlp(wrong)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    scheme = ws.DistributedWeightSyncScheme(timeout=TIMEOUT, sync=not applier)
    versions: list[int] = []
    error = None
    try:
        scheme.init_on_worker(
            "policy", model=model, worker_idx=rank, store_info={"host": "127.0.0.1", "port": port}
        )
        if applier:
            scheme.connect()  # (the background applier: each version applied as it comes)
            versions.append(scheme.get_receiver().version)
        while True:
            try:
                version = scheme.receive(timeout=0.2)
            except ws.SenderLostError:
                break
            if version is not None:
                versions.append(version)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        scheme.shutdown()
    state = {"state": model.state_dict(), "versions": versions, "error": error}
    torch.save(state, Path(out, f"worker{rank}.pt"))


def _report(report: Any) -> dict[str, Any]:
    return {
        "version": report.version,
        "worker_ids": list(report.worker_ids),
        "nbytes": report.nbytes,
        # (One route per session that sent: each rank's own, or, on one
        # host, rank 0's alone, from the buffer every rank wrote.)
        "routes": len(report.chain.routes) if report.chain is not None else 0,
    }


def rank_main(rank: int, world: int, init: str, out: str, case: str, port: int, workers: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        init_device_mesh("cpu", (world,))
        model = plain_mlp(hidden=TP_HIDDEN if case.startswith("tp") else 5)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        dies = case.endswith("rank_dies")
        delta = "always" if case == "delta" else False  # (a delta whenever the workers hold a base)
        scheme = ws.DistributedWeightSyncScheme(
            timeout=TIMEOUT, verify=case in ("verify", "delta"), delta=delta
        )
        scheme.init_on_sender("policy", model=model, num_workers=workers, host="127.0.0.1", port=port)
        try:
            reports = []
            try:
                reports.append(_report(scheme.connect()))
            except ws.WeightSyncError as exc:
                results["error"] = [type(exc).__name__, str(exc)]
                return
            steps = 3 if not dies else 1
            sender = scheme.get_sender()  # (the rank's collective sender)
            for step in range(steps):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.5 * (step + 1))
                if case == "async":
                    # Staged at send_async(): what the weights become after
                    # it is not what the workers get.
                    sender.send_async()
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(100.0)
                    reports.append(_report(sender.wait_async()))
                    with torch.no_grad():
                        for p in model.parameters():
                            p.sub_(100.0)
                elif case == "bad_part" and step == 1:
                    # Rank 1's shard of one weight is of another shape: every
                    # rank raises, and no worker is told of this version.
                    weights = dict(model.state_dict())
                    if rank == 1:
                        weights["0.weight"] = torch.zeros(2, 2)
                    try:
                        scheme.send(weights)
                        results["error"] = ["none", ""]
                    except ws.WeightSyncError as exc:
                        results["error"] = [type(exc).__name__, str(exc)]
                else:
                    reports.append(_report(scheme.send()))
            results["reports"] = reports
            results["store_info"] = scheme.get_store_info()  # (a pickled scheme takes it to the workers)
            results["delta"] = scheme.last_delta
            results["get_sender"] = type(sender).__name__
            try:  # connect() waits for the workers, collectively
                scheme.wait_for_workers()
                results["wait_for_workers"] = "returned"
            except ws.WeightSyncStateError as exc:
                results["wait_for_workers"] = str(exc)
            if dies:
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                started = time.monotonic()
                try:
                    # (A short deadline of its own: the sends before had the
                    # scheme's, as the workers were still starting.)
                    scheme.send(timeout=DIES_TIMEOUT)
                    results["error"] = ["none", ""]
                except ws.WeightSyncError as exc:
                    results["error"] = [type(exc).__name__, str(exc)]
                results["seconds"] = time.monotonic() - started
                return
            full = {name: t.full_tensor() for name, t in model.state_dict().items()}
            if rank == 0:
                torch.save(full, Path(out, "full.pt"))
        finally:
            scheme.shutdown()
    except Exception:
        results["crash"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        if not dies:
            dist.destroy_process_group()


def main() -> None:
    out, case = sys.argv[1], sys.argv[2]
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    port = _free_port()
    ctx = mp.get_context("spawn")
    if case.startswith("tp"):
        workers = 4
        group_ports = [_free_port(), _free_port()]
        procs = [
            ctx.Process(target=tp_worker_main, args=(rank, port, out, group_ports[(rank - 1) // 2], case))
            for rank in range(1, workers + 1)
        ]
    else:
        procs = [
            ctx.Process(
                target=worker_main,
                args=(rank, port, out, case == "mismatch" and rank == 2, case == "applier"),
            )
            for rank in range(1, workers + 1)
        ]
    for proc in procs:
        proc.start()
    init = f"file://{os.path.join(out, 'rendezvous')}"
    trainers = [
        ctx.Process(target=rank_main, args=(rank, 2, init, out, case, port, workers)) for rank in range(2)
    ]
    for proc in trainers:
        proc.start()
    for proc in trainers:
        proc.join(120)
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    for proc in trainers:
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
