"""The in-process study loop (studies/lib/loop.py): the trainer's log-probs line up with the
rollout's, the lag sets the staleness, each mismatch knob does what it says, R3 removes the
routing one, and bad settings name their field."""

from __future__ import annotations

import pytest
import torch

import verl_sat  # noqa: F401  (registers the SAT losses)
from studies.lib.loop import LoopConfig, StudyLoop
from verl_sat.rollout.engine import EngineOptions, HFEngine, fixed_logit_bias


def run(model_and_tokenizer, **overrides) -> list[dict]:
    settings = {"steps": 3, "prompts_per_step": 2, "rollout_n": 2, "max_response_length": 4, **overrides}
    return StudyLoop(LoopConfig(**settings), *model_and_tokenizer).run()


def test_without_mismatch_the_trainer_reproduces_the_rollouts_log_probs(model_and_tokenizer):
    rows = run(model_and_tokenizer, steps=1)  # lag 1, first step: the same weights on both sides
    assert rows[0]["actor/mismatch_abs_mean"] < 1e-5
    assert rows[0]["training/sat/staleness_steps/max"] == 0.0


def test_the_lag_sets_the_staleness_as_the_trainer_does(model_and_tokenizer, varied_reward):
    """One batch in flight (verl's separate_async): staleness in [1, n], n reached once per cycle."""
    rows = run(model_and_tokenizer, steps=7, lag=3, lr=1e-2)
    assert [r["training/sat/staleness_steps/max"] for r in rows] == [0, 1, 2, 3, 1, 2, 3]
    assert rows[0]["actor/mismatch_abs_mean"] < 1e-5  # fresh weights
    assert rows[3]["actor/mismatch_abs_mean"] > 1e-3  # three updates later the policy has moved
    lag1 = run(model_and_tokenizer, steps=3, lag=1, lr=1e-2)
    assert [r["training/sat/staleness_steps/max"] for r in lag1] == [0, 1, 1]  # lag 1 is one step off


def test_held_out_accuracy_is_the_trained_policys_on_problems_never_trained(model_and_tokenizer, varied_reward):
    from studies.lib.loop import HELDOUT_GREEDY_KEY, HELDOUT_KEY, heldout_problems

    model, tokenizer = model_and_tokenizer
    cfg = LoopConfig(steps=3, prompts_per_step=4, rollout_n=2, max_response_length=4, eval_problems=40, eval_at=(0, 2))
    loop = StudyLoop(cfg, model, tokenizer)
    drawn = []
    real = loop._training_problem
    loop._training_problem = lambda task: drawn.append(real(task)) or drawn[-1]
    rows = loop.run()
    heldout = {(p.a, p.b) for p in heldout_problems(40, cfg.eval_seed)}
    assert len(heldout) == 40 and not heldout & {(p.a, p.b) for p in drawn}
    assert [HELDOUT_KEY in r for r in rows] == [False, True, True]  # after step 2 and the last step
    assert f"{HELDOUT_KEY}_initial" in rows[0] and HELDOUT_GREEDY_KEY in rows[-1]
    assert all(0.0 <= r[HELDOUT_KEY] <= 1.0 for r in rows if HELDOUT_KEY in r)
    # the same weights score the same: the evaluation's random numbers are fixed by eval_seed
    assert loop.heldout_accuracy() == loop.heldout_accuracy()
    assert loop.policy.training  # back in training mode after each evaluation


