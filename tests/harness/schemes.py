"""The scheme registry: every scheme the suites run over, with what it can do.

What a scheme can do is described once, by the bench
(:data:`weightsync.bench.SCHEME_CAPABILITIES`); the flags here are read
from it. A suite asks for the schemes whose flags fit what it checks
(``schemes(processes=True)``: every scheme whose workers are processes the
test can kill or stop), instead of naming schemes; a new scheme enters every
suite its flags allow once the bench describes it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import pytest

import weightsync as ws
from weightsync.bench import SCHEME_CAPABILITIES, SchemeCapabilities

# The tests' schemes send with a deadline of 30 s unless told otherwise.
TEST_TIMEOUT = 30.0


@dataclass(frozen=True)
class SchemeSpec:
    """One scheme and what its workers are, as flags read from its
    capabilities."""

    capabilities: SchemeCapabilities
    #: Marks every test of this scheme carries (a scheme slow to start runs
    #: in the extended step).
    marks: tuple[Any, ...] = ()

    @property
    def cls(self) -> type[ws.WeightSyncScheme]:
        return self.capabilities.cls

    @property
    def processes(self) -> bool:
        """Workers are processes (the test can SIGKILL or SIGSTOP them, read their /proc)."""
        return self.capabilities.workers in ("processes", "actors")

    @property
    def pipes(self) -> bool:
        """Workers are joined to the trainer by the user's pipes."""
        return self.capabilities.reach == "pipe"

    @property
    def actors(self) -> bool:
        """Workers are Ray actors: Ray owns their processes, and an actor is
        never told of a clean shutdown (it keeps serving until the trainer ends)."""
        return self.capabilities.workers == "actors"

    @property
    def cross_host(self) -> bool:
        """Workers may be on other hosts."""
        return self.capabilities.cross_host

    @property
    def zero_copy(self) -> bool:
        """A worker's tensors run on the trainer's shared memory after an
        update (their data_ptr() changes; their identity is kept by every scheme)."""
        return self.capabilities.copy == "shared"

    @property
    def keeps_data_ptr(self) -> bool:
        return not self.zero_copy


# Marks of the schemes slow to start. A Ray test takes actors that import
# torch (seconds each) from a two-node Ray test cluster; a test of the
# distributed scheme (worker processes reached by rank through the
# trainer's store on 127.0.0.1; across hosts: the cluster step) starts a
# gloo group per worker. The extended step runs them, as every test that
# uses the ``ray_runtime`` fixture (conftest.py).
MARKS: dict[str, tuple[Any, ...]] = {
    "ray": (pytest.mark.extended,),
    "distributed": (pytest.mark.extended,),
}

REGISTRY: dict[str, SchemeSpec] = {
    name: SchemeSpec(capabilities, marks=MARKS.get(name, ()))
    for name, capabilities in SCHEME_CAPABILITIES.items()
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
