"""The processes of ``weightsync bench --sharded-trainer`` (see
``_sharded_hosts``): ``python -m weightsync.bench._sharded_procs rank ...``
(a trainer rank) and ``... worker ...`` (a whole-copy worker, or a member
of a tensor-parallel replica), each on its emulated host; ``... run ...``
runs the whole case from the command line.

A send is checked by boxes: each trainer rank cuts its rows of every
tensor to what each worker holds (a whole-copy worker: all of them; a
tensor-parallel member: its rows or columns of each tensor) and takes their
CRC32, and each worker takes the CRC32 of the same boxes of its own
tensors: no rank gathers, and no worker holds more than its shards."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import random
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import weightsync as ws

from ._chaos_hosts import RECOVERY
from ._dist_hosts import control_store, wait_keys
from ._model import mlp_shapes, tensor_crc
from ._sharded_hosts import MIB, TIMEOUT, format_sharded_table, run_sharded

__all__ = ["rank_main", "worker_main"]


class _Model(nn.Module):
    """The bench's model: 8 float32 tensors of about ``mib`` MiB in all;
    with ``mesh`` (a tensor-parallel replica's), each is sharded over it
    along :func:`tp_dim` (rows or columns, as a column- and a row-parallel
    layer are)."""

    def __init__(self, mib: float, mesh: Any = None) -> None:
        super().__init__()
        for i, shape in enumerate(mlp_shapes(int(mib * MIB), 8).values()):
            value = torch.zeros(shape)
            if mesh is not None:
                from torch.distributed.tensor import Shard, distribute_tensor

                value = distribute_tensor(value, mesh, [Shard(tp_dim(i, shape))])
            self.register_parameter(f"p{i}", nn.Parameter(value, requires_grad=False))


#: A box of a tensor: per dimension, [start, stop).
Box = tuple[tuple[int, int], ...]


def tp_dim(i: int, shape: Sequence[int]) -> int:
    """The dimension tensor-parallel members split tensor ``i`` along: rows
    and columns in turn (a vector: its one dimension)."""
    return i % 2 if len(shape) > 1 else 0


def _chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """``index``'s [start, stop) of ``n`` split as ``torch.chunk`` splits it (and DTensor's ``Shard``)."""
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def member_box(shape: Sequence[int], i: int, tp: int, index: int) -> Box:
    """The box of tensor ``i`` (of ``shape``) that tensor-parallel member
    ``index`` of ``tp`` holds (``tp`` 1: the whole)."""
    box = [(0, n) for n in shape]
    if tp > 1:
        box[tp_dim(i, shape)] = _chunk(shape[tp_dim(i, shape)], tp, index)
    return tuple(box)


def _cut(tensor: torch.Tensor, box: Sequence[Sequence[int]], origin: Box) -> torch.Tensor:
    """``box`` of the global tensor, out of ``tensor``, which holds ``origin`` of it."""
    return tensor[tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))]


def _meet(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- a worker ------------------------------------------------------------------


def _jiffies() -> tuple[int, int]:
    """The machine's CPU time so far (all cores; every emulated host shares
    them): busy and all, in clock ticks."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # (less idle and iowait)


def _connect_quietly(scheme: ws.DistributedWeightSyncScheme) -> None:
    """``connect()``: a trainer that shut down before its first send (a
    rank was killed, and there is no gather row) ends it quietly."""
    with contextlib.suppress(ws.SenderLostError):
        scheme.connect()


