"""torchrl's own schemes (``torchrl.weight_update``, 0.14) as alternatives
to weightsync in ``weightsync bench --compare``: ``torchrl-mp``
(``MultiProcessWeightSyncScheme``) and ``torchrl-shared``
(``SharedMemWeightSyncScheme``) in the bench's worker processes,
``torchrl-ray`` (``RayWeightSyncScheme``) on its Ray actors. Each runs with
torchrl's defaults, set up as torchrl's collectors set it up:

- processes: ``init_on_sender(model=, devices=, ctx=spawn)`` on the trainer
  (a collector passes itself as context, which resolves to the same model
  and to its ``policy_device``: the device of each worker's policy),
  ``connect()`` (the initial weights into each worker's queue), the scheme
  pickled to each worker, which calls
  ``init_on_receiver(model=, model_id=, worker_idx=)`` and
  ``connect(worker_idx=)`` (``torchrl/collectors/utils.py``,
  ``_make_policy_factory``); from then on torchrl's background thread in
  the worker applies each ``send(weights=model)`` and acks it.
- Ray: ``init_on_sender(remote_collectors=, model=)``, the scheme handed to
  each actor (``init_on_receiver(context=actor)``), then the actors'
  ``_connect_weights_scheme`` and the trainer's ``connect()`` together, as
  ``benchmarks/ray_vs_torchrl.py`` does; each send calls every actor's
  ``_receive_weights_scheme`` and streams the tensors over gloo.

The trainer's model lives on the bench's trainer device and each worker's
on the workers' device (``--trainer-device``, ``--worker-device``; Ray:
the CPU only). torchrl is told the workers' device as a collector tells
it (``devices=``, one per worker): for workers on the trainer's device the
initial weights are the trainer's own tensors; for workers on another
device, ``init_on_sender`` makes one copy of them there, which every
worker on that device shares. Either way ``connect()`` re-points each
worker's model at what it received (by CUDA IPC for a CUDA tensor, by
shared memory for a CPU one), and each worker checks that its model is
still on its device.

The timed region is ``scheme.send()``, which returns once every worker
acked (processes) or every actor's receive returned (Ray). After it, the
trainer tells each worker the version over the case's pipe (outside the
timing), and the worker reports its checksums as for any alternative.

A bench worker process is already running when a case starts, while
torchrl's schemes hold ``multiprocessing`` queues, which Python pickles only
while spawning a process. :func:`_as_if_spawning` lets them be pickled to a
running worker: their pipes' file descriptors (and any tensor's) go through
``multiprocessing.resource_sharer``, their semaphores by name, as between
any processes of one machine.

Importing this module never imports torchrl or ray.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.context
import multiprocessing.resource_sharer
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection
from typing import Any, cast

import torch
from torch import nn

from ._model import GeneratedMLP, check_on_device, corrupt_model, tensor_checksums
from ._pools import WorkerPool, timed_rounds
from ._ray_pool import RayActorPool
from ._types import BenchConfig, CaseResult

__all__ = ["PROCESS_SCHEMES", "run_on_actors", "run_over_pipes", "serve"]

# The model's id in torchrl's schemes: what a collector calls its policy.
MODEL_ID = "policy"
_VERSION = struct.Struct("<q")
_STOP = b""

# Alternative name -> the class name in torchrl.weight_update.
PROCESS_SCHEMES = {
    "torchrl-mp": "MultiProcessWeightSyncScheme",
    "torchrl-shared": "SharedMemWeightSyncScheme",
}


class _RunningProcess:
    """Stands in for the ``Popen`` of a spawning process while a torchrl
    scheme is pickled for a bench worker that already runs: a file
    descriptor is handed over by ``resource_sharer`` (as when a connection is
    sent over a pipe) instead of being inherited."""

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd

    @staticmethod
    def DupFd(fd: int) -> Any:
        return multiprocessing.resource_sharer.DupFd(fd)


@contextmanager
def _as_if_spawning() -> Iterator[None]:
    """Let this thread pickle ``multiprocessing`` queues and locks (torchrl's
    schemes hold them) for a process that is already running."""
    set_popen = multiprocessing.context.set_spawning_popen
    set_popen(cast(Any, _RunningProcess()))
    try:
        yield
    finally:
        set_popen(None)


# -- the trainer's side -------------------------------------------------------------


def run_over_pipes(
    pool: WorkerPool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    model: nn.Module,
    named: dict[str, torch.Tensor],
    result: CaseResult,
) -> None:
    """``torchrl-mp`` or ``torchrl-shared``: case ``index`` in the bench's
    worker processes. Blocks for the whole case; the scheme is shut down and
    the workers' side closed before it returns or raises."""
    import torchrl.weight_update

    case = pool.cases[index]
    conns = pool.pipes(index)
    scheme = getattr(torchrl.weight_update, PROCESS_SCHEMES[case.scheme])()
    try:
        # As a collector whose workers' policies are on the workers' device
        # (torchrl/collectors/_multi_base.py: init_on_sender(context=self,
        # ctx=ctx), which reads the collector's policy_device: one
        # torch.device per worker).
        scheme.init_on_sender(
            model_id=MODEL_ID,
            model=model,
            devices=[torch.device(case.worker_device)] * case.workers,
            ctx=mp.get_context("spawn"),
        )
        # The initial weights wait in each worker's queue for its connect().
        scheme.connect()
        for slot, conn in enumerate(conns):
            conn.send_bytes(_VERSION.pack(slot))  # the worker's index in the scheme
        with _as_if_spawning():
            pool.start_alternative(index, case.scheme, shapes, scheme, serve)

        def one_round(version: int) -> None:
            # As a collector's update_policy_weights_(policy): returns once
            # every worker's background thread applied the weights and acked.
            scheme.send(weights=model)

        def tell_version(version: int) -> None:
            for conn in conns:
                conn.send_bytes(_VERSION.pack(version))

        timed_rounds(pool, config, named, one_round, result, before_verify=tell_version)
        result.packet_nbytes = sum(t.nbytes for t in named.values())
    finally:
        try:
            for conn in conns:
                with suppress(OSError):
                    conn.send_bytes(_STOP)
            pool.end_case(index)
        finally:
            scheme.shutdown()