def test_a_corrections_pi_old_is_the_last_broadcast_for_the_whole_cycle(model_and_tokenizer, varied_reward):
    model, tokenizer = model_and_tokenizer
    cfg = LoopConfig(steps=2, lag=3, prompts_per_step=2, rollout_n=2, max_response_length=4, lr=1e-2, correction="tis")
    loop = StudyLoop(cfg, model, tokenizer)
    loop.run()
    pairs = list(zip(model.parameters(), loop.old_policy.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)  # no broadcast yet: pi_old = version 0
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), loop.policy.parameters(), strict=True))
    loop.sync_weights(3)
    pairs = zip(loop.policy.parameters(), loop.old_policy.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("loss", [{"loss_mode": "sat", "loss_agg_mode": "token-mean"}, {"loss_mode": "sat_gspo"}])
def test_the_counterfactual_activity_equals_the_sat_losss_own_metrics(model_and_tokenizer, loss):
    """study/* (computed for every arm from docs/sat.md#the-rule) agree with what the SAT loss reports."""
    rows = run(model_and_tokenizer, steps=4, lag=4, lr=3e-2, logit_bias_std=0.3, **loss)
    for r in rows:
        assert r["study/q"] == pytest.approx(r["actor/sat_q"], rel=1e-5, abs=1e-7)
        assert r["study/gate_rate"] == pytest.approx(r["actor/sat_gate_rate"], abs=1e-6)
        assert r["study/intercepted_frac"] == pytest.approx(r["actor/sat_intercepted_frac"], abs=1e-6)
        assert r["study/q_below_radius"] == float(r["study/q"] < 0.18232155679395462)


def test_a_fixed_logit_bias_is_a_systematic_mismatch(model_and_tokenizer):
    model, _ = model_and_tokenizer
    options = EngineOptions(logit_bias_std=1.0, seed=5)
    bias = fixed_logit_bias(model, options)
    assert bias.shape == (model.config.vocab_size,)
    torch.testing.assert_close(bias, fixed_logit_bias(model, options))  # the same offset every time
    assert fixed_logit_bias(model, EngineOptions(seed=5)) is None
    rows = run(model_and_tokenizer, logit_bias_std=1.0)
    assert all(r["actor/mismatch_abs_mean"] > 0.05 for r in rows)


def test_r3_removes_a_routing_mismatch(model_and_tokenizer):
    plain = run(model_and_tokenizer, steps=2, router_bias_std=3.0)
    replayed = run(model_and_tokenizer, steps=2, router_bias_std=3.0, routing_replay="R3")
    assert min(r["actor/mismatch_abs_mean"] for r in plain) > 1e-3
    assert max(r["actor/mismatch_abs_mean"] for r in replayed) < 1e-4


@pytest.mark.parametrize(
    ("overrides", "metric"),
    [
        ({"loss_mode": "sat", "loss_agg_mode": "token-mean"}, "actor/sat_gate_rate"),
        ({"loss_mode": "sat_gspo", "sat_enabled": False}, "actor/pg_clipfrac"),
        ({"loss_mode": "vanilla", "correction": "tis", "loss_agg_mode": "token-mean"}, "rollout_corr/rollout_is_mean"),
        ({"loss_mode": "gspo", "correction": "icepop"}, "rollout_corr/rollout_rs_token_k1_masked_fraction"),
        ({"loss_mode": "gspo", "correction": "geo_rs"}, "rollout_corr/rollout_rs_seq_mean_k1_masked_fraction"),
        ({"loss_mode": "cispo", "loss_agg_mode": "token-mean"}, "actor/pg_clipfrac"),
        (
            {"loss_mode": "dppo_tv", "loss_agg_mode": "token-mean", "eps_low": 0.001, "eps_high": 0.001},
            "actor/pg_clipfrac",
        ),
    ],
)
def test_every_arm_trains_through_verls_registered_loss(model_and_tokenizer, varied_reward, overrides, metric):
    model, tokenizer = model_and_tokenizer
    loop = StudyLoop(
        LoopConfig(steps=1, lag=2, prompts_per_step=2, rollout_n=2, max_response_length=4, lr=1e-2, **overrides),
        model,
        tokenizer,
    )
    before = [p.detach().clone() for p in loop.policy.parameters()]
    rows = loop.run()
    assert metric in rows[0] and all(torch.isfinite(torch.tensor(v)) for v in rows[0].values())
    assert any(not torch.equal(a, b) for a, b in zip(before, loop.policy.parameters(), strict=True))
    # no broadcast within the cycle: the rollout still holds the starting weights
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loop.rollout.model.parameters(), strict=True))


def test_run_writes_verls_file_logger_format(model_and_tokenizer, tmp_path):
    from verl_sat.paper.report import load_run

    cfg = LoopConfig(steps=2, lag=2, prompts_per_step=2, rollout_n=2, max_response_length=4)
    StudyLoop(cfg, *model_and_tokenizer).run(tmp_path, method="sat_gspo")
    run_ = load_run(tmp_path)
    assert (run_.method, run_.lag) == ("sat_gspo", 2)
    assert list(run_.series("critic/score/mean").index) == [1, 2]  # one row per optimizer step


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lag", 0),
        ("loss_mode", "ppo"),
        ("correction", "is"),
        ("routing_replay", "R2"),
        ("rollout_n", 1),
        ("logit_bias_std", -1.0),
        ("correction", "is_token"),
        ("eval_problems", -1),
        ("eval_at", (5000,)),
        ("sat_alpha", 1.0),
    ],
)
def test_bad_loop_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"LoopConfig.{field}"):
        LoopConfig(**{field: value})


def test_engine_options_take_the_bias_knobs_from_engine_kwargs():
    from types import SimpleNamespace

    from verl_sat.rollout.server import engine_options

    config = SimpleNamespace(seed=0, engine_kwargs={"hf": {"logit_bias_std": 0.5, "router_bias_std": 1.5}})
    options = engine_options(config, 0)
    assert (options.logit_bias_std, options.router_bias_std) == (0.5, 1.5)


def test_the_engine_draws_the_fixed_logit_bias_from_its_options(model_and_tokenizer):
    import copy

    model, _ = model_and_tokenizer
    engine = HFEngine(copy.deepcopy(model), {0}, 0, EngineOptions(logit_bias_std=0.5, seed=3))
    assert engine.logit_bias is not None and 0.4 < float(engine.logit_bias.std()) < 0.6
    assert HFEngine(copy.deepcopy(model), {0}, 0, EngineOptions(seed=3)).logit_bias is None


def test_a_run_is_a_function_of_its_config(model_and_tokenizer, varied_reward):
    """Same config, same rows: a study's run can be rerun (or reused) exactly."""
    first = run(model_and_tokenizer, steps=2, lag=2, lr=1e-2, logit_bias_std=0.3)
    second = run(model_and_tokenizer, steps=2, lag=2, lr=1e-2, logit_bias_std=0.3)
    drop = ("timing_s/gen", "timing_s/step")
    assert [{k: v for k, v in r.items() if k not in drop} for r in first] == [
        {k: v for k, v in r.items() if k not in drop} for r in second
    ]
