"""q over the optimizer step (docs/sat.md#the-rule step 2; verl_sat.sat.step_q) at the paper's shapes.

A step of many micro-batches, each holding one to three long responses (dynamic batching at
~35k tokens, multi-thousand-token responses): with ``step`` scope SAT-GSPO gates about 1 - alpha
of the step's active tokens and never more; with ``micro_batch`` scope it gates nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import actor_config, cached_actor_config
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import (
    AGG_MODES,
    LEVELS,
    PROPERTY,
    SATCase,
    assert_biting_share,
    run_loss,
    sat_cases,
    spec_rule,
    spec_score,
)

from verl_sat.sat.losses import compute_policy_loss_sat, compute_policy_loss_sat_gspo, loss_context
from verl_sat.sat.quantile import exact_quantile
from verl_sat.sat.step_q import needs_step_q, step_scores
from verl_sat.trainer.engines import StepQuantileEngine, compose, enable_step_q

LOSSES = {"sat": compute_policy_loss_sat, "sat_gspo": compute_policy_loss_sat_gspo}


def paper_step(seed: int, n_micro: int = 24, max_len: int = 3000, max_seqs: int = 3) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of 1-3 responses of max_len/3..max_len tokens (each holds >= 1/7 of its
    micro-batch, as multi-thousand-token responses packed at ~35k do), with a per-response drift."""
    g = torch.Generator().manual_seed(seed)
    micro = []
    for _ in range(n_micro):
        b = int(torch.randint(1, max_seqs + 1, (1,), generator=g))
        lengths = torch.randint(max_len // 3, max_len, (b,), generator=g)
        width = int(lengths.max())
        mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        drift = torch.randn(b, 1, generator=g) * 0.05  # sequence-level staleness
        old = -torch.rand(b, width, generator=g) * 3
        log_prob = old + drift + torch.randn(b, width, generator=g) * 0.02
        adv = torch.randn(b, 1, generator=g).expand(b, width).clone()
        micro.append({"old": old, "log_prob": log_prob, "adv": adv, "mask": mask})
    return micro


def step_q(loss_mode: str, micro: list[dict[str, torch.Tensor]], alpha: float = 0.9) -> float:
    """What the scoring pass computes: q over every micro-batch's scores (one rank)."""
    values, weights = [], []
    for m in micro:
        v, w = step_scores(loss_mode, m["log_prob"], m["old"], m["mask"])
        values.append(v)
        weights.append(torch.ones_like(v, dtype=torch.long) if w is None else w)
    return float(exact_quantile(torch.cat(values), alpha, torch.cat(weights)))


def gated_tokens(loss_mode: str, micro: list[dict[str, torch.Tensor]], scope: str, q: float | None) -> tuple[int, int]:
    config = actor_config(loss_mode, sat_quantile_scope=scope)
    gated = active = 0
    for m in micro:
        with loss_context(step_q=q) as ctx:
            _, metrics = LOSSES[loss_mode](m["old"], m["log_prob"], m["adv"], m["mask"], config=config)
        gated += int(ctx.gate.sum())
        active += int(m["mask"].sum())
        assert metrics["actor/sat_seqs_per_micro_batch"] == float(m["mask"].any(-1).sum())
    return gated, active


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sat_gspo_gates_about_one_minus_alpha_of_the_step_with_step_scope(seed):
    micro = paper_step(seed)
    gated, active = gated_tokens("sat_gspo", micro, "step", step_q("sat_gspo", micro))
    assert gated <= 0.1 * active  # never more than 1 - alpha
    assert gated >= 0.1 * active - 3000  # short of it by less than one response (ties at q)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sat_gspo_with_micro_batch_scope_gates_nothing_at_this_shape(seed):
    """The old behaviour, kept as an option: the top response of a micro-batch holds >= 10% of
    its tokens, so q is its own score and the strict |d| > q gates nothing (SAT-GSPO = GSPO)."""
    micro = paper_step(seed)
    gated, _ = gated_tokens("sat_gspo", micro, "micro_batch", None)
    assert gated == 0


def test_token_level_sat_gates_the_steps_tail_in_step_scope():
    micro = paper_step(3)
    gated, active = gated_tokens("sat", micro, "step", step_q("sat", micro))
    assert 0.1 * active - len(micro) <= gated <= 0.1 * active


def test_one_micro_batch_step_equals_micro_batch_scope():
    """A step of one micro-batch: the step's q is the micro-batch's, so both scopes agree bit for bit."""
    (m,) = paper_step(4, n_micro=1, max_seqs=3, max_len=300)
    for loss_mode, fn in LOSSES.items():
        q = step_q(loss_mode, [m])
        with loss_context(step_q=q):
            a = fn(m["old"], m["log_prob"], m["adv"], m["mask"], config=actor_config(loss_mode))
        b = fn(
            m["old"],
            m["log_prob"],
            m["adv"],
            m["mask"],
            config=actor_config(loss_mode, sat_quantile_scope="micro_batch"),
        )
        assert torch.equal(a[0], b[0]) and a[1]["actor/sat_q"] == b[1]["actor/sat_q"]


@st.composite
def handed_q(draw, case: SATCase) -> float:
    """A q the optimizer step might hand this micro-batch, exact in the case's dtype: 0, a multiple
    of the micro-batch's own q (below it: more gated; above: fewer), or a multiple of PPO's reach."""
    own = spec_rule(case).q
    reach = min(math.log1p(case.eps_high), -math.log1p(-case.eps_low))
    kind = draw(st.sampled_from(["own"] * 3 + ["reach", "zero"]))
    q = {
        "own": own * draw(st.sampled_from([0.25, 0.5, 0.9, 1.0, 1.0, 1.5, 4.0])),
        "reach": reach * draw(st.floats(0.01, 2.0)),
        "zero": 0.0,
    }[kind]
    return float(torch.tensor(q, dtype=case.dtype))


@st.composite
def cases_with_step_q(draw, level: str) -> tuple[SATCase, float]:
    case = draw(sat_cases(level))
    return case, draw(handed_q(case))


@pytest.mark.parametrize("level", LEVELS)
def test_pessimism_and_base_identity_under_any_step_q(level):
    """Proposition 4.1 whatever q the step hands the micro-batch (docs/sat.md#the-rule, step 2),
    against verl's own registered ``vanilla`` (token level) and ``gspo`` (sequence level), in every
    loss_agg_mode: the gate is the spec's for that q; -S_SAT >= -S_PPO on every token, so the
    aggregated loss too; tokens (token level) or responses (sequence level) the q leaves ungated
    keep verl's loss and gradient bit for bit; nothing gated: loss and gradient are verl's.
    Bites where, under the handed q, a band token is present (SAT strictly more pessimistic);
    the controls are draws where that q gates nothing."""
    bites, ungated = [], []

    @PROPERTY
    @given(drawn=cases_with_step_q(level), agg=st.sampled_from(AGG_MODES))
    def check(drawn: tuple[SATCase, float], agg: str) -> None:
        case, q = drawn
        spec = spec_rule(case, q=q)
        cfg_sat = cached_actor_config(case.loss_name, **case.sat_settings())
        cfg_base = cached_actor_config(case.base_name, eps_low=case.eps_low, eps_high=case.eps_high)
        sat = run_loss(case.loss_name, case.batch(), cfg_sat, agg, step_q=q)
        base = run_loss(case.base_name, case.batch(), cfg_base, agg)
        mask, gate = case.mask, sat.gate
        # the gate is the spec's, but where |d| is within rounding of q (a sequence score summed in
        # another order than spec_score's): there the applied gate decides
        near = mask.numpy() & (np.abs(np.abs(spec_score(case).numpy()) - q) <= 4 * torch.finfo(case.dtype).eps * q)
        assert np.array_equal(gate.numpy()[~near], spec.gate[~near])
        assert torch.all(sat.token_loss[mask] >= base.token_loss[mask])  # -S_SAT >= -S_PPO per token
        assert sat.loss.item() >= base.loss.item() - 1e-6 * max(1.0, abs(base.loss.item()))
        keep = mask & ~gate if case.level == "token" else mask & ~gate.any(-1, keepdim=True)
        assert torch.equal(sat.grad[keep], base.grad[keep]) and torch.equal(sat.token_loss[keep], base.token_loss[keep])
        if not gate.any():
            assert torch.equal(sat.loss, base.loss) and torch.equal(sat.grad, base.grad)
        bites.append(spec.bites)
        ungated.append(not bool(gate.any()))

    check()
    assert_biting_share(bites, f"pessimism under a handed q, a band token [{level}]", minimum=0.25)
    assert_biting_share(ungated, f"base identity under a handed q, nothing gated [{level}]", minimum=0.15, maximum=0.75)


# ---------------------------------------------------------------------------------------------
# the engine mixin: scoring pass first, then the training pass with q and the scores
# ---------------------------------------------------------------------------------------------
class FakeEngine:
    """Records forward_backward_batch calls; returns log-probs like verl's engines (nested, full sequence)."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, bool, dict]] = []

    def get_data_parallel_group(self):
        return None

    def get_data_parallel_size(self):
        return 1

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from verl.utils import tensordict_utils as tu

        keys = ("sat_step_q", "calculate_entropy", "sat_micro_batch_is_step")
        seen = {k: tu.get_non_tensor_data(data, key=k, default=None) for k in keys}
        seen["has_scores"] = "sat_score_log_probs" in data.keys()
        self.calls.append((forward_only, loss_function is None, seen))
        return {"model_output": {"log_probs": data["full_log_probs"]}}


def fake_mini_batch(seed: int = 0):
    """A verl-like mini-batch: prompts and responses nested, response fields nested over responses."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = [3, 5, 2], [4, 2, 6]
    full = [torch.zeros(p + r) for p, r in zip(prompt_lens, response_lens, strict=True)]
    old, lp = [], []
    for i, r in enumerate(response_lens):
        o = -torch.rand(r, generator=g)
        old.append(o)
        lp.append(o + 0.1 * torch.randn(r, generator=g))
        full[i][prompt_lens[i] - 1 : prompt_lens[i] - 1 + r] = lp[-1]  # verl's log-prob of token t+1 at t

    def nested(xs):
        return torch.nested.as_nested_tensor(xs, layout=torch.jagged)

    data = TensorDict(
        {
            "prompts": nested([torch.ones(p, dtype=torch.long) for p in prompt_lens]),
            "responses": nested([torch.ones(r, dtype=torch.long) for r in response_lens]),
            "response_mask": nested([torch.ones(r) for r in response_lens]),
            "old_log_probs": nested(old),
            "full_log_probs": nested(full),
        },
        batch_size=[3],
    )
    return data, lp, old


def test_engine_mixin_scores_the_step_before_training():
    from verl.workers.utils.padding import no_padding_2_padding

    data, lp, old = fake_mini_batch()
    engine = compose(FakeEngine, (StepQuantileEngine,))()
    config = actor_config("sat")
    enable_step_q(engine, config)
    assert isinstance(engine, StepQuantileEngine) and needs_step_q(config)
    engine.forward_backward_batch(data, loss_function=lambda **_: None)
    (first, second) = engine.calls
    assert first[0] is True and first[1] is True  # scoring pass: forward only, no loss
    assert second[0] is False and second[2]["has_scores"]
    d = torch.cat([(a - b).abs() for a, b in zip(lp, old, strict=True)])
    assert second[2]["sat_step_q"] == float(exact_quantile(d, 0.9))
    scored = no_padding_2_padding(data["full_log_probs"], data)
    assert torch.allclose(scored[2, :6], lp[2])
    assert "sat_score_log_probs" not in data.keys()  # cleaned up after the step


@pytest.mark.parametrize(
    "overrides", [{"sat_quantile_scope": "micro_batch"}, {"sat_enabled": False}, {"loss_mode": "vanilla"}]
)
def test_engine_mixin_passes_through_when_no_step_q_is_needed(overrides):
    data, _, _ = fake_mini_batch()
    engine = compose(FakeEngine, (StepQuantileEngine,))()
    loss_mode = overrides.pop("loss_mode", "sat_gspo")
    enable_step_q(engine, actor_config(loss_mode, **overrides))
    engine.forward_backward_batch(data, loss_function=lambda **_: None)
    assert len(engine.calls) == 1 and engine.calls[0][0] is False and engine.calls[0][2]["sat_step_q"] is None


def test_forward_only_calls_are_untouched():
    data, _, _ = fake_mini_batch()
    engine = compose(FakeEngine, (StepQuantileEngine,))()
    enable_step_q(engine, actor_config("sat"))
    engine.forward_backward_batch(data, loss_function=None, forward_only=True)
    assert len(engine.calls) == 1


def test_step_gate_rate_shares_add_up_to_the_steps_token_weighted_rate():
    """verl sums a SUM metric over micro-batches and averages it over ranks: the shares give
    gated / N over the whole step, however the tokens are split."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType

    from verl_sat.trainer.actor import step_gate_rate

    g = torch.Generator().manual_seed(0)
    ranks = [[torch.rand(b, 50, generator=g) > 0.9 for b in (1, 3, 2)], [torch.rand(4, 50, generator=g) > 0.9]]
    n_step = sum(gate.numel() for rank in ranks for gate in rank)
    gated = sum(int(gate.sum()) for rank in ranks for gate in rank)
    per_rank = []
    for rank in ranks:
        total = 0.0
        for gate in rank:
            data = TensorDict({}, batch_size=[gate.shape[0]])
            tu.assign_non_tensor(data, sat_step_tokens=n_step, dp_size=len(ranks))
            metric = step_gate_rate(data, gate)
            assert metric.aggregation == AggregationType.SUM
            total += metric.values[0]
        per_rank.append(total)
    assert sum(per_rank) / len(ranks) == pytest.approx(gated / n_step, rel=1e-12)


def test_scoring_pass_computes_log_pi_only_and_restores_the_batch_switches():
    """Entropy (and sum pi^2, distillation) off in the scoring pass, back on for training."""
    from verl.utils import tensordict_utils as tu

    data, _, _ = fake_mini_batch()
    tu.assign_non_tensor(data, calculate_entropy=True)
    engine = compose(FakeEngine, (StepQuantileEngine,))()
    enable_step_q(engine, actor_config("sat_gspo"))
    engine.forward_backward_batch(data, loss_function=lambda **_: None)
    assert [call[2]["calculate_entropy"] for call in engine.calls] == [False, True]
    assert tu.get_non_tensor_data(data, key="calculate_entropy", default=None) is True
    assert tu.get_non_tensor_data(data, key="distillation_only", default="unset") == "unset"


def test_forward_scoring_refuses_dynamic_context_parallel():
    from types import SimpleNamespace

    data, _, _ = fake_mini_batch()
    engine = compose(FakeEngine, (StepQuantileEngine,))()
    engine.engine_config = SimpleNamespace(dynamic_context_parallel=True)
    enable_step_q(engine, actor_config("sat_gspo"))
    with pytest.raises(NotImplementedError, match="sat_step_score=old_log_prob"):
        engine.forward_backward_batch(data, loss_function=lambda **_: None)


@pytest.mark.parametrize(
    ("micro", "dynamic", "skipped"), [(3, False, True), (8, False, True), (2, False, False), (3, True, False)]
)
def test_no_scoring_pass_when_one_micro_batch_on_one_rank_is_the_step(micro, dynamic, skipped):
    """The micro-batch's own q is then the step's, at the step's weights: the pass would be waste."""
    from verl.utils import tensordict_utils as tu

    data, _, _ = fake_mini_batch()  # 3 samples
    tu.assign_non_tensor(data, micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic)
    engine = compose(FakeEngine, (StepQuantileEngine,))()
    enable_step_q(engine, actor_config("sat_gspo"))
    engine.forward_backward_batch(data, loss_function=lambda **_: None)
    assert len(engine.calls) == (1 if skipped else 2)
    training = engine.calls[-1][2]
    assert training["sat_micro_batch_is_step"] is (True if skipped else None)
    assert (training["sat_step_q"] is None) is skipped
    assert tu.get_non_tensor_data(data, key="sat_micro_batch_is_step", default=None) is None  # cleaned up


def test_whole_step_context_takes_the_micro_batchs_own_q_without_error():
    """Through verl's ppo_loss (global_batch_info set) a whole-step micro-batch needs no step q."""
    (m,) = paper_step(5, n_micro=1, max_len=300)
    info = {"dp_size": 1, "batch_num_tokens": 10**6}  # whatever verl counted: the flag decides
    config = actor_config("sat_gspo", global_batch_info=info)
    with loss_context(whole_step=True):
        a = compute_policy_loss_sat_gspo(m["old"], m["log_prob"], m["adv"], m["mask"], config=config)
    b = compute_policy_loss_sat_gspo(m["old"], m["log_prob"], m["adv"], m["mask"], config=actor_config("sat_gspo"))
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize("loss_mode", ["sat", "sat_gspo"])
@pytest.mark.parametrize("pad", [float("-inf"), float("nan")])
def test_step_scores_ignore_what_padding_holds(loss_mode, pad):
    """An engine's padding may hold -inf or NaN log-probs: the step's scores (and so q) are those
    of clean padding, as the loss's own scores are."""
    (m,) = paper_step(6, n_micro=1, max_len=300)
    clean = step_scores(loss_mode, m["log_prob"], m["old"], m["mask"])
    dirty = step_scores(loss_mode, m["log_prob"].masked_fill(~m["mask"], pad), m["old"], m["mask"])
    assert torch.equal(clean[0], dirty[0]) and torch.isfinite(dirty[0]).all()


def test_a_responses_score_does_not_depend_on_how_wide_its_row_is_padded():
    """The step's q pads the mini-batch, the loss its micro-batch: the sequence score must be the
    same bits at any width, or a response scored exactly at q is gated in the loss (an fp32 row sum
    differed in the last bit on about 30% of these rows)."""
    from verl_sat.sat.rule import sequence_score

    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        length = int(torch.randint(3, 40, (1,), generator=g))
        x = torch.randn(length, generator=g) * 0.05
        width = int(torch.randint(length, 200, (1,), generator=g))
        narrow, wide = torch.zeros(1, length), torch.zeros(1, width)
        narrow[0, :length] = wide[0, :length] = x
        lengths = torch.tensor([float(length)])
        assert torch.equal(sequence_score(narrow, lengths), sequence_score(wide, lengths))
