"""studies/autolag/autolag_study.py: the committed protocol's plan, the pilot's target rule, and a tiny
study end to end (pilot, target, fixed and auto arms, summary)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from study_scripts import load_study
from test_job_summary import at, capture_figures, legend_labels, points

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "studies" / "autolag"


@pytest.fixture
def saved_figures(monkeypatch) -> dict:
    return capture_figures(monkeypatch)


@pytest.fixture(scope="module")
def autolag():
    return load_study("autolag", "autolag_study")


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


def test_a_tiny_study_end_to_end(autolag, tmp_path, monkeypatch, saved_figures):
    """The pilot's target by the protocol's rule, the arms' broadcasts and modelled time, the
    contrasts, and the two figures read back against the runs they were drawn from."""
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
    check_the_figures(autolag, saved_figures, out, target)


def check_the_figures(autolag, figures: dict, out: Path, target: float) -> None:
    """autolag_tradeoff.png: per arm, one point at (mean broadcasts, mean held-out accuracy) with its
    t 95% bar, from autolag_runs.csv; autolag_trajectory.png: each auto run's broadcasts at (step, lag),
    and per arm the seed mean of dbar_pi's 10-step moving average, with auto's target, from the
    runs' metrics.jsonl."""
    import csv

    from studies.lib.harness import smooth
    from studies.lib.stats import paired_t_interval
    from verl_sat.files import read_metrics

    table = list(csv.DictReader((out / "autolag_runs.csv").open()))
    arms = ["lag 1", "lag 2", "auto"]
    (ax,) = figures["autolag_tradeoff.png"].axes
    assert [c.get_label() for c in ax.containers] == arms == legend_labels(ax)
    for arm, bar in zip(arms, ax.containers, strict=True):
        cell = [r for r in table if r["condition"] == arm]
        mean, lo, hi = paired_t_interval([float(r["heldout_acc"]) for r in cell])
        broadcasts = sum(int(r["broadcasts"]) for r in cell) / len(cell)
        assert points(bar.lines[0]) == at([(broadcasts, mean)]), arm
        assert [float(v) for v in bar.lines[2][0].get_segments()[0].ravel()] == at([(broadcasts, lo), (broadcasts, hi)])
    left, right = figures["autolag_trajectory.png"].axes
    runs = {r["name"]: read_metrics(out / "runs" / r["name"] / "metrics.jsonl") for r in table}
    auto = sorted(r["name"] for r in table if r["condition"] == "auto")
    assert len(left.collections) == len(auto) == 2
    for name, dots in zip(auto, left.collections, strict=True):
        broadcast = [(r["step"], r[autolag.LAG_KEY]) for r in runs[name] if r[autolag.BROADCAST_KEY]]
        assert broadcast and points(dots) == at(broadcast), name
    *curves, line = right.get_lines()
    assert [c.get_label() for c in curves] == sorted(arms) and line.get_label() == f"auto's target {target:.4f}"
    assert list(line.get_ydata()) == [target, target]
    for arm, curve in zip(sorted(arms), curves, strict=True):
        chosen = [smooth([r[autolag.DBAR_PI_KEY] for r in runs[r["name"]]], 10) for r in table if r["condition"] == arm]
        mean = [sum(c[i] for c in chosen) / len(chosen) for i in range(len(chosen[0]))]
        assert points(curve) == at(enumerate(mean, 1)), arm


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


def committed_autolag(results: str) -> list[dict]:
    """A committed autolag_runs.csv, typed as ``autolag_stats`` writes it (the fields the tables read)."""
    import csv

    numbers = ("heldout_acc", "dbar_pi_final", "mean_lag", "modelled_time@c=0.1", "modelled_time@c=0.5")
    return [
        {
            **r,
            "seed": int(r["seed"]),
            "broadcasts": int(r["broadcasts"]),
            "modelled_time@c=1": float(r["modelled_time@c=1"]),
            **{k: float(r[k]) for k in numbers},
        }
        for r in csv.DictReader((STUDY / results / "autolag_runs.csv").open())
    ]


def study_section(heading: str) -> str:
    """docs/study.md from ``heading`` to the next heading of its level or above."""
    page = (REPO / "docs" / "study.md").read_text()
    start = page.index(heading)
    ends = [i for i in (page.find("\n### ", start + 1), page.find("\n## ", start + 1)) if i > 0]
    return " ".join(page[start : min(ends, default=len(page))].split())  # a sentence may wrap


