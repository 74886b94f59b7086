"""Alternatives to weightsync that ``weightsync bench --compare`` runs in the
same pools of workers, with the same model and sizes, timed and verified like
the schemes.

Each round is timed from the trainer's first action until every worker has
applied the weights and replied; after it, outside the timing, every worker's
CRC32 per tensor is compared with the trainer's, as for the schemes (for
``bare-tight``, once after the last round instead). Each
alternative is labelled by what it guarantees (``copy``, ``torn``), so a
shared-buffer figure is never read as a private-copy one:

- ``pickle-pipe``: the trainer pickles its state_dict (``pickle``, so the
  bytes of every tensor are serialised) and sends it over each worker's pipe;
  the worker unpickles it and ``load_state_dict``'s it. Private copy.
- ``torch-mp``: ``torch.multiprocessing``'s reductions
  (``ForkingPickler.dumps``): the trainer's tensors move to shared memory once
  and each round sends their file descriptors over the pipe; the worker maps
  them and copies them into its model. Private copy.
- ``bare-shm``: a bare loop checked like every case: the trainer copies its
  tensors into one shared buffer and writes a version to each pipe (a
  framed message); each worker copies them out into its model and echoes
  it. Private copy.
- ``bare-tight``: the bare loop as tightly as a user could write it, the
  reference ``benchmarks/small_vs_bare_loop.py`` times weightsync against:
  the same shared buffer, then one byte written to each worker's socket
  (no framing, no poll); each worker blocks in ``os.read``, copies the
  tensors out into its model and writes one byte back, which the trainer
  reads from each worker in turn. The model changes before each round
  (outside the timing); every worker's checksums and count of applied
  rounds are compared with the trainer's after each round (each worker
  checksums right after its echo, as a weightsync worker does after its
  ack), or with ``--check-once`` (as weightsync's then) once, after the
  last round. CPU only. Private copy.
- ``cuda-ipc`` (a CUDA device on either side): the hand-written GPU loop
  torchrl's schemes stand for: one staging tensor on the GPU (the
  trainer's, else the workers'), shared once with every worker through
  torch's reductions (one CUDA IPC handle, opened once per worker). Each
  round the trainer copies its tensors into it and waits for the copies
  (``torch.cuda.synchronize``), then writes a version to each pipe; each
  worker copies them out into its model (device to device where its model
  is on the GPU), synchronizes and echoes it. Private copy.
- ``pinned-shm`` (a CUDA device on either side): ``bare-shm`` with its
  shared buffer page-locked (``cudaHostRegister``) in the trainer, where it
  copies device to host into it, and in each GPU worker, which copies host
  to device out of it; copies are issued ``non_blocking`` and waited for
  before the notification and before the echo. Private copy.
- ``ray-put``: the hand-written zero-copy Ray broadcast, on the bench's Ray
  actors (:mod:`weightsync.bench._ray_pool`): one ``ray.put`` of the tensors'
  bytes as numpy arrays, then one method call per actor that copies the
  arrays (read-only views of the object store) into its model in place, and
  one ``ray.get`` of the calls. Private copy; the stored object never
  changes and an actor applies it between its method calls.
- ``torchrl-mp``, ``torchrl-shared``, ``torchrl-ray``: torchrl's own
  ``MultiProcessWeightSyncScheme``, ``SharedMemWeightSyncScheme`` and
  ``RayWeightSyncScheme`` with their defaults, set up as torchrl's
  collectors set them up (:mod:`weightsync.bench._torchrl`), where torchrl
  is importable.

  ``torchrl-mp`` and ``torchrl-shared``: shared, torn. At ``connect()`` the
  worker's model is re-pointed (``to_module``) at the tensors it received
  through its queue, which torch's reductions share (CPU tensors by shared
  memory, CUDA tensors by CUDA IPC): the trainer's own parameters where
  the workers' device is the trainer's, else the one copy of them that
  ``init_on_sender`` made on the workers' device. Each send then copies the
  trainer's tensors into those (mp: in each worker, from the tensors sent
  again through the queue; shared: in the trainer), onto themselves where
  they are the trainer's own, so every worker reads one buffer, the
  trainer's live parameters or their copy: no private copy, and a worker
  running while the trainer steps its optimiser (or while the next send
  copies) reads a mix of two versions. Any placement of trainer and
  workers, a CUDA one where CUDA IPC is offered (native Linux).

  ``torchrl-ray``: private, torn. Each actor receives over gloo, tensor by
  tensor, straight into its live parameters, while the trainer streams
  them: an actor's model is a mix of two versions until the last tensor is
  in, and stays one if the trainer stops or a receive times out midway.

An alternative that needs a package (``requires`` of its
:class:`weightsync.bench.AlternativeInfo` in
:data:`weightsync.bench.ALTERNATIVES`) is skipped with a note where that
package is not importable.

The trainer waits for every reply before it changes its weights again, so no
check here sees two versions mixed; ``torn`` says what the alternative
itself allows.
"""

