"""studies/autolag/autolag_study.py: the committed protocol's plan, the pilot's target rule, and a tiny
study end to end (pilot, target, fixed and auto arms, summary)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "studies" / "autolag"


@pytest.fixture(scope="module")
def autolag():
    spec = importlib.util.spec_from_file_location("autolag_study", STUDY / "autolag_study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["autolag_study"] = module
    spec.loader.exec_module(module)
    return module


def test_the_protocol_fixes_fresh_seeds_and_the_four_arms(autolag):
    protocol = autolag.read_protocol(autolag.PROTOCOL)
    specs = autolag.confirmatory_specs(protocol, target=0.01)
    assert len(protocol["seeds"]) >= 8 and protocol["pilot"]["seed"] not in protocol["seeds"]
    used = set(range(1, 6)) | set(range(1001, 1017)) | {801, 901}  # earlier studies' seeds
    assert not used & {*protocol["seeds"], protocol["pilot"]["seed"]}
    assert sorted({autolag.condition(s) for s in specs}) == ["auto", "lag 1", "lag 4", "lag 8"]
    auto = [s.config() for s in specs if s.tag == "auto"]
    assert all(c.auto_lag and c.auto_target == 0.01 and c.lag == 8 and c.loss_mode == "sat_gspo" for c in auto)
    assert all(c.routing_replay == "R3" for c in (s.config() for s in specs))


def test_the_second_protocol_changes_only_the_rule_and_the_seeds(autolag):
    first = autolag.read_protocol(autolag.PROTOCOL)
    second = autolag.read_protocol(STUDY / "study_protocol_autolag2.md")
    assert second["auto"] == {**first["auto"], "fresh": True}
    assert not set(second["seeds"]) & {*first["seeds"], first["pilot"]["seed"]} and len(second["seeds"]) >= 8
    assert {k: v for k, v in second.items() if k not in ("auto", "seeds")} == {
        k: v for k, v in first.items() if k not in ("auto", "seeds")
    }
    assert all(s.config().auto_fresh for s in autolag.confirmatory_specs(second, 0.03) if s.tag == "auto")
    assert not any(s.config().auto_fresh for s in autolag.confirmatory_specs(first, 0.03) if s.tag == "auto")


def test_the_target_is_the_pilots_median_dbar_pi_at_the_staleness(autolag):
    rows = [
        {"training/sat/staleness_steps/max": s, "actor/mismatch_abs_mean": d}
        for s, d in [(1, 0.1), (4, 0.3), (4, 0.1), (2, 9.0), (4, 0.2)]
    ]
    assert autolag.pilot_target(rows, 4) == pytest.approx(0.2)
    with pytest.raises(SystemExit, match="no step at staleness 5"):
        autolag.pilot_target(rows, 5)


def test_a_tiny_study_end_to_end(autolag, tmp_path, monkeypatch):
    from verl_sat.default import model as tiny

    tiny.create(tmp_path / "assets" / "model", seed=0)
    protocol = {
        "settings": {"steps": 4, "lr": 0.01, "prompts_per_step": 2, "rollout_n": 2, "eval_problems": 8},
        "checkpoints": [0],
        "arm": "sat_gspo_r3",
        "fixed_lags": [1, 2],
        "auto": {"min": 1, "max": 3, "signal": "dbar_pi"},
        "pilot": {"seed": 99, "lag": 2, "staleness": 1},
        "seeds": [7, 8],
        "primary": [["auto", "lag 2"], ["auto", "lag 1"]],
        "secondary": [],
        "sync_cost": 0.5,
        "sync_cost_sensitivity": [1.0],
    }
    monkeypatch.setattr(autolag, "protocol_state", lambda path: {"protocol_commit": "c", "protocol_blob": "b"})
    monkeypatch.setattr(autolag, "read_protocol", lambda path: protocol)
    out = tmp_path / "s"
    assert autolag.run(out, tmp_path / "assets", jobs=2, dry_run=False) == 0
    pilot_rows = (out / "runs" / "pilot-sat_gspo_r3-lag2-seed99" / "metrics.jsonl").open()
    pilot = [json.loads(line)["data"] for line in pilot_rows]
    expected = statistics.median(
        r["actor/mismatch_abs_mean"] for r in pilot if r["training/sat/staleness_steps/max"] == 1
    )
    target = json.loads((out / "autolag_target.json").read_text())["target"]
    assert target == pytest.approx(expected)
    spec = json.loads((out / "runs" / "auto-sat_gspo_r3-lag3-seed7" / "study_spec.json").read_text())
    assert dict(map(tuple, spec["settings"]))["auto_target"] == pytest.approx(target)
    result = json.loads((out / "autolag.json").read_text())
    by = {(r["condition"], r["seed"]): r for r in result["runs"]}
    assert sorted(by) == [(c, k) for c in ("auto", "lag 1", "lag 2") for k in (7, 8)]  # the pilot is left out
    assert by[("lag 1", 7)]["broadcasts"] == 4 and by[("lag 2", 7)]["broadcasts"] == 2
    assert by[("lag 2", 7)]["modelled_time@c=0.5"] == 4 + 0.5 * 2
    assert 1 <= by[("auto", 7)]["broadcasts"] <= 4
    assert [r["a"] + " - " + r["b"] for r in result["primary"]] == ["auto - lag 2", "auto - lag 1"]
    text = (out / "autolag.md").read_text()
    assert "| auto |" in text and "| lag 1 |" in text and "## Primary contrasts" in text
    assert (out / "autolag_tradeoff.png").stat().st_size > 1000 and (out / "autolag_trajectory.png").is_file()


@pytest.mark.parametrize(
    ("protocol", "results"), [("study_protocol_autolag.md", "results"), ("study_protocol_autolag2.md", "results2")]
)
def test_the_committed_contrasts_recompute_from_the_committed_runs(autolag, protocol, results):
    """Each protocol's primary contrasts, recomputed from its committed autolag_runs.csv, are the
    committed autolag.json's (the protocol read from its new place, byte for byte the old one)."""
    import csv

    plan = autolag.read_protocol(STUDY / protocol)
    rows = [
        {**r, "seed": int(r["seed"]), "heldout_acc": float(r["heldout_acc"])}
        for r in csv.DictReader((STUDY / results / "autolag_runs.csv").open())
    ]
    committed = json.loads((STUDY / results / "autolag.json").read_text())["primary"]
    recomputed = [autolag.paired_conditions(rows, a, b, "heldout_acc") for a, b in plan["primary"]]
    assert [r["seeds"] for r in recomputed] == [len(plan["seeds"])] * len(plan["primary"])
    for new, old in zip(recomputed, committed, strict=True):
        assert (new["a"], new["b"], new["seeds"]) == (old["a"], old["b"], old["seeds"])
        assert new["diff"] == pytest.approx(old["diff"]) and new["ci"] == pytest.approx(old["ci"])
        assert new["wilcoxon_p"] == pytest.approx(old["wilcoxon_p"])
        assert new["permutation_p"] == pytest.approx(old["permutation_p"])
