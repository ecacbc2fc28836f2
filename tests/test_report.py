"""Tests of verl_sat.paper.report and verl_sat.paper.table on the fixture runs in tests/fixtures/runs/."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_job_summary import at, capture_figures, points

from verl_sat.paper import report
from verl_sat.paper.report import (
    CollapseRule,
    Run,
    as_percent,
    build_rows,
    find_acc_key,
    infer_method_lag,
    load_run,
    main,
    metric_series,
    run_label,
    run_styles,
)
from verl_sat.paper.table import PAPER_TABLE1, normalize_method, paper_row

RUNS = Path(__file__).parent / "fixtures" / "runs"
RUN_DIRS = [RUNS / "sat_gspo_r3-lag8", RUNS / "baseline_run", RUNS / "gspo-lag1"]

# (method, lag, run, best AIME24 %, its step, dbar_pi over the last 10 steps, collapse flag)
EXPECTED = {
    "grpo": (8, "baseline_run", 31.25, 10, 0.011, "yes (reward, acc)"),
    "gspo": (1, "gspo-lag1", 32.5, 20, 0.0097, "no"),
    "sat_gspo_r3": (8, "sat_gspo_r3-lag8", 37.5, 15, 0.008, "no"),
}


def test_paper_table_complete() -> None:
    assert set(PAPER_TABLE1) == {
        "base", "grpo", "gspo", "grpo_r3", "gspo_r3", "grpo_tis", "gspo_tis", "grpo_tis_r3", "gspo_tis_r3",
        "dppo", "sat_grpo", "sat_gspo", "sat_grpo_r3", "sat_gspo_r3",
    }  # fmt: skip
    best = PAPER_TABLE1["sat_gspo_r3"]
    assert best.aime24 == {1: 35.83, 8: 34.79} and best.dbar_pi == {1: 0.0056, 8: 0.0076}
    assert max(PAPER_TABLE1.values(), key=lambda r: r.aime24[8]).method == "sat_gspo_r3"
    assert PAPER_TABLE1["grpo"].collapses_later == frozenset({8})
    assert PAPER_TABLE1["base"].dbar_pi == {}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("SAT-GSPO+R3", "sat_gspo_r3"),
        ("gspo_r3_tis", "gspo_tis_r3"),
        ("GRPO + TIS + R3", "grpo_tis_r3"),
        ("vanilla", "grpo"),
        ("dppo_tv", "dppo"),
        ("dppo_tv_r3", "dppo_r3"),
        ("base_model", "base"),
        ("my-new-thing", "my_new_thing"),
    ],
)
def test_normalize_method(name: str, key: str) -> None:
    assert normalize_method(name) == key


def test_paper_row_lookup() -> None:
    row = paper_row("SAT-GRPO")
    assert row is not None and row.aime24[1] == 32.71
    assert paper_row("unknown") is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [("sat_gspo_r3-lag8", ("sat_gspo_r3", 8)), ("grpo_lag1_seed3", ("grpo", 1)), ("GSPO-TIS-lag-8", ("gspo_tis", 8))],
)
def test_infer_method_lag(name: str, expected: tuple[str, int]) -> None:
    assert infer_method_lag(name) == expected


def test_infer_method_lag_error_names_the_run() -> None:
    with pytest.raises(ValueError, match="'mystery'"):
        infer_method_lag("mystery")


def test_load_run_formats() -> None:
    flat = load_run(RUNS / "sat_gspo_r3-lag8")
    assert (flat.method, flat.lag) == ("sat_gspo_r3", 8)
    assert flat.series("actor/sat_gate_rate")[0] == (1, pytest.approx(0.099))
    verl_logger = load_run(RUNS / "baseline_run")  # {"step", "data"} lines, run.json gives method/lag
    assert (verl_logger.method, verl_logger.lag, verl_logger.name) == ("grpo", 8, "baseline_run")
    assert verl_logger.series("critic/score/mean")[9] == (10, pytest.approx(0.6))
    mixed = load_run(RUNS / "gspo-lag1")
    assert "note" not in mixed.metrics and "actor/pg_loss" not in mixed.metrics  # strings and NaN skipped
    assert mixed.series("eval/aime24/avg@16") == [(0, 0.09375), (10, 0.3), (20, 0.325)]


def test_metric_series_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "a": 1.0}\n\n{"a": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 3 has no integer 'step'"):
        metric_series(bad)
    bad.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        metric_series(bad)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_run(tmp_path / "nowhere")
    (tmp_path / "two").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "two" / name).write_text("")
    with pytest.raises(FileNotFoundError, match=r"found: a.jsonl, b.jsonl"):
        load_run(tmp_path / "two")


def test_find_acc_key_priority() -> None:
    keys = [
        "val-core/aime24/reward/mean@16",
        "val-core/aime24/acc/best@16/mean",
        "val-core/aime24/acc/mean@16",
        "val-core/aime24/acc/mean@4",
    ]
    assert find_acc_key(keys) == "val-core/aime24/acc/mean@16"
    assert find_acc_key([*keys, "eval/aime24/avg@16", "eval/aime24/pass@16"]) == "eval/aime24/avg@16"
    assert find_acc_key(["val-core/math500/acc/mean@1"]) is None
    assert as_percent([(0, 0.5)]) == [(0, 50.0)] and as_percent([(0, 35.0)]) == [(0, 35.0)]


def test_table_rows_match_expected() -> None:
    rows = build_rows([load_run(d) for d in RUN_DIRS], last_n=10)
    assert [r.method for r in rows] == ["grpo", "gspo", "sat_gspo_r3"]  # paper order
    for row in rows:
        lag, run, best, step, dbar, collapse = EXPECTED[row.method]
        assert (row.lag, row.run, row.best_step, row.collapse) == (lag, run, step, collapse)
        assert row.best_acc == pytest.approx(best)
        assert row.dbar_pi == pytest.approx(dbar)
        paper = PAPER_TABLE1[row.method]
        assert row.paper_acc == paper.aime24[lag] and row.paper_dbar_pi == paper.dbar_pi[lag]
        assert row.acc_diff == pytest.approx(best - paper.aime24[lag])
    assert rows[0].acc_key == "val-core/aime24/acc/mean@16"
    assert rows[0].paper_collapse == "yes" and rows[1].paper_collapse == "no"


def test_last_n_default_uses_all_short_runs() -> None:
    row = build_rows([load_run(RUNS / "sat_gspo_r3-lag8")])[0]
    assert row.dbar_pi == pytest.approx(0.009)  # 10 steps at 0.010, 10 at 0.008
    assert row.dbar_steps == 20


@pytest.fixture
def saved_figures(monkeypatch) -> dict:
    return capture_figures(monkeypatch)


def test_cli_writes_table_and_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str], saved_figures) -> None:
    """table1.md/csv, report.json and the five figures; each figure read back against the runs'
    metrics it was drawn from (one panel per lag, one line per run, labelled by ``run_label``)."""
    rows = main([*map(str, RUN_DIRS), "--out", str(tmp_path), "--last-n", "10", "--all-paper-rows"])
    table = (tmp_path / "table1.md").read_text()
    assert (
        "| sat_gspo_r3 (SAT-GSPO + R3) | 8 | sat_gspo_r3-lag8 | 37.50 | 15 | 34.79 | +2.71 | 0.0080 | 0.0076 |" in table
    )
    assert "| grpo (GRPO) | 8 | baseline_run | 31.25 | 10 | 30.17 | +1.08 | 0.0110 | 0.0110 | +0.0000 |" in table
    assert "| yes (reward, acc) | yes |" in table
    assert "| sat_grpo (SAT-GRPO) | 1 | – | – | – | 32.71 |" in table  # a paper row without a run
    assert len(rows) == 14 * 2  # every (method, lag) of the paper; our 3 runs fill 3 of them
    for name in ("fig4_dbar_pi.png", "fig5_aime24.png", "reward.png", "aime24_curve.png", "sat_gate.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    check_figures(saved_figures, [load_run(p) for p in RUN_DIRS], rows)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["last_n"] == 10 and len(report["rows"]) == len(rows)
    assert (tmp_path / "table1.csv").read_text().startswith("method,lag,run,")
    assert "AIME24" in capsys.readouterr().out


def check_figures(figures: dict, runs: list[Run], rows: list) -> None:
    """Each run's curve sits on its lag's panel with its metric per step (no smoothing: --smooth 0);
    Figure 4 marks the paper's dbar_pi at the run's last step, Figure 5's bars are each row's best
    AIME24 beside the paper's, sat_gate.png holds the gate rate above q."""

    def curves(ax) -> dict:
        return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}

    def panels(name: str) -> dict:
        return {ax.get_title(): ax for ax in figures[name].axes if ax.get_title()}

    metrics = {
        "fig4_dbar_pi.png": lambda r: r.series(report.DBAR_PI_KEY),
        "reward.png": report.reward_series,
        "aime24_curve.png": lambda r: as_percent(r.series(find_acc_key(list(r.metrics)))),
    }
    for name, series in metrics.items():
        by_lag = panels(name)
        assert sorted(by_lag) == ["lag 1", "lag 8"], name
        for run in runs:
            line = curves(by_lag[f"lag {run.lag}"])[run_label(run)]
            assert series(run) and points(line) == at(series(run)), (name, run.name)
    fig4 = panels("fig4_dbar_pi.png")
    for run in runs:
        last = report.PAPER_TABLE1[run.method].dbar_pi[run.lag]
        stars = [line for line in fig4[f"lag {run.lag}"].get_lines() if line.get_marker() == "*"]
        assert (run.series(report.DBAR_PI_KEY)[-1][0], last) in [tuple(points(s)) for s in stars], run.name
    bars = panels("fig5_aime24.png")
    for lag in (1, 8):
        panel = [r for r in rows if r.lag == lag and (r.best_acc is not None or r.paper_acc is not None)]
        ours, paper = bars[f"AIME24, lag {lag}"].containers
        assert [b.get_height() for b in ours] == pytest.approx([r.best_acc or 0.0 for r in panel])
        assert [b.get_height() for b in paper] == pytest.approx([r.paper_acc or 0.0 for r in panel])
    gate = figures["sat_gate.png"].axes
    for run in runs:
        column = 0 if run.lag == 1 else 1
        for row, key in enumerate((report.GATE_RATE_KEY, report.Q_KEY)):
            drawn = curves(gate[2 * row + column] if len(gate) == 4 else gate[row])
            if run.series(key):
                assert points(drawn[run_label(run)]) == at(run.series(key)), (run.name, key)
            else:
                assert run_label(run) not in drawn


