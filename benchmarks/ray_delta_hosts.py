"""RayWeightSyncScheme(delta=True) across emulated hosts, on a real update
trajectory.

Makes an emulated cluster (``--rate`` NICs; the trainer on host 0, one Ray
actor on each of ``--hosts`` receiving hosts), takes the bytes a trainer
would send after each of ``--steps`` AdamW steps (``--trajectory``, from
``weightsync.bench.TRAJECTORIES``: by default the bf16 cast of an fp32
master at lr 3e-6, ``--size`` MiB sent), and sends them step after step,
first with ``delta=False`` then with ``delta=True``, each to a fresh scheme.
The initial send and a few more of the same weights are untimed (the
relay agents start; every host takes the base); each step's send is timed (``send()``, until every actor
acked) and checked bit for bit on every actor (CRC32 of every tensor),
outside the timing. The sent model is 8 tensors, so the relay's frames are
taken over their concatenation.

Prints, for each: the median send, against S/B (S bytes over NICs of B
bytes/s: the floor of sending them whole), and the bytes the trainer put
on the relay's chains per send (median, MiB and fraction of S).

Run (root, iproute2): ``python benchmarks/ray_delta_hosts.py [--hosts 3]
[--size 64] [--steps 8] [--trajectory bf16-lr3e-6] [--rate 1gbit]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import zlib
from typing import Any

MIB = 1 << 20
_PIECES = 8


def _driver(hosts: int, mib: float, steps: int, trajectory: str, delta_only: bool) -> None:
    """Runs on host 0: the trainer. One JSON line per scheme."""
    import ray
    import torch

    import weightsync as ws
    from weightsync.bench import TRAJECTORIES, update_trajectory

    kind = TRAJECTORIES[trajectory]
    # The trajectory's master is fp32; a bf16 cast sends half its bytes.
    master = int(mib * MIB) * (2 if kind.wire == "bf16" else 1)
    flats = list(update_trajectory(kind, master, steps))
    dtype = torch.bfloat16 if kind.wire == "bf16" else torch.float32
    values = [flat.view(dtype) for flat in flats]
    numel = values[0].numel()
    bounds = [numel * i // _PIECES for i in range(_PIECES + 1)]
    shapes = {f"p{i}": (bounds[i + 1] - bounds[i],) for i in range(_PIECES)}
    model = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}

    def load(step: int) -> list[int]:
        for i, tensor in enumerate(model.values()):
            tensor.copy_(values[step][bounds[i] : bounds[i + 1]])
        return [zlib.crc32(t.view(torch.uint8).numpy()) for t in model.values()]

    @ray.remote(num_cpus=0)
    class Collector:
        def __init__(self) -> None:
            torch.set_num_threads(1)
            self.tensors: dict[str, torch.Tensor] = {}

        def setup(self, scheme: ws.RayWeightSyncScheme, model_id: str) -> None:
            self.tensors = {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}
            scheme.init_on_worker(model_id, model=self.tensors)

        def checksums(self) -> list[int]:
            return [zlib.crc32(t.view(torch.uint8).numpy()) for t in self.tensors.values()]

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level=logging.ERROR, log_to_driver=False)
    actors = [Collector.options(resources={f"host{h}": 1}).remote() for h in range(1, hosts + 1)]
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    for delta in [True] if delta_only else [False, True]:
        scheme = ws.RayWeightSyncScheme(timeout=300.0, delta=delta)
        model_id = f"delta{int(delta)}"
        ray.get([a.setup.remote(scheme, model_id) for a in actors])
        load(0)
        scheme.init_on_sender(model_id, remote_collectors=actors, model=model)
        scheme.connect(timeout=300)
        # Untimed, until one send reached every host whole (the relay
        # agents start with the first): with delta=True, until one went as
        # a delta to every host, which then all hold the base.
        for _ in range(4):
            chain = scheme.send().chain
            if chain is not None and chain.delta == (delta,):
                break
        row: dict[str, Any] = {"delta": delta, "bytes": nbytes, "times": [], "wire": []}
        row.update(chains=[], why=[])
        for step in range(1, steps + 1):
            want = load(step)
            started = time.perf_counter()
            chain = scheme.send().chain or ws.ChainReport()
            elapsed = time.perf_counter() - started
            got = ray.get([a.checksums.remote() for a in actors])
            bad = [i for i, sums in enumerate(got) if sums != want]
            if bad:
                raise SystemExit(f"step {step}: actors {bad} do not hold the trainer's weights")
            row["times"].append(elapsed)
            row["wire"].append(chain.wire_bytes)
            row["chains"].append(list(chain.delta))
            row["why"].append(chain.delta_choice.get("why", ""))
        scheme.shutdown()
        print(json.dumps(row), flush=True)
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hosts", type=int, default=3, help="receiving hosts (default 3)")
    parser.add_argument("--size", type=float, default=64, help="MiB sent per step (default 64)")
    parser.add_argument("--steps", type=int, default=8, help="timed sends (default 8)")
    parser.add_argument("--trajectory", default="bf16-lr3e-6", help="default bf16-lr3e-6")
    parser.add_argument("--rate", default="1gbit", help="the NICs' rate (default 1gbit)")
    parser.add_argument("--delta-only", action="store_true", help="skip the delta=False run")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        _driver(args.hosts, args.size, args.steps, args.trajectory, args.delta_only)
        return

    from weightsync.bench import EmulatedCluster
    from weightsync.bench import emulation_unavailable_reason as unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot emulate hosts here: {reason}")
    with EmulatedCluster(args.hosts + 1, args.rate) as cluster:
        cluster.start_ray(cpus=4, object_store_mib=max(1024, int(6 * args.size)))
        argv = [sys.executable, os.path.abspath(__file__), "--driver", "--hosts", str(args.hosts)]
        argv += ["--size", str(args.size), "--steps", str(args.steps), "--trajectory", args.trajectory]
        if args.delta_only:
            argv.append("--delta-only")
        proc = cluster.popen(0, argv, env={"RAY_ADDRESS": cluster.ray_address or ""},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        out, err = proc.communicate(timeout=3000)
        if proc.returncode != 0:
            raise SystemExit(f"the driver failed: {err[-3000:]}")
        floor_rate = cluster.bytes_per_second
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    sent = rows[0]["bytes"] if rows else 0
    print(
        f"{args.hosts} receiving hosts x 1 actor, {args.rate} NICs, {sent / MIB:.1f} MiB sent "
        f"({_PIECES} tensors), {args.trajectory}, {args.steps} timed sends; "
        f"S/B {sent / floor_rate * 1e3:.0f} ms"
    )
    print(
        f"{'delta':>6} {'median ms':>10} {'x S/B':>7} {'wire MiB/send':>14} {'x S':>7}  "
        "chains per send (D: delta, F: full bytes)"
    )
    for row in rows:
        floor = row["bytes"] / floor_rate
        median = statistics.median(row["times"])
        wire = statistics.median(row["wire"])
        chains = " ".join("".join("D" if d else "F" for d in c) or "-" for c in row["chains"])
        print(
            f"{row['delta']!s:>6} {median * 1e3:>10.0f} {median / floor:>6.2f}x {wire / MIB:>14.2f} "
            f"{wire / row['bytes']:>6.3f}  {chains}"
        )
        print(f"{'':>6} each send, ms: {' '.join(f'{t * 1e3:.0f}' for t in row['times'])}")
        print(f"{'':>6} each send, wire MiB: {' '.join(f'{w / MIB:.2f}' for w in row['wire'])}")
        for why in row.get("why", []) if row["delta"] else []:
            print(f"{'':>6} {why}")


if __name__ == "__main__":
    main()
