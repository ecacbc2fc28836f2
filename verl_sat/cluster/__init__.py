"""verl-sat beyond one machine (docs/cluster.md): the job on a Ray cluster started beforehand.

Modules: ``nodes`` (the cluster's alive nodes, a function run once on each through a Ray task
pinned to it), ``paths`` (before training on a cluster: the ``ray.init`` keys only a local
cluster takes are dropped, and every local path the config names is checked on every node, failing
with the key, the node and the path) and ``preflight`` (``python -m verl_sat.cluster.preflight``:
GPUs, host memory, disk, package versions on every node, the shared run directory, and the
layout of verl's resource pools on the nodes' GPUs).
"""

from verl_sat.cluster.nodes import Node, alive_nodes, on_each_node
from verl_sat.cluster.paths import cluster_address, prepare_cluster

__all__ = ["Node", "alive_nodes", "cluster_address", "on_each_node", "prepare_cluster"]