from __future__ import annotations

import multiprocessing.reduction
import os
import pickle
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing  # registers torch's reductions on ForkingPickler
from torch import nn

from ._model import GeneratedMLP, change_model, corrupt_model, tensor_checksums
from ._pools import Pool, WorkerPool, timed_rounds, timed_worker_cpu
from ._ray_pool import RayActorPool
from ._torchrl import run_on_actors as run_torchrl_on_actors
from ._torchrl import run_over_pipes as run_torchrl_over_pipes
from ._types import (
    ALTERNATIVES,
    DTYPES,
    BenchConfig,
    BenchError,
    CaseResult,
    itemsize,
    placement_unavailable,
)

__all__ = ["resolve", "run_alternative", "serve_alternative", "serve_tight"]

_VERSION = struct.Struct("<q")
_ALIGN = 64
_STOP = b""


def resolve(
    names: Sequence[str], devices: tuple[str, str] = ("cpu", "cpu")
) -> tuple[list[str], dict[str, str]]:
    """Split ``names`` into those that can run here, with the trainer's and
    the workers' models on ``devices``, and those that cannot, with the
    reason for each."""
    runnable, skipped = [], {}
    for name in dict.fromkeys(names):
        info = ALTERNATIVES[name]
        why = info.unavailable() or placement_unavailable(info.devices, *devices)
        if why is None:
            runnable.append(name)
        else:
            skipped[name] = why
    return runnable, skipped


# -- the shared-buffer layout of bare-shm ---------------------------------------


