"""The tests' harness: the scheme registry (:mod:`.schemes`), clusters of
real workers over every scheme (:mod:`.clusters`), the session's Ray
(:mod:`.ray_runtime`), the leak checks (:mod:`.leaks`) and the one weight
checksum (:mod:`.checksums`).

The code that runs in worker processes, Ray actors and programs of their
own is here too, imported by those by module name: the workers and models
(:mod:`.workers`), the workers that apply in the background
(:mod:`.background_workers`), the torn-read probe (:mod:`.torn_read_probe`),
the parts of a torchrl run (:mod:`.torchrl_parts`), and the programs
(:mod:`.programs`): the trainers on an emulated cluster
(:mod:`.ray_cluster_trainer`, :mod:`.distributed_cluster_trainer`) and
their workers (:mod:`.distributed_workers`), and the trainer interrupted by
Ctrl-C (:mod:`.interrupted_trainer`).

conftest.py holds only the fixtures built on it.
"""

from .checksums import weight_checksums
from .clusters import (
    PROCS,
    READY_TIMEOUT,
    Cluster,
    RankCluster,
    RayCluster,
    ThreadCluster,
    new_cluster,
    reap,
    start_pipe_worker,
    start_worker,
    stop_pipe_workers,
)
from .leaks import fd_baseline, open_fds, shm_entries, weightsync_threads
from .programs import TESTS_DIR, program
from .ray_runtime import RAY_NODES, RayRuntime
from .schemes import REGISTRY, TEST_TIMEOUT, SchemeSpec, make_scheme, scheme_names, schemes, spec

__all__ = [
    "PROCS",
    "RAY_NODES",
    "READY_TIMEOUT",
    "REGISTRY",
    "TESTS_DIR",
    "TEST_TIMEOUT",
    "Cluster",
    "RankCluster",
    "RayCluster",
    "RayRuntime",
    "SchemeSpec",
    "ThreadCluster",
    "fd_baseline",
    "make_scheme",
    "new_cluster",
    "open_fds",
    "program",
    "reap",
    "scheme_names",
    "schemes",
    "shm_entries",
    "spec",
    "start_pipe_worker",
    "start_worker",
    "stop_pipe_workers",
    "weight_checksums",
    "weightsync_threads",
]
