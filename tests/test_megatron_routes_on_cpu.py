"""verl_sat.routing.megatron: the router's own top-k and the counts behind the Megatron routing metrics.

The hook runs on real routers in tests/test_megatron_e2e.py; here it runs on a stand-in router
and replay state, so each count can be checked by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from verl.utils.megatron.router_replay_patch import RouterReplayAction

from verl_sat.routing.megatron import RouteAgreementHooks, megatron_replay_mode, own_topk


def router(weight: torch.Tensor, score_function="softmax", expert_bias=None, action=None, target=None, mask=None):
    """A TopKRouter's attributes the hook reads: gating, config, top-k, score function, replay state."""
    replay = SimpleNamespace(router_replay_action=action, target_topk_idx=target, target_replay_mask=mask)
    config = SimpleNamespace(num_moe_experts=weight.shape[0], moe_router_group_topk=None, moe_router_num_groups=None)
    return SimpleNamespace(
        gating=lambda h: h @ weight.T,
        config=config,
        topk=2,
        score_function=score_function,
        expert_bias=expert_bias,
        router_replay=replay,
    )


def hooks() -> RouteAgreementHooks:
    h = object.__new__(RouteAgreementHooks)  # no model: the hook alone
    h.routers = []
    from verl_sat.routing.gates import RouteCounts

    h.counts = RouteCounts()
    return h


WEIGHT = torch.eye(4)  # logits = the hidden state itself: the top-2 can be read off the input
HIDDEN = torch.tensor([[[4.0, 3.0, 0.0, 0.0]], [[0.0, 0.0, 2.0, 5.0]], [[1.0, 0.0, 3.0, 0.0]]])  # [s, b, h]


def test_own_topk_is_the_routers_choice():
    own = own_topk(router(WEIGHT), HIDDEN).sort(-1).values
    assert own.tolist() == [[0, 1], [2, 3], [0, 2]]
    # sigmoid routers pick by sigmoid(z) + expert bias: a bias can move the choice
    biased = own_topk(router(WEIGHT, "sigmoid", expert_bias=torch.tensor([0.0, 0.0, 0.0, 2.0])), HIDDEN)
    assert biased.sort(-1).values.tolist() == [[0, 3], [2, 3], [2, 3]]


def test_the_hook_counts_replayed_rows_and_agreement():
    target = torch.tensor([[1, 0], [2, 0], [0, 2]])  # row 0 agrees (same set), row 1 differs, row 2 agrees
    mask = torch.tensor([True, True, False])  # row 2 was left to the router (verl's R3 final row)
    h = hooks()
    h._hook(router(WEIGHT, action=RouterReplayAction.REPLAY_FORWARD, target=target, mask=mask), (HIDDEN,), None)
    metrics = h.counts.metrics()
    assert metrics["actor/routing_replay/replayed_frac"] == 1.0  # every row reaching the loss has its route
    assert metrics["actor/routing_replay/topk_agreement"] == pytest.approx(1 / 2)


def test_a_filler_route_inside_the_mask_is_not_replayed():
    target = torch.tensor([[1, 0], [0, 0], [0, 2]])  # row 1 holds verl's all-equal filler, not a route
    h = hooks()
    mask = torch.tensor([True, True, False])
    h._hook(router(WEIGHT, action=RouterReplayAction.REPLAY_FORWARD, target=target, mask=mask), (HIDDEN,), None)
    metrics = h.counts.metrics()
    assert metrics["actor/routing_replay/replayed_frac"] == pytest.approx(1 / 2)
    assert metrics["actor/routing_replay/topk_agreement"] == 1.0


@pytest.mark.parametrize("action", [None, RouterReplayAction.RECORD, RouterReplayAction.REPLAY_BACKWARD])
def test_the_hook_ignores_passes_that_do_not_replay_forward(action):
    h = hooks()
    h._hook(router(WEIGHT, action=action, target=torch.zeros(3, 2, dtype=torch.long)), (HIDDEN,), None)
    assert h.counts.metrics() == {}


def test_only_a_megatron_actor_with_replay_selects_the_engine():
    assert megatron_replay_mode({"strategy": "megatron", "megatron": {"router_replay": {"mode": "R3"}}}) == "R3"
    assert megatron_replay_mode({"strategy": "megatron", "megatron": {}}) == "disabled"
    assert megatron_replay_mode({"strategy": "fsdp", "megatron": {"router_replay": {"mode": "R3"}}}) == "disabled"
