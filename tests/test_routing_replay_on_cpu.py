"""Routing replay (verl_sat.routing.gates, docs/routing_replay.md) on the tiny Qwen3-MoE: no Ray, seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from verl_sat.default import model as tiny
from verl_sat.rollout.engine import EngineOptions, GenerationRequest, HFEngine
from verl_sat.rollout.sampling import SamplingParams
from verl_sat.routing.gates import (
    align_routes,
    find_routers,
    loss_rows,
    record_routes,
    replay_routes,
    routes_per_sample,
)
from verl_sat.trainer.recipe import apply_routing_replay

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(1)
    config = Qwen3MoeConfig(vocab_size=VOCAB, pad_token_id=0, **tiny.MODEL_KWARGS)
    config._attn_implementation, config._experts_implementation = "sdpa", "eager"
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).float().eval()


def _ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _experts_inputs(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
    """Capture the ``top_k_index`` every ``mlp.experts`` call receives."""
    seen: list[torch.Tensor] = []
    handles = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
        for layer in model.model.layers
    ]
    return seen, handles


def test_replay_of_own_routes_is_bit_identical(model):
    ids = _ids(3, 9)
    mask = torch.ones_like(ids)
    with record_routes(model) as rec:
        reference = model(input_ids=ids, attention_mask=mask).logits
    routes = rec.recorded(3)
    assert routes.shape == (3, 9, 4, 2) and routes.dtype == torch.int32
    with replay_routes(model, routes, mask) as hooks:
        replayed = model(input_ids=ids, attention_mask=mask).logits
    assert hooks.replayed_layers == 4
    assert torch.equal(reference, replayed)


def test_replay_overrides_the_router_and_keeps_router_gradients(model):
    import copy

    ids = _ids(2, 8, seed=2)
    mask = torch.ones_like(ids)
    with record_routes(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    routes = rec.recorded(2)
    changed = copy.deepcopy(model).train()
    with torch.no_grad():
        for router in find_routers(changed):
            router.weight.add_(torch.randn_like(router.weight))  # the router's own top-k now differs
    with record_routes(changed) as own:
        changed(input_ids=ids, attention_mask=mask)
    assert not torch.equal(own.recorded(2), routes)

    seen, handles = _experts_inputs(changed)
    try:
        with replay_routes(changed, routes, mask):
            logits = changed(input_ids=ids, attention_mask=mask).logits
    finally:
        for h in handles:
            h.remove()
    for layer, top_k_index in enumerate(seen):
        assert torch.equal(top_k_index.view(2, 8, 2).to(torch.int32), routes[:, :, layer])
    logits.logsumexp(-1).mean().backward()
    for router in find_routers(changed):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_routing_metrics_count_agreement_and_replayed_tokens(model):
    """actor/routing_replay/*: own routes agree everywhere; a changed router agrees exactly where
    its own top-k set equals the replayed one; padding and zero (unrecorded) rows are not replayed."""
    import copy

    ids = _ids(2, 8, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # two padding tokens
    with record_routes(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    routes = rec.recorded(2).clone()
    routes[0, 0] = 0  # an unrecorded row (verl's zero padding): keeps its own routing
    with replay_routes(model, routes, mask) as hooks:
        model(input_ids=ids, attention_mask=mask)
    reaching, unrecorded = (14 - 2) * 4, 4  # each sequence's last row reaches no loss term
    assert hooks.counts.metrics() == {
        "actor/routing_replay/replayed_frac": (reaching - unrecorded) / reaching,
        "actor/routing_replay/topk_agreement": 1.0,
    }
    # the rollout's layout (SGLang, vLLM): one row less per sequence, every row the loss needs
    short = [rec.recorded(2)[0, :7], routes[1, :5]]
    with replay_routes(model, short, mask) as hooks:
        model(input_ids=ids, attention_mask=mask)
    assert hooks.counts.metrics()["actor/routing_replay/replayed_frac"] == 1.0
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(changed):
            router.weight.add_(0.1 * torch.randn(router.weight.shape, generator=generator))
    with record_routes(changed) as own:
        changed(input_ids=ids, attention_mask=mask)
    mine = own.recorded(2)
    replayed = loss_rows(mask)[..., None].expand(2, 8, 4).clone()
    replayed[0, 0] = False
    same = (mine.sort(-1).values == routes.sort(-1).values).all(-1)
    with replay_routes(changed, routes, mask) as hooks:
        changed(input_ids=ids, attention_mask=mask)
    agreement = hooks.counts.metrics()["actor/routing_replay/topk_agreement"]
    assert agreement == pytest.approx((same & replayed).sum().item() / replayed.sum().item())
    assert 0.0 < agreement < 1.0


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding(model, side):
    lengths = [5, 9, 7]
    seqs = [_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    singles, routes = [], []
    for seq in seqs:
        with record_routes(model) as rec:
            singles.append(model(input_ids=seq[None], attention_mask=torch.ones_like(seq[None])).logits[0])
        routes.append(rec.recorded(1)[0])
    width = max(lengths)
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, seq in enumerate(seqs):
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[i, cols], mask[i, cols] = seq, 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    seen, handles = _experts_inputs(model)
    try:
        with replay_routes(model, routes, mask):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    finally:
        for h in handles:
            h.remove()
    for layer, top_k_index in enumerate(seen):
        got = routes_per_sample(top_k_index.view(3, width, 1, 2), mask)
        for i in range(3):
            assert torch.equal(got[i][:, 0].to(torch.int32), routes[i][:, layer])
    for i in range(3):
        torch.testing.assert_close(logits[i][mask[i].bool()], singles[i], atol=1e-4, rtol=1e-4)


def test_bad_route_shape_names_the_sample(model):
    mask = torch.ones((2, 6), dtype=torch.long)
    good = torch.zeros((6, 4, 2), dtype=torch.int32)
    bad = torch.zeros((3, 4, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sample 1 have shape \(3, 4, 2\).*expected \(6, 4, 2\)"):
        align_routes([good, bad], mask, num_layers=4, top_k=2)
    with pytest.raises(ValueError, match="do not match the input"):
        align_routes(torch.zeros((2, 5, 4, 2)), mask, num_layers=4, top_k=2)


def test_sglang_layout_and_zero_rows_keep_own_routing():
    mask = torch.tensor([[0, 1, 1, 1]])
    short = torch.tensor([[[1, 2]], [[3, 4]]])  # seq_len - 1 rows, one layer
    indices, replay = align_routes([short], mask, num_layers=1, top_k=2)
    assert replay[0, :, 0].tolist() == [False, True, True, False]
    assert indices[0, 1:3, 0].tolist() == [[1, 2], [3, 4]]
    zero_row = torch.tensor([[[1, 2]], [[0, 0]], [[0, 0]]])  # verl's aligned field, trailing zeros
    _, replay = align_routes([zero_row], mask, num_layers=1, top_k=2)
    assert replay[0, :, 0].tolist() == [False, True, False, False]


# ------------------------------------------------------------------------------------- rollout
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny.create(tmp_path_factory.mktemp("tiny_moe"), seed=0)


def _requests(n: int, max_tokens: int = 6) -> list[GenerationRequest]:
    params = SamplingParams.from_request({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True})
    prompts = [list(range(3, 3 + 5 + 2 * i)) for i in range(n)]  # ragged: left padding in the batch
    return [GenerationRequest(p, params, max_tokens) for p in prompts]


def _full_forward_log_probs(engine: HFEngine, prompt: list[int], tokens: list[int], routes=None) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        if routes is None:
            logits = engine.model(input_ids=ids, attention_mask=mask).logits
        else:
            with replay_routes(engine.model, [torch.as_tensor(routes)], mask):
                logits = engine.model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize(("router_noise_std", "router_bias_std"), [(0.0, 0.0), (2.0, 0.0), (0.0, 2.0)])
def test_rollout_returns_routes_that_reproduce_its_log_probs(model_dir, router_noise_std, router_bias_std):
    options = EngineOptions(seed=0, router_noise_std=router_noise_std, router_bias_std=router_bias_std)
    engine = HFEngine.from_pretrained(str(model_dir), options)
    engine.record_routes = True
    requests = _requests(3)
    results = engine.generate_batch(requests)
    clean = HFEngine.from_pretrained(str(model_dir), EngineOptions(seed=0))  # the "trainer": no noise
    gaps_replay, gaps_plain = [], []
    for request, result in zip(requests, results, strict=True):
        n = len(request.prompt_ids) + len(result.token_ids) - 1
        assert result.routed_experts.shape == (n, 4, 2) and result.routed_experts.dtype == np.int32
        rollout = torch.tensor(result.log_probs)
        replayed = _full_forward_log_probs(clean, request.prompt_ids, result.token_ids, result.routed_experts)
        plain = _full_forward_log_probs(clean, request.prompt_ids, result.token_ids)
        gaps_replay.append(float((replayed - rollout).abs().max()))
        gaps_plain.append(float((plain - rollout).abs().max()))
    assert max(gaps_replay) < 1e-4  # R3: the trainer reproduces the rollout's log-probs
    if router_noise_std > 0 or router_bias_std > 0:
        assert max(gaps_plain) > 1e-2  # without replay the perturbed routing is a real mismatch


def test_rollout_routes_survive_abort_and_resume(model_dir):
    engine = HFEngine.from_pretrained(str(model_dir), EngineOptions(seed=0))
    engine.record_routes = True
    request = _requests(1, max_tokens=8)[0]
    polls = iter([False, False, False, True])
    first = engine.generate_batch([request], lambda: next(polls, True))[0]
    assert first.stop_reason == "aborted" and len(first.token_ids) == 3
    assert first.routed_experts.shape == (len(request.prompt_ids) + 2, 4, 2)
    resumed_prompt = request.prompt_ids + first.token_ids
    second = engine.generate_batch([GenerationRequest(resumed_prompt, request.params, 3)])[0]
    # verl's llm_server keeps the first routes and appends the last len(new tokens) rows
    merged = np.concatenate([first.routed_experts, second.routed_experts[-len(second.token_ids) :]])
    total = len(request.prompt_ids) + len(first.token_ids) + len(second.token_ids)
    assert merged.shape == (total - 1, 4, 2)
    # the resumed call's prefill re-derives the same routing for the tokens already routed
    assert np.array_equal(second.routed_experts[: len(first.routed_experts)], first.routed_experts)


def test_rollout_records_nothing_unless_enabled(model_dir):
    engine = HFEngine.from_pretrained(str(model_dir), EngineOptions(seed=0))
    assert all(r.routed_experts is None for r in engine.generate_batch(_requests(2, max_tokens=2)))


# ------------------------------------------------------------------------------ configuration
def _cfg(strategy: str, bypass: bool = True):
    return OmegaConf.create(
        {
            "algorithm": {"rollout_correction": {"bypass_mode": bypass}},
            "actor_rollout_ref": {
                "actor": {"strategy": strategy, "fsdp_config": {}, "megatron": {"router_replay": {"mode": "disabled"}}},
                "rollout": {"enable_rollout_routing_replay": False},
            },
        }
    )


def test_apply_routing_replay_fsdp_and_megatron():
    cfg = _cfg("fsdp2")
    apply_routing_replay(cfg, "R3")
    assert cfg.actor_rollout_ref.actor.fsdp_config.router_replay.mode == "R3"
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    cfg = _cfg("megatron")
    apply_routing_replay(cfg, "R3")
    assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is True
    cfg = _cfg("megatron", bypass=False)
    apply_routing_replay(cfg, "R2")
    assert cfg.actor_rollout_ref.actor.megatron.router_replay.mode == "R2"
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay is False
    with pytest.raises(ValueError, match="bypass_mode"):
        apply_routing_replay(_cfg("fsdp2"), "R2")
    untouched = _cfg("fsdp2")
    apply_routing_replay(untouched, "disabled")
    assert "router_replay" not in untouched.actor_rollout_ref.actor.fsdp_config


def test_the_actors_engine_is_verls_with_the_mixins_and_registered_for_its_vendor(monkeypatch):
    """One way of extending verl's engines: the composed class is what verl's registry returns."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from verl_sat.routing.fsdp import RoutingReplayFSDP
    from verl_sat.trainer.engines import StepQuantileEngine, engine_mixins, register_engine

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    # set, then deleted: monkeypatch restores an unset variable only if it was the one to set it,
    # and register_engine below sets it (left set, it reached every later launch's environment)
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "unset")
    monkeypatch.delenv("VERL_ENGINE_VENDOR")

    def config(loss_mode: str, mode: str) -> DictConfig:
        return OmegaConf.create(
            {
                "strategy": "fsdp2",
                "fsdp_config": {"router_replay": {"mode": mode}},
                "policy_loss": {"loss_mode": loss_mode},
            }
        )

    mixins = engine_mixins(config("sat_gspo", "R3"))
    assert mixins == (StepQuantileEngine, RoutingReplayFSDP)
    vendor = register_engine("fsdp2", mixins)
    assert register_engine("fsdp2", mixins) == vendor  # idempotent
    import os

    assert os.environ["VERL_ENGINE_VENDOR"] == vendor
    cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    assert cls.__mro__[1:4] == (StepQuantileEngine, RoutingReplayFSDP, FSDPEngineWithLMHead)
    assert engine_mixins(config("vanilla", "disabled")) == ()
    assert engine_mixins(config("sat", "disabled")) == (StepQuantileEngine,)


class _RecordingEngine:
    """Stands in for verl's FSDP engine below the mixin: records the passes it is handed."""

    engine_config = OmegaConf.create({"router_replay": {"mode": "R3"}})

    def __init__(self) -> None:
        self.passes: list[bool] = []

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self.passes.append(forward_only)
        return {}


@pytest.mark.parametrize("flag", [None, False])
def test_a_training_pass_without_the_replay_flag_is_refused_under_r3(flag):
    """R3 configured, a training pass without verl's per-batch flag: refused before any forward
    (it would route on its own and train on other experts than mu's); forward-only passes without
    the flag (the reference model's) and flagged training passes go through."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_sat.routing.fsdp import RoutingReplayFSDP

    engine = type("Composed", (RoutingReplayFSDP, _RecordingEngine), {})()
    data = TensorDict({"input_ids": torch.zeros(2, 3, dtype=torch.long)}, batch_size=[2])
    if flag is not None:
        tu.assign_non_tensor_data(data, "enable_routing_replay", flag)
    with pytest.raises(RuntimeError, match="enable_routing_replay"):
        engine.forward_backward_batch(data, None, forward_only=False)
    assert engine.passes == []
    engine.forward_backward_batch(data, None, forward_only=True)
    tu.assign_non_tensor_data(data, "enable_routing_replay", True)
    engine.forward_backward_batch(data, None, forward_only=False)
    assert engine.passes == [True, False]


def test_an_actor_engine_without_a_needed_mixin_is_refused_after_init_model():
    """The worker-level twin of the pass-level refusal: verl built an engine without a mixin the
    actor's config needs (register_engine did not run first), so the launch stops at init_model,
    naming the engine and each missing mixin; R3 alone needs the replay, SAT-GSPO's step q too."""
    from verl_sat.routing.fsdp import RoutingReplayFSDP
    from verl_sat.trainer.engines import StepQuantileEngine, check_engine

    def actor(loss_mode: str, mode: str) -> DictConfig:
        return OmegaConf.create(
            {
                "strategy": "fsdp2",
                "fsdp_config": {"router_replay": {"mode": mode}},
                "policy_loss": {"loss_mode": loss_mode},
            }
        )

    replaying = type("Composed", (RoutingReplayFSDP, _RecordingEngine), {})()
    with pytest.raises(RuntimeError, match=r"the actor's engine _RecordingEngine lacks RoutingReplayFSDP \("):
        check_engine(_RecordingEngine(), actor("gspo", "R3"))
    check_engine(replaying, actor("gspo", "R3"))
    with pytest.raises(RuntimeError, match=r"the actor's engine Composed lacks StepQuantileEngine \("):
        check_engine(replaying, actor("sat_gspo", "R3"))
    with pytest.raises(RuntimeError, match="lacks StepQuantileEngine, RoutingReplayFSDP"):
        check_engine(_RecordingEngine(), actor("sat_gspo", "R3"))
    check_engine(type("Both", (StepQuantileEngine, RoutingReplayFSDP, _RecordingEngine), {})(), actor("sat_gspo", "R3"))
    check_engine(_RecordingEngine(), actor("gspo", "disabled"))  # nothing to mix in
