"""The cluster's nodes, and one function run on each of them.

Each call is a Ray task pinned to its node (``NodeAffinitySchedulingStrategy``, ``soft=False``)
and reserving no CPU, so it runs beside a job that holds every slot. Its function must be
importable on the node (verl-sat installed there, as every worker of the job needs it anyway).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Ray's resource that only the head node holds.
HEAD_RESOURCE = "node:__internal_head__"


@dataclass(frozen=True)
class Node:
    """One alive Ray node: its id, IP, hostname and declared resources (``GPU``, ``CPU``, ...)."""

    node_id: str
    ip: str
    hostname: str
    resources: dict[str, float] = field(compare=False, hash=False)

    @property
    def is_head(self) -> bool:
        return HEAD_RESOURCE in self.resources

    @property
    def gpus(self) -> int:
        """Accelerator slots Ray schedules on (verl's bundles ask for ``GPU``, or ``NPU``)."""
        return int(self.resources.get("GPU", self.resources.get("NPU", 0)))

    @property
    def cpus(self) -> int:
        return int(self.resources.get("CPU", 0))

    @property
    def name(self) -> str:
        """How findings name the node: ``<id prefix> (<ip>, <hostname>[, head])``."""
        head = ", head" if self.is_head else ""
        return f"{self.node_id[:12]} ({self.ip}, {self.hostname}{head})"


def alive_nodes() -> list[Node]:
    """The connected cluster's alive nodes, head first, then by IP and id (``ray.nodes()``)."""
    import ray

    nodes = [
        Node(n["NodeID"], n["NodeManagerAddress"], n.get("NodeManagerHostname", ""), dict(n.get("Resources", {})))
        for n in ray.nodes()
        if n.get("Alive")
    ]
    return sorted(nodes, key=lambda n: (not n.is_head, n.ip, n.node_id))


def on_node(node: Node, fn: Callable[..., Any], *args: Any) -> Any:
    """An ``ObjectRef`` of ``fn(*args)`` run on ``node`` (no CPU reserved, never retried)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    strategy = NodeAffinitySchedulingStrategy(node_id=node.node_id, soft=False)
    return task.options(scheduling_strategy=strategy).remote(*args)


def on_each_node(fn: Callable[..., Any], *args: Any, nodes: Sequence[Node] | None = None) -> dict[Node, Any]:
    """``fn(*args)`` on every node at once (``nodes``, default all alive ones): node -> result."""
    import ray

    nodes = list(nodes) if nodes is not None else alive_nodes()
    refs = [on_node(node, fn, *args) for node in nodes]
    return dict(zip(nodes, ray.get(refs), strict=True))