def worker_main(host: str, ports: list[int], rank: int, mib: float, tp: int, group: str) -> None:
    """Worker ``rank``: a whole copy under each scheme, applied as updates
    arrive; or (``tp`` > 1) member ``(rank - 1) % tp`` of a tensor-parallel
    replica (its gloo group's rendezvous at ``group``), which takes the
    sharded trainer's sends only, in a ``receive()`` loop. Answers rank 0's
    checks."""
    sharded_port, gathered_port, hopped_port, ctrl_port = ports
    index = (rank - 1) % tp
    if tp > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group(
            "gloo", init_method=f"tcp://{group}", rank=index, world_size=tp,
            timeout=datetime.timedelta(seconds=TIMEOUT),
        )  # fmt: skip
        models = {"sharded": _Model(mib, init_device_mesh("cpu", (tp,)))}
    else:
        models = {"sharded": _Model(mib), "gathered": _Model(mib)}
        if hopped_port:
            models["hopped"] = _Model(mib)
    schemes = {}
    for name, port in (("sharded", sharded_port), ("gathered", gathered_port), ("hopped", hopped_port)):
        if name in models:
            scheme = ws.DistributedWeightSyncScheme(sync=tp > 1, timeout=TIMEOUT)
            scheme.init_on_worker(
                name, model=models[name], worker_idx=rank, store_info={"host": host, "port": port}
            )
            schemes[name] = scheme
    ctrl = control_store(host, ctrl_port, master=False)
    ctrl.set(f"up/{rank}", str(os.getpid()).encode())  # (a soak stops it by its pid)

    def answer(command: str, tag: Any) -> bool:
        if command == "quit":
            return False
        # The boxes rank 0 asks of this worker's place, of its own tensors,
        # read as a step of the model reads them: no update is applied in
        # the background meanwhile (one stopped and continued may be
        # finishing one), as none is during a forward call.
        scheme = schemes[tag["model"]]
        with contextlib.nullcontext() if tp > 1 else scheme.get_receiver().step():
            model = models[tag["model"]]
            state = {name: t.to_local() if tp > 1 else t for name, t in model.state_dict().items()}
            shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
            sums = []
            for name, box in tag["boxes"][str(index)]:
                i = list(shapes).index(name)
                sums.append(tensor_crc(_cut(state[name], box, member_box(shapes[name], i, tp, index))))
        ctrl.set(f"crc/{tag['tag']}/{rank}", json.dumps(sums).encode())
        return True

    try:
        if tp > 1:
            # The group's members call receive() together: each call is a
            # round in which they agree on the version they apply.
            k = 0
            lost = False
            while True:
                if lost:
                    # (A trainer rank was killed: the checks of what this
                    # member holds still come.)
                    time.sleep(0.05)
                else:
                    try:
                        # (Waits for an update up to 50 ms, then the round.)
                        schemes["sharded"].receive(timeout=0.05)
                    except ws.SenderLostError:
                        lost = True
                try:
                    came = ctrl.check([f"cmd/{k + 1}"])
                except RuntimeError:  # (the trainer's store is gone: it ended)
                    return
                if came:
                    k += 1
                    if not answer(*json.loads(bytes(ctrl.get(f"cmd/{k}")))):
                        return
        schemes["sharded"].connect()
        # The whole model's first version comes once the trainer's sharded
        # sends are done: meanwhile this thread answers the trainer's checks.
        for name in ("gathered", "hopped"):
            if name in schemes:
                threading.Thread(target=_connect_quietly, args=(schemes[name],), daemon=True).start()
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
            if not answer(*json.loads(bytes(ctrl.get(key)))):
                return
    finally:
        for scheme in schemes.values():
            scheme.shutdown()


# -- a trainer rank --------------------------------------------------------------


#: The deadline of the send a trainer rank is killed or stopped in (s).
KILL_DEADLINE = 10.0
#: How many times a faulted round is sent while its fault misses the send.
TRIES = 4


