"""The token-level study's instruments (studies/token_level/instrument.py, token_loop.py): the token
classes, the removed per-token gradient = SAT's intercepted tokens, the parameter-space shares, and
a wrapped loop whose losses are the plain loop's."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cached_actor_config, random_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import verl_sat  # noqa: F401  (registers the SAT losses)
from studies.token_level import instrument
from studies.token_level.instrument import DIGIT, EOS, FORMAT, OTHER
from verl_sat.sat.losses import compute_policy_loss_sat
from verl_sat.sat.rule import intercepted, sat_factors, staleness_score


@pytest.fixture(scope="module")
def tokenizer():
    from verl_sat.default import model as tiny

    return tiny.build_tokenizer()


def test_the_answer_lines_tokens_fall_in_their_classes(tokenizer):
    eos = tokenizer.eos_token_id
    table = instrument.class_table(tokenizer, {eos})
    ids = tokenizer("Answer: 107", add_special_tokens=False)["input_ids"]
    texts = [tokenizer.decode([i]) for i in ids]
    want = [DIGIT if t.strip().isdecimal() else FORMAT for t in texts]
    assert [int(table[i]) for i in ids] == want
    assert want.count(DIGIT) >= 1 and want.count(FORMAT) >= 1
    assert int(table[eos]) == EOS
    letter = tokenizer("Q", add_special_tokens=False)["input_ids"][0]  # not in "Answer: "
    assert int(table[letter]) == OTHER
    response = torch.tensor([[*ids, eos, 10**6]])  # an id outside the vocabulary: other
    assert instrument.classify(response, table).tolist() == [[*want, EOS, OTHER]]


def _token_grads(batch: dict[str, torch.Tensor], alpha: float, exponent: float) -> tuple[torch.Tensor, torch.Tensor]:
    args = (batch["old_log_prob"], batch["log_prob"], batch["advantages"], batch["response_mask"], "token-mean")
    on = cached_actor_config(sat_alpha=alpha, sat_kernel_exponent=exponent)
    off = cached_actor_config(sat_enabled=False)
    return (
        instrument.token_gradient(compute_policy_loss_sat, *args, off),
        instrument.token_gradient(compute_policy_loss_sat, *args, on),
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    alpha=st.sampled_from([0.5, 0.9, 0.95]),
    exponent=st.sampled_from([2.0, 4.0]),
    scale=st.sampled_from([0.05, 0.15, 0.3]),
)
def test_the_removed_gradient_sits_exactly_on_sats_intercepted_tokens(seed, alpha, exponent, scale):
    """delta = g_GRPO - g_SAT is nonzero at exactly the tokens rule.intercepted counts, equals
    GRPO's own gradient there (SAT clips them to a constant), and is zero elsewhere."""
    batch = random_batch(seed, 6, 7, scale=scale, dtype=torch.float64)
    mask = batch["response_mask"]
    g_base, g_sat = _token_grads(batch, alpha, exponent)
    delta = g_base - g_sat
    d = staleness_score("token", batch["log_prob"], batch["old_log_prob"], mask)
    f = sat_factors(d, mask, alpha, "hill", exponent)
    ratio = torch.exp(batch["log_prob"] - batch["old_log_prob"])
    moved = (delta != 0) & mask.bool()
    assert int(moved.sum()) == int(intercepted(ratio, batch["advantages"], f, 0.2, 0.2))
    assert bool((moved <= f.gate).all())  # only gated tokens can lose their gradient
    torch.testing.assert_close(delta[moved], g_base[moved])  # ... all of it
    assert bool((g_sat[moved] == 0).all())
    classes = torch.zeros_like(mask, dtype=torch.long)
    m = instrument.class_metrics(classes, mask, f.gate, d, batch["advantages"], g_base, delta)
    assert 0.0 <= m["token/removed_weight_share"] <= 1.0
    assert m["token/intercepted"] == float(moved.sum())


