"""A chaos soak across emulated hosts: the torch.distributed scheme, or
Ray's relay (``ChaosConfig(scheme="ray")``), under faults that arrive
together and keep arriving.

A trainer on host 0 of an :class:`~weightsync.bench._netns.EmulatedCluster`
sends a model (8 float32 tensors, 1% of its elements changed per version,
``verify=True``: every worker checks the digests before it applies) to one
worker per receiving host, back to back: ``send_async()``, then
``wait_async()``, each send with the same deadline. Workers of the
torch.distributed scheme are processes that take each update at their
safe point (``receive(timeout=0.2)`` in a loop), as collectors do; with
Ray, each host runs a Ray node (``ray start``) and the worker is an actor
there, which applies updates as they arrive.

Meanwhile a seeded schedule (``random.Random(seed)``: the same seed gives
the same faults at the same moments of the run) injects, one host at a time
and at most two hosts at once:

- ``kill``: every process of the host is killed (SIGKILL); after a while a
  new worker starts there under a new rank (with Ray: the host's node is
  started again, then a new actor), and the trainer adds it
  (``scheme.add_worker()``), as a supervisor restarting a collector would;
- ``cut``: the host's link goes down for 2 to 20 s, then comes back;
- ``stop``: the host's processes are stopped (SIGSTOP), then continued;
- ``slow``: the host's link rate drops tenfold for a while;
- ``interrupt``: the trainer gets SIGINT (Ctrl-C) during a send, and sends
  again.

The trainer removes a worker it lost (``WorkerLostError``) and goes on. A
worker whose process ended on its own (its sender lost for it; with Ray,
a node that Ray declared dead while it was cut off or stopped) is started
again under a new rank once its host is healthy.

What must hold, judged after the run from the trainer's record of every send
and the schedule's record of every fault (:func:`judge`):

- no send outlives its deadline by more than :data:`HANG_BOUND` s;
- ``send_async()`` returns within :data:`STAGE_BOUND` s (it only stages);
- a send either reaches every targeted worker or raises a ``WorkerError``
  naming workers that were each lost or late, and each named worker's host
  was faulted (or its process gone) at some moment of the send, give or
  take :data:`RECOVERY` s after a heal; workers not named applied the
  version, digest-checked;
- once every fault is healed, a send reaches every live worker, and each
  worker ends holding exactly the trainer's last version (CRC32 of every
  tensor);
- the trainer's descriptors (a Ray driver's own gRPC connections apart)
  and memory stay flat, and the cluster leaves no namespace, process or
  ``/dev/shm`` entry behind.

Run it with ``python benchmarks/chaos_soak.py`` (needs root and iproute2);
``tests/test_chaos_hosts.py`` runs a short seeded one in ``pytest -m
cluster``.

Processes: :func:`run_chaos` (the machine's own namespace) starts ``python
-m weightsync.bench._chaos_hosts trainer ...`` on host 0 and ``... worker
...`` on the others, each in a process group of its own. The trainer reports
one JSON line per send on its stdout, and takes commands on its stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import weightsync as ws

from ._model import mlp_shapes, tensor_checksums
from ._netns import EmulatedCluster

__all__ = ["ChaosConfig", "Fault", "judge", "run_chaos", "schedule"]

MIB = 1 << 20
MODEL_ID = "chaos"
#: A send may end this long past its deadline (its error's way back, a
#: chain's repair ending).
HANG_BOUND = 3.0
#: send_async() returns once the weights are staged: this long at most.
STAGE_BOUND = 2.0
#: After a heal, a host may still be named for this long (TCP's backed-off
#: retransmissions, a chain re-forming, a restarted worker's start).
RECOVERY = 4.0
#: How long a restarted worker takes to import torch and announce itself, at most.
START_WAIT = 120.0


@dataclass(frozen=True)
class ChaosConfig:
    """One soak: ``hosts`` receiving hosts (one worker each) behind links of
    ``rate``, ``sends`` sends of ``mib`` MiB with deadline ``timeout``,
    faults from ``seed`` every ``gap`` s on average once ``calm`` sends went
    without any (the baseline rate)."""

    hosts: int = 3
    rate: str = "1gbit"
    mib: float = 64.0
    sends: int = 1000
    calm: int = 20
    timeout: float = 8.0
    seed: int = 1
    gap: float = 15.0
    delta: bool = False
    #: ``"distributed"`` (DistributedWeightSyncScheme, a worker process per
    #: host) or ``"ray"`` (RayWeightSyncScheme's relay, an actor per host's
    #: Ray node; a killed host's node is started again, then a new actor).
    scheme: str = "distributed"
    #: Sends to the others while one host misses them, for the bytes-on-the-wire figure.
    missed: tuple[int, ...] = (1, 5, 20)


@dataclass
class Fault:
    """One fault of the schedule: ``kind`` on ``host`` at ``at`` s into the
    chaos, healed ``seconds`` later (kill: restarted then)."""

    at: float
    kind: str
    host: int
    seconds: float
    applied: float | None = None  # time.monotonic()
    healed: float | None = None


#: How often each kind is drawn, and how long each lasts (s).
_KINDS: dict[str, tuple[float, tuple[float, float]]] = {
    "kill": (2.0, (3.0, 10.0)),
    "cut": (3.0, (2.0, 20.0)),
    "stop": (2.0, (1.0, 10.0)),
    "slow": (2.0, (5.0, 20.0)),
    "interrupt": (1.0, (0.0, 0.0)),
}


def schedule(seed: int, hosts: int, seconds: float, gap: float) -> list[Fault]:
    """The faults of a run of ``seconds`` s over hosts 1..``hosts``: one
    every ``gap`` s on average (exponential gaps), each on a host that is
    healthy then, at most two hosts faulted at once. The same arguments
    give the same list."""
    rng = random.Random(seed)
    kinds = list(_KINDS)
    weights = [_KINDS[k][0] for k in kinds]
    faults: list[Fault] = []
    busy: dict[int, float] = {}  # host -> healed at
    t = rng.expovariate(1.0 / gap)
    while t < seconds:
        kind = rng.choices(kinds, weights)[0]
        low, high = _KINDS[kind][1]
        length = rng.uniform(low, high)
        free = [h for h in range(1, hosts + 1) if busy.get(h, -1.0) + RECOVERY < t]
        faulted_now = sum(1 for healed in busy.values() if healed + RECOVERY >= t)
        if kind == "interrupt":
            faults.append(Fault(t, kind, 0, 0.0))
        elif free and faulted_now < 2:
            host = rng.choice(free)
            busy[host] = t + length
            faults.append(Fault(t, kind, host, length))
        t += rng.expovariate(1.0 / gap)
    return faults


# -- the trainer (host 0) --------------------------------------------------------


def _nudge(tensors: dict[str, torch.Tensor], version: int) -> None:
    """Change 1% of the elements, the same ones for the same version."""
    generator = torch.Generator().manual_seed(version)
    for tensor in tensors.values():
        flat = tensor.view(-1)
        where = torch.randint(0, flat.numel(), (max(flat.numel() // 100, 1),), generator=generator)
        flat[where] += 1.0


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _resources() -> dict[str, Any]:
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    kinds = _fd_kinds()
    # A Ray driver's gRPC connections (IPv6 sockets here; weightsync's own,
    # the store's, gloo's and the liveness', are IPv4): Ray's to keep.
    grpc = sum(n for kind, n in kinds.items() if kind.startswith("tcp6")) if "ray" in sys.modules else 0
    store = _ray_store_resident() if "ray" in sys.modules else 0
    return {"fds": len(os.listdir("/proc/self/fd")), "rss": rss - store, "ray_store_rss": store,
            "fd_kinds": kinds, "ray_grpc": grpc}  # fmt: skip


def _ray_store_resident() -> int:
    """Bytes of Ray's object store resident in this process. A driver maps the
    whole store and each ``ray.put`` touches pages of it not touched before,
    so its resident size climbs by a put's bytes until the store's high-water
    mark: shared pages Ray owns, not memory the trainer keeps."""
    total, in_store = 0, False
    with contextlib.suppress(OSError), open("/proc/self/smaps") as smaps:
        for line in smaps:
            if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                in_store = "/plasma" in line
            elif in_store and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _fd_kinds() -> dict[str, int]:
    """The trainer's descriptors by kind, its TCP sockets by the peer's
    address and port (which of them grows, if the count does)."""
    peers: dict[str, str] = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/self/net/{name}") as table:
            for line in list(table)[1:]:
                fields = line.split()
                ip, port = fields[2].split(":")
                address = ".".join(str(int(ip[i : i + 2], 16)) for i in (6, 4, 2, 0)) if name == "tcp" else ip
                peers[fields[9]] = (
                    f"{name} {address}:{int(port, 16)}" if fields[3] != "0A" else f"{name} listen"
                )
    with contextlib.suppress(OSError), open("/proc/self/net/unix") as table:
        for line in list(table)[1:]:
            fields = line.split()
            peers[fields[6]] = "unix " + (fields[7] if len(fields) > 7 else "(unnamed)")
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            kind = peers.get(target[8:-1], "socket (unix, or gone)")
        else:
            kind = target.split(":")[0] if ":" in target else "file"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


class _Trainer:
    """The trainer of the torch.distributed scheme: its workers are
    processes of their own (:func:`worker_main`), added by rank."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.tensors = {n: torch.randn(s) for n, s in mlp_shapes(int(args.mib * MIB), 8).items()}
        self.delta: Any = "always" if args.delta else False
        self.timeout = args.timeout
        self.sends = 0
        self.scheme: Any = self._scheme(args)
        self.sender = self.scheme.get_sender()

    def _scheme(self, args: argparse.Namespace) -> Any:
        scheme = ws.DistributedWeightSyncScheme(timeout=args.timeout, delta=self.delta, verify=True)
        scheme.init_on_sender(MODEL_ID, num_workers=args.workers, model=self.tensors, host=args.host)
        return scheme

    def start(self) -> None:
        """Tell the orchestrator where workers find the trainer; wait for
        them; the first send."""
        info = self.scheme.get_store_info()
        assert info is not None
        _emit({"store": info})
        self.scheme.wait_for_workers(timeout=START_WAIT)  # (each imports torch first)
        self.scheme.connect()

    def add(self, wid: int, host: int) -> None:
        started = time.monotonic()
        try:
            self.scheme.add_worker(worker_id=wid, timeout=START_WAIT)
            _emit({"added": wid, "t0": started, "t1": time.monotonic()})
        except BaseException as exc:  # (Ctrl-C too: the orchestrator hears of every add)
            self._add_failed(wid, exc)

    def _add_failed(self, wid: int, exc: BaseException) -> None:
        """Say the add of ``wid`` failed, and whether the scheme knows it
        (not: the orchestrator starts another worker in its place)."""
        known = wid in self.scheme.sender_transports
        failure = f"{type(exc).__name__}: {exc}"[:400]
        _emit({"add_failed": failure, "wid": wid, "known": known, "t1": time.monotonic()})

    def _chains(self, chain: ws.ChainReport) -> tuple[list[list[int]], list[int]]:
        """A send's chains (its report's), each as its workers' ranks
        (worker id + 1) in order, and the bytes the trainer put on each."""
        # (With share_on_host, a host's one worker is its chain member.)
        return [list(members) for members, _ in chain.routes], list(chain.sent)

    def poll(self) -> None:
        """Between two sends: nothing (a Ray trainer adds the actors that came up)."""

    def removed(self, wid: int) -> None:
        """Worker ``wid`` was removed after it was lost."""

    def states(self) -> dict[str, Any]:
        """What the trainer can tell of its workers' final states (a worker
        process writes its own: nothing here)."""
        return {}

    def send(self, worker_ids: list[int] | None = None) -> dict[str, Any]:
        """One send of the next version: send_async(), then wait()."""
        self.sends += 1
        _nudge(self.tensors, self.sends)
        record: dict[str, Any] = {
            "send": self.sends,
            "targets": sorted(worker_ids or self.scheme.sender_transports),
        }
        record["t0"] = time.monotonic()
        # What the send did, as its report says (a failed send's error carries one).
        report: ws.SendReport | None = None
        try:
            handle = self.sender.send_async(worker_ids=worker_ids, timeout=self.timeout)
            record["staged"] = time.monotonic()
            report = handle.wait()
            record.update(version=report.version, ok=True)
        except KeyboardInterrupt:
            record.update(interrupted=True)
        except ws.WorkerError as exc:
            report = exc.report
            record.update(
                version=exc.version,
                ok=False,
                failures={str(w): type(e).__name__ for w, e in exc.failures.items()},
                message=str(exc)[:400],
            )
        except Exception as exc:  # not a worker's: a problem of the run (judge() says so)
            record.update(ok=False, unexpected=f"{type(exc).__name__}: {exc}"[:400])
        record["t1"] = time.monotonic()
        chain = ws.ChainReport() if report is None or report.chain is None else report.chain
        record["wire"] = chain.wire_bytes
        record["delta"] = list(chain.delta)
        record["chains"], record["chain_wire"] = self._chains(chain)
        if self.delta:  # (why the send went as it did, and what hosts behind were sent)
            choice = chain.delta_choice
            record["why"] = {"base": choice.get("why"), "behind": choice.get("behind")}
        if self.sends % 25 == 0:
            record.update(_resources())
        for wid, kind in (record.get("failures") or {}).items():
            if kind == "WorkerLostError":
                with contextlib.suppress(Exception):
                    self.scheme.remove_worker(int(wid))
                    self.removed(int(wid))
                    record.setdefault("removed", []).append(int(wid))
        return record

    def command(self, line: str) -> bool:
        """Act on one command from the orchestrator; False on ``quit``."""
        words = line.split()
        if not words:
            return True
        if words[0] == "add":
            self.add(int(words[1]), int(words[2]))
        elif words[0] == "send":
            ids = json.loads(words[1]) if len(words) > 1 else None
            _emit(self.send(ids))
        elif words[0] == "crc":
            _emit(
                {
                    "crc": tensor_checksums(self.tensors),
                    "version": self.sender.async_sender.version,
                    "workers": self.states(),
                }
            )
        elif words[0] == "quit":
            return False
        return True


