"""The ``weightsync`` command line (the ``weightsync`` script, and
``python -m weightsync``). ``weightsync bench`` times full sends and compares
them with memcpy of the same bytes; see :mod:`weightsync.bench._run`."""

from __future__ import annotations

import argparse
import io
import json
import sys
import textwrap
import time
from collections.abc import Sequence

from ._compare import resolve
from ._machine import cuda_facts, describe_devices, describe_machine, machine_facts
from ._plot import PlotUnavailableError, require_matplotlib, write_plot
from ._progress import Progress
from ._run import run_bench
from ._table import (
    DEVICE_FLOOR_NOTE,
    FLOOR_NOTE,
    WIDTH,
    columns_for,
    device_copy_lines,
    format_row,
    legend,
    startup_lines,
    table_header,
)
from ._trajectories import TRAJECTORIES
from ._types import (
    ALTERNATIVES,
    DTYPES,
    LOCAL_SCHEMES,
    MAX_ROUNDS_FACTOR,
    MEMORY_METHOD,
    SCHEMES,
    BenchConfig,
    BenchError,
    CaseResult,
    VerificationError,
    cuda_unavailable,
    parse_device,
    placement_unavailable,
)

__all__ = ["main"]

_DEFAULTS = BenchConfig()


def _parser() -> argparse.ArgumentParser:
    # Imported here: ``python -m weightsync.bench._delta_bench`` imports this package first.
    from ._delta_bench import delta_legend

    parser = argparse.ArgumentParser(
        prog="weightsync", description="Move model weights from a trainer to its workers."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    known, alternatives = (
        "\n".join(f"  {i.name:<14} " + f"[copy: {i.copy}, torn: {i.torn}] " + i.summary for i in infos)
        for infos in (SCHEMES.values(), ALTERNATIVES.values())
    )
    columns = (
        "columns (the default table shows the first ones; --wide all of them):\n"
        + legend(columns_for(True, True, wide=True))
        + (
            f"\n\n+MiB T/W: {MEMORY_METHOD} (RSS counts touched shared pages in every process mapping "
            "them; per process in the results file)."
        )
    )
    bench = commands.add_parser(
        "bench",
        help="time full sends (every ack in) against memcpy of the same bytes",
        description=(
            "Time scheme.send() (the whole send: every worker applied and acked) for each "
            "combination of scheme, size, workers and tensors; verify after every send that each "
            "worker holds exactly the trainer's weights; compare with a single-threaded memcpy and "
            "with the floor of (workers+1) memcpys (their bytes at the machine's memory bandwidth, or "
            "the chain of two copies in sequence, whichever is larger), measured in the same run."
        ),
        epilog=f"known schemes:\n{known}\nalternatives (--compare):\n{alternatives}\n\n{columns}"
        f"\n\ncolumns of --delta (medians over the steps):\n{delta_legend()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--scheme",
        nargs="+",
        choices=[*sorted(SCHEMES), "all"],
        default=None,
        metavar="NAME",
        help=f"schemes to run, or all (default: the local ones, {' '.join(LOCAL_SCHEMES)}; known: "
        f"{', '.join(sorted(SCHEMES))}; all, or the default, skips one that cannot run here (ray "
        "without the ray extra), with a note)",
    )
    bench.add_argument(
        "--compare",
        nargs="+",
        choices=[*ALTERNATIVES, "all"],
        default=[],
        metavar="NAME",
        help="also run these alternatives to weightsync, or all, with the same model and sizes "
        f"(known: {', '.join(ALTERNATIVES)}; one that cannot run here is skipped with a note)",
    )
    bench.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=_DEFAULTS.dtype,
        metavar="DTYPE",
        help=f"element type of the generated model (default: %(default)s; known: {', '.join(DTYPES)})",
    )
    bench.add_argument(
        "--size",
        nargs="+",
        type=float,
        default=list(_DEFAULTS.sizes_mib),
        metavar="MIB",
        help="bytes of weights, in MiB (default: %(default)s)",
    )
    bench.add_argument(
        "--workers",
        nargs="+",
        type=int,
        default=list(_DEFAULTS.workers),
        metavar="N",
        help="numbers of workers: processes, or Ray actors for ray and ray-put (default: %(default)s)",
    )
    bench.add_argument(
        "--tensors",
        nargs="+",
        type=int,
        default=list(_DEFAULTS.tensors),
        metavar="N",
        help="numbers of tensors the bytes are split into (default: %(default)s)",
    )
    bench.add_argument(
        "--partial",
        nargs="+",
        type=float,
        default=list(_DEFAULTS.partials),
        metavar="FRACTION",
        help="fractions of the model each send writes, as partial updates of its first tensors by "
        "name (weightsync's schemes only; use many --tensors for small fractions; the sent column "
        "shows the share moved; memcpy and floor stay those of the whole model) (default: %(default)s)",
    )
    bench.add_argument(
        "--verify",
        action="store_true",
        help="run each of weightsync's cases twice: unchecked, and with send(verify=True) (every "
        "tensor digested by the trainer and checked by each worker); needs the verify extra",
    )
    bench.add_argument(
        "--blocking",
        action="store_true",
        help="time each of weightsync's sends as one blocking send(), as the README's trainer calls "
        "it, instead of send_async() then wait_async() (no stall is measured)",
    )
    bench.add_argument(
        "--check-once",
        action="store_true",
        help="check each worker once, after the last send, instead of after every send (weightsync's "
        "cases and bare-tight alike), so that no worker's check runs while another still applies a "
        "timed send (worker processes only, not ray)",
    )
    for side, who in (("trainer", "the trainer's model"), ("worker", "every worker's model")):
        bench.add_argument(
            f"--{side}-device",
            type=_device,
            default="cpu",
            metavar="DEVICE",
            help=f"where {who} lives: cpu, cuda or cuda:N (default: cpu); with a CUDA device the floor "
            "is that of the placement (D2D, page-locked D2H and H2D copies timed in the same run), the "
            "checks compare CPU copies of the bytes, and what cannot run there is skipped with a note",
        )
    bench.add_argument(
        "--repeats", type=int, default=_DEFAULTS.repeats, help="timed sends per case (default: %(default)s)"
    )
    bench.add_argument(
        "--warmup", type=int, default=_DEFAULTS.warmup, help="untimed sends first (default: %(default)s)"
    )
    bench.add_argument(
        "--min-time",
        type=float,
        default=0.25,
        metavar="SECONDS",
        help="a case goes on sending past --repeats until its timed sends took this long in all, "
        f"up to {MAX_ROUNDS_FACTOR}x --repeats sends, so that a small case's median stands on enough "
        "sends (default: %(default)s; 0: exactly --repeats)",
    )
    bench.add_argument(
        "--timeout",
        type=float,
        default=_DEFAULTS.timeout,
        help="deadline of each send, and of each wait for a worker, in seconds (default: %(default)s)",
    )
    bench.add_argument(
        "--worker-threads",
        type=int,
        default=_DEFAULTS.worker_threads,
        metavar="N",
        help="torch threads in each worker; 0: torch's default (default: %(default)s)",
    )
    bench.add_argument(
        "--json",
        metavar="PATH",
        help="write the raw samples and machine facts there (default: no results file)",
    )
    bench.add_argument(
        "--no-json", action="store_true", help="write no results file (the default; kept for old scripts)"
    )
    bench.add_argument(
        "--wide", action="store_true", help="print every column (p10/max, GB/s, memcpy, memory...)"
    )
    bench.add_argument(
        "--plot",
        metavar="PATH",
        help="also write a PNG of median latency against size to PATH, per scheme, one line per worker "
        "count (and per kind of send with --verify or --partial, each named in the legend), the floor "
        "dashed (needs matplotlib: the plot extra)",
    )
    bench.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr even when it is not a terminal (on a terminal it always shows)",
    )
    across = bench.add_argument_group(
        "across hosts (Ray scheme against the network floor, ray put/get and gloo broadcast, or with "
        "--scheme distributed, the torch.distributed scheme against gloo broadcast and a gloo star; see "
        "docs/distributed.md)"
    )
    across.add_argument(
        "--emulate-hosts",
        type=int,
        metavar="N",
        help="make an emulated cluster of N hosts on this machine (network namespaces, a Ray node in "
        "each, the trainer on the first), with NICs of --link-rate; needs root and iproute2. Its table's "
        "'cluster cpu' is the share of this machine's CPUs the emulated hosts used during weightsync's "
        "sends, and 'host core-ms/GiB' the CPU time (user + system, summed over cores) that one "
        "receiving host's processes (relay agent, actors, raylet) spent per relayed send, per GiB sent",
    )
    across.add_argument(
        "--link-rate",
        metavar="RATE",
        help="NIC speed of each emulated host (default: 1gbit); under torchrun, of each real host's "
        "NIC, for the floor S/B (default: none, GB/s per worker is shown instead)",
    )
    across.add_argument(
        "--cluster",
        action="store_true",
        help="run on the Ray cluster this machine belongs to (ray.init(address='auto')), one receiving "
        "host per node but this one",
    )
    across.add_argument(
        "--hosts",
        type=int,
        nargs="+",
        metavar="H",
        help="receiving host counts to run (default: 2 3 5 7, those that fit)",
    )
    across.add_argument(
        "--per-host",
        type=int,
        default=1,
        metavar="K",
        help="actors (workers, for --scheme distributed) per receiving host (default: 1)",
    )
    across.add_argument("--no-peers", action="store_true", help="time weightsync only, without the two peers")
    across.add_argument(
        "--sharded-trainer",
        metavar="TxR",
        help="with --emulate-hosts N: a sharded trainer (FSDP2) of R ranks on each of T hosts, every rank "
        "sending its own part to one whole-copy worker on each other host (--hosts H of them, default "
        "N - T; with 1x R --emulate-hosts 1, --per-host K workers on the trainer's host), against "
        "gathering the model onto rank 0 and sending it from there; each send checked bit for bit "
        "against every rank's shards, and each rank's peak RSS",
    )
    across.add_argument(
        "--worker-tp",
        type=int,
        default=1,
        metavar="G",
        help="with --sharded-trainer: the workers are replicas of a tensor-parallel policy, G hosts each "
        "(every tensor sharded over the replica); each takes in only its 1/G (default: 1, whole copies)",
    )
    across.add_argument(
        "--kill-rank",
        type=int,
        default=None,
        metavar="K",
        help="with --sharded-trainer: after the timed sends, trainer rank K (1 or more) is killed (SIGKILL) "
        "a quarter of the way into one more send (its parts in flight; sent again, the fault sooner, if "
        "the send ended first); prints what every other rank's send raised and when, and whether each "
        "worker holds the version before or the new one (or a mix); no gather row",
    )
    across.add_argument(
        "--stop-rank",
        type=int,
        default=None,
        metavar="K",
        help="with --sharded-trainer: as --kill-rank, but rank K is stopped (SIGSTOP) until the others "
        "raised, then continued; then every rank sends once more, and every worker must hold that version",
    )
    across.add_argument(
        "--soak",
        type=int,
        default=None,
        metavar="N",
        help="with --sharded-trainer: after the timed sends, N more sends of deadline 6 s under seeded "
        "faults (--soak-seed): half calm, the others a trainer rank stopped (SIGSTOP) or, with whole copies, "
        "a worker stopped, each continued once the others raised; the last kills a trainer rank. Each send "
        "is judged: every rank raises the same error naming the faulted one in time, no worker or replica "
        "holds a mix; exits 1 on a violation",
    )
    across.add_argument("--soak-seed", type=int, default=0, metavar="S", help="the seed of --soak's faults")
    delta = bench.add_argument_group(
        "sending only what changed (--delta: DistributedWeightSyncScheme(delta=True) against delta=False "
        "in the same run, on one host or with --emulate-hosts N --link-rate R across hosts)"
    )
    delta.add_argument(
        "--delta",
        action="store_true",
        help="send real update trajectories (each step's weights, computed before timing) with "
        "delta=True and delta=False, each send checked on every worker; columns: the trainer NIC's "
        "bytes per send (its tx_bytes counter), time against S/B and against delta=False, the "
        "trainer's stall, the codec's encode and decode CPU ms, the hosts' CPU, and the index/value "
        "format's size on the same steps; --size is S, the bytes of one send (default 64)",
    )
    delta.add_argument(
        "--trajectory",
        nargs="+",
        choices=list(TRAJECTORIES),
        default=list(TRAJECTORIES),
        metavar="NAME",
        help=f"trajectories to send with --delta (default: all: {', '.join(TRAJECTORIES)})",
    )
    delta.add_argument(
        "--pin-cores",
        action="store_true",
        help="with --delta --emulate-hosts N --hosts 1: the trainer on core 0 and the receiving host on "
        "core 1 (taskset), the chain's cost per hop on hosts with a core each",
    )
    delta.add_argument(
        "--keep-steps",
        metavar="DIR",
        help="keep the computed trajectory steps in DIR and use them again in later --delta runs of "
        "the same --size and --steps (default: computed anew, in a temporary directory)",
    )
    delta.add_argument(
        "--steps",
        type=int,
        default=5,
        help="timed steps of each trajectory with --delta (default: %(default)s)",
    )
    # Testing hook: this worker corrupts its model after applying, so verification must fail.
    bench.add_argument("--corrupt-worker", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _device(text: str) -> str:
    """``--trainer-device`` / ``--worker-device``, as :func:`parse_device` reads it."""
    try:
        return parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _emulation(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[float, list[int]] | None:
    """The link rate (bytes/s) and receiving host counts of ``--emulate-hosts``,
    checked; None (said why on stderr) where this machine cannot emulate."""
    from ._netns import parse_rate, unavailable_reason

    why = unavailable_reason()
    if why is not None:
        print(f"weightsync bench: --emulate-hosts cannot run here: {why}", file=sys.stderr)
        return None
    if args.emulate_hosts < 3:
        parser.error("--emulate-hosts needs at least 3 hosts (the trainer's and two receiving ones)")
    try:
        rate = parse_rate(args.link_rate)
    except ValueError as exc:
        parser.error(str(exc))
    hosts = args.hosts or [h for h in (2, 3, 5, 7) if h < args.emulate_hosts]
    if max(hosts) >= args.emulate_hosts:
        parser.error(f"--hosts {max(hosts)} needs --emulate-hosts {max(hosts) + 1} or more")
    return rate, hosts


def _across_hosts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--emulate-hosts`` / ``--cluster``: the cases of :mod:`._hosts`, or
    (``--scheme distributed``) of :mod:`._dist_hosts`."""
    from ._hosts import emulate, format_hosts_table, receiving_nodes, run_on_cluster

    args.link_rate = args.link_rate or "1gbit"

    sizes = tuple(args.size) if args.size != list(_DEFAULTS.sizes_mib) else (64.0, 256.0)
    if args.scheme is not None and "distributed" in args.scheme:
        return _distributed_across_hosts(args, parser, sizes)
    print(describe_machine(machine_facts()), flush=True)
    if args.emulate_hosts is not None:
        checked = _emulation(args, parser)
        if checked is None:
            return 2
        rate, hosts = checked
        print(
            f"floor = S/B, B = {args.link_rate} = {rate / 1e6:.0f} MB/s each way per host; TCP chain = "
            "plain TCP relayed host to host over every link at once; "
            f"median of {args.repeats} sends, each verified; cluster cpu = the share of this machine's "
            "CPUs the emulated hosts used during weightsync's sends (near 100%, the CPUs set the time); "
            "host core-ms/GiB = CPU time (user + system, all cores) of one receiving host's processes "
            "(relay agent, actors, raylet) per relayed send, per GiB sent",
            flush=True,
        )
        print(format_hosts_table([], None), flush=True)
        done = emulate(
            args.emulate_hosts, args.link_rate, hosts, sizes, args.per_host, args.repeats,
            peers=not args.no_peers, progress=lambda text: print(text, flush=True),
        )  # fmt: skip
        rows = done["rows"]
    else:
        import ray

        out = io.StringIO()

        ray.init(address="auto", logging_level=40, log_to_driver=False)  # 40: logging.ERROR
        try:
            hosts = args.hosts or [len(receiving_nodes())]
            run_on_cluster(hosts, sizes, args.per_host, args.repeats, not args.no_peers, out)
        finally:
            ray.shutdown()
        rows = [json.loads(line) for line in out.getvalue().splitlines()]
        rate = None
    if args.json:
        with open(args.json, "w") as handle:
            ceiling = done["ceiling_s"] if rate else None
            json.dump({"rows": rows, "bytes_per_second": rate, "tcp_chain_s": ceiling}, handle, indent=1)
    print("\nall cases:\n" + format_hosts_table(rows, rate, done["ceiling_s"] if rate else None))
    return 0


def _distributed_across_hosts(
    args: argparse.Namespace, parser: argparse.ArgumentParser, sizes: tuple[float, ...]
) -> int:
    """``--scheme distributed --emulate-hosts N``: the cases of :mod:`._dist_hosts`."""
    from ._dist_hosts import emulate_distributed, format_distributed_table

    if args.emulate_hosts is None:
        parser.error(
            "--scheme distributed runs on an emulated cluster (--emulate-hosts N); on a real one, start "
            "the ranks with torchrun (see docs/distributed.md)"
        )
    checked = _emulation(args, parser)
    if checked is None:
        return 2
    rate, hosts = checked
    print(describe_machine(machine_facts()), flush=True)
    print(
        f"DistributedWeightSyncScheme; floor = S/B, B = {args.link_rate} = {rate / 1e6:.0f} MB/s each way "
        f"per host; median of {args.repeats} sends, each verified; gloo star = one gloo send per worker "
        "in turn (torchrl's DistributedWeightSyncScheme)",
        flush=True,
    )
    print(format_distributed_table([], rate), flush=True)
    done = emulate_distributed(
        args.emulate_hosts, args.link_rate, hosts, sizes, args.per_host, args.repeats,
        peers=not args.no_peers, progress=lambda text: print(text, flush=True),
    )  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": done["rows"], "bytes_per_second": rate}, handle, indent=1)
    print("\nall cases:\n" + format_distributed_table(done["rows"], rate))
    return 0


def _sharded_across_hosts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--sharded-trainer TxR --emulate-hosts N``: the case of :mod:`._sharded_hosts`."""
    from ._netns import parse_rate, unavailable_reason
    from ._sharded_hosts import format_sharded_table, run_sharded

    try:
        trainer_hosts, ranks = (int(n) for n in args.sharded_trainer.lower().split("x"))
    except ValueError:
        parser.error(
            f"--sharded-trainer takes TxR (trainer hosts x ranks per host), not {args.sharded_trainer!r}"
        )
    if args.emulate_hosts is None or trainer_hosts < 1 or ranks < 1 or trainer_hosts * ranks < 2:
        parser.error("--sharded-trainer TxR runs 2 or more ranks on an emulated cluster (--emulate-hosts N)")
    hosts = args.hosts[0] if args.hosts else args.emulate_hosts - trainer_hosts
    # One host (--emulate-hosts 1): --per-host K workers beside the ranks.
    local = args.per_host if args.emulate_hosts == trainer_hosts == 1 else 0
    if (hosts < 1 and not local) or trainer_hosts + hosts > args.emulate_hosts:
        parser.error(f"--sharded-trainer {args.sharded_trainer} and --hosts {hosts} need --emulate-hosts "
                     f"{trainer_hosts + max(hosts, 1)} or more")  # fmt: skip
    tp = args.worker_tp
    if tp < 1 or (local or hosts) % tp:
        parser.error(f"--worker-tp {tp}: the {local or hosts} workers make no replicas of {tp}")
    if sum(x is not None for x in (args.kill_rank, args.stop_rank, args.soak)) > 1:
        parser.error("--kill-rank, --stop-rank and --soak: one of them per run")
    fault = (
        ("kill", args.kill_rank)
        if args.kill_rank is not None
        else ("stop", args.stop_rank)
        if args.stop_rank is not None
        else None
    )
    if args.soak is not None:
        if args.soak < 1:
            parser.error(f"--soak {args.soak}: one send or more")
        fault = ("soak", args.soak)
    elif fault is not None and not 0 < fault[1] < trainer_hosts * ranks:
        parser.error(
            f"--{fault[0]}-rank {fault[1]}: one of ranks 1 to {trainer_hosts * ranks - 1} (rank 0 drives it)"
        )
    why = unavailable_reason()
    if why is not None:
        print(f"weightsync bench: --emulate-hosts cannot run here: {why}", file=sys.stderr)
        return 2
    mib = args.size[0] if args.size != list(_DEFAULTS.sizes_mib) else 64.0
    rate = parse_rate(args.link_rate)
    print(describe_machine(machine_facts()), flush=True)
    if tp > 1:
        where = (
            f"{(local or hosts) // tp} tensor-parallel replicas of {tp} workers, one per host; floor = "
            f"(S/{tp})/B (each worker takes in its 1/{tp}), B = {args.link_rate} = {rate / 1e6:.0f} MB/s "
            "each way per host"
        )
    else:
        where = (
            f"{local} whole-copy workers on the trainer's host (no floor: no NIC carries the bytes)"
            if local
            else f"{hosts} whole-copy workers, one per host; floor = S/B (each worker takes in S), "
            f"B = {args.link_rate} = {rate / 1e6:.0f} MB/s each way per host"
        )
    after = (
        f"then {fault[1]} sends under seeded faults (seed {args.soak_seed}), each judged"
        if fault is not None and fault[0] == "soak"
        else f"then rank {fault[1]} is {'killed (SIGKILL)' if fault[0] == 'kill' else 'stopped (SIGSTOP)'} a "
        "quarter of the way into one more send; every worker checked"
        if fault is not None
        else "gather+send = every rank's full_tensor(), then rank 0 sends the whole model (single sender)"
        if tp == 1
        else "no gather row (a single sender sends whole tensors)"
    )
    print(
        f"a sharded trainer (FSDP2: {trainer_hosts} hosts x {ranks} ranks) to {where}; median of "
        f"{args.repeats} sends, each checked bit for bit on every worker; {after}",
        flush=True,
    )
    try:
        result = run_sharded(
            trainer_hosts, ranks, hosts, mib, args.repeats, args.link_rate,
            progress=lambda text: print(text, flush=True), local_workers=local, worker_tp=tp, fault=fault,
            seed=args.soak_seed,
        )  # fmt: skip
    except RuntimeError as exc:
        print(f"weightsync bench: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    print(format_sharded_table(result))
    # (A soak that broke a promise fails the command, as a test would.)
    soak = result["row"].get("fault") or {}
    return 1 if soak.get("violations") else 0


def _delta(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--delta``: the cases of :mod:`._delta_bench`, on one host or
    (``--emulate-hosts N``) across emulated hosts."""
    from ._delta_bench import delta_legend, emulate_delta, format_delta_table, target_lines
    from ._netns import unavailable_reason

    if args.cluster or args.scheme not in (["distributed"], None):
        parser.error("--delta runs the distributed scheme (--scheme distributed), on one or emulated hosts")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    sizes = list(args.size) if args.size != list(_DEFAULTS.sizes_mib) else [64.0]
    if len(sizes) != 1:
        parser.error("--delta takes one --size")
    args.link_rate = args.link_rate or "1gbit"
    if args.emulate_hosts is not None:
        checked = _emulation(args, parser)
        if checked is None:
            return 2
        hosts, total = checked[1], args.emulate_hosts
        if args.pin_cores and list(hosts) != [1]:
            parser.error("--pin-cores runs one receiving host: --hosts 1")
    else:
        # One host: every process in one network namespace of its own, so
        # that its lo counts only their bytes.
        why = unavailable_reason()
        if why is not None:
            print(f"weightsync bench: --delta needs a network namespace: {why}", file=sys.stderr)
            return 2
        hosts, total = [0], 1
    print(describe_machine(machine_facts()), flush=True)
    print(
        f"DistributedWeightSyncScheme(delta=True) against delta=False in the same run; S = {sizes[0]:g} MiB "
        f"sent per step; {args.per_host} worker(s) per receiving host; medians of {args.steps} steps; "
        "enc/dec: the codec on the same steps in this process (CPU time)",
        flush=True,
    )
    try:
        done = emulate_delta(
            total, args.link_rate, hosts, args.trajectory, sizes[0], args.steps, args.per_host,
            progress=lambda text: print(text, flush=True), keep_steps=args.keep_steps, pin=args.pin_cores,
        )  # fmt: skip
    except RuntimeError as exc:
        print(f"weightsync bench: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(done, handle, indent=1)
    print("\nall cases:\n" + format_delta_table(done["rows"], done["bytes_per_second"]))
    print("columns:\n" + delta_legend())
    targets = target_lines(done["rows"], done["bytes_per_second"])
    if targets:
        print("targets (1 Gbit/s NICs):\n" + "\n".join(targets))
    return 0


def _bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.plot:
        try:
            require_matplotlib()
        except PlotUnavailableError as exc:
            print(f"weightsync bench: {exc}", file=sys.stderr)
            return 2
    # Without --scheme, or with all, a scheme that cannot run here is left
    # out with a note; one named on the command line must run.
    every = args.scheme is None or "all" in args.scheme
    if args.scheme is None:
        names: list[str] = list(LOCAL_SCHEMES)
    else:
        names = sorted(SCHEMES) if "all" in args.scheme else list(dict.fromkeys(args.scheme))
    schemes: list[str] = []
    skipped: dict[str, str] = {}
    devices = (args.trainer_device, args.worker_device)
    for name in names:
        info = SCHEMES[name]
        why = info.unavailable() or placement_unavailable(info.devices, *devices)
        if why is None:
            schemes.append(name)
        elif every:
            skipped[name] = why
        else:
            # Named on the command line: a run without it is not the run asked for.
            print(f"weightsync bench: --scheme {name} cannot run here: {why}", file=sys.stderr)
            return 2
    compare, cannot = resolve(list(ALTERNATIVES) if "all" in args.compare else args.compare, devices)
    skipped.update(cannot)
    for name, why in skipped.items():
        print(f"weightsync bench: skipping {name}: {why}", file=sys.stderr)
    try:
        config = BenchConfig(
            schemes=tuple(schemes),
            compare=tuple(compare),
            dtype=args.dtype,
            sizes_mib=tuple(args.size),
            workers=tuple(args.workers),
            tensors=tuple(args.tensors),
            partials=tuple(args.partial),
            verify=(False, True) if args.verify else (False,),
            repeats=args.repeats,
            warmup=args.warmup,
            min_seconds=args.min_time,
            timeout=args.timeout,
            worker_threads=args.worker_threads or None,
            trainer_device=args.trainer_device,
            worker_device=args.worker_device,
            blocking=args.blocking,
            check_once=args.check_once,
        )
    except ValueError as exc:
        parser.error(str(exc))
    tensors = "" if len(config.tensors) > 1 else f"{config.tensors[0]} "
    cuda = config.devices != ("cpu", "cpu")
    _say(
        describe_machine(machine_facts()),
        *([describe_devices(*config.devices, cuda_facts(config.devices))] if cuda else []),
        f"{tensors}{config.dtype} tensors; {_sends_per_case(config)} after {config.warmup} untimed; "
        "copy: private = own copy per worker, shared = one shared buffer (compare like with like)",
    )
    shown = columns_for(
        any(p < 1.0 for p in config.partials),
        True in config.verify,
        wide=args.wide,
        several_tensor_counts=len(config.tensors) > 1,
        cuda=cuda,
    )
    print(table_header(shown), flush=True)
    progress = Progress(sys.stderr, config.cases(), config) if args.progress or sys.stderr.isatty() else None

    def show(result: CaseResult) -> None:
        if progress is not None:
            progress.clear()
        print(format_row(result, shown), flush=True)

    started = time.perf_counter()
    try:
        try:
            run = run_bench(
                config,
                on_result=show,
                on_start=progress.start if progress is not None else None,
                corrupt_worker=args.corrupt_worker,
            )
        finally:
            if progress is not None:
                progress.finish()
    except VerificationError as exc:
        print(f"weightsync bench: verification failed: {exc}", file=sys.stderr)
        return 1
    except BenchError as exc:
        print(f"weightsync bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("weightsync bench: interrupted", file=sys.stderr)
        return 130
    run.skipped = skipped
    print(f"{len(run.results)} cases in {time.perf_counter() - started:.1f} s", flush=True)
    for name, why in skipped.items():
        _say(f"skipped {name}: {why}")
    print("\n".join(startup_lines(run.startup, run.results)))
    for line in device_copy_lines(run.results):
        print(line)
    if "floor ms" in shown or "x floor" in shown:
        _say(DEVICE_FLOOR_NOTE if cuda else FLOOR_NOTE)
    print(legend(shown, cuda=cuda))
    results_file = None if args.no_json else args.json
    if results_file:
        try:
            run.write_json(results_file)
        except OSError as exc:
            print(f"weightsync bench: cannot write {results_file}: {exc}", file=sys.stderr)
            return 1
        print(f"raw samples and machine facts: {results_file}")
    if args.plot:
        try:
            write_plot(run.results, args.plot, describe_machine(run.machine))
        except OSError as exc:
            print(f"weightsync bench: cannot write {args.plot}: {exc}", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    return 0


def _sends_per_case(config: BenchConfig) -> str:
    """How many timed sends a case makes, in words."""
    if not config.min_seconds:
        return f"{config.repeats} timed sends per case"
    return (
        f"{config.repeats} timed sends per case or more, until they took {config.min_seconds:g} s "
        f"(at most {MAX_ROUNDS_FACTOR * config.repeats}),"
    )


def _say(*paragraphs: str) -> None:
    """Print each paragraph wrapped within :data:`WIDTH` columns."""
    for paragraph in paragraphs:
        print(textwrap.fill(paragraph, WIDTH, subsequent_indent="  "), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``weightsync`` command line with ``argv`` (default: ``sys.argv[1:]``).

    Blocks until the command is done and returns its exit status: 0 on
    success, 1 when a benchmark failed (a worker held other weights than the
    trainer, died or timed out), 2 when ``--plot`` is asked without
    matplotlib installed, ``--scheme`` names a scheme whose package is
    missing (``ray``) or that cannot run on the devices asked, or
    ``--trainer-device`` / ``--worker-device`` names a CUDA device that is
    not visible (said in one line, before any worker starts), 130 after
    Ctrl-C.

    :raises SystemExit: the arguments are invalid (status 2) or ``--help`` was asked.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and (args.trainer_device, args.worker_device) != ("cpu", "cpu"):
        if args.delta or args.emulate_hosts is not None or args.cluster or args.scheme == ["distributed"]:
            parser.error(
                "--trainer-device and --worker-device place the models of the bench on one host "
                "(not with --delta, --emulate-hosts, --cluster or --scheme distributed alone)"
            )
        for side in ("trainer", "worker"):
            device = getattr(args, f"{side}_device")
            why = cuda_unavailable([device])
            if why is not None:
                print(f"weightsync bench: --{side}-device {device}: {why}", file=sys.stderr)
                return 2
    if args.command == "bench" and args.sharded_trainer is not None:
        args.link_rate = args.link_rate or "1gbit"
        return _sharded_across_hosts(args, parser)
    if args.command == "bench" and args.delta:
        return _delta(args, parser)
    if args.command == "bench" and (args.emulate_hosts is not None or args.cluster):
        return _across_hosts(args, parser)
    if args.command == "bench" and args.scheme == ["distributed"]:
        from ._netns import parse_rate
        from ._torchrun import torchrun_bench, under_torchrun

        if under_torchrun():
            # Every rank runs the cases; rank 0 prints the table.
            sizes = tuple(args.size) if args.size != list(_DEFAULTS.sizes_mib) else (64.0, 256.0)
            rate = parse_rate(args.link_rate) if args.link_rate else None
            return torchrun_bench(sizes, args.repeats, rate, args.json)
    if args.command == "bench":
        return _bench(args, parser)
    parser.print_help()
    return 2