def _layout(shapes: Mapping[str, tuple[int, ...]], item: int) -> tuple[list[tuple[str, int, int]], int]:
    """(name, offset, nbytes) per tensor in name order, and the buffer's size."""
    entries = []
    offset = 0
    for name in sorted(shapes):
        nbytes = item * int(torch.Size(shapes[name]).numel())
        entries.append((name, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, max(offset, 1)


def _views(
    buffer: torch.Tensor, shapes: Mapping[str, tuple[int, ...]], dtype: str
) -> dict[str, torch.Tensor]:
    entries, _ = _layout(shapes, itemsize(dtype))
    return {
        name: buffer[offset : offset + nbytes].view(DTYPES[dtype]).view(shapes[name])
        for name, offset, nbytes in entries
    }


# -- the trainer's side ------------------------------------------------------------


class _Sender:
    """One alternative's trainer side: ``payload`` goes to each worker once
    at the start; ``send`` starts one round (acks are awaited by the caller);
    ``close`` releases what the sender holds, after the workers' side ended.
    ``gpu`` is the case's CUDA device (:attr:`Case.gpu`), or None."""

    payload: Any = None
    packet_nbytes = 0

    def __init__(
        self,
        named: dict[str, torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        dtype: str,
        gpu: str | None,
    ) -> None:
        self.named = named

    def send(self, version: int, conns: Sequence[Connection]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what :meth:`send` used. Idempotent."""


class _PicklePipe(_Sender):
    def send(self, version: int, conns: Sequence[Connection]) -> None:
        data = pickle.dumps((version, self.named), protocol=pickle.HIGHEST_PROTOCOL)
        self.packet_nbytes = len(data)
        for conn in conns:
            conn.send_bytes(data)


class _TorchMP(_Sender):
    def send(self, version: int, conns: Sequence[Connection]) -> None:
        # One pickle per worker: each shared file descriptor is handed out once.
        for conn in conns:
            data = multiprocessing.reduction.ForkingPickler.dumps((version, self.named))
            self.packet_nbytes = len(data)
            conn.send_bytes(data)


class _BareShm(_Sender):
    def __init__(
        self,
        named: dict[str, torch.Tensor],
        shapes: Mapping[str, tuple[int, ...]],
        dtype: str,
        gpu: str | None,
    ) -> None:
        super().__init__(named, shapes, dtype, gpu)
        _, nbytes = _layout(shapes, itemsize(dtype))
        self.payload = self._staging(nbytes, gpu)
        self.packet_nbytes = nbytes
        views = _views(self.payload, shapes, dtype)
        self.pairs = [(views[name], named[name]) for name in sorted(named)]
        # Copies that may run asynchronously are waited for before the notification.
        self.sync = next((t.device for t in (self.payload, *named.values()) if t.is_cuda), None)

    def _staging(self, nbytes: int, gpu: str | None) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8).share_memory_()

    def send(self, version: int, conns: Sequence[Connection]) -> None:
        with torch.no_grad():
            for target, source in self.pairs:
                target.copy_(source, non_blocking=True)
        if self.sync is not None:
            torch.cuda.synchronize(self.sync)
        message = _VERSION.pack(version)
        for conn in conns:
            conn.send_bytes(message)


class _CudaIpc(_BareShm):
    """The staging is one tensor on the GPU; its pickle is a CUDA IPC handle."""

    def _staging(self, nbytes: int, gpu: str | None) -> torch.Tensor:
        assert gpu is not None, "cuda-ipc runs only where a CUDA device is involved"
        return torch.zeros(nbytes, dtype=torch.uint8, device=gpu)


class _PinnedShm(_BareShm):
    """The shared staging is page-locked in the trainer where a GPU copies into it."""

    def _staging(self, nbytes: int, gpu: str | None) -> torch.Tensor:
        buffer = super()._staging(nbytes, gpu)
        on_gpu = any(t.is_cuda for t in self.named.values())
        self.pinned = _PageLock(buffer) if on_gpu else None
        return buffer

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.release()


class _PageLock:
    """``tensor``'s memory (this process's mapping of it) registered
    page-locked with CUDA until :meth:`release`, so copies between it and a
    GPU go by DMA. Registered once per mapping: registering a range twice
    fails."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        cudart = torch.cuda.cudart()
        # 1: cudaHostRegisterPortable, page-locked for every device's context.
        torch.cuda.check_error(cudart.cudaHostRegister(tensor.data_ptr(), tensor.nbytes, 1))
        self.registered = True

    def release(self) -> None:
        """Unregister it. Idempotent."""
        if self.registered:
            self.registered = False
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))


_SENDERS: dict[
    str, Callable[[dict[str, torch.Tensor], Mapping[str, tuple[int, ...]], str, str | None], _Sender]
] = {
    "pickle-pipe": _PicklePipe,
    "torch-mp": _TorchMP,
    "bare-shm": _BareShm,
    "cuda-ipc": _CudaIpc,
    "pinned-shm": _PinnedShm,
}


def _await_acks(conns: Sequence[Connection], version: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    expected = _VERSION.pack(version)
    for slot, conn in enumerate(conns):
        try:
            if not conn.poll(max(deadline - time.monotonic(), 0)):
                raise BenchError(f"{what}: worker {slot} did not reply to round {version} in {timeout:g} s")
            reply = conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise BenchError(f"{what}: worker {slot} closed its pipe ({exc!r})") from exc
        if reply != expected:
            raise BenchError(f"{what}: worker {slot} replied {reply!r} to round {version}")


def run_alternative(
    pool: Pool, index: int, config: BenchConfig, shapes: dict[str, tuple[int, ...]], result: CaseResult
) -> None:
    """Time and verify the rounds of alternative case ``index`` into
    ``result``; ``pool`` is the pool of the alternative's ``pool``. Blocks for
    the whole case; the workers' side is closed before it returns or raises.

    :raises VerificationError: a worker's weights differ from the trainer's.
    :raises BenchError: a worker failed, died or timed out.
    """
    case = pool.cases[index]
    model = GeneratedMLP(shapes, fill="pattern", dtype=case.dtype, device=case.trainer_device)
    named = dict(sorted(model.state_dict().items()))
    if case.scheme.startswith("torchrl-"):
        if isinstance(pool, RayActorPool):
            run_torchrl_on_actors(pool, index, config, shapes, model, named, result)
        else:
            assert isinstance(pool, WorkerPool), f"no pool runs {case.scheme!r}"
            run_torchrl_over_pipes(pool, index, config, shapes, model, named, result)
    elif isinstance(pool, RayActorPool):
        _run_on_actors(pool, index, config, shapes, named, result)
    elif case.scheme == "bare-tight":
        assert isinstance(pool, WorkerPool), f"no pool runs {case.scheme!r}"
        _run_tight(pool, index, config, shapes, named, result)
    else:
        assert isinstance(pool, WorkerPool), f"no pool runs {case.scheme!r}"
        _run_over_pipes(pool, index, config, shapes, named, result)


def _run_over_pipes(
    pool: WorkerPool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    named: dict[str, torch.Tensor],
    result: CaseResult,
) -> None:
    case = pool.cases[index]
    what = f"{case.scheme} round of {case.size_mib:g} MiB to {case.workers} worker(s)"
    conns = pool.pipes(index)
    sender = _SENDERS[case.scheme](named, shapes, case.dtype, case.gpu)

    def one_round(version: int) -> None:
        sender.send(version, conns)
        _await_acks(conns, version, config.timeout, what)

    try:
        pool.start_alternative(index, case.scheme, shapes, sender.payload, serve_alternative)
        timed_rounds(pool, config, named, one_round, result)
        result.packet_nbytes = sender.packet_nbytes
    finally:
        try:
            for conn in conns:
                with suppress(OSError):
                    conn.send_bytes(_STOP)
        finally:
            try:
                pool.end_case(index)
            finally:
                sender.close()


# -- bare-tight -------------------------------------------------------------------

# One byte each way per round: "go" (the buffer holds the next round) and
# its echo once applied; "end" after the last round.
_GO = b"\x01"
_END = b"\x00"


def _bound_reads(fd: int, seconds: float) -> None:
    """Make a blocking read of socket ``fd`` fail after ``seconds`` (the
    kernel's ``SO_RCVTIMEO``: no poll per read), so a silent worker cannot
    hang the trainer."""
    sock = socket.socket(fileno=fd)
    try:
        whole = int(seconds)
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6))
        )
    finally:
        sock.detach()  # the fd stays the pipe's


