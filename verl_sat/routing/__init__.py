"""Routing replay, R2 and R3 (docs/routing_replay.md): one dispatcher over three modules.

- ``gates``: the router contract of Hugging Face MoE models: record, replay and perturb the top-k.
- ``fsdp``: R2/R3 on verl's FSDP engine, where verl replays nothing.
- ``megatron``: the routing metrics on verl's own Megatron replay.

The trainer's worker asks this module which engine mixin the actor needs
(:func:`engine_mixins`) and lets it prepare the worker (:func:`prepare_worker`); nothing here
imports back.
"""

from __future__ import annotations

from typing import Any

from verl_sat.routing.fsdp import RoutingReplayFSDP, fsdp_replay_mode
from verl_sat.routing.megatron import MegatronRouteMetrics, megatron_replay_mode


def replay_mode(actor_config: Any) -> str:
    """The actor's R2/R3 mode on its engine (FSDP or Megatron), else ``disabled``."""
    mode = fsdp_replay_mode(actor_config)
    return mode if mode != "disabled" else megatron_replay_mode(actor_config)


def engine_mixins(actor_config: Any) -> tuple[type, ...]:
    """The mixin the actor's engine needs: FSDP replays through the gate hooks, Megatron measures
    verl's replay; none when routing replay is disabled."""
    if fsdp_replay_mode(actor_config) != "disabled":
        return (RoutingReplayFSDP,)
    if megatron_replay_mode(actor_config) != "disabled":
        return (MegatronRouteMetrics,)
    return ()


def prepare_worker(worker: Any) -> str:
    """Before verl's ``init_model``: an FSDP actor with R2/R3 sets the worker's
    ``enable_routing_replay``, so verl's own decorators mark compute_log_prob / update_actor batches
    (verl sets it only for Megatron and VeOmni). Returns the mode."""
    if "actor" not in getattr(worker, "role", "actor"):
        return "disabled"
    if fsdp_replay_mode(worker.config.actor) != "disabled":
        worker.enable_routing_replay = True
    return replay_mode(worker.config.actor)
