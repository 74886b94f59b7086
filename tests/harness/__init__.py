"""The tests' harness: the scheme registry (:mod:`.schemes`), clusters of
real workers over every scheme (:mod:`.clusters`), the session's Ray
(:mod:`.ray_runtime`) and the leak checks (:mod:`.leaks`).

conftest.py holds only the fixtures built on it.
"""

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
    stop_pipe_workers,
)
from .leaks import fd_baseline, open_fds, shm_entries, weightsync_threads
from .ray_runtime import RAY_NODES, RayRuntime
from .schemes import REGISTRY, TEST_TIMEOUT, SchemeSpec, make_scheme, scheme_names, schemes, spec

__all__ = [
    "PROCS",
    "RAY_NODES",
    "READY_TIMEOUT",
    "REGISTRY",
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
    "reap",
    "scheme_names",
    "schemes",
    "shm_entries",
    "spec",
    "start_pipe_worker",
    "stop_pipe_workers",
    "weightsync_threads",
]