def rank_main(
    rank: int,
    world: int,
    init: str,
    host: str,
    mib: float,
    repeats: int,
    workers: int,
    tp: int,
    fault: tuple[str, int] | None = None,
    one_host: bool = False,
    seed: int = 0,
) -> None:
    """Trainer rank ``rank``: FSDP2 over the ``world`` ranks, to ``workers``
    workers (``tp`` > 1: replicas of ``tp`` tensor-parallel members, which
    take the sharded sends only); rank 0 prints ``PORTS <sharded>
    <gathered> <hopped> <control>``, then the row (``one_host``: the
    gathered model also goes through a host leader, as the single sender
    did before it fed its own host from its staging buffer: the
    ``hopped`` row; else its port is 0). With ``fault`` (``("kill", K)``
    or ``("stop", K)``, K a rank other than 0, which drives the run), after
    the timed sends that rank is killed or stopped in one more send
    (:func:`_fault_case`), in place of the gather rows."""
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
        hopped: ws.DistributedWeightSyncScheme | None = None
        worker_pids: list[int] = []
        ctrl: Any = None
        if rank == 0:
            ctrl = control_store(host, 0, master=True)
            info = scheme.get_store_info()
            assert info is not None
            other = {"port": 0}
            if tp == 1:
                whole = {name: torch.zeros(t.shape) for name, t in model.state_dict().items()}
                gathered = ws.DistributedWeightSyncScheme(timeout=TIMEOUT)
                gathered.init_on_sender("gathered", num_workers=workers, model=whole, host=host)
                other = gathered.get_store_info() or other
                if one_host:
                    hopped = ws.DistributedWeightSyncScheme(timeout=TIMEOUT, share_from_trainer=False)
                    hopped.init_on_sender("hopped", num_workers=workers, model=whole, host=host)
            hop_port = 0 if hopped is None else (hopped.get_store_info() or {"port": 0})["port"]
            print(f"PORTS {info['port']} {other['port']} {hop_port} {ctrl.port}", flush=True)
            worker_pids = [int(v) for v in wait_keys(ctrl, [f"up/{r}" for r in range(1, workers + 1)])]
        dist.barrier()
        commands = 0

        # Each rank's rows of each tensor (Shard(0): the ranks' rows in
        # order), cut to what each tensor-parallel place holds: the workers
        # check them against this rank's own shards, so no rank ever gathers.
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        rows: list[Any] = [None] * world
        dist.all_gather_object(rows, [t.to_local().shape[0] for t in model.state_dict().values()])
        mine: dict[str, Box] = {}
        for i, name in enumerate(shapes):
            start = sum(rows[r][i] for r in range(rank))
            mine[name] = ((start, start + rows[rank][i]), *((0, n) for n in shapes[name][1:]))

        def expect(model_name: str, ahead: float = 0.0) -> tuple[dict[str, Any], dict[str, Any]]:
            """(Collective.) The boxes each tensor-parallel place is asked
            for, and their CRC32s, of every rank's shards (``ahead``: as
            they will be once ``ahead`` is added to every element);
            empty but on rank 0."""
            local = dict(model.state_dict())
            places = tp if model_name == "sharded" else 1
            boxes: dict[str, list[Any]] = {}
            sums: dict[str, list[int]] = {}
            for index in range(places):
                for i, name in enumerate(shapes):
                    box = _meet(mine[name], member_box(shapes[name], i, places, index))
                    if box is not None:
                        boxes.setdefault(str(index), []).append([name, box])
                        piece = _cut(local[name].to_local(), box, mine[name])
                        sums.setdefault(str(index), []).append(tensor_crc(piece + ahead if ahead else piece))
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, [boxes, sums])
            if rank != 0:
                return {}, {}
            asked = {str(i): [b for said, _ in everyone for b in said.get(str(i), [])] for i in range(places)}
            want = {str(i): [c for _, got in everyone for c in got.get(str(i), [])] for i in range(places)}
            return asked, want

        def ask(model_name: str, tag: str, asked: dict[str, Any]) -> list[Any]:
            """(Rank 0.) Each worker's CRC32s of the boxes ``asked`` of its place, by worker rank - 1."""
            nonlocal commands
            commands += 1
            ctrl.set(
                f"cmd/{commands}",
                json.dumps(["crc", {"model": model_name, "tag": tag, "boxes": asked}]).encode(),
            )
            keys = [f"crc/{tag}/{r}" for r in range(1, workers + 1)]
            return [json.loads(v) for v in wait_keys(ctrl, keys)]

        def check(model_name: str, tag: str) -> None:
            """Every worker holds each rank's shards, bit for bit (collective)."""
            asked, want = expect(model_name)
            if rank != 0:
                return
            places = tp if model_name == "sharded" else 1
            got = ask(model_name, tag, asked)
            bad = [r for r, g in enumerate(got, 1) if g != want[str((r - 1) % places)]]
            if bad:
                raise SystemExit(f"{tag}: worker ranks {bad} do not hold the trainer's weights")

        def step_of(step: int) -> float:
            return 0.25 * (step + 1)

        def change(step: int) -> None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(step_of(step))

        rss_start = _rss_mib()
        scheme.connect()
        check("sharded", "first")
        times = []
        busy = every = 0
        for step in range(repeats):
            change(step)
            dist.barrier()
            started, ticks = time.perf_counter(), _jiffies()
            scheme.send()
            times.append(time.perf_counter() - started)
            after = _jiffies()
            busy, every = busy + after[0] - ticks[0], every + after[1] - ticks[1]
            check("sharded", f"ws{step}")
        rss_sharded = _rss_mib()
        rss: list[Any] = [None] * world
        gather_times: list[float] = []
        send_times: list[float] = []
        hop_times: list[float] = []
        faulted: dict[str, Any] | None = None
        if fault is not None:
            # (In place of the gather rows: the group does not go on without a killed rank.)
            dist.all_gather_object(rss, (rss_start, rss_sharded, rss_sharded))
            # A quarter of the fastest send: the first of a run can take
            # several times a warm one, and a fault timed from it can land
            # after the send it was meant for ended.
            fastest = min(times)
            rounds = _Round(rank, scheme, ctrl, host, expect, ask, change, step_of, fastest, tp, worker_pids)
            faulted = _fault_case(rounds, fault, check, repeats, seed, workers, tp)
        else:
            first = {name: t.full_tensor() for name, t in model.state_dict().items()}
            if gathered is not None:
                gathered.connect(weights=first)
            if hopped is not None:
                hopped.connect(weights=first)
            del first
            # (Tensor-parallel workers take the sharded sends only.)
            for step in range(-1, repeats if tp == 1 else -1):  # a first round untimed
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
                if hopped is not None:
                    hop = time.perf_counter()
                    hopped.send(full)
                    if step >= 0:
                        hop_times.append(time.perf_counter() - hop)
                del full
                check("gathered", f"g{step}")
                if one_host:  # (collective: every rank checks)
                    check("hopped", f"h{step}")
            dist.all_gather_object(rss, (rss_start, rss_sharded, _rss_mib()))
        nbytes = sum(t.numel() * 4 for t in model.state_dict().values())
        if rank == 0:
            commands += 1
            ctrl.set(f"cmd/{commands}", json.dumps(["quit", 0]).encode())
            row = {
                "ranks": world, "workers": workers, "tp": tp, "mib": mib, "bytes": nbytes,
                "weightsync": times, "gather": gather_times, "single_send": send_times,
                "hopped_send": hop_times, "cpu_busy": busy / every if every else None,
                "rss_start_mib": [r[0] for r in rss], "rss_after_sharded_mib": [r[1] for r in rss],
                "rss_end_mib": [r[2] for r in rss], "fault": faulted,
            }  # fmt: skip
            for single in (gathered, hopped):
                if single is not None:
                    single.shutdown()
        scheme.shutdown()
        if rank == 0:
            print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


