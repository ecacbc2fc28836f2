"""sat.lag=auto (verl_sat.trainer.auto_lag): the rule, its validation, its wiring onto verl's keys and
weight sync, what a run logs, and the study loop driven by the same rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import PROPERTY, assert_biting_share
from test_main_on_cpu import assets, cpu_cfg, no_build, restore_environ  # noqa: F401  (fixtures)
from test_schedule_on_cpu import v1_config

from verl_sat import main
from verl_sat.trainer import progress
from verl_sat.trainer.auto_lag import (
    BROADCAST_KEY,
    LAG_KEY,
    SIGNAL_KEY,
    AutoLag,
    AutoLagConfig,
    AutoLagTrainerMixin,
    GatedWeightSync,
    suggest_targets,
    suggestion_line,
)
from verl_sat.trainer.recipe import SATRecipeConfig, apply_lag

# per-step signals: missing, NaN or in [0, 1]; any length, or at least 12 steps (several gaps of max)
signal = st.one_of(st.none(), st.floats(0, 1), st.just(float("nan")))
signals = st.lists(signal, min_size=1, max_size=60) | st.lists(signal, min_size=12, max_size=60)


def test_every_gap_between_broadcasts_lies_in_min_max_and_only_the_signal_shortens_it():
    """k >= min and (s > target or k >= max): each gap in [min, max]; a gap below max ends on a step
    whose signal exceeded target; a step at or past min with the signal above target broadcasts; a
    signal never above target is a fixed lag of max. Bites where the signal shortens a gap below
    max; also measured: min holding back a step above target, max forcing a broadcast on a quiet
    step, and a signal never above target over at least one gap of max."""
    shortened, held, forced, quiet = [], [], [], []

    @PROPERTY
    @given(signals, st.integers(1, 4), st.integers(0, 6), st.floats(0.01, 0.99))
    def check(values, lo, extra, target) -> None:
        hi = lo + extra
        gate = AutoLag(AutoLagConfig(target=target, min=lo, max=hi))
        last, short, hold, force = 0, 0, 0, 0
        for step, value in enumerate(values, start=1):
            broadcast, k = gate.decide(value)
            assert k == step - last
            above = value is not None and value == value and value > target
            if broadcast:
                assert lo <= k <= hi
                if k < hi:
                    assert above
                    short += 1
                elif not above:
                    force += 1
                last = step
            else:
                assert k < hi and not (above and k >= lo)
                hold += above  # above target, held back by min
        never_above = all(v is None or v != v or v <= target for v in values)
        if never_above:
            assert short == 0 and gate.broadcasts == len(values) // hi  # a fixed lag of max
        quiet.append(never_above and len(values) >= hi)
        shortened.append(short > 0)
        held.append(hold > 0)
        forced.append(force > 0)

    check()
    assert_biting_share(shortened, "auto lag, the signal shortens a gap", minimum=0.25, maximum=0.95)
    assert_biting_share(held, "auto lag, min holds back a step above target", minimum=0.1)
    assert_biting_share(forced, "auto lag, max forces a broadcast", minimum=0.25)
    assert_biting_share(quiet, "auto lag, a signal never above target: a fixed lag of max", minimum=0.05)


def test_a_batch_drawn_before_the_last_broadcast_cannot_trigger_one():
    gate = AutoLag(AutoLagConfig(target=0.1, min=1, max=4))
    assert gate.decide(0.9, fresh=False) == (False, 1)  # it speaks of weights the rollout no longer holds
    assert gate.decide(0.9, fresh=True) == (True, 2)
    old = AutoLag(AutoLagConfig(target=0.1, min=1, max=4, fresh=False))  # the first study's rule
    assert old.decide(0.9, fresh=False) == (True, 1)


def test_the_trainer_reads_freshness_from_verls_version_tags():
    """The rollout holds the version of the last sync (a global step); a batch whose newest
    ``max_global_steps`` tag is older was drawn before it and cannot trigger."""
    trainer = FakeTrainer({"lag": "auto", "auto_lag": {"target": 0.1, "min": 1, "max": 8}})
    trainer.global_steps = 1  # fit() has advanced to step 1; on_init_end synced version 0
    manager = trainer.standalone_checkpoint_manager
    trainer._auto_lag_wrap_sync()
    sync = trainer.standalone_checkpoint_manager
    for step, newest in [(1, 0), (2, 0), (3, 1), (4, 1), (5, 3)]:  # (global step, the batch's newest version)
        tags = [{"max_global_steps": newest - 1}, {"max_global_steps": newest}]
        trainer._auto_lag_observe({"actor/mismatch_abs_mean": 0.5}, tags)
        sync.update_weights(step)
    # 1: drawn by 0, the rollout's: sync (rollout now 1); 2: drawn by 0 < 1: none; 3: drawn by 1: sync
    # (rollout 3); 4: drawn by 1 < 3: none; 5: drawn by 3: sync
    assert manager.synced == [1, 3, 5]


def test_a_forced_broadcast_ignores_min():
    gate = AutoLag(AutoLagConfig(target=0.5, min=3, max=5))
    assert gate.decide(0.9) == (False, 1)  # above target, below min
    gate.force_next()
    assert gate.decide(0.0) == (True, 2)
    assert gate.decide(0.9) == (False, 1)


@pytest.mark.parametrize(
    "node,message",
    [
        ({"target": 0}, r"sat.auto_lag.target must be a number > 0, got 0"),
        ({"target": -1.0}, r"sat.auto_lag.target must be a number > 0"),
        ({"target": "high"}, r"sat.auto_lag.target must be a number > 0, got 'high'"),
        ({"min": 4, "max": 2}, r"sat.auto_lag.min=4 must be <= sat.auto_lag.max=2"),
        ({"min": 0}, r"sat.auto_lag.min must be an integer >= 1, got 0"),
        ({"max": 2.5}, r"sat.auto_lag.max must be an integer >= 1, got 2.5"),
        ({"signal": "reward"}, r"sat.auto_lag.signal must be one of \['dbar_pi', 'intercepted', 'q'\], got 'reward'"),
        ({"tagret": 0.1}, r"unknown key\(s\) under sat.auto_lag: sat.auto_lag.tagret"),
    ],
)
def test_bad_values_name_the_key(node, message):
    with pytest.raises(ValueError, match=message):
        SATRecipeConfig.from_node({"lag": "auto", "auto_lag": node})


def test_the_lag_is_an_integer_or_auto():
    assert SATRecipeConfig.from_node({"lag": "auto"}).lag == "auto"
    with pytest.raises(ValueError, match=r"sat.lag must be an integer >= 1 or 'auto', got 'fast'"):
        SATRecipeConfig.from_node({"lag": "fast"})


def test_auto_maps_to_one_optimizer_step_per_global_step():
    cfg = v1_config()
    apply_lag(cfg, "auto")
    v1 = cfg.trainer.v1
    assert v1.separate_async.parameter_sync_step == 1 and cfg.data.train_batch_size == 8
    assert v1.separate_async.num_warmup_batches == 1.0 and v1.sampler.max_off_policy_threshold == 2
    assert cfg.actor_rollout_ref.hybrid_engine is False


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "sat_colocate_async"])
def test_auto_where_every_step_broadcasts_is_refused_naming_the_mode(mode):
    with pytest.raises(ValueError, match=rf"sat.lag=auto needs trainer.v1.trainer_mode=separate_async.*{mode}"):
        apply_lag(v1_config(mode), "auto")


def test_bad_auto_values_fail_in_prepare_before_ray(assets, tmp_path, no_build):  # noqa: F811
    with pytest.raises(ValueError, match=r"sat.auto_lag.min=9 must be <= sat.auto_lag.max=8"):
        main.prepare(cpu_cfg(assets, tmp_path, "sat.lag=auto", "sat.auto_lag.min=9"))
    with pytest.raises(ValueError, match=r"sat.lag=auto needs trainer.v1.trainer_mode=separate_async"):
        main.prepare(cpu_cfg(assets, tmp_path, "sat.lag=auto", "trainer.v1.trainer_mode=sync"))
    assert not (tmp_path / "run").exists()  # nothing written


def test_prepare_records_the_rule_and_keeps_what_the_user_set(assets, tmp_path, no_build):  # noqa: F811
    cfg = cpu_cfg(assets, tmp_path, "sat.lag=auto", "sat.auto_lag.target=0.05", "sat.auto_lag.signal=q")
    sat, run_dir = main.prepare(cfg)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["lag"] == "auto"
    assert record["auto_lag"] == {"target": 0.05, "min": 1, "max": 8, "signal": "q", "fresh": True}
    assert cfg.trainer.v1.separate_async.parameter_sync_step == 1
    assert cfg.data.train_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size


class FakeManager:
    def __init__(self) -> None:
        self.synced: list[int] = []

    def update_weights(self, global_steps: int) -> dict:
        self.synced.append(global_steps)
        return {"sync/bytes": 1.0}

    def sleep_replicas(self) -> str:
        return "asleep"


class FakeTrainer(AutoLagTrainerMixin):
    def __init__(self, sat: dict, test_freq: int = -1, total: int = 100) -> None:
        from omegaconf import OmegaConf

        self.config = OmegaConf.create({"sat": sat, "trainer": {"test_freq": test_freq}})
        self.total_training_steps = total
        self.standalone_checkpoint_manager = FakeManager()


def test_the_trainer_syncs_only_on_the_steps_the_rule_picks():
    trainer = FakeTrainer({"lag": "auto", "auto_lag": {"target": 0.1, "min": 2, "max": 4}})
    manager = trainer.standalone_checkpoint_manager
    logged = []
    for step, dbar in enumerate([0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.2], start=1):
        trainer._auto_lag_observe({"actor/mismatch_abs_mean": dbar})
        trainer._auto_lag_wrap_sync()
        logged.append(trainer.standalone_checkpoint_manager.update_weights(step))  # what verl's on_step_end calls
    assert isinstance(trainer.standalone_checkpoint_manager, GatedWeightSync)
    assert trainer.standalone_checkpoint_manager.sleep_replicas() == "asleep"  # the rest passes through
    assert manager.synced == [2, 6]  # min 2 holds step 1; max 4 forces step 6; step 7 is below min
    assert [row[BROADCAST_KEY] for row in logged] == [0, 1, 0, 0, 0, 1, 0]
    assert [row[LAG_KEY] for row in logged] == [1, 2, 1, 2, 3, 4, 1]
    assert logged[1]["sync/bytes"] == 1.0 and "sync/bytes" not in logged[0]  # verl's own sync metrics kept
    assert logged[0][SIGNAL_KEY] == 0.5


def test_validation_steps_always_sync_so_validation_samples_the_trained_weights():
    """verl validates after the step's sync at test_freq and at the last step, on the rollout."""
    trainer = FakeTrainer({"lag": "auto", "auto_lag": {"target": 1e9, "min": 1, "max": 8}}, test_freq=3, total=7)
    manager = trainer.standalone_checkpoint_manager
    trainer._auto_lag_wrap_sync()
    for step in range(1, 8):
        trainer.standalone_checkpoint_manager.update_weights(step)
    assert manager.synced == [3, 6, 7]  # the target is never met: only validation forces a sync


