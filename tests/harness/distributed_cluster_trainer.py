"""The trainer of tests/test_distributed_cluster.py: runs on host 0 of an
emulated cluster (``python -m harness.distributed_cluster_trainer HOST
WORKERS NUMEL...``, :mod:`.programs`) with DistributedWeightSyncScheme, and takes commands on stdin,
one per line, answering on stdout:

    (start)             -> STORE <host> <port>
    connect             -> OK <json>       once every worker announced itself
    send [ids]          -> SENDING, then SENT <json>: version, digests (checksum per
                           tensor of what was sent), seconds, error, chains, fed
                           (per chain: whom each host leader fed), delta (per
                           chain: whether it carried a delta), wire (bytes the
                           trainer sent)
    nudge [ids]         -> as send, with 1% of the elements changed instead of all

With WS_DELTA=1 in the environment the scheme sends a delta whenever its
workers hold a base (delta="always").
    quit                -> BYE             after shutdown()
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

import weightsync as ws

from .checksums import weight_checksums
from .distributed_workers import build_model


def _error(exc: ws.WorkerError) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "worker_ids": list(exc.worker_ids),
        "failures": {str(w): type(e).__name__ for w, e in exc.failures.items()},
        "message": str(exc),
    }


def main() -> None:
    # Ctrl-C (the tests' SIGINT) reaches the trainer as in a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    host, workers = sys.argv[1], int(sys.argv[2])
    shapes = {f"w{i}": int(n) for i, n in enumerate(sys.argv[3:])}
    torch.manual_seed(0)
    model = build_model(shapes)
    delta = "always" if os.environ.get("WS_DELTA") == "1" else False
    timeout = float(os.environ.get("WS_TIMEOUT", "30"))
    scheme = ws.DistributedWeightSyncScheme(timeout=timeout, delta=delta)
    scheme.init_on_sender("policy", num_workers=workers, model=model, host=host)
    info = scheme.get_store_info()
    assert info is not None
    print(f"STORE {info['host']} {info['port']}", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "connect":
            scheme.connect()
            print("OK " + json.dumps({"version": scheme.get_sender().async_sender.version}), flush=True)
        elif command in ("send", "nudge"):
            ids = json.loads(args[0]) if args else None
            for tensor in model.values():
                if command == "send":
                    tensor.normal_()
                else:
                    flat = tensor.view(-1)
                    flat[torch.randperm(flat.numel())[: flat.numel() // 100]] += 1.0
            digests = weight_checksums(model)
            print("SENDING", flush=True)
            started = time.perf_counter()
            error = None
            try:
                version = scheme.send(worker_ids=ids).version
            except ws.WorkerError as exc:
                version, error = exc.version, _error(exc)
            except KeyboardInterrupt:
                version, error = None, {"type": "KeyboardInterrupt", "worker_ids": [], "failures": {}}
            seconds = time.perf_counter() - started
            chains = [list(chain) for chain, _ in scheme.last_routes]
            fed = [{str(k): list(v) for k, v in f.items()} for _, f in scheme.last_routes]
            result = {"version": version, "digests": digests, "seconds": seconds, "error": error}
            more = {"chains": chains, "fed": fed, "delta": scheme.last_delta, "wire": scheme.last_wire_bytes}
            print("SENT " + json.dumps({**result, **more}), flush=True)
        elif command == "quit":
            scheme.shutdown()
            print("BYE", flush=True)
            return


if __name__ == "__main__":
    main()
