"""The engine of ``weightsync bench``: run its cases, time full sends,
verify every one, and measure memcpy references of the same bytes in the
same run.

A run starts one pool of worker processes (spawn,
:class:`weightsync.bench._pools.WorkerPool`) and reuses it for every case
(see :mod:`weightsync.bench._pools`). Ray cases (the ``ray`` scheme, the
``ray-put`` and ``torchrl-ray`` alternatives) run the same way on a pool of
Ray actors instead (:mod:`weightsync.bench._ray_pool`), started only when
the run has a Ray case.

For each case the trainer

1. builds a generated MLP-like model of tensors of the run's dtype (float32
   unless asked) on the trainer's device (``--trainer-device``, the CPU
   unless asked); each worker builds one of the same layout holding zeros
   on the workers' device (``--worker-device``)
   (:mod:`weightsync.bench._model`);
2. warms up, then times each send from ``send_async()`` until ``wait_async()``
   returned (or around one blocking ``send()``, ``blocking``): the whole
   send, until every worker applied the version and its ack is in; and the
   stall, until ``send_async()`` returned (the weights are staged, and the
   trainer may change them); for Ray, one ``ray.put`` of the same bytes
   after each send, the stall's reference there;
3. after every send, outside the timed region, compares a CRC32 per tensor
   that each worker computed over its own model with the trainer's (over
   CPU copies of the bytes of tensors on a GPU: bit-exact); a mismatch
   raises :class:`~weightsync.bench.VerificationError` (``check_once``:
   once, after the last send, so that no worker's check runs while another
   worker still applies a timed send);
4. changes one tensor of its model, so every send carries different bytes;
5. times, half before the sends and half after, a single-threaded memcpy of
   the same bytes (:mod:`weightsync.bench._memcpy`).

The floor of the scheme's work is measured once per size and worker count,
not per case (:func:`measure_floors`): just before the first case of a size,
for every worker count of that size, ``workers + 1`` memcpys (one into
staging, one out per worker) on one thread and on every core, and two
memcpys in sequence (the chain, once per size); where a CUDA device is
involved, also one D2D, one page-locked D2H and one page-locked H2D copy of
the same bytes on that GPU (once per size), from which the floor of the
placement is added up (:attr:`~weightsync.bench.CaseResult.floor_median_s`).
Every case of that size and worker count gets the same samples, so its rows
show one floor, even where the machine's load changed between the cases.

Alternatives to weightsync (``--compare``, :mod:`weightsync.bench._compare`)
run in the same pools with the same model and sizes, timed and verified the
same way. During each case the peak extra memory of the trainer and of each
worker (process or Ray actor) is measured (:mod:`weightsync.bench._memory`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

import weightsync as ws

from ._compare import run_alternative
from ._machine import cuda_facts, machine_facts
from ._memcpy import device_copy_seconds, floor_seconds, memcpy_seconds
from ._memory import PeakMemoryProbe
from ._model import GeneratedMLP, change_model, mlp_shapes, model_nbytes, tensor_checksums
from ._pools import Pool, WorkerPool, timed_worker_cpu
from ._ray_pool import RayActorPool
from ._types import (
    MODEL_ID,
    SCHEMES,
    BenchConfig,
    BenchError,
    BenchRun,
    Case,
    CaseResult,
    FloorSamples,
    WorkerStartup,
    itemsize,
    pool_of,
)

__all__ = ["floor_key", "measure_floors", "run_bench", "run_case"]

FloorKey = tuple[int, int, str | None]


def _model_bytes(case: Case) -> int:
    """Bytes of the model of ``case`` (what its row's MiB shows)."""
    item = itemsize(case.dtype)
    return model_nbytes(mlp_shapes(case.nbytes, case.tensors, item), item)


def floor_key(case: Case) -> FloorKey:
    """What a case's floor depends on: the model's bytes, the worker count
    and the GPU its device copies are timed on (None: all on the CPU)."""
    return _model_bytes(case), case.workers, case.gpu


def floor_repeats(config: BenchConfig) -> int:
    """Samples of each copy of a floor: measured once for a size's cases,
    so more than a case's sends."""
    return max(2 * config.repeats, 12)


def measure_floors(cases: list[Case], repeats: int) -> dict[FloorKey, FloorSamples]:
    """Time the floor of every distinct :func:`floor_key` of ``cases``, each
    copy ``repeats`` times: the ``workers + 1`` memcpys per worker count, the
    chain of two memcpys and (a GPU involved) the device copies once per
    size, shared by its worker counts. Runs in this process; blocks for the
    copies."""
    keys = list(dict.fromkeys(floor_key(case) for case in cases))
    chains: dict[int, tuple[list[float], list[float]]] = {}
    devices: dict[tuple[int, str], dict[str, list[float]]] = {}
    floors: dict[FloorKey, FloorSamples] = {}
    for nbytes, workers, gpu in keys:
        if nbytes not in chains:
            chains[nbytes] = floor_seconds(nbytes, 2, repeats)
        if gpu is not None and (nbytes, gpu) not in devices:
            devices[nbytes, gpu] = device_copy_seconds(nbytes, gpu, repeats)
        serial, split = floor_seconds(nbytes, workers + 1, repeats)
        chain_serial, chain_split = chains[nbytes]
        floors[nbytes, workers, gpu] = FloorSamples(
            nbytes,
            workers,
            gpu,
            serial,
            split,
            chain_serial,
            chain_split,
            {} if gpu is None else devices[nbytes, gpu],
        )
    return floors


def run_case(pool: Pool, index: int, config: BenchConfig, floor: FloorSamples | None = None) -> CaseResult:
    """Run case ``index`` on ``pool``, the pool its scheme or alternative
    runs on (:func:`pool_of`; see the module docstring). Blocks for the whole
    case; the scheme is shut down and the workers' side closed before it
    returns or raises. ``floor``: the floor of the case's size and worker
    count (:func:`measure_floors`); None: measured for this case alone,
    before it.

    :raises VerificationError: a worker's weights differ from the trainer's.
    :raises BenchError: a send failed, or a worker failed, died or timed out.
    """
    case = pool.cases[index]
    item = itemsize(case.dtype)
    shapes = mlp_shapes(case.nbytes, case.tensors, item)
    result = CaseResult(case, model_nbytes(shapes, item), 0)
    if floor is None:
        floor = measure_floors([case], floor_repeats(config))[floor_key(case)]
    floor.apply(result)
    refs = max(config.repeats, 6)
    # Half the references before the case and half after, so a change in the
    # machine's load meanwhile hits sends and references alike; both halves
    # outside the memory probe, which sees only the case's own allocations.
    _measure_references(result, refs // 2)
    probe = PeakMemoryProbe([os.getpid(), *pool.worker_pids(case.workers)])
    probe.start()
    if case.scheme not in SCHEMES:
        run_alternative(pool, index, config, shapes, result)
    else:
        _run_scheme(pool, index, config, shapes, result)
    result.memory = probe.stop()
    _measure_references(result, refs - refs // 2)
    return result


def _run_scheme(
    pool: Pool,
    index: int,
    config: BenchConfig,
    shapes: dict[str, tuple[int, ...]],
    result: CaseResult,
) -> None:
    case = pool.cases[index]
    model = GeneratedMLP(shapes, fill="pattern", dtype=case.dtype, device=case.trainer_device)
    named = dict(sorted(model.state_dict().items()))
    names = list(named)
    keys = _partial_keys(named, case.partial)
    # A send changes only what it writes, so every worker can be checked whole.
    tensors = list(named.values()) if keys is None else [named[k] for k in keys]
    scheme = SCHEMES[case.scheme].factory(config.timeout)
    try:
        connecting = time.perf_counter()
        scheme.init_on_sender(MODEL_ID, model=model, **pool.sender_args(index))
        pool.start_case(index, scheme, shapes, check_once=config.check_once)
        sender = scheme.get_sender()
        sender.connect(timeout=config.timeout)
        result.connect_s = time.perf_counter() - connecting
        if keys is not None:
            report = sender.send()  # a partial update goes to workers that hold the whole model
            pool.verify(report.version, names, tensor_checksums(named))
        on_ray = pool_of(case.scheme) == "ray"
        for step in config.rounds(result.send_s):
            change_model(tensors, step)
            staged = None
            cpu = time.thread_time()
            start = time.perf_counter()
            if config.blocking:
                report = sender.send(keys=keys, verify=case.verify)
            else:
                sender.send_async(keys=keys, verify=case.verify)
                staged = time.perf_counter() - start  # the trainer may change its weights from here on
                report = sender.wait_async()
            elapsed = time.perf_counter() - start
            cpu = time.thread_time() - cpu
            if not config.check_once:
                pool.verify(report.version, names, tensor_checksums(named))
            if step >= config.warmup:
                result.send_s.append(elapsed)
                result.cpu_s.append(cpu)
                result.report_s.append(report.seconds)
                if staged is not None:
                    result.stall_s.append(staged)
                if on_ray:
                    result.put_s.append(_put_seconds(tensors))
            result.packet_nbytes = report.nbytes
        if config.check_once:
            expected = tensor_checksums(named)
            scheme.shutdown()  # each worker reports once its sender is gone
            pool.verify(report.version, names, expected)
    except ws.WeightSyncError as exc:
        raise BenchError(
            f"{case.scheme} send of {case.size_mib:g} MiB to {case.workers} worker(s): {exc}"
        ) from exc
    finally:
        try:
            scheme.shutdown()
        finally:
            result.worker_cpu_s = timed_worker_cpu(pool.end_case(index), len(result.send_s))


def _put_seconds(tensors: list[Any]) -> float:
    """Seconds of one ``ray.put`` of ``tensors``' bytes as numpy arrays (what
    a hand-written broadcast puts), the object let go at once."""
    import ray

    arrays = tuple(t.detach().reshape(-1).view(torch.uint8).numpy() for t in tensors)
    start = time.perf_counter()
    ref = ray.put(arrays)
    elapsed = time.perf_counter() - start
    del ref
    return elapsed


def _partial_keys(named: dict[str, Any], fraction: float) -> list[str] | None:
    """The first tensors by name that hold ``fraction`` of the bytes (at
    least one), or None for the whole model."""
    if fraction >= 1.0:
        return None
    total = sum(t.numel() * t.element_size() for t in named.values())
    keys: list[str] = []
    taken = 0
    for name, tensor in named.items():
        if keys and taken >= fraction * total:
            break
        keys.append(name)
        taken += tensor.numel() * tensor.element_size()
    return keys


def _measure_references(result: CaseResult, repeats: int) -> None:
    """Add ``repeats`` samples of the single memcpy of ``result``'s bytes
    (the floor is the size's: :func:`measure_floors`). They run in the
    trainer process while the workers wait for an update."""
    if repeats <= 0:
        return
    result.memcpy_s += memcpy_seconds(result.nbytes, repeats)


def run_bench(
    config: BenchConfig,
    *,
    on_result: Callable[[CaseResult], None] | None = None,
    on_start: Callable[[int, Case], None] | None = None,
    on_startup: Callable[[WorkerStartup], None] | None = None,
    corrupt_worker: int | None = None,
) -> BenchRun:
    """Run every case of ``config`` with one pool of worker processes and,
    if a case runs on Ray, one pool of Ray actors (starting Ray if it is not
    initialised, and shutting down only a Ray it started). Blocks for the
    whole run; every worker is joined and every scheme shut down before it
    returns or raises (Ctrl-C included).

    ``on_startup`` is called once the workers are up, for each pool that
    started some (:class:`WorkerStartup`); ``on_start`` is called with its
    index before each case, ``on_result`` after it. ``corrupt_worker`` is a testing
    hook: that worker changes its model after each update it applies, so
    verification must fail.

    :raises VerificationError: a worker's weights differ from the trainer's.
    :raises BenchError: a send failed, or a worker failed, died or timed out.
    """
    started = time.perf_counter()
    run = BenchRun(config, machine_facts())
    if config.devices != ("cpu", "cpu"):
        run.machine["cuda"] = cuda_facts(config.devices)
    cases = config.cases()
    timeout, threads, corrupt = config.timeout, config.worker_threads, corrupt_worker
    # Each pool starts workers only for its own cases, if it has any.
    with (
        WorkerPool(cases, timeout=timeout, worker_threads=threads, corrupt_worker=corrupt) as processes,
        RayActorPool(
            cases, timeout=timeout, worker_threads=threads, corrupt_worker=corrupt, mixin=config.ray_mixin
        ) as actors,
    ):
        pools: dict[str, Pool] = {pool.kind: pool for pool in (processes, actors)}
        run.startup = [pool.startup for pool in (processes, actors) if pool.startup is not None]
        if on_startup is not None:
            for startup in run.startup:
                on_startup(startup)
        floors: dict[FloorKey, FloorSamples] = {}
        for index, case in enumerate(cases):
            if floor_key(case) not in floors:
                # The first case of its size: the floors of all its worker
                # counts now, in one machine state, for every case of the size.
                size = [c for c in cases if c.size_mib == case.size_mib and floor_key(c) not in floors]
                floors.update(measure_floors(size, floor_repeats(config)))
            if on_start is not None:
                on_start(index, case)
            result = run_case(pools[pool_of(case.scheme)], index, config, floors[floor_key(case)])
            run.results.append(result)
            if on_result is not None:
                on_result(result)
    run.seconds = time.perf_counter() - started
    run.machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return run