def trainer_main(args: argparse.Namespace) -> None:
    # SIGUSR1: every thread's stack to stderr (the orchestrator asks when the trainer hangs).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C reaches the trainer as in a terminal, even where the orchestrator
    # was started in the background (a shell's "&" leaves SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    trainer = _RayTrainer(args) if args.ray_address else _Trainer(args)
    trainer.start()
    _emit({"connected": time.monotonic(), **_resources()})
    soaking = True
    commands = _Lines(sys.stdin.fileno())
    try:
        while True:
            try:
                # Commands first (a restarted worker to add), then the next send.
                line = commands.next(0 if soaking else 0.2)
                if line is not None:
                    if line.strip() == "done":
                        soaking = False
                        _emit({"soaked": trainer.sends})
                        continue
                    if not line or not trainer.command(line):
                        break
                    continue
                trainer.poll()
                if soaking:
                    _emit(trainer.send())
            except KeyboardInterrupt:
                # Ctrl-C between two sends (a send's own is in its record).
                _emit({"interrupted_between": time.monotonic()})
    finally:
        trainer.scheme.shutdown()
        _emit({"bye": time.monotonic(), **_resources()})


class _Lines:
    """The lines coming on descriptor ``fd``, read without Python's buffer:
    a buffered reader would keep lines that came together where select()
    no longer sees them."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""
        self._closed = False

    def next(self, wait: float) -> str | None:
        """The next whole line (``""`` once the descriptor closed), waiting
        up to ``wait`` s for one; None when none came."""
        while b"\n" not in self._buffer and not self._closed:
            if not select.select([self.fd], [], [], wait)[0]:
                return None
            data = os.read(self.fd, 65536)
            self._buffer += data
            self._closed = not data
        if b"\n" not in self._buffer:
            return ""
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode() + "\n"


class _RayActor:
    """A worker of the Ray scheme: an actor on one receiving host (its
    Ray node's resource ``host<i>``); updates are applied as they arrive."""

    def __init__(self, scheme: Any, mib: float) -> None:
        self.tensors = {n: torch.zeros(s) for n, s in mlp_shapes(int(mib * MIB), 8).items()}
        self.scheme = scheme
        scheme.init_on_worker(MODEL_ID, model=self.tensors)

    def ready(self) -> bool:
        return True

    def state(self) -> dict[str, Any]:
        return {"version": self.scheme.get_receiver().version, "crc": tensor_checksums(self.tensors)}


class _RayTrainer(_Trainer):
    """The trainer of Ray's relay (``RayWeightSyncScheme``): a Ray driver on
    host 0; its workers are actors it starts on the other hosts' nodes.
    An added worker is a new actor, added once it started (a node that was
    restarted joins first)."""

    def _scheme(self, args: argparse.Namespace) -> Any:
        import ray

        ray.init(address=args.ray_address, logging_level=logging.ERROR, log_to_driver=False)
        self.actor_class = ray.remote(num_cpus=0)(_RayActor)
        self.mib = args.mib
        scheme = ws.RayWeightSyncScheme(timeout=args.timeout, delta=self.delta, verify=True)
        self.actors = {h - 1: self._actor(scheme, h) for h in range(1, args.workers + 1)}
        scheme.init_on_sender(MODEL_ID, remote_collectors=list(self.actors.values()), model=self.tensors)
        # Actors being started: worker id -> (actor, its ready call, host, when asked).
        self.starting: dict[int, tuple[Any, Any, int, float]] = {}
        return scheme

    def _actor(self, scheme: Any, host: int) -> Any:
        return self.actor_class.options(resources={f"host{host}": 1}).remote(scheme, self.mib)

    def start(self) -> None:
        _emit({"store": {}})
        self.scheme.connect(timeout=START_WAIT)  # (the actors and relay agents start)

    def add(self, wid: int, host: int) -> None:
        try:
            actor = self._actor(self.scheme, host)
            self.starting[wid] = (actor, actor.ready.remote(), host, time.monotonic())
        except BaseException as exc:  # (Ctrl-C too: the orchestrator hears of every add)
            self._add_failed(wid, exc)

    def poll(self) -> None:
        import ray

        for wid, (actor, ready, _host, asked) in list(self.starting.items()):
            done, _ = ray.wait([ready], timeout=0)
            if not done and time.monotonic() - asked < START_WAIT:
                continue
            del self.starting[wid]
            try:
                ray.get(ready, timeout=0)
                self.scheme.add_worker(actor, worker_id=wid, timeout=START_WAIT)
                self.actors[wid] = actor
                _emit({"added": wid, "t0": asked, "t1": time.monotonic()})
            except BaseException as exc:  # (Ctrl-C too: the orchestrator hears of every add)
                if wid in self.scheme.sender_transports:
                    self.actors[wid] = actor  # (a worker still: later sends go to it)
                else:
                    with contextlib.suppress(Exception):
                        ray.kill(actor)
                self._add_failed(wid, exc)

    def removed(self, wid: int) -> None:
        self.actors.pop(wid, None)

    def _chains(self, chain: ws.ChainReport) -> tuple[list[list[int]], list[int]]:
        # The relay's chains are of nodes: each as the ranks of its actors.
        where = sorted(self.scheme.staging.node_of.items())
        ranks = [
            [wid + 1 for node in members for wid, at in where if at == node and wid in self.actors]
            for members, _ in chain.routes
        ]
        return ranks, list(chain.sent)

    def states(self) -> dict[str, Any]:
        import ray

        out: dict[str, Any] = {}
        for wid, actor in self.actors.items():
            try:
                out[str(wid)] = ray.get(actor.state.remote(), timeout=30)
            except Exception as exc:
                out[str(wid)] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        return out


# -- a worker (one per receiving host) --------------------------------------------


def worker_main(args: argparse.Namespace) -> None:
    tensors = {n: torch.zeros(s) for n, s in mlp_shapes(int(args.mib * MIB), 8).items()}
    scheme = ws.DistributedWeightSyncScheme(timeout=args.timeout)
    store = {"host": args.store_host, "port": args.store_port}
    scheme.init_on_worker(MODEL_ID, model=tensors, worker_idx=args.rank, store_info=store)
    with open(args.out + ".up", "w"):
        pass  # up: the orchestrator has the trainer add it now
    outcome = "closed"
    try:
        while True:
            scheme.receive(timeout=0.2)  # the collector's safe point
    except ws.SenderClosedError:
        pass
    except ws.SenderLostError:
        outcome = "lost"
    finally:
        version = scheme.get_receiver().version
        with open(args.out, "w") as out:
            json.dump(
                {"rank": args.rank, "version": version, "crc": tensor_checksums(tensors), "end": outcome}, out
            )
        scheme.shutdown()


# -- the orchestrator (the machine's own namespace) --------------------------------


@dataclass
class _Worker:
    rank: int
    host: int
    proc: subprocess.Popen[Any]
    out: str
    started: float
    ended: float | None = None  # killed by the schedule, or found exited
    added: bool = False  # the trainer was told to add it (once it was up)


@dataclass
class _Run:
    config: ChaosConfig
    cluster: EmulatedCluster
    tmp: str
    trainer: subprocess.Popen[str] | None = None
    store: dict[str, Any] = field(default_factory=dict)
    workers: list[_Worker] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    next_rank: int = 1
    #: Sends that named a healthy worker held back by a faulted host of its chain (judge()).
    held_back: list[int] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    # -- processes --------------------------------------------------------------
    def start_trainer(self) -> None:
        argv = [sys.executable, "-m", "weightsync.bench._chaos_hosts", "trainer",
                "--host", self.cluster.addresses[0], "--workers", str(self.config.hosts),
                "--mib", str(self.config.mib), "--timeout", str(self.config.timeout)]  # fmt: skip
        if self.config.delta:
            argv.append("--delta")
        if self.ray:
            assert self.cluster.ray_address is not None
            argv += ["--ray-address", self.cluster.ray_address]
        with open(os.path.join(self.tmp, "trainer.err"), "wb") as err:
            self.trainer = self.cluster.popen(
                0, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1
            )
        assert self.trainer.stdout is not None
        first = json.loads(self.trainer.stdout.readline() or "{}")
        if "store" not in first:
            raise RuntimeError(f"the chaos trainer did not start: {self.stderr('trainer')}")
        self.store = first["store"]
        threading.Thread(target=self._read_trainer, name="bench-chaos-trainer", daemon=True).start()

    def _read_trainer(self) -> None:
        assert self.trainer is not None and self.trainer.stdout is not None
        for line in self.trainer.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                with self.arrived:
                    (self.records if "send" in record else self.events).append(record)
                    self.arrived.notify_all()

    @property
    def ray(self) -> bool:
        return self.config.scheme == "ray"

    def start_worker(self, host: int, first: bool = False) -> _Worker:
        """A worker on ``host``: a process of its own; with Ray, the host's
        node (the trainer starts its actor: at once for the ``first``
        workers, else when told to add it)."""
        with self.lock:
            rank, self.next_rank = self.next_rank, self.next_rank + 1
        if self.ray:
            node = self.cluster.ray_nodes[host]
            if not first and node.poll() is not None:
                node = self.cluster.start_ray_node(host)  # (else a new actor on the node that runs)
            worker = _Worker(rank, host, node, "", time.monotonic())
            with self.lock:
                self.workers.append(worker)
            return worker
        out = os.path.join(self.tmp, f"rank{rank}.json")
        argv = [sys.executable, "-m", "weightsync.bench._chaos_hosts", "worker",
                "--store-host", str(self.store["host"]), "--store-port", str(self.store["port"]),
                "--rank", str(rank), "--mib", str(self.config.mib), "--timeout", str(self.config.timeout),
                "--out", out]  # fmt: skip
        with open(os.path.join(self.tmp, f"rank{rank}.err"), "wb") as err:
            proc = self.cluster.popen(host, argv, stdout=subprocess.DEVNULL, stderr=err)
        worker = _Worker(rank, host, proc, out, time.monotonic())
        with self.lock:
            self.workers.append(worker)
        return worker

    def stderr(self, name: str, tail: int = 1500) -> str:
        """The end of what process ``name`` (``trainer``, ``rank3``) wrote to
        stderr (the trainer's, with every thread's stack if it still runs)."""
        if name == "trainer" and self.trainer is not None and self.trainer.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.trainer.pid, signal.SIGUSR1)
                time.sleep(1.0)
            tail = max(tail, 6000)
        with contextlib.suppress(OSError), open(os.path.join(self.tmp, f"{name}.err"), errors="replace") as f:
            return f.read()[-tail:]
        return ""

    def command(self, line: str) -> None:
        assert self.trainer is not None and self.trainer.stdin is not None
        self.trainer.stdin.write(line + "\n")
        self.trainer.stdin.flush()

    def send_and_wait(self, line: str) -> dict[str, Any]:
        """Have the trainer make one send (a ``send`` command); its record.

        :raises RuntimeError: the trainer did not answer in time.
        """
        count = len(self.records)
        self.command(line)
        if not self.wait_for(lambda: len(self.records) > count, self.config.timeout * 3):
            raise RuntimeError(f"the chaos trainer did not answer {line!r}: {self.stderr('trainer')}")
        return self.records[-1]

    def wait_for(self, test: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while not test():
                left = deadline - time.monotonic()
                if left <= 0 or (self.trainer is not None and self.trainer.poll() is not None):
                    return test()
                self.arrived.wait(min(left, 0.5))
        return True

    def live(self, host: int) -> _Worker | None:
        with self.lock:
            mine = [w for w in self.workers if w.host == host and w.ended is None]
        return mine[-1] if mine else None

    def restart(self, host: int) -> None:
        """A new worker on ``host`` (a new rank); the trainer adds it once it
        is up (:meth:`supervise`), as a supervisor would."""
        self.start_worker(host)

    def add_those_up(self) -> None:
        """Have the trainer add each restarted worker that is up (it called
        ``init_on_worker``), once."""
        with self.lock:
            waiting = [
                w for w in self.workers if w.rank > self.config.hosts and not w.added and w.ended is None
            ]
        # (A Ray trainer adds an actor once it started: it is told at once.)
        ready = [w for w in waiting if self.ray or os.path.exists(w.out + ".up")]
        for worker in ready:
            worker.added = True
            self.command(f"add {worker.rank - 1} {worker.host}")

    def pending_adds(self) -> int:
        with self.lock:
            return sum(
                1 for w in self.workers if w.rank > self.config.hosts and not w.added and w.ended is None
            )

    def live_at(self, host: int, t: float) -> _Worker | None:
        """The worker running on ``host`` at ``t`` (None: none)."""
        with self.lock:
            mine = [
                w
                for w in self.workers
                if w.host == host and w.started <= t and (w.ended is None or w.ended > t)
            ]
        return mine[-1] if mine else None

    # -- the faults ---------------------------------------------------------------
    def apply(self, fault: Fault) -> None:
        fault.applied = time.monotonic()
        if fault.kind == "interrupt":
            assert self.trainer is not None
            os.kill(self.trainer.pid, signal.SIGINT)
        elif fault.kind == "kill":
            self.cluster.kill_host(fault.host, signal.SIGKILL)
            worker = self.live(fault.host)
            if worker is not None:
                worker.ended = time.monotonic()
        elif fault.kind == "cut":
            self.cluster.set_link(fault.host, False)
        elif fault.kind == "stop":
            self.cluster.kill_host(fault.host, signal.SIGSTOP)
        elif fault.kind == "slow":
            self.cluster.set_rate(fault.host, f"{int(self.cluster.bytes_per_second * 8 / 10)}bit")

    def heal(self, fault: Fault) -> None:
        if fault.kind == "kill":
            self.restart(fault.host)
        elif fault.kind == "cut":
            self.cluster.set_link(fault.host, True)
        elif fault.kind == "stop":
            self.cluster.kill_host(fault.host, signal.SIGCONT)
        elif fault.kind == "slow":
            self.cluster.set_rate(fault.host, None)
        fault.healed = time.monotonic()

    def supervise(self, faulted: set[int]) -> None:
        """A worker whose process ended on its own, or that the trainer
        removed, is started again (a new one, under a new rank), once its
        host is healthy."""
        # (The trainer removed those it lost: a process may outlive that.)
        removed = {wid for record in self.records for wid in record.get("removed", ())}
        with self.lock:
            ended = [
                w
                for w in self.workers
                if w.ended is None and (w.proc.poll() is not None or w.rank - 1 in removed)
            ]
            # One whose add failed before the scheme knew it (an actor that
            # died first, its node cut off meanwhile; an add interrupted by
            # Ctrl-C) is no worker: another is started. (Once each.)
            failed = {e["wid"] for e in self.events if "add_failed" in e and not e.get("known", True)}
            if failed:
                ended += [
                    w for w in self.workers if w.ended is None and w.rank - 1 in failed and w not in ended
                ]
        for worker in ended:
            worker.ended = time.monotonic()
            self.events.append({"exited": worker.rank, "host": worker.host, "t": worker.ended})
        self.add_those_up()
        for host in range(1, self.config.hosts + 1):
            if host not in faulted and self.live(host) is None:
                self.restart(host)

    def chaos(self, faults: list[Fault], sends: int) -> None:
        """Run ``faults`` (their ``at`` from now) until the trainer made
        ``sends`` sends, healing each when due; then heal what is left."""
        started = time.monotonic()
        pending = sorted(faults, key=lambda f: f.at)
        active: list[Fault] = []
        while len(self.records) < sends and self.trainer is not None and self.trainer.poll() is None:
            now = time.monotonic() - started
            for fault in [f for f in active if f.applied is not None and now >= f.at + f.seconds]:
                self.heal(fault)
                active.remove(fault)
            while pending and pending[0].at <= now:
                fault = pending.pop(0)
                self.apply(fault)
                self.faults.append(fault)
                if fault.kind != "interrupt":
                    active.append(fault)
            self.supervise({f.host for f in active})
            time.sleep(0.05)
        for fault in active:
            self.heal(fault)
        self.supervise(set())


def judge(run: _Run) -> list[str]:
    """What went wrong in ``run`` (see the module's docstring): [] when every
    rule held."""
    config = run.config
    problems: list[str] = []
    held_back: list[int] = []
    host_of = {w.rank - 1: w for w in run.workers}
    windows: dict[int, list[tuple[float, float]]] = {}
    for fault in run.faults:
        if fault.kind == "interrupt" or fault.applied is None:
            continue
        healed = fault.healed if fault.healed is not None else float("inf")
        windows.setdefault(fault.host, []).append((fault.applied, healed + RECOVERY))

    def faulted(host: int, t0: float, t1: float) -> bool:
        return any(a <= t1 and t0 <= b for a, b in windows.get(host, []))

    for record in run.records:
        t0, t1 = record["t0"], record["t1"]
        if record.get("interrupted"):
            continue
        if "unexpected" in record:
            problems.append(f"send {record['send']} raised {record['unexpected']}")
        if t1 - t0 > config.timeout + HANG_BOUND:
            problems.append(
                f"send {record['send']} took {t1 - t0:.2f} s, past its {config.timeout} s deadline"
            )
        if "staged" in record and record["staged"] - t0 > STAGE_BOUND:
            problems.append(f"send {record['send']}: send_async() took {record['staged'] - t0:.2f} s")
        for wid, kind in (record.get("failures") or {}).items():
            worker = host_of.get(int(wid))
            if worker is None:
                problems.append(f"send {record['send']} named worker {wid}, which was never started")
                continue
            gone = worker.ended is not None and worker.ended <= t1 + RECOVERY
            if kind not in ("WorkerLostError", "AckTimeoutError"):
                problems.append(
                    f"send {record['send']}: worker {wid} failed with {kind}: {record.get('message')}"
                )
            elif not gone and not faulted(worker.host, t0, t1):
                # A pipelined chain moves at its slowest hop's pace: a host
                # behind a faulted one in the send's chain may be held back
                # past the deadline. Counted, not a problem.
                chains = [chain for chain in record.get("chains", []) if worker.rank in chain]
                chained = {rank for chain in chains for rank in chain}
                hosts = {host_of[r - 1].host for r in chained if r - 1 in host_of}
                if kind == "AckTimeoutError" and any(faulted(h, t0, t1) for h in hosts - {worker.host}):
                    held_back.append(record["send"])
                    continue
                problems.append(
                    f"send {record['send']} named worker {wid} ({kind}) on host {worker.host}, which was "
                    f"neither faulted nor gone during it: {record.get('message')}; {_context(run, record)}"
                )
    run.held_back = held_back
    return problems


def _context(run: _Run, record: dict[str, Any]) -> str:
    """What happened around ``record``'s send, for a problem's message: the
    send before it and the faults within :data:`RECOVERY` s of it (times
    from the send's start)."""
    t0, t1 = record["t0"], record["t1"]
    before = [r for r in run.records if r["send"] == record["send"] - 1]
    previous = "none"
    if before:
        r = before[0]
        failed = r.get("failures") or r.get("unexpected")
        outcome = f"ok in {r['t1'] - r['t0']:.2f} s" if r.get("ok") else str(failed)
        previous = f"{outcome}, ended {t0 - r['t1']:.2f} s before"
    faults = [
        f"{f.kind} host {f.host} at {f.applied - t0:+.2f} s"
        + (f" healed {f.healed - t0:+.2f} s" if f.healed is not None else "")
        for f in run.faults
        if f.applied is not None
        and f.applied <= t1 + RECOVERY
        and (f.healed is None or f.healed >= t0 - RECOVERY or f.kind == "interrupt")
        and f.applied >= t0 - 60
    ]
    chains = record.get("chains")
    return f"took {t1 - t0:.2f} s; chains {chains}; the send before: {previous}; faults near: {faults}"


def _figures(run: _Run, calm_end: float, chaos_end: float, resources: list[dict[str, Any]]) -> dict[str, Any]:
    records = [r for r in run.records if not r.get("interrupted")]
    calm = [r for r in records if r["t1"] <= calm_end]
    chaos = [r for r in records if calm_end < r["t0"] and r["t1"] <= chaos_end]
    calm_start = min((r["t0"] for r in calm), default=calm_end)
    heal_to_latest = []
    for fault in run.faults:
        if fault.healed is None or fault.kind == "interrupt":
            continue
        for record in records:
            if record["t0"] < fault.healed or not record.get("ok"):
                continue
            worker = run.live_at(fault.host, record["t0"])
            if worker is not None and worker.rank - 1 in record["targets"]:
                heal_to_latest.append((fault.kind, record["t1"] - fault.healed))
                break
    by_kind: dict[str, list[float]] = {}
    for kind, seconds in heal_to_latest:
        by_kind.setdefault(kind, []).append(seconds)
    return {
        "sends": len(run.records),
        "interrupted": sum(1 for r in run.records if r.get("interrupted")),
        "held_back_by_a_faulted_chain_member": len(run.held_back),
        "failed": sum(1 for r in records if not r.get("ok")),
        "calm_per_minute": 60 * len(calm) / max(calm_end - calm_start, 1e-9),
        "chaos_per_minute": 60 * len(chaos) / max(chaos_end - calm_end, 1e-9),
        "worst_past_deadline_s": max((r["t1"] - r["t0"] - run.config.timeout for r in records), default=0.0),
        "worst_stage_s": max((r["staged"] - r["t0"] for r in records if "staged" in r), default=0.0),
        "heal_to_latest_s": {
            k: {"median": statistics.median(v), "max": max(v), "n": len(v)} for k, v in by_kind.items()
        },
        "faults": {k: sum(1 for f in run.faults if f.kind == k) for k in _KINDS},
        "trainer_fds": [r["fds"] for r in resources],
        "trainer_ray_grpc_fds": [r.get("ray_grpc", 0) for r in resources],
        "trainer_rss_mib": [round(r["rss"] / MIB, 1) for r in resources],
        "trainer_ray_store_rss_mib": [round(r.get("ray_store_rss", 0) / MIB, 1) for r in resources],
    }


def _missed_versions(run: _Run) -> dict[str, Any]:
    """Bytes the trainer puts on the wire for a send after host 1's worker
    missed ``k`` versions (sent to the others only), against a send all kept
    up with, and the full bytes."""
    figures: dict[str, Any] = {}
    worker = run.live(1)
    if worker is None:
        return figures
    others = sorted(w.rank - 1 for w in run.workers if w.ended is None and w.host != 1)
    everyone = sorted(w.rank - 1 for w in run.workers if w.ended is None)

    def one(ids: list[int]) -> dict[str, Any]:
        return run.send_and_wait(f"send {json.dumps(ids, separators=(',', ':'))}")

    one(everyone)
    kept_up = one(everyone)
    figures["kept_up"] = {"wire": kept_up["wire"], "delta": kept_up["delta"], "ok": kept_up.get("ok")}
    for k in run.config.missed:
        for _ in range(k):
            one(others)
        after = one(everyone)
        # What host 1's own chain carried (the others' delta is in "wire" too).
        chains = zip(after["chains"], after["chain_wire"], strict=False)
        own = [carried for chain, carried in chains if worker.rank in chain]
        figures[f"missed_{k}"] = {
            "wire": after["wire"], "host_wire": sum(own), "delta": after["delta"], "ok": after.get("ok"),
        }  # fmt: skip
    return figures


def run_chaos(config: ChaosConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one soak (see the module's docstring); its figures, its problems
    (``judge``) and its schedule. Needs root and iproute2 (an emulated
    cluster)."""
    say = progress or (lambda text: None)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    nbytes = sum(int(torch.Size(s).numel()) * 4 for s in mlp_shapes(int(config.mib * MIB), 8).values())
    with (
        tempfile.TemporaryDirectory(prefix="ws-chaos-") as tmp,
        EmulatedCluster(config.hosts + 1, config.rate) as cluster,
    ):
        run = _Run(config, cluster, tmp)
        problems: list[str] = []
        try:
            if run.ray:
                say("starting a Ray node on every host")
                cluster.start_ray(cpus=2, object_store_mib=512)
            run.start_trainer()
            for host in range(1, config.hosts + 1):
                run.start_worker(host, first=True)
            if not run.wait_for(lambda: any("connected" in e for e in run.events), START_WAIT):
                raise RuntimeError(
                    f"the chaos trainer's workers did not connect: {run.stderr('trainer')} "
                    + " ".join(run.stderr(f"rank{w.rank}", 600) for w in run.workers)
                )
            say(f"connected; {config.calm} calm sends")
            run.wait_for(lambda: len(run.records) >= config.calm, config.calm * (config.timeout + HANG_BOUND))
            calm_end = time.monotonic()
            # The faults' times are seconds from now; the schedule spans about
            # as long as the sends take with faults (it stops with them).
            horizon = (config.sends - config.calm) * (config.timeout + HANG_BOUND)
            faults = schedule(config.seed, config.hosts, horizon, config.gap)
            say(f"chaos: {config.sends - config.calm} sends, a fault every {config.gap:g} s on average")
            run.chaos(faults, config.sends)
            chaos_end = time.monotonic()
            run.command("done")
            if not run.wait_for(lambda: any("soaked" in e for e in run.events), START_WAIT):
                raise RuntimeError(f"the chaos trainer did not stop sending: {run.stderr('trainer')}")

            # Every fault healed: wait for the restarted workers, then a send must reach all.
            def all_added() -> bool:
                run.supervise(set())
                asked = sum(1 for w in run.workers if w.added)
                answered = sum(1 for e in run.events if "added" in e or "add_failed" in e)
                return run.pending_adds() == 0 and answered >= asked

            healed = run.wait_for(all_added, START_WAIT)
            if not healed:
                problems.append("a restarted worker was not added in time")
            final: dict[str, Any] = {}
            for _ in range(3):
                run.send_and_wait("send")
                final = run.records[-1]
                if final.get("ok"):
                    break
            if not final.get("ok"):
                problems.append(f"no send reached every worker once every fault was healed: {final}")
            say("the versions a host missed")
            missed = _missed_versions(run)
            count = len(run.events)
            run.command("crc")
            run.wait_for(lambda: any("crc" in e for e in run.events[count:]), 30)
            crc = next(e for e in run.events[count:] if "crc" in e)
            run.command("quit")
            run.wait_for(lambda: any("bye" in e for e in run.events), 60)
            assert run.trainer is not None
            run.trainer.wait(timeout=60)
            for worker in run.workers:
                if worker.ended is None and not run.ray:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        worker.proc.wait(timeout=30)
            for worker in run.workers:
                if worker.ended is not None:
                    continue
                try:
                    if run.ray:  # (the trainer asked its actors)
                        state = crc["workers"].get(str(worker.rank - 1), {})
                    else:
                        with open(worker.out) as handle:
                            state = json.load(handle)
                except (OSError, json.JSONDecodeError):
                    state = {}
                if "version" not in state:
                    problems.append(
                        f"worker {worker.rank - 1} (host {worker.host}) left no final state: {state}"
                    )
                    continue
                if state["version"] != crc["version"] or state["crc"] != crc["crc"]:
                    problems.append(
                        f"worker {worker.rank - 1} (host {worker.host}) ended at version {state['version']}, "
                        f"the trainer at {crc['version']}, or its bytes differ"
                    )
            problems += judge(run)
            resources = [r for r in run.records if "fds" in r]
            figures = _figures(run, calm_end, chaos_end, resources)
            figures.update(missed_versions=missed, full_bytes=nbytes)
            if len(resources) >= 8:
                half = len(resources) // 2
                # (Ray's gRPC connections apart: Ray keeps them as it sees fit.)
                early = statistics.median(r["fds"] - r.get("ray_grpc", 0) for r in resources[:half])
                late = statistics.median(r["fds"] - r.get("ray_grpc", 0) for r in resources[half:])
                if late > early + 8:
                    grew = f"grew from {early} to {late}"
                    problems.append(f"the trainer's descriptors (Ray's gRPC apart) {grew}")
                rss_early = statistics.median(r["rss"] for r in resources[:half])
                rss_late = statistics.median(r["rss"] for r in resources[half:])
                if rss_late > rss_early + 4 * nbytes:
                    problems.append(
                        f"the trainer's memory grew from {rss_early / MIB:.0f} to {rss_late / MIB:.0f} MiB"
                    )
        except Exception as exc:
            # The processes' stderr outlives the run, for the error's reader.
            kept = shutil.copytree(tmp, tempfile.mkdtemp(prefix="ws-chaos-failed-"), dirs_exist_ok=True)
            with open(os.path.join(kept, "record.json"), "w") as record:
                applied = [asdict(f) for f in run.faults]
                json.dump({"events": run.events, "sends": run.records, "schedule": applied}, record)
            raise RuntimeError(f"{exc} (every process's stderr is kept in {kept})") from exc
        finally:
            if run.trainer is not None and run.trainer.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.trainer.pid, signal.SIGKILL)
        cluster.close()
        left = cluster.namespaces_left()
        if left:
            problems.append(f"namespaces left behind: {left}")
    # (Every host shares this machine's /dev/shm: weightsync's segments are
    # memfds, never named there; Ray's object stores go with their nodes.)
    shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before) if os.path.isdir("/dev/shm") else []
    if shm_left:
        problems.append(f"shared memory left behind in /dev/shm: {shm_left[:10]}")
    return {
        "config": asdict(config),
        "figures": figures,
        "problems": problems,
        "schedule": [asdict(f) for f in run.faults],
        "events": run.events,
        "sends": run.records,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m weightsync.bench._chaos_hosts")
    sub = parser.add_subparsers(dest="role", required=True)
    trainer = sub.add_parser("trainer")
    trainer.add_argument("--host", required=True)
    trainer.add_argument("--workers", type=int, required=True)
    trainer.add_argument("--mib", type=float, required=True)
    trainer.add_argument("--timeout", type=float, required=True)
    trainer.add_argument("--delta", action="store_true")
    trainer.add_argument("--ray-address", help="Ray's relay (RayWeightSyncScheme), workers as actors")
    worker = sub.add_parser("worker")
    worker.add_argument("--store-host", required=True)
    worker.add_argument("--store-port", type=int, required=True)
    worker.add_argument("--rank", type=int, required=True)
    worker.add_argument("--mib", type=float, required=True)
    worker.add_argument("--timeout", type=float, required=True)
    worker.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.role == "trainer":
        trainer_main(args)
    else:
        worker_main(args)


if __name__ == "__main__":
    main()
