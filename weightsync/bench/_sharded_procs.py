"""The processes of ``weightsync bench --sharded-trainer`` (see
``_sharded_hosts``): ``python -m weightsync.bench._sharded_procs rank ...``
(a trainer rank) and ``... worker ...`` (a whole-copy worker), each on its
emulated host; ``... run ...`` runs the whole case from the command line."""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import weightsync as ws

from ._dist_hosts import control_store, wait_keys
from ._model import mlp_shapes, tensor_crc
from ._sharded_hosts import MIB, TIMEOUT, format_sharded_table, run_sharded

__all__ = ["rank_main", "worker_main"]


class _Model(nn.Module):
    """The bench's model: 8 float32 tensors of about ``mib`` MiB in all."""

    def __init__(self, mib: float) -> None:
        super().__init__()
        for i, shape in enumerate(mlp_shapes(int(mib * MIB), 8).values()):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape), requires_grad=False))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- a worker ------------------------------------------------------------------


def worker_main(host: str, ports: list[int], rank: int, mib: float) -> None:
    """Worker ``rank``: a whole copy under each scheme, applied as updates
    arrive; answers rank 0's checks."""
    sharded_port, gathered_port, ctrl_port = ports
    models = {"sharded": _Model(mib), "gathered": _Model(mib)}
    schemes = {}
    for name, port in (("sharded", sharded_port), ("gathered", gathered_port)):
        scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=TIMEOUT)
        scheme.init_on_worker(
            name, model=models[name], worker_idx=rank, store_info={"host": host, "port": port}
        )
        schemes[name] = scheme
    ctrl = control_store(host, ctrl_port, master=False)
    ctrl.set(f"up/{rank}", b"1")
    try:
        schemes["sharded"].connect()
        # The whole model's first version comes once the trainer's sharded
        # sends are done: meanwhile this thread answers the trainer's checks.
        threading.Thread(target=schemes["gathered"].connect, daemon=True).start()
        k = 0
        while True:
            key = f"cmd/{k + 1}"
            try:
                ctrl.wait([key], datetime.timedelta(seconds=1))
            except RuntimeError:  # its timeout: is the trainer still there?
                try:
                    schemes["gathered"].receive()
                except ws.SenderLostError:
                    return
                continue
            k += 1
            command, tag = json.loads(bytes(ctrl.get(key)))
            if command == "crc":
                # Each trainer rank's rows of each tensor, as it sent them.
                state = dict(models[tag["model"]].state_dict())
                sums = [
                    [tensor_crc(state[name][lo:hi]) for name, lo, hi in pieces] for pieces, _ in tag["ranks"]
                ]
                ctrl.set(f"crc/{tag['tag']}/{rank}", json.dumps(sums).encode())
            elif command == "quit":
                return
    finally:
        for scheme in schemes.values():
            scheme.shutdown()


# -- a trainer rank --------------------------------------------------------------


