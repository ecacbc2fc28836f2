"""Alias of ``verl_sat.preflight.cluster.prepare_cluster`` (``verl_sat.main`` imports it from here)."""

from verl_sat.preflight.cluster import cluster_address, prepare_cluster

__all__ = ["cluster_address", "prepare_cluster"]
