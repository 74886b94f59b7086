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
  torchrl's ``DistributedWeightSyncScheme`` sends;
- ``torchrl`` (where torchrl is installed): torchrl's own
  ``DistributedWeightSyncScheme.send()`` (it sends to each worker in turn,
  one gloo message per tensor, and waits for that worker's ack), its
  workers taking updates in their background thread.

The gloo ways end with a barrier, so that each time covers every worker's
copy. Rank 0 prints the table: ms, and x the floor S/B when ``--link-rate``
gives B (the NIC's rate); otherwise the effective rate per worker.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import weightsync as ws

from ._machine import describe_machine, machine_facts
from ._model import mlp_shapes, tensor_checksums, unflatten_into

__all__ = ["under_torchrun", "torchrun_bench"]

MIB = 1 << 20
_TIMEOUT = 300.0


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started."""
    return all(name in os.environ for name in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE"))


class _Case:
    """One size on this rank: the model, and how each way is timed."""

    def __init__(self, mib: float, repeats: int, rank: int, world: int) -> None:
        shapes = mlp_shapes(int(mib * MIB), 8)
        make = torch.randn if rank == 0 else torch.zeros
        self.tensors = {name: make(shape) for name, shape in shapes.items()}
        self.nbytes = sum(t.numel() * 4 for t in self.tensors.values())
        self.mib, self.repeats, self.rank, self.world = mib, repeats, rank, world
        self.steps = 0
        # Rank 0: the report of its last send (how the chain went).
        self.report: ws.SendReport | None = None

    def timed(self, way: str, send: Callable[[], None]) -> list[float]:
        """``send()`` on every rank (``repeats`` times after one untimed
        round), from a barrier to a barrier once it is done everywhere;
        every rank's weights are checked against rank 0's after each.

        :raises SystemExit: a rank does not hold the trainer's weights.
        """
        import torch.distributed as dist

        times = []
        for step in range(-1, self.repeats):
            self.steps += 1
            if self.rank == 0:  # a new version each time
                first = next(iter(self.tensors.values()))
                first.view(-1)[self.steps % first.numel()] += 1.0
            dist.barrier()
            started = time.perf_counter()
            send()
            dist.barrier()
            if step >= 0:
                times.append(time.perf_counter() - started)
            sums: list[Any] = [None] * self.world
            dist.all_gather_object(sums, tensor_checksums(self.tensors))
            bad = [r for r in range(1, self.world) if sums[r] != sums[0]]
            if bad:
                raise SystemExit(f"{way}, step {step}: ranks {bad} do not hold the trainer's weights")
        return times

    def _on_trainer(self, send: Callable[[], Any]) -> None:
        if self.rank == 0:
            self.report = send()

    def weightsync(self, row: dict[str, Any]) -> None:
        scheme = ws.DistributedWeightSyncScheme(sync=False, timeout=_TIMEOUT)
        if self.rank == 0:
            scheme.init_on_sender(f"bench-{self.mib:g}", model=self.tensors)
        else:
            scheme.init_on_worker(f"bench-{self.mib:g}", model=self.tensors)
        try:
            scheme.connect()
            # (The workers wait at the barrier: rank 0's send returns once every worker acked.)
            row["weightsync"] = self.timed("weightsync", lambda: self._on_trainer(scheme.send))
            chain_report = self.report.chain if self.report is not None else None
            if chain_report is not None and chain_report.routes:  # (rank 0)
                chain, fed = chain_report.routes[-1]
                row["chain"], row["fed"] = list(chain), {str(k): list(v) for k, v in fed.items()}
        finally:
            scheme.shutdown()

    def gloo(self, row: dict[str, Any]) -> None:
        import torch.distributed as dist

        flat = torch.empty(self.nbytes // 4)

        def send(way: str) -> None:
            if self.rank == 0:
                torch.cat([t.view(-1) for t in self.tensors.values()], out=flat)
            if way == "bcast":
                dist.broadcast(flat, 0)
            elif self.rank == 0:
                for r in range(1, self.world):  # one worker after the other, as torchrl's scheme
                    dist.send(flat, r)
            else:
                dist.recv(flat, 0)
            if self.rank != 0:
                unflatten_into(flat, self.tensors)

        for way in ("bcast", "star"):
            row[f"gloo_{way}"] = self.timed(f"gloo {way}", lambda way=way: send(way))  # type: ignore[misc]

    def torchrl(self, row: dict[str, Any]) -> None:
        """torchrl's ``DistributedWeightSyncScheme``, timed as weightsync's
        is (nothing where torchrl is not installed: the same on every rank)."""
        try:
            from torchrl.weight_update import DistributedWeightSyncScheme as TorchrlScheme
        except ImportError:
            return
        import torch.distributed as dist

        module = torch.nn.Module()  # torchrl's scheme takes its weights from a module
        for i, tensor in enumerate(self.tensors.values()):
            module.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))
        scheme = TorchrlScheme(backend="gloo", timeout=_TIMEOUT)
        info: list[Any] = [None]
        if self.rank == 0:
            # Its store binds to the address of this host's name; an emulated
            # host's name is the machine's, so while the store is made the
            # name is the address the workers reach this host by.
            named = socket.gethostname
            address = _address_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            socket.gethostname = lambda: address
            try:
                scheme.init_on_sender(model_id="policy", num_workers=self.world - 1, model=module)
            finally:
                socket.gethostname = named
            # (torchrl 0.14 names get_store_info() in its docs but has no such method.)
            info = [scheme._store_info]
        dist.broadcast_object_list(info, 0)
        if self.rank != 0:
            scheme._store_info = info[0]  # what a scheme pickled after init_on_sender carries
            context = _Holder(module)  # (torchrl keeps a weak reference to it: held here till the end)
            scheme.init_on_receiver(model_id="policy", context=context, worker_idx=self.rank)
        try:
            scheme.connect()  # its workers then take updates in a thread of theirs
            row["torchrl"] = self.timed(
                "torchrl", lambda: self._on_trainer(lambda: scheme.send(weights=module))
            )
        finally:
            scheme.shutdown()


class _Holder:
    """What torchrl's scheme finds a worker's model in (``.policy``)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy


def _address_towards(host: str, port: int) -> str:
    """This host's address on its route to ``host`` (sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return str(probe.getsockname()[0])


def _case(mib: float, repeats: int, rank: int, world: int) -> dict[str, Any] | None:
    """One size: every way. Returns the row on rank 0, None elsewhere."""
    case = _Case(mib, repeats, rank, world)
    row: dict[str, Any] = {"workers": world - 1, "mib": mib, "bytes": case.nbytes}
    case.weightsync(row)
    case.gloo(row)
    case.torchrl(row)
    return row if rank == 0 else None


def format_torchrun_table(
    rows: Sequence[dict[str, Any]], bytes_per_second: float | None, torchrl: bool = False
) -> str:
    """Median ms of each way, and x the floor S/B (without a link rate, S
    over the time, in GB/s); ``torchrl``: with torchrl's scheme's column."""
    unit = "x floor" if bytes_per_second else "GB/s"
    lines = [
        f"{'workers':>7} {'MiB':>6} {'floor ms':>9} {'weightsync ms':>14} {unit:>7} "
        f"{'gloo bcast':>11} {unit:>7} {'gloo star':>10} {unit:>7}"
        + (f" {'torchrl':>10} {unit:>7}" if torchrl else "")
    ]
    for row in rows:
        floor = row["bytes"] / bytes_per_second if bytes_per_second else None

        def cell(key: str, width: int, row: dict[str, Any] = row, floor: float | None = floor) -> str:
            if key not in row:
                return f"{'-':>{width}} {'':>7}"
            med = statistics.median(row[key])
            ratio = f"{med / floor:.2f}x" if floor else f"{row['bytes'] / med / 1e9:.2f}"
            return f"{med * 1e3:>{width}.0f} {ratio:>7}"

        floor_ms = f"{floor * 1e3:>9.0f}" if floor else f"{'-':>9}"
        lines.append(
            f"{row['workers']:>7} {row['mib']:>6g} {floor_ms} {cell('weightsync', 14)} "
            f"{cell('gloo_bcast', 11)} {cell('gloo_star', 10)}"
            + (f" {cell('torchrl', 10)}" if torchrl else "")
        )
    return "\n".join(lines)


def torchrun_bench(
    sizes_mib: Sequence[float], repeats: int, bytes_per_second: float | None, json_path: str | None
) -> int:
    """Run every size on this rank; rank 0 prints the table (and writes
    ``json_path``). Every rank of the job must call it with the same arguments."""
    import torch.distributed as dist

    # torch's default thread count, as users' processes run.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torchrl = importlib.util.find_spec("torchrl") is not None
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
            print(format_torchrun_table([], bytes_per_second, torchrl), flush=True)
        rows = []
        for mib in sizes_mib:
            row = _case(mib, repeats, rank, world)
            if row is not None:
                rows.append(row)
                print(format_torchrun_table([row], bytes_per_second, torchrl).splitlines()[-1], flush=True)
        if rank == 0:
            print("\nall cases:\n" + format_torchrun_table(rows, bytes_per_second, torchrl), flush=True)
            if json_path:
                with open(json_path, "w") as handle:
                    json.dump({"rows": rows, "bytes_per_second": bytes_per_second}, handle, indent=1)
    finally:
        dist.destroy_process_group()
    return 0