#: The deadline of each send of a soak (s): a stopped rank or worker holds
#: its round until it passes.
SOAK_DEADLINE = 6.0
#: How long past a send's deadline a rank may take to raise, naming the
#: faulted one (GRACE and the merge, with room for a loaded machine).
NAMED_WITHIN = 3.0


@dataclasses.dataclass(frozen=True)
class Fault:
    """One round's fault: ``kind`` "none", "stop-rank" or "kill-rank" (trainer
    rank ``target``), or "stop-worker" (worker rank ``target``)."""

    kind: str
    target: int = 0


def soak_schedule(seed: int, rounds: int, world: int, workers: int, tp: int) -> list[Fault]:
    """The seeded faults of a soak's ``rounds`` sends (every rank computes
    the same): half the rounds calm, the others a stopped trainer rank or
    (whole-copy workers) a stopped worker, and in the last a trainer rank
    killed (the group does not go on without it)."""
    rng = random.Random(seed)
    kinds = ["none", "none", "stop-rank"] + (["stop-worker"] if tp == 1 else [])
    plan = []
    for _ in range(rounds - 1):
        kind = rng.choice(kinds)
        target = 0 if kind == "none" else rng.randrange(1, world if kind == "stop-rank" else workers + 1)
        plan.append(Fault(kind, target))
    return [*plan, Fault("kill-rank", rng.randrange(1, world))]


