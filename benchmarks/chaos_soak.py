"""A chaos soak across emulated hosts: the torch.distributed scheme or Ray's
relay (``--scheme ray``) under host kills and restarts, link cuts, stopped hosts, slowed links and Ctrl-C
of the trainer, all from one seed (``weightsync.bench._chaos_hosts`` says
what runs and what must hold).

It prints the figures (sends a minute without faults and during them, the
time from each heal until the healed host holds the latest version, the
worst time any send took past its deadline, the bytes the trainer puts on
the wire after a host missed 1, 5 and 20 versions) and every problem found,
and exits 1 if there was one. ``--json PATH`` keeps the whole record (the
schedule, every event).

Needs root and iproute2 (network namespaces). Replay a run with its seed.

Run: ``python benchmarks/chaos_soak.py --sends 1000 --seed 7 [--delta] [--scheme ray]``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from weightsync.bench import ChaosConfig, run_chaos
from weightsync.bench import emulation_unavailable_reason as unavailable_reason


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sends", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--delta", action="store_true", help='delta="always": a delta whenever a base is held'
    )
    parser.add_argument(
        "--scheme", choices=["distributed", "ray"], default="distributed",
        help="torch.distributed's chain, or Ray's relay (actors on a Ray node per host)",
    )  # fmt: skip
    parser.add_argument("--hosts", type=int, default=3, help="receiving hosts, one worker each")
    parser.add_argument("--size", type=float, default=64.0, metavar="MIB")
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--timeout", type=float, default=8.0, help="each send's deadline, s")
    parser.add_argument("--gap", type=float, default=15.0, help="mean seconds between two faults")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot emulate a cluster here: {reason}", file=sys.stderr)
        return 2
    config = ChaosConfig(
        hosts=args.hosts, rate=args.link_rate, mib=args.size, sends=args.sends, timeout=args.timeout,
        seed=args.seed, gap=args.gap, delta=args.delta, scheme=args.scheme,
    )  # fmt: skip
    # Ctrl-C stops the soak (and cleans up), even where it was started in
    # the background: a shell's "&" leaves SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    result = run_chaos(
        config, progress=lambda text: print(f"[{time.monotonic() - started:7.1f} s] {text}", flush=True)
    )
    figures = result["figures"]
    print(json.dumps({"config": result["config"], "figures": figures}, indent=1))
    for problem in result["problems"]:
        print(f"PROBLEM: {problem}")
    took = time.monotonic() - started
    print(f"{len(result['problems'])} problems; {figures.get('sends')} sends in {took:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
