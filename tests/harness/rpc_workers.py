"""Worker processes of RPCWeightSyncScheme's tests (imported by spawned
children): each joins the test's ``torch.distributed.rpc`` job as rank
``rank`` (named ``worker<rank>``), builds a :class:`StepModel`, initialises
the scheme on it and calls ``connect()`` (the background applier, as in a
torchrl collector), then answers the test's commands over ``conn``::

    "state"          -> ("state", version, {name: checksum}, mixed forward calls)
    ("step", secs)   -> ("stepped",): one forward call lasting ``secs``
    "stop"           -> ("stopped", weightsync threads left): scheme and RPC shut down

A forward call reads every parameter at its start and at its end: one that
saw two versions (an update landed during it) is counted as mixed.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

import weightsync as ws

from .checksums import weight_checksums

SHAPES = {"w0": 1 << 18, "w1": 3001, "w2": 7}


class StepModel(nn.Module):
    """Parameters of ``SHAPES``; a forward call lasts ``seconds`` and
    notes whether the weights changed during it."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterDict({n: nn.Parameter(torch.zeros(k)) for n, k in SHAPES.items()})
        self.mixed = 0

    def forward(self, seconds: float) -> None:
        before = weight_checksums(self)
        time.sleep(seconds)
        if weight_checksums(self) != before:
            self.mixed += 1


def options(timeout: float = 60.0) -> Any:
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=timeout, init_method="env://")


def join(name: str, rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options())


def serve(scheme: ws.RPCWeightSyncScheme, rank: int, world: int, port: int, conn: Any) -> None:
    torch.set_num_threads(1)
    join(f"worker{rank}", rank, world, port)
    model = StepModel()
    scheme.init_on_worker("policy", model=model, worker_idx=rank - 1)
    scheme.connect(worker_idx=rank - 1)  # (returns at once: the applier takes each update)
    conn.send(("ready", os.getpid()))
    try:
        while True:
            command = conn.recv()
            if command == "state":
                version = scheme.get_receiver().version
                conn.send(("state", version, weight_checksums(model), model.mixed))
            elif isinstance(command, tuple) and command[0] == "step":
                model(command[1])
                conn.send(("stepped",))
            elif command == "stop":
                scheme.shutdown()
                threads = [t.name for t in threading.enumerate() if t.name.startswith("weightsync")]
                conn.send(("stopped", threads))
                return
    finally:
        scheme.shutdown()
        rpc.shutdown(graceful=False)