def test_a_rollback_broadcasts_at_once_and_halves_max():
    trainer = FakeTrainer({"lag": "auto", "auto_lag": {"target": 0.1, "min": 2, "max": 8}})
    assert trainer._auto_lag_after_rollback() == {"sat.auto_lag.max": (8, 4)}
    trainer._auto_lag_wrap_sync()
    assert trainer.standalone_checkpoint_manager.update_weights(5)[BROADCAST_KEY] == 1.0  # below min, forced
    assert trainer._auto_lag_after_rollback() == {"sat.auto_lag.max": (4, 2)}
    assert trainer._auto_lag_after_rollback() == {}  # max reached min


def test_a_fixed_lag_run_is_left_alone():
    trainer = FakeTrainer({"lag": 2})
    trainer._auto_lag_observe({"actor/mismatch_abs_mean": 1.0})
    trainer._auto_lag_wrap_sync()
    assert isinstance(trainer.standalone_checkpoint_manager, FakeManager)
    assert trainer._auto_lag_after_rollback() == {}


def test_targets_are_suggested_from_dbar_pi_by_staleness():
    rows = [
        {"actor/sat_by_staleness/0/mismatch_abs_mean": 0.001, "actor/sat_by_staleness/2/mismatch_abs_mean": 0.03},
        {"actor/sat_by_staleness/1/mismatch_abs_mean": 0.01, "actor/sat_by_staleness/2/mismatch_abs_mean": 0.05},
        {"actor/sat_by_staleness/2/gate_rate": 0.5, "actor/mismatch_abs_mean": 9.0},
    ]
    assert suggest_targets(rows) == pytest.approx({0: 0.001, 1: 0.01, 2: 0.04})
    line = suggestion_line(rows)
    assert "s=1: 0.01, s=2: 0.04" in line and "s=0" not in line
    assert suggestion_line([{"critic/score/mean": 1.0}]) is None