def rank_main(rank: int, world: int, init: str, host: str, mib: float, repeats: int, workers: int) -> None:
    """Trainer rank ``rank``: FSDP2 over the ``world`` ranks; rank 0 prints
    ``PORTS <sharded> <gathered> <control>``, then the row."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT),
    )  # fmt: skip
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        # Built on the meta device and sharded first, as FSDP2 trainers of
        # big models do: no rank ever holds the whole model.
        with torch.device("meta"):
            model = _Model(mib)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.normal_()
        scheme = ws.DistributedWeightSyncScheme(timeout=TIMEOUT)
        scheme.init_on_sender("sharded", model=model, num_workers=workers, host=host)
        gathered: ws.DistributedWeightSyncScheme | None = None
        ctrl: Any = None
        if rank == 0:
            whole = {name: torch.zeros(t.shape) for name, t in model.state_dict().items()}
            gathered = ws.DistributedWeightSyncScheme(timeout=TIMEOUT)
            gathered.init_on_sender("gathered", num_workers=workers, model=whole, host=host)
            ctrl = control_store(host, 0, master=True)
            info, other = scheme.get_store_info(), gathered.get_store_info()
            assert info is not None and other is not None
            print(f"PORTS {info['port']} {other['port']} {ctrl.port}", flush=True)
            wait_keys(ctrl, [f"up/{r}" for r in range(1, workers + 1)])
        dist.barrier()
        commands = 0

        # Each rank's pieces (its rows of each tensor): the workers check
        # them against this rank's own shards, so no rank ever gathers.
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, [t.to_local().shape[0] for t in model.state_dict().values()])
        pieces = []
        for i, name in enumerate(model.state_dict()):
            start = sum(rows[r][i] for r in range(rank))  # (Shard(0): the ranks' rows in order)
            pieces.append((name, start, start + rows[rank][i]))

        def check(model_name: str, tag: str) -> None:
            """Every worker holds each rank's shards, bit for bit (collective)."""
            nonlocal commands
            local = dict(model.state_dict())
            mine = [tensor_crc(local[name].to_local()) for name, _, _ in pieces]
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, [pieces, mine])
            if rank != 0:
                return
            commands += 1
            ctrl.set(
                f"cmd/{commands}",
                json.dumps(["crc", {"model": model_name, "tag": tag, "ranks": everyone}]).encode(),
            )
            keys = [f"crc/{tag}/{r}" for r in range(1, workers + 1)]
            got = [json.loads(v) for v in wait_keys(ctrl, keys)]
            want = [sums for _, sums in everyone]
            bad = [r for r, g in enumerate(got, 1) if g != want]
            if bad:
                raise SystemExit(f"{tag}: worker ranks {bad} do not hold the trainer's weights")

        def change(step: int) -> None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.25 * (step + 1))

        rss_start = _rss_mib()
        scheme.connect()
        check("sharded", "first")
        times = []
        for step in range(repeats):
            change(step)
            dist.barrier()
            started = time.perf_counter()
            scheme.send()
            times.append(time.perf_counter() - started)
            check("sharded", f"ws{step}")
        rss_sharded = _rss_mib()
        first = {name: t.full_tensor() for name, t in model.state_dict().items()}
        if gathered is not None:
            gathered.connect(weights=first)
        del first
        gather_times, send_times = [], []
        for step in range(-1, repeats):  # a first round untimed
            change(100 + step)
            dist.barrier()
            started = time.perf_counter()
            full = {name: t.full_tensor() for name, t in model.state_dict().items()}
            sent = time.perf_counter()
            if gathered is not None:
                gathered.send(full)
            sent = time.perf_counter() - sent
            dist.barrier()
            if step >= 0:
                gather_times.append(time.perf_counter() - started)
                send_times.append(sent)
            del full
            check("gathered", f"g{step}")
        rss: list[Any] = [None] * world
        dist.all_gather_object(rss, (rss_start, rss_sharded, _rss_mib()))
        nbytes = sum(t.numel() * 4 for t in model.state_dict().values())
        if rank == 0:
            commands += 1
            ctrl.set(f"cmd/{commands}", json.dumps(["quit", 0]).encode())
            row = {
                "ranks": world, "workers": workers, "mib": mib, "bytes": nbytes,
                "weightsync": times, "gather": gather_times, "single_send": send_times,
                "rss_start_mib": [r[0] for r in rss], "rss_after_sharded_mib": [r[1] for r in rss],
                "rss_end_mib": [r[2] for r in rss],
            }  # fmt: skip
            assert gathered is not None
            gathered.shutdown()
        scheme.shutdown()
        if rank == 0:
            print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m weightsync.bench._sharded_hosts")
    roles = parser.add_subparsers(dest="role", required=True)
    rank = roles.add_parser("rank")
    rank.add_argument("rank", type=int)
    rank.add_argument("world", type=int)
    rank.add_argument("init")
    rank.add_argument("host")
    rank.add_argument("mib", type=float)
    rank.add_argument("repeats", type=int)
    rank.add_argument("workers", type=int)
    worker = roles.add_parser("worker")
    worker.add_argument("host")
    worker.add_argument("ports", type=int, nargs=3)
    worker.add_argument("rank", type=int)
    worker.add_argument("mib", type=float)
    run = roles.add_parser("run", help="the whole case on an emulated cluster (root)")
    run.add_argument("--trainer-hosts", type=int, default=2)
    run.add_argument("--ranks-per-host", type=int, default=2)
    run.add_argument("--hosts", type=int, default=4)
    run.add_argument("--size", type=float, default=64.0)
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--link-rate", default="1gbit")
    run.add_argument("--local-workers", type=int, default=0, help="workers on the trainer's one host")
    args = parser.parse_args(argv)
    if args.role == "rank":
        rank_main(args.rank, args.world, args.init, args.host, args.mib, args.repeats, args.workers)
    elif args.role == "worker":
        worker_main(args.host, args.ports, args.rank, args.mib)
    else:
        result = run_sharded(
            args.trainer_hosts, args.ranks_per_host, args.hosts, args.size, args.repeats, args.link_rate,
            progress=lambda text: print(text, file=sys.stderr, flush=True), local_workers=args.local_workers,
        )  # fmt: skip
        print(format_sharded_table(result))


if __name__ == "__main__":
    main()
