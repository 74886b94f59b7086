"""``torchrun ... -m weightsync bench --scheme distributed``: the
torch.distributed scheme on a real cluster, its ranks started by
``torchrun``: rank 0 is the trainer, every other rank a worker.

For each size, S bytes (a model of 8 float32 tensors) go from rank 0 to
every other rank three ways, each checked bit for bit after every send
(CRC32 of every tensor, gathered outside the timing):

- ``weightsync``: ``DistributedWeightSyncScheme.send()``, over torchrun's
  store (the scheme finds it in the environment), workers applying in the
  background (``sync=False``): the send returns once every worker acked;
- ``gloo bcast``: a ``broadcast`` of one flat buffer in the world group
  (``init_process_group("gloo")``), which each worker copies into its model;
- ``gloo star``: one ``send`` of the flat buffer to each worker in turn, as
  torchrl's ``DistributedWeightSyncScheme`` sends.

The gloo ways end with a barrier, so that each time covers every worker's
copy. Rank 0 prints the table: ms, and x the floor S/B when ``--link-rate``
gives B (the NIC's rate); otherwise the effective rate per worker.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
import zlib
from collections.abc import Sequence
from typing import Any

import torch

import weightsync as ws
from weightsync._transports._distributed import ChainStaging

from ._machine import describe_machine, machine_facts
from ._model import mlp_shapes

__all__ = ["under_torchrun", "torchrun_bench"]

MIB = 1 << 20
_TIMEOUT = 300.0


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started."""
    return all(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"))


def _checksums(tensors: dict[str, torch.Tensor]) -> list[int]:
    return [zlib.crc32(t.numpy().tobytes()) for t in tensors.values()]


def _case(mib: float, repeats: int, rank: int, world: int) -> dict[str, Any] | None:
    """One size: every way, ``repeats`` times after one untimed round.
    Returns the row on rank 0, None elsewhere.

    :raises SystemExit: a rank does not hold the trainer's weights.
    """
    import torch.distributed as dist

    shapes = mlp_shapes(int(mib * MIB), 8)
    if rank == 0:
        tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    else:
        tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    model_id = f"bench-{mib:g}"
    scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=_TIMEOUT)
    if rank == 0:
        scheme.init_on_sender(model_id, model=tensors)
    else:
        scheme.init_on_worker(model_id, model=tensors)
    row: dict[str, Any] = {"workers": world - 1, "mib": mib, "bytes": nbytes}

    def check(way: str, step: int) -> None:
        sums: list[Any] = [None] * world
        dist.all_gather_object(sums, _checksums(tensors))
        bad = [r for r in range(1, world) if sums[r] != sums[0]]
        if bad:
            raise SystemExit(f"{way}, step {step}: ranks {bad} do not hold the trainer's weights")

    def change(step: int) -> None:
        if rank == 0:
            first = next(iter(tensors.values()))
            first.view(-1)[step % first.numel()] += 1.0

    try:
        scheme.connect()
        times = []
        for step in range(-1, repeats):
            change(step)
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                scheme.send()
            dist.barrier()  # (the workers wait here: rank 0 returned once every worker acked)
            if step >= 0:
                times.append(time.perf_counter() - started)
            check("weightsync", step)
        row["weightsync"] = times
        staging = scheme.staging
        if isinstance(staging, ChainStaging):  # (rank 0)
            row["chain"] = list(staging.last_chains[-1]) if staging.last_chains else []
            row["fed"] = (
                {str(k): list(v) for k, v in staging.last_fed[-1].items()} if staging.last_fed else {}
            )
    finally:
        scheme.shutdown()

    flat = torch.empty(nbytes // 4)
    for way in ("bcast", "star"):
        times = []
        for step in range(-1, repeats):
            change(1000 + step)
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                torch.cat([t.view(-1) for t in tensors.values()], out=flat)
            if way == "bcast":
                dist.broadcast(flat, 0)
            elif rank == 0:
                for r in range(1, world):  # one worker after the other, as torchrl's scheme
                    dist.send(flat, r)
            else:
                dist.recv(flat, 0)
            if rank != 0:
                offset = 0
                for target in tensors.values():
                    target.view(-1).copy_(flat[offset : offset + target.numel()])
                    offset += target.numel()
            dist.barrier()
            if step >= 0:
                times.append(time.perf_counter() - started)
            check(f"gloo {way}", step)
        row[f"gloo_{way}"] = times
    return row if rank == 0 else None


def format_torchrun_table(rows: Sequence[dict[str, Any]], bytes_per_second: float | None) -> str:
    """Median ms of each way, and x the floor S/B (or GB/s per worker without a link rate)."""
    unit = "x floor" if bytes_per_second else "GB/s"
    lines = [
        f"{'workers':>7} {'MiB':>6} {'floor ms':>9} {'weightsync ms':>14} {unit:>7} "
        f"{'gloo bcast':>11} {unit:>7} {'gloo star':>10} {unit:>7}"
    ]
    for row in rows:
        floor = row["bytes"] / bytes_per_second if bytes_per_second else None

        def cell(key: str, width: int, row: dict[str, Any] = row, floor: float | None = floor) -> str:
            med = statistics.median(row[key])
            ratio = f"{med / floor:.2f}x" if floor else f"{row['bytes'] / med / 1e9:.2f}"
            return f"{med * 1e3:>{width}.0f} {ratio:>7}"

        floor_ms = f"{floor * 1e3:>9.0f}" if floor else f"{'-':>9}"
        lines.append(
            f"{row['workers']:>7} {row['mib']:>6g} {floor_ms} {cell('weightsync', 14)} "
            f"{cell('gloo_bcast', 11)} {cell('gloo_star', 10)}"
        )
    return "\n".join(lines)


def torchrun_bench(
    sizes_mib: Sequence[float], repeats: int, bytes_per_second: float | None, json_path: str | None
) -> int:
    """Run every size on this rank; rank 0 prints the table (and writes
    ``json_path``). Every rank of the job must call it with the same arguments."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise SystemExit("weightsync bench under torchrun needs at least 2 ranks (a trainer and a worker)")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=_TIMEOUT))
    try:
        if rank == 0:
            print(describe_machine(machine_facts()) + " (rank 0's host)", flush=True)
            print(
                f"DistributedWeightSyncScheme under torchrun: rank 0 to {world - 1} workers; median of "
                f"{repeats} sends, each verified on every rank; gloo star = one gloo send per worker in turn "
                "(torchrl's DistributedWeightSyncScheme)",
                flush=True,
            )
            print(format_torchrun_table([], bytes_per_second), flush=True)
        rows = []
        for mib in sizes_mib:
            row = _case(mib, repeats, rank, world)
            if row is not None:
                rows.append(row)
                print(format_torchrun_table([row], bytes_per_second).splitlines()[-1], flush=True)
        if rank == 0:
            print("\nall cases:\n" + format_torchrun_table(rows, bytes_per_second), flush=True)
            if json_path:
                with open(json_path, "w") as handle:
                    json.dump({"rows": rows, "bytes_per_second": bytes_per_second}, handle, indent=1)
    finally:
        dist.destroy_process_group()
    return 0