def test_the_console_and_run_json_show_the_broadcasts(tmp_path):
    rows = [
        {"step": 1, BROADCAST_KEY: 0.0, LAG_KEY: 1.0},
        {"step": 2, BROADCAST_KEY: 1.0, LAG_KEY: 2.0},
        {"step": 3, BROADCAST_KEY: 1.0, LAG_KEY: 1.0},
    ]
    assert progress.progress_line(rows[1]).endswith("| lag 2 -> broadcast")
    assert progress.progress_line(rows[0]).endswith("| lag 1")
    assert "lag" not in progress.progress_line({"step": 1}).split("|")[-1]
    (tmp_path / "run.json").write_text("{}")
    sat = SATRecipeConfig.from_node({"lag": "auto", "auto_lag": {"target": 0.03, "max": 4}})
    (line,) = progress.lag_lines(tmp_path, rows, sat)
    assert "2 broadcasts in 3 optimizer steps, mean lag 1.50" in line and "dbar_pi > 0.03" in line
    record = json.loads((tmp_path / "run.json").read_text())["auto_lag"]
    assert record["broadcasts"] == 2 and record["lags"] == [2, 1] and record["max"] == 4


# -- the study loop, driven by the same rule ------------------------------------------------------
def test_the_study_loop_broadcasts_by_the_rule_and_keeps_the_staleness_bound(model_and_tokenizer, monkeypatch):
    from studies.lib.loop import LoopConfig, StudyLoop
    from verl_sat.default import reward

    monkeypatch.setattr(reward, "compute_score", lambda source, text, answer: float(len(text) % 2))
    base = {"steps": 9, "prompts_per_step": 2, "rollout_n": 2, "max_response_length": 4, "lr": 1e-2}
    never = StudyLoop(LoopConfig(**base, lag=3, auto_lag=True, auto_target=1e9), *model_and_tokenizer).run()
    fixed = StudyLoop(LoopConfig(**base, lag=3), *model_and_tokenizer).run()
    staleness = [r["training/sat/staleness_steps/max"] for r in never]
    assert staleness == [r["training/sat/staleness_steps/max"] for r in fixed]  # a target never met: lag max
    assert [r[BROADCAST_KEY] for r in never] == [r[BROADCAST_KEY] for r in fixed] == [0, 0, 1] * 3
    # any drift triggers, but only on a batch the rollout's current weights drew: with one batch in
    # flight the one after a broadcast was drawn before it, so the broadcasts come every other step
    eager = StudyLoop(LoopConfig(**base, lag=3, auto_lag=True, auto_target=1e-9), *model_and_tokenizer).run()
    pattern = [r[BROADCAST_KEY] for r in eager]
    assert all(a + b == 1.0 for a, b in zip(pattern[2:], pattern[3:], strict=False)), pattern
    assert all(r["training/sat/staleness_steps/max"] <= 2 for r in eager)
    # the first study's rule (any batch triggers) broadcasts after every step
    loose = StudyLoop(
        LoopConfig(**base, lag=3, auto_lag=True, auto_target=1e-9, auto_fresh=False), *model_and_tokenizer
    )
    loose_rows = loose.run()
    assert all(r[BROADCAST_KEY] == 1.0 for r in loose_rows[1:])
    assert [r["training/sat/staleness_steps/max"] for r in loose_rows][3:] == [1] * 6  # one step off, as lag 1
    assert all(r["training/sat/staleness_steps/max"] <= 3 for r in never + eager + loose_rows)
    with pytest.raises(ValueError, match=r"sat.auto_lag.min=4 must be <= sat.auto_lag.max=3"):
        LoopConfig(**base, lag=3, auto_lag=True, auto_min=4)


def test_a_report_reads_an_auto_run_at_its_staleness_bound(tmp_path):
    from verl_sat.paper.report import load_run

    run = tmp_path / "r"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"method": "sat_gspo_r3", "lag": "auto", "auto_lag": {"max": 8}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "data": {"critic/score/mean": 0.5}}\n')
    assert load_run(Path(run)).lag == 8
