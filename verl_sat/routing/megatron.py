"""Routing metrics on verl's own Megatron router replay (docs/routing_replay.md; docs/routing_replay.md).

On Megatron, R2/R3 are verl's: ``RouterReplay`` (``verl.utils.megatron.router_replay_patch``)
hands each ``TopKRouter`` the recorded top-k ``R`` before a forward (``REPLAY_FORWARD``) and
the router gathers its probabilities at ``R`` instead of at its own top-k. Nothing there says
how often the two differ. This module measures it without touching verl's replay: a forward
hook on every router recomputes the router's own choice from the same input,

    z_t  = gating(h_t)                     (the logits the router has just used)
    own_t = top-k(score(z_t))              (score = z for softmax routers, sigmoid(z) + bias else)

and counts, per MoE layer, the rows whose routing reaches the loss (R3: verl's replay mask,
``build_r3_replay_mask``, every real row but each sequence's last; R2: all rows), whether
``R_t`` there is a recorded route (not the all-equal filler verl aligns with), and whether
``set(own_t) == set(R_t)``. The metrics are the FSDP replay engine's
(``verl_sat.routing.gates.RouteCounts``):

    actor/routing_replay/replayed_frac = rows given a recorded route / rows reaching the loss
    actor/routing_replay/topk_agreement = replayed rows with own_t = R_t / replayed rows

so ``replayed_frac`` is 1 when the rollout returned a route for every row the loss depends on.

The hook adds one small matmul per MoE layer in replayed forwards only. :class:`MegatronRouteMetrics`
is mixed over verl's ``MegatronEngineWithLMHead`` by ``verl_sat.trainer.engines`` for a Megatron
actor with R2/R3.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_sat.routing.gates import RouteCounts, recorded_routes, router_replay_mode


def megatron_replay_mode(actor_config: Any) -> str:
    """``actor.megatron.router_replay.mode`` of a Megatron actor, else ``disabled``."""
    if str(actor_config.get("strategy", "")) != "megatron":
        return "disabled"
    return router_replay_mode(actor_config.get("megatron"))


def own_topk(router: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The router's own top-k experts ``[N, k]`` for ``hidden`` (what it would pick without replay)."""
    logits = router.gating(hidden).view(-1, router.config.num_moe_experts)
    scores = logits
    if router.score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if getattr(router, "expert_bias", None) is not None:
            scores = scores + router.expert_bias
    if router.config.moe_router_group_topk:
        from megatron.core.transformer.moe.moe_utils import group_limited_topk

        _, indices = group_limited_topk(
            scores=scores,
            topk=router.topk,
            num_tokens=scores.shape[0],
            num_experts=scores.shape[1],
            num_groups=router.config.moe_router_num_groups,
            group_topk=router.config.moe_router_group_topk,
        )
        return indices
    return torch.topk(scores, k=router.topk, dim=1).indices


class RouteAgreementHooks:
    """Forward hooks on a Megatron model's routers that fill a :class:`RouteCounts` on replayed calls."""

    def __init__(self, modules: list[Any]) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for chunk in modules for m in chunk.modules() if isinstance(m, TopKRouter)]
        self.counts = RouteCounts()
        for router in self.routers:  # for the engine's lifetime
            router.register_forward_hook(self._hook)

    def _hook(self, router: Any, args: tuple, output: Any) -> None:
        from verl.utils.megatron.router_replay_patch import RouterReplayAction

        replay = getattr(router, "router_replay", None)
        if replay is None or replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return
        target = replay.target_topk_idx
        if target is None or not args:
            return
        with torch.no_grad():
            own = own_topk(router, args[0])
            if own.shape != target.shape:
                return  # verl's own check raises on a misaligned replay; nothing to count here
            mask = getattr(replay, "target_replay_mask", None)
            if mask is None:  # R2: every row is replayed and reaches the loss
                reaching = torch.ones(own.shape[0], dtype=torch.bool, device=own.device)
            else:  # R3: verl's build_r3_replay_mask, every real row but each sequence's last
                reaching = mask.reshape(-1).bool().to(own.device)
            self.counts.add(own, target, recorded_routes(target).to(own.device), reaching)


class MegatronRouteMetrics:
    """Mixed over ``MegatronEngineWithLMHead``: the routing metrics of its replayed forwards.

    Per ``forward_backward_batch`` a fresh :class:`RouteCounts`; when verl replayed routes in it
    (R3: every actor pass; R2: the update), the two metrics join the output's ``metrics``, one
    value per call, beside verl's own loss metrics.
    """

    _routes_hooks: RouteAgreementHooks | None = None

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        if self._routes_hooks is None:
            self._routes_hooks = RouteAgreementHooks(list(self.module))  # type: ignore[attr-defined]
        self._routes_hooks.counts = RouteCounts()
        output = super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
        values = self._routes_hooks.counts.metrics()
        if values and isinstance(output, dict):
            metrics = output.setdefault("metrics", {})
            metrics.update({k: [v] for k, v in values.items()})
        return output
