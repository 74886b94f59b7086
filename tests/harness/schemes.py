"""The scheme registry: every scheme the suites run over, with what it can do.

A suite asks for the schemes whose flags fit what it checks
(``schemes(processes=True)``: every scheme whose workers are processes the
test can kill or stop), instead of naming schemes; a new scheme enters every
suite its flags allow by one line here.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import pytest

import weightsync as ws

# The tests' schemes send with a deadline of 30 s unless told otherwise.
TEST_TIMEOUT = 30.0


@dataclass(frozen=True)
class SchemeSpec:
    """One scheme and what its workers are."""

    cls: type[ws.WeightSyncScheme]
    #: Workers are processes (the test can SIGKILL or SIGSTOP them, read their /proc).
    processes: bool
    #: Workers are joined to the trainer by the user's pipes.
    pipes: bool
    #: Workers are Ray actors: Ray owns their processes, and an actor is never
    #: told of a clean shutdown (it keeps serving until the trainer ends).
    actors: bool
    #: Workers may be on other hosts.
    cross_host: bool
    #: A worker's tensors run on the trainer's shared memory after an update
    #: (their data_ptr() changes; their identity is kept by every scheme).
    zero_copy: bool
    #: Marks every test of this scheme carries (a scheme slow to start runs
    #: in the extended step).
    marks: tuple[Any, ...] = ()

    @property
    def keeps_data_ptr(self) -> bool:
        return not self.zero_copy


REGISTRY: dict[str, SchemeSpec] = {
    "multiprocess": SchemeSpec(
        ws.MultiProcessWeightSyncScheme,
        processes=True,
        pipes=True,
        actors=False,
        cross_host=False,
        zero_copy=False,
    ),
    "shared": SchemeSpec(
        ws.SharedMemWeightSyncScheme,
        processes=True,
        pipes=True,
        actors=False,
        cross_host=False,
        zero_copy=True,
    ),
    "inprocess": SchemeSpec(
        ws.InProcessWeightSyncScheme,
        processes=False,
        pipes=False,
        actors=False,
        cross_host=False,
        zero_copy=False,
    ),
    # A Ray test takes actors that import torch (seconds each) from a two-node
    # Ray test cluster: the extended step runs them, as every test that uses
    # the ``ray_runtime`` fixture (conftest.py).
    "ray": SchemeSpec(
        ws.RayWeightSyncScheme,
        processes=True,
        pipes=False,
        actors=True,
        cross_host=True,
        zero_copy=False,
        marks=(pytest.mark.extended,),
    ),
    # Worker processes reached by rank through the trainer's store on
    # 127.0.0.1 (across hosts: the cluster step). Every test of it starts a
    # gloo group per worker: the extended step runs them.
    "distributed": SchemeSpec(
        ws.DistributedWeightSyncScheme,
        processes=True,
        pipes=False,
        actors=False,
        cross_host=True,
        zero_copy=False,
        marks=(pytest.mark.extended,),
    ),
}


def schemes(*, extended: Collection[str] = (), **flags: bool) -> list[Any]:
    """The schemes whose flags equal ``flags``, as pytest parameters (each
    with its marks; those named in ``extended`` also in the extended step).

    ``schemes()`` is every scheme; ``schemes(pipes=True)`` the pipe schemes.
    """
    unknown = set(flags) - {"processes", "pipes", "actors", "cross_host", "zero_copy"}
    if unknown:
        raise TypeError(f"unknown scheme flags {sorted(unknown)}")
    chosen = []
    for name, spec in REGISTRY.items():
        if all(getattr(spec, flag) == want for flag, want in flags.items()):
            marks = (*spec.marks, pytest.mark.extended) if name in extended else spec.marks
            chosen.append(pytest.param(name, marks=marks, id=name))
    return chosen


def scheme_names(**flags: bool) -> list[str]:
    """The names of the schemes whose flags equal ``flags`` (for a child
    process that takes names on its command line)."""
    return [param.values[0] for param in schemes(**flags)]


def spec(name: str) -> SchemeSpec:
    return REGISTRY[name]


def make_scheme(name: str, timeout: float | None = TEST_TIMEOUT, **options: Any) -> ws.WeightSyncScheme:
    """A scheme with the given deadline (and ``options``); ``timeout=None``
    gives none, so the scheme keeps the library's default."""
    cls = REGISTRY[name].cls
    return cls(**options) if timeout is None else cls(timeout=timeout, **options)
