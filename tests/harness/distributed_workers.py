"""Worker processes of DistributedWeightSyncScheme's tests (imported by
spawned children, and by the cluster driver's workers on emulated hosts).

A worker builds ``{name: zeros(numel)}``, joins the trainer's store as rank
``rank``, and then, until told to stop, calls ``receive()`` and answers the
test's commands over ``conn`` (a pipe, or its stdin/stdout)::

    "state"  -> ("state", version, {name: checksum}) (:func:`.checksums.weight_checksums`)
    "stop"   -> ("stopped", version, threads): the worker shut its scheme down
                (``threads``: weightsync's threads still running then) and exits
    and, when the trainer shuts down: ("closed", version, threads)
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch
from tensordict import TensorDict

import weightsync as ws

from .checksums import weight_checksums


def own_threads() -> list[str]:
    """The names of weightsync's threads still running in this process."""
    return [t.name for t in threading.enumerate() if t.name.startswith("weightsync")]


def build_model(shapes: dict[str, int], dtype: torch.dtype = torch.float32) -> TensorDict:
    tensors = {name: torch.zeros(numel, dtype=dtype) for name, numel in shapes.items()}
    return TensorDict(tensors, batch_size=[])


def serve(
    scheme: ws.DistributedWeightSyncScheme,
    rank: int,
    shapes: dict[str, int],
    send: Any,
    poll: Any,
    dtype: torch.dtype = torch.float32,
    **init: Any,
) -> None:
    """Run one worker: ``send(message)`` answers, ``poll()`` is the next
    command or None; ``init``: more arguments of ``init_on_worker``."""
    torch.set_num_threads(1)
    model = build_model(shapes, dtype)
    scheme.init_on_worker("policy", model=model, worker_idx=rank, **init)
    send(("ready", os.getpid()))
    version = None
    try:
        while True:
            try:
                got = scheme.receive(timeout=0.02)
            except ws.SenderClosedError:
                scheme.shutdown()
                send(("closed", version, own_threads()))
                return
            if got is not None:
                version = got
            command = poll()
            if command == "state":
                send(("state", version, weight_checksums(model)))
            elif command == "stop":
                scheme.shutdown()
                send(("stopped", version, own_threads()))
                return
    finally:
        scheme.shutdown()  # (idempotent)


def pipe_worker(
    scheme: ws.DistributedWeightSyncScheme,
    rank: int,
    conn: Any,
    shapes: dict[str, int],
    uid: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Worker process over a multiprocessing pipe; ``uid``: run as that user
    (a process of another user cannot map the trainer's or its host
    leader's memory)."""
    if uid is not None:
        # Imported on first use, which that user may not be allowed to read
        # (Python's own library under /root, mode 700, on some machines).
        import encodings.idna  # noqa: F401

        import anyio._backends._asyncio  # noqa: F401

        os.setgid(uid)
        os.setuid(uid)
    serve(scheme, rank, shapes, conn.send, lambda: conn.recv() if conn.poll() else None, dtype)


if __name__ == "__main__":
    # A worker on an emulated host: python -m harness.distributed_workers HOST PORT RANK NUMEL...
    # Commands come on stdin, one per line; answers go to stdout as repr() lines.
    import select

    host, port, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = {f"w{i}": int(n) for i, n in enumerate(sys.argv[4:])}
    scheme = ws.DistributedWeightSyncScheme(timeout=30.0)

    def send(message: Any) -> None:
        print(repr(message), flush=True)

    def poll() -> str | None:
        if select.select([sys.stdin], [], [], 0)[0]:
            return sys.stdin.readline().strip() or "stop"
        return None

    serve(scheme, rank, sizes, send, poll, store_info={"host": host, "port": port})
