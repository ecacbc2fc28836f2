"""benchmarks/trainer_staleness_study.py without the trainer: planned commands, table and plots.

The table and figures are built from synthetic run directories (metrics.jsonl in verl's
file-logger format, run.json and study_run.json as the study writes them).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    """The benchmark script as a module."""
    path = REPO / "benchmarks" / "trainer_staleness_study.py"
    spec = importlib.util.spec_from_file_location("trainer_staleness_study", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trainer_staleness_study"] = module
    spec.loader.exec_module(module)
    return module


def overrides_of(cmd: list[str]) -> dict[str, str]:
    """``key=value`` Hydra overrides of a planned command line."""
    return dict(arg.split("=", 1) for arg in cmd if "=" in arg)


# ---------------------------------------------------------------------------------------------
# planned commands
# ---------------------------------------------------------------------------------------------


def test_quick_plan_commands(study, tmp_path):
    specs = study.specs_from_args(study.build_parser().parse_args(["--quick", "--noise", "0.7"]))
    assert [(s.key, s.lag, s.seed) for s in specs] == [
        ("gspo", 1, 1),
        ("sat_gspo", 1, 1),
        ("gspo", 8, 1),
        ("sat_gspo", 8, 1),
    ]
    for spec in specs:
        cmd = study.command(spec, tmp_path)
        assert cmd[1:3] == ["-m", "verl_sat.main"]
        o = overrides_of(cmd)
        assert o["sat.lag"] == str(spec.lag)
        assert o["sat.routing_replay"] == "disabled"
        assert o["actor_rollout_ref.actor.policy_loss.loss_mode"] == "sat_gspo"
        assert o["actor_rollout_ref.actor.policy_loss.sat_enabled"] == (
            "true" if spec.method == "sat_gspo" else "false"
        )
        assert o[study.NOISE_KEY] == "0.7"
        assert o["actor_rollout_ref.rollout.seed"] == o["data.seed"] == "1"
        assert o["sat.run_dir"] == str(tmp_path / "runs" / spec.name)
        # optimizer steps equalised across lags
        assert int(o["trainer.total_training_steps"]) * spec.lag == study.QUICK["steps"]
    # the quick mode's budget is 10 min on 2 cores; a second job overlaps start-ups but does not double speed
    assert study.estimate_s(specs, jobs=2) / 60 <= 10.0
    assert study.estimate_s(specs, jobs=1) / study.estimate_s(specs, jobs=2) == pytest.approx(study.PARALLEL_GAIN)


def test_full_plan_commands(study, tmp_path):
    specs = study.specs_from_args(study.build_parser().parse_args([]))
    assert len(specs) == 4 * 2 * 2 * 3
    assert {s.key for s in specs} == {"gspo", "sat_gspo", "grpo", "sat_grpo", "gspo_r3", "sat_gspo_r3", "grpo_r3",
                                      "sat_grpo_r3"}  # fmt: skip
    assert {s.seed for s in specs} == {1, 2, 3} and {s.lag for s in specs} == {1, 8}
    expected_loss = {"gspo": "sat_gspo", "sat_gspo": "sat_gspo", "grpo": "sat", "sat_grpo": "sat"}
    expected_agg = {"gspo": "seq-mean-token-mean", "sat_gspo": "seq-mean-token-mean", "grpo": "token-mean",
                    "sat_grpo": "token-mean"}  # fmt: skip
    for spec in specs:
        o = overrides_of(study.command(spec, tmp_path, extra=["sat.assets_dir=/x"]))
        assert o["actor_rollout_ref.actor.policy_loss.loss_mode"] == expected_loss[spec.method]
        assert o["actor_rollout_ref.actor.loss_agg_mode"] == expected_agg[spec.method]
        assert o["sat.routing_replay"] == ("R3" if spec.r3 else "disabled")
        assert o["sat.method"] == spec.key
        assert o["actor_rollout_ref.rollout.seed"] == o["data.seed"] == str(spec.seed)
        assert o[study.NOISE_KEY] == str(study.DEFAULT_NOISE)
        assert int(o["trainer.total_training_steps"]) * spec.lag == study.FULL["steps"]
        assert o["sat.assets_dir"] == "/x"


def test_steps_must_divide_by_lag(study):
    with pytest.raises(ValueError, match="multiple of every lag"):
        study.plan(["gspo"], [False], [1, 8], [1], steps=12, noise=0.1)
    with pytest.raises(ValueError, match="unknown method"):
        study.plan(["ppo"], [False], [1], [1], steps=8, noise=0.1)


def test_dry_run_prints_commands(study, tmp_path, capsys):
    assert study.main(["--quick", "--dry-run", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "estimate" in text and text.count("-m verl_sat.main") == 4
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# table and plots from synthetic runs
# ---------------------------------------------------------------------------------------------


def write_run(root: Path, key: str, lag: int, seed: int, rewards: list[float], dbar: float, gate: float | None) -> None:
    """A finished run as the study leaves it."""
    run_dir = root / "runs" / f"{key}-lag{lag}-seed{seed}"
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w") as fh:
        for step, reward in enumerate(rewards, start=1):
            data = {"critic/score/mean": reward, "actor/mismatch_abs_mean": dbar * step}
            if gate is not None:
                data["actor/sat_gate_rate"] = gate
            fh.write(json.dumps({"step": step, "data": data}) + "\n")
    (run_dir / "run.json").write_text(json.dumps({"method": key, "lag": lag, "config": {}}))
    status = {"key": key, "lag": lag, "seed": seed, "status": "ok", "seconds": 1.0}
    (run_dir / "study_run.json").write_text(json.dumps(status))


@pytest.fixture
def synthetic(tmp_path) -> Path:
    rising = [0.05 * i for i in range(1, 17)]  # last 25% = 0.65 .. 0.8
    collapsing = [0.1, 0.3, 0.6, 0.8] + [0.1] * 12  # peak 0.8 early, late 0.1
    write_run(tmp_path, "gspo", 1, 1, rising, dbar=0.01, gate=None)
    write_run(tmp_path, "gspo", 1, 2, collapsing, dbar=0.01, gate=None)
    write_run(tmp_path, "sat_gspo", 1, 1, rising, dbar=0.02, gate=0.1)
    write_run(tmp_path, "sat_gspo", 8, 1, [0.3], dbar=0.05, gate=0.08)
    # an R3 run that failed: status only, no metrics
    failed = tmp_path / "runs" / "sat_gspo_r3-lag8-seed1"
    failed.mkdir()
    (failed / "study_run.json").write_text(json.dumps({"key": "sat_gspo_r3", "lag": 8, "seed": 1,
                                                       "status": "unavailable"}))  # fmt: skip
    return tmp_path


def test_summary_rows(study, synthetic):
    cells = study.write_summary(synthetic)
    by = {(c.method, c.lag): c for c in cells}
    assert list(by) == [("gspo", 1), ("sat_gspo", 1), ("sat_gspo", 8), ("sat_gspo_r3", 8)]

    gspo = by[("gspo", 1)]
    assert gspo.seeds == 2
    final, final_std = gspo.values["final_reward"]
    assert final == pytest.approx((0.725 + 0.1) / 2) and final_std > 0
    assert gspo.values["best_reward"][0] == pytest.approx(0.8)
    assert gspo.collapses == (0, 2)  # the sentinel: a reward drop without a mismatch spike is not its signature
    assert [s.reward_rule_collapsed for s in study.load_study(synthetic)[1] if s.name.startswith("gspo-lag1")] == [
        False,
        True,
    ]  # report.CollapseRule, kept in study.json: the late drop of seed 2
    assert gspo.values["dbar_pi"][0] == pytest.approx(0.01 * 8.5)  # mean of 0.01 * (1..16)
    assert gspo.values["gate_rate"] is None

    sat8 = by[("sat_gspo", 8)]
    assert sat8.values["final_reward"] == (pytest.approx(0.3), 0.0)
    assert sat8.collapses == (0, 0)  # one point: too short to judge
    assert sat8.values["gate_rate"][0] == pytest.approx(0.08)
    assert by[("sat_gspo_r3", 8)].statuses == {"unavailable": 1} and by[("sat_gspo_r3", 8)].seeds == 0

    text = (synthetic / "study.md").read_text()
    # 16 steps, CPU default warm-up 6: both runs scored, no collapse signature (dbar_pi grows slowly)
    assert "| gspo | 1 | 2 | 0.413 ± 0.442 | 0.800 ± 0.000 | 0/2 | 0.0850 ± 0.0000 | – | 2 ok |" in text
    assert "| sat_gspo | 8 | 1 | 0.300 ± 0.000 | 0.300 ± 0.000 | n/a |" in text
    assert "| sat_gspo_r3 | 8 | 0 | – | – | n/a | – | – | 1 unavailable |" in text
    record = json.loads((synthetic / "study.json").read_text())
    assert len(record["runs"]) == 5 and len(record["cells"]) == 4


def test_plots_non_empty(study, synthetic):
    study.write_summary(synthetic)
    for name in ("reward.png", "dbar_pi.png"):
        png = synthetic / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_summarize_only_cli(study, synthetic, capsys):
    assert study.main(["--summarize-only", str(synthetic)]) == 0
    assert "| sat_gspo | 1 | 1 |" in capsys.readouterr().out
    assert (synthetic / "study.md").is_file()


def test_short_runs_not_judged_for_collapse(study, synthetic):
    runs, _ = study.load_study(synthetic)
    run = next(r for r in runs if r.name == "gspo-lag1-seed2")
    run.metrics = {k: dict(list(v.items())[:6]) for k, v in run.metrics.items()}
    assert study.run_stats(run, seed=2).collapsed is None  # 6 points: the sentinel is still warming up


def test_seed_band_and_optimizer_steps(study, synthetic):
    runs, _ = study.load_study(synthetic)
    lag8 = next(r for r in runs if r.lag == 8)
    assert study.optimizer_step_series(lag8, lambda r: r.series("critic/score/mean")) == [(8, 0.3)]
    steps, mean, std = study.seed_band([[(1, 0.0), (2, 1.0)], [(1, 1.0)]])
    assert steps == [1, 2] and mean == [0.5, 1.0] and std[1] == 0.0


def test_sentinel_replay_counts_a_collapse_signature(study, tmp_path):
    rewards = [0.5, 0.45, 0.55, 0.5, 0.48, 0.52, 0.5, 0.47, 0.53, 0.5] + [0.0] * 6
    write_run(tmp_path, "gspo", 1, 1, rewards, dbar=0.01, gate=None)
    metrics = tmp_path / "runs" / "gspo-lag1-seed1" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for row in rows:  # dbar_pi flat, then 100x from the collapse on
        row["data"]["actor/mismatch_abs_mean"] = (
            0.01 * (1 + 0.05 * (row["step"] % 3)) * (100 if row["step"] > 10 else 1)
        )
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, stats = study.load_study(tmp_path)
    assert (stats[0].sentinel_alarms, stats[0].sentinel_scored, stats[0].collapsed) == (1, 10, True)
    assert study.replay_sentinel(runs[0], study.SentinelConfig(enabled=True)) == (0, 0)  # warm-up 20 > 16 steps


def test_dbar_pi_by_staleness_table_and_plot(study, tmp_path):
    for seed, scale in ((1, 1.0), (2, 3.0)):
        write_run(tmp_path, "gspo", 8, seed, [0.2, 0.3], dbar=0.01, gate=None)
        metrics = tmp_path / "runs" / f"gspo-lag8-seed{seed}" / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        for row in rows:  # dbar_pi grows with staleness: 0.01 * (s + 1) * scale, the same on both steps
            row["data"].update(
                {f"actor/sat_by_staleness/{s}/mismatch_abs_mean": 0.01 * (s + 1) * scale for s in range(8)}
            )
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = study.write_summary(tmp_path)
    (cell,) = cells
    assert sorted(cell.by_staleness) == list(range(8))
    assert cell.by_staleness[7][0] == pytest.approx(0.08 * 2)  # mean of 0.08 and 0.24
    text = (tmp_path / "study.md").read_text()
    assert "| method | lag | s=0 | s=1 |" in text and "| gspo | 8 | 0.020 ± 0.014 |" in text
    png = tmp_path / "dbar_pi_by_staleness.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
