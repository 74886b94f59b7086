"""``weightsync bench --sharded-trainer RxT --emulate-hosts N``: a sharded
trainer (FSDP2's ``fully_shard``, ``T`` trainer hosts of ``R`` ranks each)
sending to whole-copy workers on the other hosts of an emulated cluster,
two ways, each send verified bit for bit outside the timing (CRC32 of each
rank's rows of every tensor on every worker against that rank's own shard:
no rank gathers to check):

- ``weightsync``: every rank's ``DistributedWeightSyncScheme.send()`` (a
  sender group: each rank sends its own part, in a chain that starts at
  another receiving host), timed on rank 0 from a barrier of the ranks to
  its return;
- ``gather``: what a trainer does without a sender group: every rank's
  ``full_tensor()`` of every parameter (an all-gather over the trainer's
  hosts), then rank 0 sends the whole model with a single-sender
  ``DistributedWeightSyncScheme``.

Each rank's peak RSS is read after the ``weightsync`` sends, before any
gather (a rank never holds more than its shard and the chunks in flight),
and again at the end.

With ``worker_tp`` G > 1 the workers are replicas of a tensor-parallel
policy, G hosts each (every tensor sharded over the replica, by rows or by
columns): each worker takes in only its S/G bytes, the floor is
(S/G)/B, and there is no gather row (a single sender sends whole tensors).

Processes: :func:`run_sharded` starts ``python -m
weightsync.bench._sharded_procs rank ...`` on the trainer hosts (a gloo
group through a file rendezvous: the hosts share this machine's
filesystem) and ``... worker ...`` on the others, each a whole copy of the
model under both schemes; rank 0 drives the workers through a control
store, as ``_dist_hosts`` does, and prints one JSON row.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from ._netns import EmulatedCluster

__all__ = ["MIB", "TIMEOUT", "format_sharded_table", "run_sharded"]

MIB = 1 << 20
#: How long any step of the case may take (s).
TIMEOUT = 300.0
# An emulated host has no name its resolver knows: c10d warns so on every
# store connection. Its errors still show.
_QUIET = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
# The port of the first tensor-parallel replica's gloo rendezvous (the next
# replicas take the next ports), on its first member's host.
_GROUP_PORT = 29710


# -- on the emulated cluster ------------------------------------------------------


def run_sharded(
    trainer_hosts: int,
    ranks_per_host: int,
    hosts: int,
    mib: float,
    repeats: int,
    rate: str = "1gbit",
    progress: Callable[[str], None] | None = None,
    local_workers: int = 0,
    worker_tp: int = 1,
    fault: tuple[str, int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """A cluster of ``trainer_hosts`` + ``hosts`` emulated hosts at ``rate``:
    ``ranks_per_host`` trainer ranks on each trainer host, one worker on
    each other host; or (``local_workers``, with ``hosts=0`` and one
    trainer host) that many workers on the trainer's host; ``worker_tp``:
    the workers are replicas of that many tensor-parallel members, on
    consecutive hosts; ``fault`` (``("kill", K)`` or ``("stop", K)``):
    after the timed sends trainer rank K (1 or more: rank 0 drives the
    run) is killed, or stopped until the others raised, a quarter of its
    fastest timed send into one more send, in place of the gather rows (a
    send that ends before its fault fires is sent again, the fault a
    quarter of the way into it; the row's ``fault``: each rank's outcome,
    what each worker holds, the tries, and for a stop, the time of the
    send after it); or ``("soak", N)``: N more sends
    under the seeded faults of ``_sharded_procs.soak_schedule`` (``seed``),
    each judged (the row's ``fault``: each round, and the violations).
    Returns rank 0's row and the link rate (bytes/s). Needs root.

    :raises RuntimeError: a process failed.
    """
    log = progress or (lambda text: None)
    world = trainer_hosts * ranks_per_host
    if local_workers and (hosts or trainer_hosts != 1):
        raise ValueError("local_workers runs everything on one host: trainer_hosts=1, hosts=0")
    workers_count = local_workers or hosts
    if worker_tp < 1 or workers_count % worker_tp:
        raise ValueError(f"{workers_count} workers do not make replicas of {worker_tp}")
    if fault is not None and fault[0] == "soak":
        if fault[1] < 1:
            raise ValueError(f"a soak of {fault[1]} sends")
    elif fault is not None and (fault[0] not in ("kill", "stop") or not 0 < fault[1] < world):
        raise ValueError(f"fault {fault}: kill or stop, a rank of 1 to {world - 1} (rank 0 drives the run)")
    with (
        tempfile.TemporaryDirectory(prefix="ws-sharded-") as tmp,
        EmulatedCluster(trainer_hosts + hosts, rate) as cluster,
    ):
        log(
            f"emulated cluster: {trainer_hosts} trainer hosts x {ranks_per_host} ranks, "
            f"{hosts} receiving hosts, {rate}"
        )
        init = os.path.join(tmp, "rendezvous")
        module = [sys.executable, "-m", "weightsync.bench._sharded_procs"]
        ranks = []
        for rank in range(world):
            host = rank // ranks_per_host
            argv = [
                *module,
                "rank",
                str(rank),
                str(world),
                init,
                cluster.addresses[host],
                str(mib),
                str(repeats),
                str(workers_count),
                str(worker_tp),
                *(["--fault", f"{fault[0]}:{fault[1]}", "--seed", str(seed)] if fault is not None else []),
                *(["--one-host"] if local_workers else []),
            ]
            out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
            with open(os.path.join(tmp, f"rank{rank}.err"), "w") as err:
                # (The trainer's own gloo group binds its host's NIC, not the
                # loopback its host name resolves to in a namespace.)
                env = {**_QUIET, "GLOO_SOCKET_IFNAME": "eth0"}
                ranks.append(cluster.popen(host, argv, env=env, stdout=out, stderr=err, text=True))
        workers = []
        try:
            first = ranks[0].stdout.readline().split() if ranks[0].stdout is not None else []
            if first[:1] != ["PORTS"]:
                ranks[0].wait(timeout=60)
                raise RuntimeError(f"rank 0 did not start: {_tail(tmp, world)}")
            for w in range(1, workers_count + 1):
                host = 0 if local_workers else trainer_hosts + w - 1
                # A replica's gloo group meets at its first member's host.
                leader = host - (w - 1) % worker_tp if not local_workers else 0
                group = f"{cluster.addresses[leader]}:{_GROUP_PORT + (w - 1) // worker_tp}"
                argv = [*module, "worker", cluster.addresses[0], *first[1:5], str(w), str(mib)]
                argv += [str(worker_tp), group]
                env = {**_QUIET, "GLOO_SOCKET_IFNAME": "eth0"} if worker_tp > 1 else _QUIET
                workers.append(cluster.popen(host, argv, env=env, stdout=subprocess.DEVNULL))
            out, _ = ranks[0].communicate(timeout=TIMEOUT * 2)
            rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            if ranks[0].returncode != 0 or not rows:
                raise RuntimeError(f"rank 0 failed: {_tail(tmp, world)}")
            return {
                "row": rows[-1],
                "bytes_per_second": cluster.bytes_per_second,
                "rate": rate,
                # (On one host no NIC carries the bytes: no floor S/B.)
                "one_host": bool(local_workers),
            }
        finally:
            for proc in [*ranks, *workers]:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _tail(tmp: str, world: int) -> str:
    """The end of each rank's stderr."""
    said = []
    for rank in range(world):
        with open(os.path.join(tmp, f"rank{rank}.err")) as err:
            said.append(f"rank {rank}: {err.read()[-1500:]}")
    return "\n".join(said)


def _growth(row: dict[str, Any], key: str) -> str:
    return "[" + ", ".join(f"{b - a:.0f}" for a, b in zip(row["rss_start_mib"], row[key], strict=True)) + "]"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _x(seconds: float, floor: float | None) -> str:
    return "-" if floor is None else f"{seconds / floor:.2f}x"


def _faulted(row: dict[str, Any]) -> list[str]:
    """The lines of the faulted rank's send: each rank's outcome, what the
    workers (each tensor-parallel replica) hold after it, and for a stop,
    the send after it."""
    fault = row.get("fault")
    if not fault:
        return []
    if fault["kind"] == "soak":
        return _soaked(fault)
    killed = fault["kind"] == "kill-rank"
    what = "killed (SIGKILL)" if killed else "stopped (SIGSTOP, until the others raised)"
    lines = [
        f"rank {fault['rank']} {what} {fault['after_s'] * 1e3:.0f} ms into a send of deadline "
        f"{fault['deadline_s']:g} s:",
        *_tries(fault),
    ]
    for rank, (kind, text, seconds) in fault["outcomes"].items():
        # (Its first sentence: the rest says what the workers hold.)
        lines.append(f"  rank {rank}: {kind} after {seconds:.2f} s: {text.split('. ')[0][:200]}")
    tp = int(row.get("tp", 1))
    states = fault["workers"]
    replicas = [states[i : i + tp] for i in range(0, len(states), tp)]
    counts = {s: states.count(s) for s in ("old", "new", "mixed")}
    split = sum(1 for r in replicas if len(set(r)) > 1)
    lines.append(
        f"  workers: {counts['old']} on the version before, {counts['new']} on the new one, "
        f"{counts['mixed']} holding a mix"
        + (f"; replicas of {tp} on two versions: {split} of {len(replicas)}" if tp > 1 else "")
    )
    if "recovered_s" in fault:
        lines.append(
            f"  then every rank's next send: {fault['recovered_s'] * 1e3:.0f} ms, every worker holding it"
        )
    return lines


def _tries(record: dict[str, Any]) -> list[str]:
    """A line on the sends a fault missed, if any (each ended before it
    fired, and was sent again with the fault sooner)."""
    tries = int(record.get("tries", 1))
    if record.get("missed"):
        return [f"  (every one of {tries} sends ended before its fault: nothing was faulted)"]
    if tries > 1:
        return [f"  ({tries - 1} send(s) before it ended before the fault fired; each was sent again)"]
    return []


def _soaked(soak: dict[str, Any]) -> list[str]:
    """The lines of a soak: a line per send (its fault, each rank's outcome
    in short, what the workers hold), then the violations."""
    lines = [f"soak of {len(soak['rounds'])} sends (seed {soak['seed']}), deadline 6 s each:"]
    for i, record in enumerate(soak["rounds"]):
        kind, target = record["kind"], record["rank"]
        what = "calm" if kind == "none" else f"{kind.replace('-', ' ')} {target}"
        said = ", ".join(
            f"{rank}: {'ok' if o[0] == 'none' else o[0]} {o[2]:.1f} s"
            for rank, o in record["outcomes"].items()
        )
        held = "/".join(record["workers"])
        lines.append(f"  {i:>2} {what:<14} ranks {said}; workers {held}")
        lines += ["   " + line for line in _tries(record)]
    violations = soak["violations"]
    lines.append(f"violations: {len(violations)}" + "".join(f"\n  {v}" for v in violations))
    return lines


def format_sharded_table(result: dict[str, Any]) -> str:
    """Median ms of each way and x the floor S/B (each worker takes in S
    bytes through one NIC of B bytes/s; S/G for tensor-parallel members of
    G), and the ranks' peak RSS."""
    row, rate = result["row"], result["bytes_per_second"]
    tp = int(row.get("tp", 1))
    # On one host no NIC carries the bytes: the columns say "-".
    floor = None if result.get("one_host") else row["bytes"] / tp / rate
    ws_med = statistics.median(row["weightsync"])
    if not row["gather"]:
        lines = [
            f"{'ranks':>5} {'workers':>7} {'TP':>3} {'MiB':>6} {'floor ms':>9} {'weightsync ms':>14} "
            f"{'x floor':>7}",
            f"{row['ranks']:>5} {row['workers']:>7} {tp:>3} {row['mib']:>6g} {_ms(floor):>9} "
            f"{ws_med * 1e3:>14.0f} {_x(ws_med, floor):>7}",
            f"(each worker holds 1/{tp} of every tensor and takes in S/{tp}: floor (S/{tp})/B; no gather "
            "row: a single sender sends whole tensors)"
            if tp > 1
            else "(no gather row: a rank was killed or stopped instead)",
            f"peak RSS per rank over its RSS before the first send, MiB (shard "
            f"{row['bytes'] / row['ranks'] / MIB:.0f} MiB): {_growth(row, 'rss_after_sharded_mib')}",
            *_busy(row),
            *_faulted(row),
        ]
        return "\n".join(lines)
    gather_med = statistics.median(row["gather"])
    shard = row["bytes"] / row["ranks"] / MIB
    single = statistics.median(row["single_send"]) if row.get("single_send") else None
    alone = (
        f"rank 0's single-sender send of the gathered model alone: {single * 1e3:.0f} ms "
        f"(weightsync / it: {ws_med / single:.2f}x)"
        if single
        else ""
    )
    if row.get("hopped_send"):
        hopped = statistics.median(row["hopped_send"])
        alone += (
            f"; through a host leader (share_from_trainer=False: the single sender before it fed its "
            f"own host from its staging buffer): {hopped * 1e3:.0f} ms "
            f"(weightsync / it: {ws_med / hopped:.2f}x)"
        )
    lines = [
        f"{'ranks':>5} {'workers':>7} {'MiB':>6} {'floor ms':>9} {'weightsync ms':>14} {'x floor':>7} "
        f"{'gather+send ms':>15} {'x floor':>7} {'gather/ws':>9}",
        f"{row['ranks']:>5} {row['workers']:>7} {row['mib']:>6g} {_ms(floor):>9} {ws_med * 1e3:>14.0f} "
        f"{_x(ws_med, floor):>7} {gather_med * 1e3:>15.0f} {_x(gather_med, floor):>7} "
        f"{gather_med / ws_med:>8.2f}x",
        f"peak RSS per rank over its RSS before the first send, MiB (shard {shard:.0f} MiB): after the "
        f"weightsync sends {_growth(row, 'rss_after_sharded_mib')}, "
        f"after the gathers {_growth(row, 'rss_end_mib')}",
        alone,
        *_busy(row),
    ]
    return "\n".join(lines)


def _busy(row: dict[str, Any]) -> list[str]:
    """The machine's CPU use during the timed sends (every emulated host
    shares its cores): near 100 %, the CPU, not the links, bounds them."""
    if row.get("cpu_busy") is None:
        return []
    return [f"the machine's cores were busy {row['cpu_busy']:.0%} of the time during weightsync's sends"]