def _run_tight(
    pool: WorkerPool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    named: dict[str, torch.Tensor],
    result: CaseResult,
) -> None:
    """``bare-tight``: every round timed on its own, the model changed
    before each (outside the timing), every worker checked after each
    round, as weightsync's are (each right after its echo), or
    (``check_once``) only once, after the last."""
    case = pool.cases[index]
    what = f"{case.scheme} round of {case.size_mib:g} MiB to {case.workers} worker(s)"
    conns = pool.pipes(index)
    fds = [conn.fileno() for conn in conns]
    staging = _BareShm(named, shapes, case.dtype, None)
    pairs = staging.pairs
    tensors = list(named.values())
    rounds = 0
    ended = False
    try:
        every_round = not config.check_once
        pool.start_alternative(index, case.scheme, shapes, (staging.payload, every_round), serve_tight)
        for fd in fds:
            _bound_reads(fd, config.timeout)
        clock = time.perf_counter
        with torch.no_grad():
            for step in config.rounds(result.send_s):
                rounds = step + 1
                change_model(tensors, step)
                cpu = time.thread_time()
                start = clock()
                for target, source in pairs:
                    target.copy_(source)
                for fd in fds:
                    os.write(fd, _GO)
                for slot, fd in enumerate(fds):
                    try:
                        reply = os.read(fd, 1)
                    except OSError as exc:  # EAGAIN: SO_RCVTIMEO ran out
                        raise BenchError(f"{what}: worker {slot} did not reply to round {step + 1}") from exc
                    if reply != _GO:
                        raise BenchError(f"{what}: worker {slot} replied {reply!r} to round {step + 1}")
                elapsed = clock() - start
                cpu = time.thread_time() - cpu
                if step >= config.warmup:
                    result.send_s.append(elapsed)
                    result.cpu_s.append(cpu)
                if every_round:
                    pool.verify(step + 1, list(named), tensor_checksums(named))
        result.packet_nbytes = staging.packet_nbytes
        expected = tensor_checksums(named)
        ended = True
        for fd in fds:
            os.write(fd, _END)
        # Once: every worker applied every round, and holds the last one bit for bit.
        pool.verify(rounds, list(named), expected)
    finally:
        try:
            if not ended:
                for fd in fds:
                    with suppress(OSError):
                        os.write(fd, _END)
        finally:
            result.worker_cpu_s = timed_worker_cpu(pool.end_case(index), len(result.send_s))


def _run_on_actors(
    pool: RayActorPool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    named: dict[str, torch.Tensor],
    result: CaseResult,
) -> None:
    """``ray-put`` on the bench's Ray actors."""
    import ray

    case = pool.cases[index]
    what = f"apply a {case.scheme} round of {case.size_mib:g} MiB"
    actors = pool.actors(case.workers)
    tensors = list(named.values())

    def one_round(version: int) -> None:
        # Raw bytes, so every dtype (bfloat16 too) has a numpy view. Ray
        # stores numpy arrays without pickling them, and actors on this node
        # get read-only views of the one stored object.
        ref = ray.put([t.detach().reshape(-1).view(torch.uint8).numpy() for t in tensors])
        pool.get([actor.apply.remote(version, ref) for actor in actors], what)

    try:
        pool.start_alternative(index, case.scheme, shapes)
        timed_rounds(pool, config, named, one_round, result)
        result.packet_nbytes = sum(t.nbytes for t in tensors)
    finally:
        pool.end_case(index)


