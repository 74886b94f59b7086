"""``weightsync bench``: time full sends of weightsync's schemes, verify
every one, and compare them with memcpy of the same bytes and with
alternatives to weightsync, measured in the same run.

Scripts and tests also use, by these names: the emulated cluster
(:class:`EmulatedCluster`: network namespaces joined by a bridge, each
with a rate-limited NIC; :func:`emulation_unavailable_reason` says why it
cannot run here), the hosts' Ray actors (:class:`HostActor`,
:func:`receiving_nodes`) and the update trajectories of the delta bench
(:data:`TRAJECTORIES`, :func:`update_trajectory`).

The command line is :func:`main` (the ``weightsync bench`` script, and
``python -m weightsync bench``); scripts run the same engine with
:func:`run_bench`::

    from weightsync.bench import BenchConfig, format_table, run_bench

    run = run_bench(BenchConfig(sizes_mib=(16.0,), workers=(1, 2)))
    print(format_table(run.results))

``import weightsync`` does not import this package: it is the benchmark,
not the library, and it uses the library only through its public names.

Modules, each importing only those before it: ``_types`` (the constants,
errors and records every other module shares), ``_model`` (the generated
model and its checksums), ``_memcpy`` (the memcpy references), ``_memory``
(peak memory), ``_machine`` (machine facts), ``_pools`` (the base of the
pools, and the pool of worker processes), ``_ray_pool`` (the pool of Ray
actors), ``_torchrl`` and ``_compare`` (the alternatives to weightsync),
``_run`` (running cases), ``_table``, ``_plot`` and ``_progress`` (what is
shown), and ``_cli`` (the command line).
"""

from __future__ import annotations

from ._chaos_hosts import ChaosConfig, run_chaos
from ._chaos_hosts import schedule as chaos_schedule
from ._cli import main
from ._compare import resolve
from ._hosts import HostActor, receiving_nodes
from ._machine import describe_machine, machine_facts
from ._memcpy import floor_seconds, memcpy_floor_seconds, memcpy_seconds
from ._model import GeneratedMLP, check_on_device, mlp_shapes, model_nbytes, tensor_checksums
from ._netns import EmulatedCluster, emulated_namespaces, namespace_name, parse_rate
from ._netns import unavailable_reason as emulation_unavailable_reason
from ._plot import PlotUnavailableError, plot_figure, write_plot
from ._run import run_bench
from ._sharded_hosts import format_sharded_table, run_sharded
from ._table import format_row, format_table, table_header
from ._trajectories import TRAJECTORIES, Trajectory, update_trajectory
from ._types import (
    ALTERNATIVES,
    DTYPES,
    LOCAL_SCHEMES,
    MEMORY_METHOD,
    MIB,
    SCHEME_CAPABILITIES,
    SCHEMES,
    AlternativeInfo,
    BenchConfig,
    BenchError,
    BenchRun,
    Case,
    CaseResult,
    PeakMemory,
    SchemeCapabilities,
    SchemeInfo,
    VerificationError,
    WorkerStartup,
    itemsize,
    labels,
    placement_unavailable,
    pool_of,
)

__all__ = [
    "ChaosConfig",
    "chaos_schedule",
    "run_chaos",
    "ALTERNATIVES",
    "DTYPES",
    "LOCAL_SCHEMES",
    "MEMORY_METHOD",
    "MIB",
    "SCHEME_CAPABILITIES",
    "SCHEMES",
    "TRAJECTORIES",
    "AlternativeInfo",
    "BenchConfig",
    "BenchError",
    "BenchRun",
    "Case",
    "CaseResult",
    "EmulatedCluster",
    "GeneratedMLP",
    "HostActor",
    "PeakMemory",
    "PlotUnavailableError",
    "SchemeCapabilities",
    "SchemeInfo",
    "Trajectory",
    "VerificationError",
    "WorkerStartup",
    "check_on_device",
    "describe_machine",
    "emulated_namespaces",
    "emulation_unavailable_reason",
    "floor_seconds",
    "format_row",
    "format_table",
    "itemsize",
    "labels",
    "machine_facts",
    "main",
    "memcpy_floor_seconds",
    "memcpy_seconds",
    "mlp_shapes",
    "model_nbytes",
    "namespace_name",
    "parse_rate",
    "placement_unavailable",
    "plot_figure",
    "pool_of",
    "receiving_nodes",
    "resolve",
    "run_bench",
    "run_sharded",
    "format_sharded_table",
    "table_header",
    "tensor_checksums",
    "update_trajectory",
    "write_plot",
]