def test_class_metrics_split_the_totals_by_class_and_sign():
    classes = torch.tensor([[DIGIT, FORMAT, EOS, OTHER, DIGIT]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    gated = torch.tensor([[True, False, True, True, True]])
    d = torch.tensor([[0.5, 0.0, -0.4, 0.3, 9.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 0.0, 1.0]])
    g_base = torch.tensor([[-0.25, -0.25, 0.25, 0.0, -0.25]])
    delta = torch.tensor([[-0.25, 0.0, 0.25, 0.0, -0.25]])
    m = instrument.class_metrics(classes, mask, gated, d, adv, g_base, delta)
    assert m["token/active"] == 4 and m["token/gated"] == 3 and m["token/intercepted"] == 2
    assert (m["token/gated_digit"], m["token/gated_dpos_digit"], m["token/icpt_apos_digit"]) == (1, 1, 1)
    assert (m["token/gated_eos"], m["token/gated_aneg_eos"], m["token/icpt_aneg_eos"]) == (1, 1, 1)
    assert (m["token/gated_other"], m["token/gated_azero_other"], m["token/icpt_apos_other"]) == (1, 1, 0)
    assert m["token/gated_format"] == 0 and m["token/wbase_format"] == 0.25 and m["token/wrem_format"] == 0
    assert m["token/removed_weight_share"] == pytest.approx(0.5 / 0.75)
    assert sum(m[f"token/active_{c}"] for c in instrument.TOKEN_CLASSES) == m["token/active"]


def test_the_parameter_shares_are_the_difference_of_the_two_losses_gradients():
    """J^T delta is GRPO's parameter gradient minus SAT's, each taken by autograd on its own loss."""
    torch.manual_seed(0)
    net = torch.nn.Linear(5, 9, dtype=torch.float64)
    x = torch.randn(4, 5, dtype=torch.float64)
    batch = random_batch(3, 4, 9, scale=0.3, dtype=torch.float64)
    adv, mask = batch["advantages"], torch.ones(4, 9, dtype=torch.float64)
    with torch.no_grad():  # mu near the net's log-probs: |d| ~ 0.07, q inside PPO's band for most tokens
        old = torch.nn.functional.logsigmoid(net(x)) + 0.07 * torch.randn(4, 9, dtype=torch.float64)
    params = list(net.parameters())

    def loss_grads(config) -> list[torch.Tensor]:
        log_prob = torch.nn.functional.logsigmoid(net(x)) * mask
        loss, _ = compute_policy_loss_sat(old, log_prob, adv, mask, "token-mean", config)
        return list(torch.autograd.grad(loss, params))

    on, off = cached_actor_config(), cached_actor_config(sat_enabled=False)
    log_prob = torch.nn.functional.logsigmoid(net(x)) * mask
    g_base = instrument.token_gradient(compute_policy_loss_sat, old, log_prob, adv, mask, "token-mean", off)
    g_sat = instrument.token_gradient(compute_policy_loss_sat, old, log_prob, adv, mask, "token-mean", on)
    assert bool((g_base != g_sat).any())  # this batch has intercepted tokens
    shares = instrument.parameter_shares(log_prob, g_base, g_base - g_sat, params)
    base, sat = loss_grads(off), loss_grads(on)
    removed = [b - s for b, s in zip(base, sat, strict=True)]
    want = instrument.shares_of(base, removed)
    for key, value in want.items():
        assert shares[key] == pytest.approx(value, rel=1e-9, abs=1e-12)
    norm = math.sqrt(sum(float((b * b).sum()) for b in base))
    assert shares["token/grad_base_norm"] == pytest.approx(norm)


def test_shares_of_measures_length_and_projection():
    base = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    assert instrument.shares_of(base, base)["token/grad_removed_proj"] == pytest.approx(1.0)
    half = instrument.shares_of(base, [torch.tensor([1.5, 0.0]), torch.tensor([2.0])])
    assert half["token/grad_removed_share"] == pytest.approx(0.5)
    orthogonal = instrument.shares_of(base, [torch.tensor([0.0, 7.0]), None])
    assert orthogonal["token/grad_removed_proj"] == 0.0
    assert orthogonal["token/grad_removed_share"] == pytest.approx(7 / 5)
    assert instrument.shares_of([None], [None])["token/grad_removed_share"] == 0.0


@pytest.fixture(scope="module")
def model_and_tokenizer(tokenizer):
    from verl_sat.default import model as tiny

    torch.set_num_threads(1)
    return tiny.build_model(tiny.build_config(tokenizer), seed=0).eval(), tokenizer


def test_the_wrapped_loop_trains_as_the_plain_loop_and_measures_every_step(model_and_tokenizer, monkeypatch):
    from studies.lib.loop import LoopConfig, StudyLoop
    from studies.token_level.token_loop import TokenLoop, TokenLoopConfig
    from verl_sat.default import reward

    monkeypatch.setattr(reward, "compute_score", lambda source, text, answer: float(len(text) % 2))
    common = {"loss_mode": "sat", "loss_agg_mode": "token-mean", "steps": 4, "lag": 2, "lr": 1e-2}
    common.update(prompts_per_step=3, rollout_n=2, max_response_length=4, router_bias_std=0.5)
    plain = StudyLoop(LoopConfig(**common), *model_and_tokenizer).run()
    wrapped = TokenLoop(TokenLoopConfig(**common, grad_every=2), *model_and_tokenizer).run()
    for a, b in zip(plain, wrapped, strict=True):
        assert a["actor/pg_loss"] == b["actor/pg_loss"] and a["actor/grad_norm"] == b["actor/grad_norm"]
        assert b["token/active"] > 0 and b["token/q"] == pytest.approx(a["study/q"])
    assert [("token/grad_removed_share" in r) for r in wrapped] == [False, True, False, True]


def test_the_kernel_exponent_reaches_the_loss_and_bad_settings_name_their_field(model_and_tokenizer):
    from studies.token_level.token_loop import TokenLoop, TokenLoopConfig

    loop = TokenLoop(TokenLoopConfig(loss_mode="sat", sat_kernel_exponent=4.0, sat_alpha=0.95), *model_and_tokenizer)
    assert loop.actor_config.policy_loss.sat_kernel_exponent == 4.0
    assert loop.actor_config.policy_loss.sat_alpha == 0.95 and loop.base_config.policy_loss.sat_enabled is False
    for bad, key in (({"loss_mode": "sat_gspo"}, "loss_mode"), ({"sat_kernel_exponent": 0.0}, "sat_kernel_exponent")):
        with pytest.raises(ValueError, match=key):
            TokenLoopConfig(**{"loss_mode": "sat", **bad})
