"""benchmarks/staleness_study.py: its plans, the regime's pre-registration, and its summary.

The runs themselves are StudyLoop runs (tests/test_study_loop_on_cpu.py); one real two-run
study with a tiny step count checks the worker pool end to end.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from verl_sat.study.stats import final_mean

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("staleness_study", REPO / "benchmarks" / "staleness_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["staleness_study"] = module
    spec.loader.exec_module(module)
    return module


def test_the_search_runs_only_baselines(study):
    specs = study.search_plan()
    assert {s.arm for s in specs} == set(study.BASELINES)
    assert {s.lag for s in specs} == set(study.SEARCH["lags"])
    assert {s.tag for s in specs} == set(study.SEARCH["mismatch"])


def test_the_full_plan_has_every_arm_at_five_seeds_and_the_same_regime(study):
    args = study.build_parser().parse_args([])
    specs, _ = study.specs_from_args(args)
    pairs = {"grpo", "sat_grpo", "gspo", "sat_gspo"}
    assert study.STRESS_LAG > 1
    assert pairs | {"grpo_tis", "dppo_tv"} <= {s.arm for s in specs if s.lag == study.STRESS_LAG}
    assert pairs <= {s.arm for s in specs if s.lag == 1}
    seeds: dict[tuple[str, int], set[int]] = {}
    for s in specs:
        seeds.setdefault((s.arm, s.lag), set()).add(s.seed)
    assert all(len(found) >= 5 for found in seeds.values())
    assert len({s.settings for s in specs}) == 1  # one regime for every arm
    cfg = next(s for s in specs if s.arm == "sat_grpo").config()
    assert cfg.loss_mode == "sat" and cfg.sat_enabled and cfg.lr == study.REGIME["lr"]
    assert study.ARMS["sat_gspo_r3"]["routing_replay"] == "R3"  # R3 arms: for a routing mismatch
    baseline = next(s for s in specs if s.arm == "gspo").config()
    assert baseline.loss_mode == "sat_gspo" and not baseline.sat_enabled


def test_a_bad_arm_is_named(study):
    with pytest.raises(ValueError, match="'ppo'"):
        study.plan({1: ("ppo",)}, (1,), study.REGIME)


def synthetic_run(out: Path, study, arm: str, lag: int, seed: int, rewards: list[float]) -> object:
    spec = study.Spec(arm, lag, seed, tuple(sorted(study.REGIME.items())))
    run_dir = out / "runs" / spec.name
    run_dir.mkdir(parents=True)
    (run_dir / "study_spec.json").write_text(json.dumps(study.asdict(spec), default=list))
    with (run_dir / "metrics.jsonl").open("w") as fh:
        for step, reward in enumerate(rewards, 1):
            data = {"critic/score/mean": reward, "actor/mismatch_abs_mean": 0.05 if reward > 0.2 else 1.0}
            if arm.startswith("sat"):
                data["actor/sat_gate_rate"] = 0.1
            fh.write(json.dumps({"step": step, "data": data}) + "\n")
    return spec


def test_summary_counts_collapses_and_gives_intervals(study, tmp_path):
    steady = [0.6 + 0.01 * (i % 3) for i in range(40)]
    collapsing = steady[:25] + [0.05] * 15
    specs = [synthetic_run(tmp_path, study, "gspo", 16, s, collapsing) for s in (1, 2)]
    specs += [synthetic_run(tmp_path, study, "sat_gspo", 16, s, steady) for s in (1, 2)]
    table = {c["arm"]: c for c in study.summarize(tmp_path, specs, "t")}
    assert table["gspo"]["collapsed"] == (2, 2) and table["sat_gspo"]["collapsed"] == (0, 2)
    assert table["gspo"]["final_reward"] == pytest.approx(0.05)
    lo, hi = table["sat_gspo"]["final_reward_ci"]
    assert lo <= table["sat_gspo"]["final_reward"] <= hi
    assert table["sat_gspo"]["gate_rate"] == pytest.approx(0.1) and table["gspo"]["gate_rate"] is None
    text = (tmp_path / "study.md").read_text()
    assert "| - | 16 | gspo | 2 |" in text and "2/2" in text
    (diff,) = study.paired_differences(json.loads((tmp_path / "study.json").read_text())["runs"])
    assert (diff["arm"], diff["reference"], diff["seeds"]) == ("sat_gspo", "gspo", 2)
    assert diff["final_reward"] == pytest.approx(final_mean(steady) - 0.05)
    assert "sat_gspo - gspo | 2 | +" in text
    for name in ("reward.png", "dbar_pi.png", "gate_rate.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert study.main(["--summarize-only", str(tmp_path)]) == 0


def test_dry_run_prints_the_plan(study, capsys):
    assert study.main(["--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "grpo-lag32-seed1" in out and "sat_grpo-lag32-seed1" in out


def test_a_two_run_study_end_to_end(study, tmp_path):
    """Two worker processes, one start-up each, a run apiece; the summary reads what they wrote."""
    from verl_sat.default import model as tiny

    tiny.create(tmp_path / "assets" / "model", seed=0)
    argv = ["--quick", "--seeds", "1", "--steps", "2", "--jobs", "2", "--out", str(tmp_path / "s")]
    argv += ["--assets", str(tmp_path / "assets")]
    assert study.main(argv) == 0
    rows = (tmp_path / "s" / "runs" / "grpo-lag32-seed1" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2
    assert "sat_grpo" in (tmp_path / "s" / "study.md").read_text()
