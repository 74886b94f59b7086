"""The test session's Ray: a two-node cluster on this machine and a pool of
worker actors reused from test to test."""

from __future__ import annotations

import os
from typing import Any

# The custom resources of the two Ray test nodes, for pinning actors.
RAY_NODES = ("head_node", "second_node")
# Idle test actors kept ready on each node once a test gave its actors back.
SPARE_ACTORS = 2


class RayRuntime:
    """The test session's Ray: a two-node cluster on this machine (Ray's own
    ``ray.cluster_utils.Cluster``), and a pool of worker actors reused from
    test to test (an actor costs seconds to start: it imports torch)."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster as RayTestCluster

        from .workers import RayWorker

        node = {"num_cpus": 1, "object_store_memory": 256 << 20}
        self.nodes = RayTestCluster(
            initialize_head=True, head_node_args={**node, "resources": {RAY_NODES[0]: 1}}
        )
        self.nodes.add_node(**node, resources={RAY_NODES[1]: 1})
        tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ray.init(
            address=self.nodes.address,
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))
                }
            },
            log_to_driver=False,
        )
        # No CPU is reserved per actor: tests start more actors than cores.
        self.actor_class = ray.remote(num_cpus=0, concurrency_groups={"ctrl": 1})(RayWorker)
        self.idle: list[Any] = []
        self.node_of: dict[Any, str] = {}  # actor -> the node resource it is pinned to

    def actor(self, node: str | None = None, **options: Any) -> Any:
        """A fresh actor (``options`` as for ``.options()``), pinned to
        ``node`` (one of :data:`RAY_NODES`) if given."""
        if node is not None:
            options = {"resources": {node: 0.01}, **options}
        actor = self.actor_class.options(**options).remote()
        if node is not None:
            self.node_of[actor] = node
        return actor

    def take(self, n: int) -> list[Any]:
        """``n`` actors, idle ones first; any two or more span both nodes."""
        taken: list[Any] = []
        for i in range(n):
            idle = {node: [a for a in self.idle if self.node_of.get(a) == node] for node in RAY_NODES}
            missing = [node for node in RAY_NODES if node not in {self.node_of[a] for a in taken}]
            # The slots left must cover the nodes not used yet; among the
            # nodes allowed, the one with the most idle actors.
            allowed = missing if n - i <= len(missing) else list(RAY_NODES)
            node = max(allowed, key=lambda nd: len(idle[nd]))
            if idle[node]:
                self.idle.remove(idle[node][0])
                taken.append(idle[node][0])
            else:
                taken.append(self.actor(node))
        return taken

    def give_back(self, actors: list[Any]) -> None:
        self.idle.extend(actors)
        self._top_up()

    def _top_up(self) -> None:
        """Start actors until :data:`SPARE_ACTORS` are idle on each node. An
        actor spends seconds of CPU importing torch: started here, between
        two tests, it is ready when a later test takes it. (Starting one opens
        no descriptor and no thread in this process; the first call does.)"""
        for node in RAY_NODES:
            for _ in range(SPARE_ACTORS - sum(self.node_of.get(a) == node for a in self.idle)):
                self.idle.append(self.actor(node))

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.nodes.shutdown()