class _Round:
    """What a rank needs to run rounds of faulted sends: its scheme, the
    control store, the helpers of :func:`rank_main` (the expected CRC32s,
    the workers' answers, the weights' changes), and every process's pid."""

    def __init__(
        self,
        rank: int,
        scheme: ws.DistributedWeightSyncScheme,
        ctrl: Any,
        host: str,
        expect: Callable[..., tuple[dict[str, Any], dict[str, Any]]],
        ask: Callable[[str, str, dict[str, Any]], list[Any]],
        change: Callable[[int], None],
        step_of: Callable[[int], float],
        fastest: float,
        tp: int,
        worker_pids: list[int],
    ) -> None:
        import torch.distributed as dist

        self.rank, self.scheme, self.expect, self.ask = rank, scheme, expect, ask
        self.change, self.step_of, self.tp = change, step_of, tp
        where: list[Any] = [(host, ctrl.port) if rank == 0 else None]
        dist.broadcast_object_list(where, src=0)
        self.ctrl = ctrl if rank == 0 else control_store(where[0][0], where[0][1], master=False)
        self.pids: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(self.pids, os.getpid())
        self.worker_pids = worker_pids
        self.after = fastest / 4  # (its parts still in flight)
        # (Rank 0.) The CRC32s of the boxes each worker holds, as of the
        # last round: a round's "old" is what the worker held before it,
        # whatever the rounds before it failed to deliver.
        self.held: list[Any] | None = None

    def run(self, tag: str, step: int, fault: Fault, deadline: float) -> dict[str, Any]:
        """One send of the next version, ``fault`` injected ``after`` s into
        it (see :meth:`_once`). A fault that missed its send (the send
        ended before it fired, on a machine that sped up since the sends
        it was timed from) is not a fault: the round is sent again, its
        fault a quarter of the way into the send that ended first, up to
        :data:`TRIES` times; the record says how many (``tries``) and
        whether the last one missed too (``missed``)."""
        for attempt in range(1, TRIES + 1):
            record = self._once(tag if attempt == 1 else f"{tag}.{attempt}", step, fault, deadline)
            # (Rank 0 says whether the round is sent again, and how soon the
            # fault fires then; a rank killed or stopped by it is not asked.)
            key = f"again/{tag}/{attempt}"
            if self.rank == 0:
                again = bool(record["missed"]) and attempt < TRIES
                if again:
                    self.after = min(o[2] for o in record["outcomes"].values()) / 4
                record["tries"] = attempt
                self.ctrl.set(key, json.dumps([again, self.after]).encode())
            else:
                again, self.after = json.loads(wait_keys(self.ctrl, [key])[0])
            if not again:
                return record
        raise AssertionError("unreachable: the last try is never sent again")

    def _once(self, tag: str, step: int, fault: Fault, deadline: float) -> dict[str, Any]:
        """One send of the next version, ``fault`` injected ``after`` s into
        it: a faulted trainer rank faults itself, on its own clock; rank 0
        stops a worker, and continues whatever was stopped once the
        others raised (past the deadline and :data:`NAMED_WITHIN`). Returns,
        on rank 0, each rank's outcome (what it raised and when), whether
        the fault missed the send, and what each worker holds: what it held
        before (``old``: the version of the round before, or of the last
        one that reached it), this version (``new``) or a mix, checked box
        by box against every rank's shards, computed before the send ({}
        on the other ranks). After a stop, rank 0 waits ``RECOVERY`` s (the
        others at the next round)."""
        import torch.distributed as dist

        old_asked, old = self.expect("sharded")
        _, new = self.expect("sharded", self.step_of(step))
        self.change(step)
        held = self.after + deadline + NAMED_WITHIN + 2.0
        dist.barrier()
        shot: _Shot | None = None
        wake: threading.Timer | None = None
        if fault.kind in ("stop-rank", "kill-rank") and self.rank == fault.target:
            sig = signal.SIGKILL if fault.kind == "kill-rank" else signal.SIGSTOP
            shot = _Shot(self.after, os.getpid(), sig)
        if self.rank == 0 and fault.kind == "stop-rank":
            wake = threading.Timer(held, os.kill, (self.pids[fault.target], signal.SIGCONT))
        if self.rank == 0 and fault.kind == "stop-worker":
            pid = self.worker_pids[fault.target - 1]
            shot = _Shot(self.after, pid, signal.SIGSTOP)
            wake = threading.Timer(held, os.kill, (pid, signal.SIGCONT))
        for timer in (shot, wake):
            if timer is not None:
                timer.start()
        started = time.monotonic()
        try:
            self.scheme.send(timeout=deadline)
            said: list[Any] = ["none", ""]
        except ws.WeightSyncError as exc:
            said = [type(exc).__name__, str(exc)]
        said.append(time.monotonic() - started)
        # (Whoever fired the fault knows whether it came before the send ended.)
        missed = shot is not None and shot.ended()
        if self.rank != 0:
            self.ctrl.set(f"said/{tag}/{self.rank}", json.dumps([*said, missed]).encode())
            return {}
        others = [
            r for r in range(1, len(self.pids)) if not (fault.kind == "kill-rank" and r == fault.target)
        ]
        heard = [json.loads(v) for v in wait_keys(self.ctrl, [f"said/{tag}/{r}" for r in others])]
        outcomes = {0: said} | {r: v[:3] for r, v in zip(others, heard, strict=True)}
        missed = missed or any(v[3] for v in heard)
        if fault.kind == "kill-rank" and all(o[0] == "none" for o in outcomes.values()):
            # Every other send ended well: the killed rank's most likely did
            # too, before its fault (then it says so at once, and lives).
            with contextlib.suppress(SystemExit):
                missed = json.loads(wait_keys(self.ctrl, [f"said/{tag}/{fault.target}"], NAMED_WITHIN)[0])[3]
        if wake is not None:
            if missed:
                wake.cancel()  # (nothing was stopped)
            wake.join()  # (whatever was stopped runs again: it answers)
        got = self.ask("sharded", tag, old_asked)
        places = [str((r - 1) % self.tp) for r in range(1, len(got) + 1)]
        before = self.held if self.held is not None else [old[place] for place in places]
        states = []
        for r, sums in enumerate(got):
            states.append("old" if sums == before[r] else "new" if sums == new[places[r]] else "mixed")
            if states[-1] == "new":
                before[r] = sums
        self.held = before
        if fault.kind.startswith("stop") and not missed:
            # Healed: what it stopped may still be named for a while (the
            # chain it woke into ends within its first-frame wait), as in
            # the single sender's soak; the next round is judged after it.
            time.sleep(RECOVERY)
        return {
            "kind": fault.kind, "rank": fault.target, "after_s": self.after, "deadline_s": deadline,
            "outcomes": {str(r): o for r, o in sorted(outcomes.items())}, "workers": states,
            "missed": missed,
        }  # fmt: skip