def run_on_actors(
    pool: RayActorPool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    model: nn.Module,
    named: dict[str, torch.Tensor],
    result: CaseResult,
) -> None:
    """``torchrl-ray``: case ``index`` on the bench's Ray actors, set up as
    ``benchmarks/ray_vs_torchrl.py`` sets torchrl's Ray scheme up."""
    from torchrl.weight_update import RayWeightSyncScheme

    case = pool.cases[index]
    actors = pool.actors(case.workers)
    scheme = RayWeightSyncScheme()  # strategy="tensordict", backend="gloo"
    started = False
    try:
        scheme.init_on_sender(model_id=MODEL_ID, remote_collectors=actors, model=model)
        # Each actor gets a copy of the scheme and initialises it as a collector's receiver.
        started = True
        pool.start_alternative(index, case.scheme, shapes, scheme)
        # The actors join the gloo group while the trainer's connect() creates
        # it and sends the initial weights.
        connects = [actor._connect_weights_scheme.remote() for actor in actors]
        scheme.connect()
        pool.get(connects, "connect torchrl's Ray scheme")

        def one_round(version: int) -> None:
            # Calls every actor's _receive_weights_scheme and streams the
            # tensors to it; returns once every call returned.
            scheme.send(weights=model)

        timed_rounds(pool, config, named, one_round, result)
        result.packet_nbytes = sum(t.nbytes for t in named.values())
    finally:
        try:
            scheme.shutdown()
        finally:
            if started:
                pool.end_case(index)


# -- the worker's side ------------------------------------------------------------


def serve(
    ctrl: Connection,
    pipe: Connection,
    name: str,
    shapes: Mapping[str, tuple[int, ...]],
    dtype: str,
    device: str,
    scheme: Any,
    corrupt: bool,
) -> None:
    """A bench worker's side of ``torchrl-mp`` / ``torchrl-shared`` (``name``),
    its model on ``device``: set ``scheme`` up as a collector's worker does,
    then report its checksums each time the trainer names a version over
    ``pipe``.

    :raises BenchError: after ``connect()``, the model is not on ``device``.
    """
    model = GeneratedMLP(dict(shapes), dtype=dtype, device=device)
    try:
        (worker_idx,) = _VERSION.unpack(pipe.recv_bytes())
        # As torchrl/collectors/utils.py (_make_policy_factory) does: the
        # initial weights, then a background thread that applies each send.
        scheme.init_on_receiver(model=model, model_id=MODEL_ID, worker_idx=worker_idx)
        scheme.connect(worker_idx=worker_idx)
        # connect() re-pointed the model at what it received: still on its device?
        check_on_device(model.state_dict(), device, f"{name} worker {worker_idx}, after connect()")
        ctrl.send(("ready",))
        while True:
            try:
                data = pipe.recv_bytes()
            except EOFError:
                return
            if data == _STOP:
                return
            (version,) = _VERSION.unpack(data)
            # Looked up again: torchrl's connect() re-points the model's tensors.
            tensors = model.state_dict()
            if corrupt:
                corrupt_model(tensors)
            ctrl.send(("applied", version, tensor_checksums(tensors)))
    finally:
        try:
            scheme.shutdown()
        finally:
            ctrl.send(("ended",))