# ---------------------------------------------------------------------------------------------
# The collapse rule
# ---------------------------------------------------------------------------------------------


def _series(values: list[float]) -> list[tuple[int, float]]:
    return list(enumerate(values))


def test_collapse_rule_cases() -> None:
    rule = CollapseRule()
    assert rule.collapsed(_series([0.1, 0.2])) is None  # too short
    assert rule.collapsed(_series([0.1, 0.3, 0.5, 0.6, 0.6])) is False  # still rising
    assert rule.collapsed(_series([0.1, 0.5, 0.6, 0.3, 0.1])) is True
    assert rule.collapsed(_series([0.1, 0.5, 0.6, 0.5, 0.5])) is False  # small dip
    assert rule.collapsed(_series([0.5, 0.4, 0.3, 0.2, 0.1])) is False  # never improved
    with pytest.raises(ValueError, match="collapse.drop"):
        CollapseRule(drop=0)


def _collapse_margin(values: list[float], rule: CollapseRule) -> float:
    """(peak - late) - drop * (peak - baseline): the rule's decision is its sign (an oracle)."""
    n = len(values)
    head = sorted(values[: max(1, math.ceil(rule.head_frac * n))])
    baseline = statistics.median(head)
    window = max(1, math.ceil(rule.window_frac * n))
    peak, late = max(values), sum(values[-window:]) / window
    return (peak - late) - rule.drop * (peak - baseline)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(min_value=-8, max_value=8).map(lambda i: i / 8), min_size=5, max_size=40),
    st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0]),
    st.integers(min_value=-16, max_value=16).map(lambda i: i / 8),
)
def test_collapse_rule_is_affine_invariant(values: list[float], scale: float, shift: float) -> None:
    # Dyadic values, scales and shifts: the transform is exact, so only exact ties may differ.
    rule = CollapseRule()
    assume(abs(_collapse_margin(values, rule)) > 1e-6)  # exact ties may round either way
    transformed = [scale * v + shift for v in values]
    assert rule.collapsed(_series(values)) == rule.collapsed(_series(transformed))


def test_every_run_is_drawn_alike_by_no_other() -> None:
    """Two runs of one method (two seeds, or an R3 run labelled like a plain one) stay apart."""
    runs = [Run(f"seed{k}", Path("."), "sat_gspo", 2) for k in range(6)] + [Run("plain", Path("."), "gspo", 2)]
    styles = run_styles(runs)
    drawn = {(s["color"], s["ls"], s.get("marker")) for s in styles}
    assert len(drawn) == len(runs)
    assert len({s["color"] for s in styles}) == 2  # a colour per method
    assert [s["label"] for s in styles][:2] == ["sat_gspo · seed0", "sat_gspo · seed1"]
    assert run_label(Run("sat_gspo_r3-lag8", Path("."), "sat_gspo_r3", 8)) == "sat_gspo_r3-lag8"
