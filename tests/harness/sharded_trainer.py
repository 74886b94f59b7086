"""Two trainer ranks of a sharded model (FSDP2's ``fully_shard`` on gloo,
uneven shards), each handing it to every scheme, for tests/test_sharded.py.

``python -m harness.sharded_trainer OUT_DIR``: rank r writes
``OUT_DIR/rank<r>.json``, {case: ["ok"] or [error class, message]}. A
crash of a rank (the SIGSEGV of a shard read as a whole tensor) leaves no
file and a non-zero exit status.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import weightsync as ws


def sharded_mlp() -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes: the two ranks' shards are uneven (5 rows: 3 and 2).
    model = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cases(model: nn.Module) -> dict[str, Callable[[], Any]]:
    """Each scheme given the sharded model, as a trainer or a worker would."""
    plain = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))

    def pipe_scheme(cls: type[ws.WeightSyncScheme]) -> Callable[[], Any]:
        def run() -> Any:
            ours, theirs = mp.Pipe()  # (refused before the pipe is used)
            scheme = cls()
            try:
                scheme.init_on_sender("policy", pipes=[ours], model=model)
                return scheme.send(timeout=2)
            finally:
                scheme.shutdown()
                ours.close()
                theirs.close()

        return run

    def in_process() -> Any:
        scheme = ws.InProcessWeightSyncScheme(timeout=2)
        try:
            scheme.init_on_sender("policy", model=model, num_workers=1)
            return scheme.send()
        finally:
            scheme.shutdown()

    def weights_at_send() -> Any:
        # A plain model at init; the sharded weights at the send.
        scheme = ws.InProcessWeightSyncScheme(timeout=2)
        try:
            scheme.init_on_sender("policy", model=plain, num_workers=1)
            return scheme.send(model.state_dict())
        finally:
            scheme.shutdown()

    def worker() -> Any:
        scheme = ws.InProcessWeightSyncScheme(timeout=2)
        scheme.init_on_worker("policy", model=model, worker_idx=0)

    def distributed() -> Any:
        scheme = ws.DistributedWeightSyncScheme(timeout=2)
        try:
            scheme.init_on_sender("policy", model=model, num_workers=1, host="127.0.0.1", port=_free_port())
            return scheme.send()
        finally:
            scheme.shutdown()

    def ray() -> Any:
        scheme = ws.RayWeightSyncScheme(timeout=2)
        try:  # (refused before any actor would be reached)
            scheme.init_on_sender("policy", model=model, remote_collectors=[])
        finally:
            scheme.shutdown()

    def none() -> Any:
        scheme = ws.NoWeightSyncScheme()
        scheme.init_on_sender("policy", model=model)
        scheme.send()
        scheme.shutdown()

    return {
        "multiprocess": pipe_scheme(ws.MultiProcessWeightSyncScheme),
        "shared": pipe_scheme(ws.SharedMemWeightSyncScheme),
        "inprocess": in_process,
        "weights at send()": weights_at_send,
        "a sharded worker": worker,
        "distributed": distributed,
        "ray": ray,
        "none": none,
    }


def layout_mismatches(model: nn.Module, rank: int) -> list[str]:
    """Where weightsync's reading of a DTensor's layout (its box of the
    global tensor, from the mesh and placements alone) differs from the
    shard torch holds on this rank: FSDP2's parameters, and a tensor
    sharded along its columns (uneven)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from weightsync._plan import layout_of

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    tensors = dict(model.state_dict())
    tensors["columns"] = distribute_tensor(torch.randn(4, 5), mesh, [Shard(1)])
    wrong = []
    for name, tensor in tensors.items():
        box = layout_of(tensor).box(rank)
        whole = tensor.full_tensor()  # (the test's reference, outside weightsync)
        piece = whole[tuple(slice(lo, hi) for lo, hi in box)]
        if not torch.equal(piece, tensor.to_local()):
            wrong.append(f"{name}: box {box}, local shape {tuple(tensor.to_local().shape)}")
    return wrong


def rank_main(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        init_device_mesh("cpu", (world,))
        model = sharded_mlp()
        results: dict[str, list[str]] = {"layouts": layout_mismatches(model, rank)}
        for name, case in cases(model).items():
            try:
                case()
                results[name] = ["ok"]
            except Exception as exc:
                results[name] = [type(exc).__name__, str(exc)]
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    init = f"file://{os.path.join(out, 'rendezvous')}"
    torch.multiprocessing.spawn(rank_main, args=(2, init, out), nprocs=2)