# -- the worker's side -------------------------------------------------------------


def _applier(
    name: str, model: nn.Module, shapes: Mapping[str, tuple[int, ...]], dtype: str, payload: Any
) -> Callable[[bytes], int]:
    """How a worker applies one round's message; returns the version once
    the model holds it (copies a GPU runs are waited for)."""
    if name in ("pickle-pipe", "torch-mp"):

        def load(data: bytes) -> int:
            version, state = pickle.loads(data)  # torch's rebuild functions map shared fds
            model.load_state_dict(state)
            return int(version)

        return load
    if name in ("bare-shm", "cuda-ipc", "pinned-shm"):
        sources = _views(payload, shapes, dtype)
        named = model.state_dict()
        pairs = [(named[key], sources[key]) for key in sorted(named)]
        sync = next((t.device for t in (payload, *named.values()) if t.is_cuda), None)

        def copy_out(data: bytes) -> int:
            with torch.no_grad():
                for target, source in pairs:
                    target.copy_(source, non_blocking=True)
            if sync is not None:
                torch.cuda.synchronize(sync)
            return int(_VERSION.unpack(data)[0])

        return copy_out
    raise ValueError(f"no worker side for alternative {name!r}")


def serve_alternative(
    ctrl: Connection,
    pipe: Connection,
    name: str,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    device: str,
    payload: Any,
    corrupt: bool,
) -> None:
    """A bench worker's side of alternative ``name`` (``pickle-pipe``,
    ``torch-mp``, ``bare-shm``, ``cuda-ipc``, ``pinned-shm``), its model on
    ``device``: apply each round from ``pipe``, reply, then report checksums
    over ``ctrl`` (as for a scheme)."""
    model = GeneratedMLP(shapes, dtype=dtype, device=device)
    # pinned-shm: this worker's mapping of the shared buffer, page-locked
    # where it copies host to device out of it.
    pinned = _PageLock(payload) if name == "pinned-shm" and device != "cpu" else None
    try:
        apply = _applier(name, model, shapes, dtype, payload)
        ctrl.send(("ready",))
        while True:
            try:
                data = pipe.recv_bytes()
            except EOFError:
                return
            if data == _STOP:
                return
            version = apply(data)
            if device != "cpu":
                torch.cuda.synchronize(device)  # the model holds the weights before the echo
            pipe.send_bytes(_VERSION.pack(version))
            tensors = model.state_dict()
            if corrupt:
                corrupt_model(tensors)
            ctrl.send(("applied", version, tensor_checksums(tensors)))
    finally:
        try:
            if pinned is not None:
                pinned.release()
        finally:
            ctrl.send(("ended",))


def serve_tight(
    ctrl: Connection,
    pipe: Connection,
    name: str,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    device: str,
    payload: Any,
    corrupt: bool,
) -> None:
    """A bench worker's side of ``bare-tight``: for each byte "go" on
    ``pipe``'s socket, copy the shared buffer into its model and write the
    byte back; at "end" (or the trainer's exit), report the rounds it
    applied and its checksums over ``ctrl``. ``payload``: (the buffer,
    whether to report after every round too, right after the echo, as a
    weightsync worker reports after its ack)."""
    payload, every_round = payload
    model = GeneratedMLP(shapes, dtype=dtype, device=device)
    sources = _views(payload, shapes, dtype)
    named = model.state_dict()
    pairs = [(named[key], sources[key]) for key in sorted(named)]
    fd = pipe.fileno()
    applied = 0
    cpus: list[float] = []  # (the CPU time of each round's read, copy and echo)
    try:
        ctrl.send(("ready",))
        with torch.no_grad():
            while True:
                cpu = time.thread_time()
                if os.read(fd, 1) != _GO:
                    break
                for target, source in pairs:
                    target.copy_(source)
                os.write(fd, _GO)
                cpus.append(time.thread_time() - cpu)
                applied += 1
                if every_round:
                    tensors = model.state_dict()
                    if corrupt:
                        corrupt_model(tensors)
                    ctrl.send(("applied", applied, tensor_checksums(tensors)))
        tensors = model.state_dict()
        if corrupt:
            corrupt_model(tensors)
        ctrl.send(("applied", applied, tensor_checksums(tensors)))
    finally:
        ctrl.send(("ended", cpus))
