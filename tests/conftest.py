"""The suites' fixtures, over the harness of :mod:`harness`: real worker
processes, real pipes, real shared memory, a real Ray cluster.

``scheme_name`` and ``cluster`` run over every scheme of the registry
(:func:`harness.schemes`); a test or module that checks what only some
schemes do narrows them by their flags, e.g.
``@pytest.mark.parametrize("scheme_name", schemes(processes=True))``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from harness import TEST_TIMEOUT, Cluster, RayRuntime, new_cluster, schemes

# A shell starts a background job (``pytest &``, nohup included) with SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler: the Ctrl-C
# tests, and the trainers they start, need Python's own.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that takes Ray actors runs in the extended step (``-m
    extended``): Ray's start and its actors' (each imports torch) cost
    seconds, which the default run's three minutes cannot hold."""
    for item in items:
        if "ray_runtime" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.extended)


@pytest.fixture(scope="session")
def ray_runtime() -> Iterator[RayRuntime]:
    """One Ray instance for the whole session, started on first use."""
    pytest.importorskip("ray")
    runtime = RayRuntime()
    yield runtime
    runtime.close()


@pytest.fixture(params=schemes())
def scheme_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=schemes())
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Three healthy workers shared by the non-destructive tests of a module."""
    c = new_cluster(request, request.param, ["net", "net", "net"])
    yield c
    c.close()


@pytest.fixture
def make_cluster(request: pytest.FixtureRequest, scheme_name: str) -> Iterator[Callable[..., Cluster]]:
    """A factory of clusters for tests that kill, pause or break workers."""
    made: list[Cluster] = []

    def make(
        kinds: list[str],
        model_id: str = "policy",
        trainer_kind: str = "net",
        timeout: float | None = TEST_TIMEOUT,
    ) -> Cluster:
        c = new_cluster(request, scheme_name, kinds, model_id, trainer_kind, timeout)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every async test runs on asyncio's own loop and on uvloop."""
    import asyncio

    import uvloop

    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