class _Shot:
    """A signal sent to ``pid`` ``after`` s from :meth:`start`, unless the
    send it is meant for ended first (:meth:`ended`): the two are decided
    under one lock, so a fault either lands in its send or never fires."""

    def __init__(self, after: float, pid: int, sig: signal.Signals) -> None:
        self._lock = threading.Lock()
        self._ended = self._fired = False
        self._timer = threading.Timer(after, self._fire, (pid, sig))
        self._timer.daemon = True

    def start(self) -> None:
        self._timer.start()

    def _fire(self, pid: int, sig: signal.Signals) -> None:
        with self._lock:
            if not self._ended:
                self._fired = True
                # (Under the lock: a process that stops itself holds it
                # until it is continued, so its send is not seen to end
                # before the fault.)
                os.kill(pid, sig)

    def ended(self) -> bool:
        """The send ended: whether the fault missed it (then it never fires)."""
        with self._lock:
            self._ended = True
            return not self._fired


def judge_round(record: dict[str, Any], tp: int) -> list[str]:
    """What a round broke of what a sender group promises (empty: nothing):
    no worker holds a mix of two versions, nor a replica two versions; a
    calm send reaches every worker; a faulted one raises on every rank but
    the faulted one, the same error, naming the faulted rank or worker,
    within the deadline and :data:`NAMED_WITHIN` s, and leaves every worker
    it reached on the new version and the others on the old."""
    kind, target, states = record["kind"], record["rank"], record["workers"]
    where = f"{kind} {target}" if kind != "none" else "calm"
    if record.get("missed"):
        # (Not a broken promise: the sends outran the fault every time.)
        return [f"{where}: every send ended before the fault fired ({record['tries']} tries)"]
    bad = [
        f"{where}: worker rank {r} holds a mix of two versions"
        for r, s in enumerate(states, 1)
        if s == "mixed"
    ]
    for first in range(0, len(states), tp):
        if len(set(states[first : first + tp])) > 1:
            bad.append(f"{where}: the replica of worker ranks {first + 1}-{first + tp} runs two versions")
    outcomes = {int(r): o for r, o in record["outcomes"].items()}
    if kind == "none":
        bad += [f"calm: rank {r} raised {o[0]}: {o[1][:200]}" for r, o in outcomes.items() if o[0] != "none"]
        bad += [f"calm: worker rank {r} holds {s}" for r, s in enumerate(states, 1) if s != "new"]
        return bad
    judged = {r: o for r, o in outcomes.items() if not (kind.endswith("-rank") and r == target)}
    name = f"rank {target}" if kind.endswith("-rank") else f"worker {target - 1}"
    for r, (error, text, seconds) in judged.items():
        if error == "none" or name not in text:
            bad.append(f"{where}: rank {r} did not raise naming {name}: {error} {text[:200]}")
        if seconds > record["deadline_s"] + NAMED_WITHIN:
            bad.append(f"{where}: rank {r} raised after {seconds:.2f} s")
    if len({(o[0], o[1]) for o in judged.values()}) > 1:
        bad.append(f"{where}: the ranks raised different errors: {sorted({o[0] for o in judged.values()})}")
    if kind == "stop-worker" and states[target - 1] != "old":
        bad.append(f"{where}: the stopped worker holds {states[target - 1]}")
    return bad