@pytest.mark.parametrize(
    ("protocol", "results", "heading"),
    [
        ("study_protocol_autolag.md", "results", "### Protocol 1"),
        ("study_protocol_autolag2.md", "results2", "### Protocol 2"),
    ],
)
def test_docs_study_quotes_the_committed_autolag_results(autolag, protocol, results, heading):
    """Every number of docs/study.md's auto-lag tables (per arm: held-out accuracy and its t 95%,
    broadcasts, mean lag, modelled time, last-quarter dbar_pi; the primary contrasts with both
    p-values and the protocol's reading) is recomputed here from the committed autolag_runs.csv
    with the study's own functions, and so are the numbers the text quotes: the target, the run
    counts, the secondary contrast, the cost sensitivity and the lags between broadcasts (these
    from autolag.json's per-run lags, which the CSV leaves out)."""
    from collections import Counter

    from studies.lib.stats import paired_t_interval

    plan = autolag.read_protocol(STUDY / protocol)
    stats = committed_autolag(results)
    text = study_section(heading)
    cells = {arm: [s for s in stats if s["condition"] == arm] for arm in ["lag 1", "lag 4", "lag 8", "auto"]}

    def mean(arm: str, key: str) -> float:
        return sum(s[key] for s in cells[arm]) / len(cells[arm])

    def t_ratio(arm: str, c: str) -> float:
        return mean(arm, f"modelled_time@c={c}") / mean("lag 1", f"modelled_time@c={c}")

    for arm, cell in cells.items():
        assert len(cell) == len(plan["seeds"]), arm
        acc, lo, hi = paired_t_interval([s["heldout_acc"] for s in cell])
        b = [s["broadcasts"] for s in cell]
        broadcasts = f"{b[0]}" if min(b) == max(b) else f"{sum(b) / len(b):.1f} ({min(b)}-{max(b)})"
        row = (
            f"| {arm} | {acc:.3f} [{lo:.3f}, {hi:.3f}] | {broadcasts} | {mean(arm, 'mean_lag'):.2f} | "
            f"{t_ratio(arm, '0.5'):.3f} | {mean(arm, 'dbar_pi_final'):.4f} |"
        )
        assert row in text, row
    assert f"primary contrast ({len(plan['seeds'])} seeds, paired)" in text
    for a, b in plan["primary"]:
        r = autolag.paired_conditions(stats, a, b, "heldout_acc")
        lo, hi = r["ci"]
        row = (
            f"| {a} - {b} | {r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {r['wilcoxon_p']:.3f} | "
            f"{r['permutation_p']:.3f} | {autolag.reading(r)} |"
        )
        assert row in text, row
    target = json.loads((STUDY / results / autolag.TARGET_FILE).read_text())["target"]
    intro = study_section("## Mismatch-driven lag")
    assert (f"**{target:.4f}**" in intro) if results == "results" else (f"Target {target:.4f}" in text)
    assert f"protocol {heading[-1]}, {len(stats) + 1} runs" in intro  # the pilot, then the arms
    lags = Counter(k for r in json.loads((STUDY / results / "autolag.json").read_text())["runs"] for k in r["lags"])
    assert sum(lags.values()) == sum(s["broadcasts"] for s in cells["auto"])
    if results == "results":
        r = autolag.paired_conditions(stats, "auto", "lag 4", "heldout_acc")
        assert f"auto - lag 4 {r['diff']:+.3f} [{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]" in text
        assert f"at c = 0.1 / 1.0 auto's T is {t_ratio('auto', '0.1'):.3f} / {t_ratio('auto', '1'):.3f}" in text
        assert f"{lags[1]} of the {sum(lags.values())} broadcasts came one step after the previous one" in text
    else:
        assert 1 not in lags and f"lags {min(lags)}-{max(lags)}; {lags[2]} of {sum(lags.values())} at lag 2" in text
        first = [s["broadcasts"] for s in committed_autolag("results") if s["condition"] == "auto"]
        before = sum(first) / len(first)
        share = mean("auto", "broadcasts") / mean("lag 1", "broadcasts")
        assert f"auto used {mean('auto', 'broadcasts'):.0f} broadcasts ({share:.0%} of lag 1's" in text
        assert f"than protocol 1's {before:.0f})" in text