def _fault_case(
    rounds: _Round,
    fault: tuple[str, int],
    check: Callable[[str, str], None],
    step: int,
    seed: int,
    workers: int,
    tp: int,
) -> dict[str, Any]:
    """(Every rank.) ``fault``: trainer rank K killed (``("kill", K)``) or
    stopped (``("stop", K)``, continued once the others raised) in a send
    of deadline :data:`KILL_DEADLINE`; or a soak (``("soak", N)``): N sends
    of deadline :data:`SOAK_DEADLINE` under the faults of
    :func:`soak_schedule` (``seed``), each judged (:func:`judge_round`).
    After a stop, every rank sends once more and every worker must hold
    that version (``check``; its time is ``recovered_s``). Returns the
    record on rank 0 ({} on the others)."""
    import torch.distributed as dist

    kind, count = fault
    if kind != "soak":
        record = rounds.run("fault", step, Fault(f"{kind}-rank", count), KILL_DEADLINE)
        if kind == "stop":
            # The group goes on: every rank sends once more, and every
            # worker holds that version (a mismatch ends the run).
            rounds.change(step + 1)
            dist.barrier()
            started = time.monotonic()
            rounds.scheme.send()
            record["recovered_s"] = time.monotonic() - started
            check("sharded", "recovered")
        return record
    plan = soak_schedule(seed, count, dist.get_world_size(), workers, tp)
    records = [rounds.run(f"soak{i}", step + i, f, SOAK_DEADLINE) for i, f in enumerate(plan)]
    if rounds.rank != 0:
        return {}
    return {
        "kind": "soak", "seed": seed, "rounds": records,
        "violations": [v for r in records for v in judge_round(r, tp)],
    }  # fmt: skip


def _fault_arg(text: str | None) -> tuple[str, int] | None:
    """``kill:K`` or ``stop:K`` as ``(kind, K)``."""
    if text is None:
        return None
    kind, _, rank = text.partition(":")
    return kind, int(rank)


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
    rank.add_argument("tp", type=int)
    rank.add_argument(
        "--fault", default=None, help="kill:K or stop:K, rank K in a last send; soak:N, N sends"
    )
    rank.add_argument("--seed", type=int, default=0, help="the soak's faults")
    rank.add_argument("--one-host", action="store_true", help="the workers are on the trainer's host")
    worker = roles.add_parser("worker")
    worker.add_argument("host")
    worker.add_argument("ports", type=int, nargs=4)
    worker.add_argument("rank", type=int)
    worker.add_argument("mib", type=float)
    worker.add_argument("tp", type=int)
    worker.add_argument("group", help="HOST:PORT of its replica's gloo rendezvous (tp > 1)")
    run = roles.add_parser("run", help="the whole case on an emulated cluster (root)")
    run.add_argument("--trainer-hosts", type=int, default=2)
    run.add_argument("--ranks-per-host", type=int, default=2)
    run.add_argument("--hosts", type=int, default=4)
    run.add_argument("--size", type=float, default=64.0)
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--link-rate", default="1gbit")
    run.add_argument("--local-workers", type=int, default=0, help="workers on the trainer's one host")
    run.add_argument("--worker-tp", type=int, default=1, help="workers in tensor-parallel replicas of G")
    run.add_argument("--kill-rank", type=int, default=None, help="kill this rank in a last send")
    run.add_argument("--stop-rank", type=int, default=None, help="stop this rank in a last send")
    args = parser.parse_args(argv)
    if args.role == "rank":
        rank_main(
            args.rank, args.world, args.init, args.host, args.mib, args.repeats, args.workers, args.tp,
            _fault_arg(args.fault), args.one_host, args.seed,
        )  # fmt: skip
    elif args.role == "worker":
        worker_main(args.host, args.ports, args.rank, args.mib, args.tp, args.group)
    else:
        result = run_sharded(
            args.trainer_hosts, args.ranks_per_host, args.hosts, args.size, args.repeats, args.link_rate,
            progress=lambda text: print(text, file=sys.stderr, flush=True), local_workers=args.local_workers,
            worker_tp=args.worker_tp,
            fault=("kill", args.kill_rank) if args.kill_rank is not None else
            ("stop", args.stop_rank) if args.stop_rank is not None else None,
        )  # fmt: skip
        print(format_sharded_table(result))


if __name__ == "__main__":
    main()
