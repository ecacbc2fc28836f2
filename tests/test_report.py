"""Tests of verl_sat.paper.report and verl_sat.paper.table on the fixture runs in tests/fixtures/runs/."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_job_summary import at, capture_figures, points

from verl_sat.paper import report
from verl_sat.paper.report import (
    CollapseRule,
    Run,
    acc_series,
    build_table,
    find_acc_key,
    infer_method_lag,
    load_run,
    main,
    metric_frame,
    run_label,
    run_styles,
)
from verl_sat.paper.table import PAPER_TABLE1, normalize_method


def paper_row(method):
    return PAPER_TABLE1.get(normalize_method(method))


RUNS = Path(__file__).parent / "fixtures" / "runs"
RUN_DIRS = [RUNS / "sat_gspo_r3-lag8", RUNS / "baseline_run", RUNS / "gspo-lag1"]


# ---------------------------------------------------------------------------------------------
# Oracles: the runs' metrics read with json alone, and the collapse rule on plain lists
# ---------------------------------------------------------------------------------------------


def raw_metrics(path: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` of a run's JSONL (flat or verl's ``{"step", "data"}``), later
    lines winning, non-numbers, booleans and NaN left out."""
    if path.is_dir():
        path = next(iter(sorted(path.glob("metrics.jsonl")) or sorted(path.glob("*.jsonl"))))
    metrics: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            for key, value in {**row, **row.get("data", {})}.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                if key not in ("step", "data") and number:
                    metrics.setdefault(key, {})[row["step"]] = float(value)
    return metrics


def raw_acc(metrics: dict[str, dict[int, float]]) -> list[tuple[int, float]]:
    """The AIME24 series by step in percent (fractions scaled by 100)."""
    pairs = sorted(metrics[find_acc_key(list(metrics))].items())
    return [(s, 100 * v) for s, v in pairs] if max(v for _, v in pairs) <= 1 else pairs


def pairs(series) -> list[tuple[int, float]]:
    return list(zip(series.index.tolist(), series.tolist(), strict=True))


def oracle_collapsed(values: list[float], rule: CollapseRule) -> bool | None:
    """The collapse rule of docs/eval.md on a plain list (statistics.median, sum / window)."""
    n = len(values)
    if n < rule.min_points:
        return None
    baseline = statistics.median(values[: math.ceil(rule.head_frac * n)])
    window = math.ceil(rule.window_frac * n)
    peak, late = max(values), sum(values[-window:]) / window
    if peak <= baseline or values.index(peak) >= n - window:
        return False
    return peak - late >= rule.drop * (peak - baseline)


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
    """Flat lines, verl's ``{"step", "data"}`` lines and a mix with strings and NaN: each run's frame
    holds, per metric, the value of every step that logged it, as json reads the file."""
    for run_dir in RUN_DIRS:
        run, raw = load_run(run_dir), raw_metrics(run_dir)
        assert sorted(run.metrics.columns) == sorted(raw), run_dir.name
        for key, by_step in raw.items():
            assert pairs(run.series(key)) == sorted(by_step.items()), (run_dir.name, key)
    flat, verl_logger = load_run(RUNS / "sat_gspo_r3-lag8"), load_run(RUNS / "baseline_run")
    assert (flat.method, flat.lag) == ("sat_gspo_r3", 8)
    assert (verl_logger.method, verl_logger.lag, verl_logger.name) == ("grpo", 8, "baseline_run")  # run.json
    mixed = load_run(RUNS / "gspo-lag1")
    assert "note" not in mixed.metrics and "actor/pg_loss" not in mixed.metrics  # strings and NaN skipped
    assert mixed.series("never/logged").empty


def test_lines_of_one_step_merge_later_winning(tmp_path: Path) -> None:
    rows = [
        {"step": 2, "a": 1.0, "flag": True},
        {"step": 1, "a": 5, "b": "text"},
        {"step": 2, "a": 3.0, "b": 0.5},
        {"step": 2, "data": {"b": float("inf"), "c": 7}},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    frame = metric_frame(path)
    assert list(frame.index) == [1, 2] and sorted(frame.columns) == ["a", "b", "c"]
    for key, by_step in raw_metrics(path).items():
        assert frame[key].dropna().to_dict() == by_step, key
    (tmp_path / "empty.jsonl").write_text("")
    assert metric_frame(tmp_path / "empty.jsonl").empty


def test_metric_frame_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "a": 1.0}\n\n{"a": 2.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 3 has no integer 'step'"):
        metric_frame(bad)
    bad.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        metric_frame(bad)
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


def test_accuracy_is_in_percent() -> None:
    for values, scale in (([0.25, 0.5, 1.0], 100.0), ([25.0, 35.0], 1.0)):
        run = Run("r", Path("."), "grpo", 1, pd.DataFrame({"eval/aime24/avg@16": values}))
        assert acc_series(run).tolist() == pytest.approx([scale * v for v in values])


def test_best_accuracy_is_the_earliest_maximum() -> None:
    acc = pd.DataFrame({"eval/aime24/avg@16": [0.2, 0.5, 0.3, 0.5, 0.1]}, index=[0, 10, 20, 30, 40])
    row = build_table([Run("r", Path("."), "grpo", 1, acc)]).iloc[0]
    assert (row.best_acc, row.best_step, row.final_acc) == (50.0, 10, pytest.approx(10.0))
    assert row.dbar_steps == 0 and pd.isna(row.dbar_pi)
    assert row.collapse == "yes (acc)" and oracle_collapsed([20.0, 50.0, 30.0, 50.0, 10.0], CollapseRule())


@pytest.mark.parametrize("last_n", [3, 10, 120])
def test_table_rows_recompute_from_the_runs_metrics(last_n: int) -> None:
    """Each row's numbers recomputed from the run's metrics as json reads them: the best AIME24 and
    its earliest step, the last accuracy, the mean dbar_pi of the last ``last_n`` steps, the
    collapse flags, and the paper's cells beside them; rows in the paper's order."""
    rule = CollapseRule()
    table = build_table([load_run(d) for d in RUN_DIRS], last_n=last_n)
    assert table.method.tolist() == ["grpo", "gspo", "sat_gspo_r3"]  # paper order
    for run_dir in RUN_DIRS:
        raw, run = raw_metrics(run_dir), load_run(run_dir)
        row = table.set_index("run").loc[run.name]
        acc = raw_acc(raw)
        best = max(v for _, v in acc)
        dbar = [v for _, v in sorted(raw[report.DBAR_PI_KEY].items())][-last_n:]
        assert row.acc_key == find_acc_key(list(raw)) and row.lag == run.lag
        assert (row.best_acc, row.best_step) == (pytest.approx(best), min(s for s, v in acc if v == best))
        assert row.final_acc == pytest.approx(acc[-1][1])
        assert (row.dbar_pi, row.dbar_steps) == (pytest.approx(sum(dbar) / len(dbar)), len(dbar))
        reward = [v for _, v in sorted(raw["critic/score/mean"].items())]
        flags = {"reward": oracle_collapsed(reward, rule), "acc": oracle_collapsed([v for _, v in acc], rule)}
        hits = [name for name, flag in flags.items() if flag]
        assert row.collapse == (f"yes ({', '.join(hits)})" if hits else "no")
        paper = PAPER_TABLE1[run.method]
        assert (row.paper_acc, row.paper_dbar_pi) == (paper.aime24[run.lag], paper.dbar_pi[run.lag])
        assert row.acc_diff == pytest.approx(best - paper.aime24[run.lag])
        assert row.dbar_diff == pytest.approx(sum(dbar) / len(dbar) - paper.dbar_pi[run.lag])
        assert row.paper_collapse == ("yes" if run.lag in paper.collapses_later else "no")
    assert table.collapse.tolist()[0] == "yes (reward, acc)"  # the fixture baseline_run collapses


def test_paper_rows_without_a_run() -> None:
    table = build_table([load_run(RUNS / "gspo-lag1")], all_paper_rows=True)
    assert len(table) == len(PAPER_TABLE1) * 2 and table.method.iloc[0] == "base"  # every (method, lag), paper order
    assert table.method.drop_duplicates().tolist() == list(PAPER_TABLE1)
    empty = table[table.run == "–"]
    assert len(empty) == len(table) - 1 and empty.best_acc.isna().all() and (empty.dbar_steps == 0).all()
    for row in empty.itertuples():
        assert row.paper_acc == PAPER_TABLE1[row.method].aime24[row.lag] and row.collapse == "–"
    other = build_table([Run("x-lag2", Path("."), "zeta", 2), Run("y", Path("."), "alpha", 8)])
    assert other.method.tolist() == ["alpha", "zeta"] and other.paper_collapse.tolist() == ["–", "–"]


@pytest.fixture
def saved_figures(monkeypatch) -> dict:
    return capture_figures(monkeypatch)


def test_cli_writes_table_and_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str], saved_figures) -> None:
    """table1.md/csv, report.json and the five figures; each figure read back against the runs'
    metrics it was drawn from (one panel per lag, one line per run, labelled by ``run_label``)."""
    table = main([*map(str, RUN_DIRS), "--out", str(tmp_path), "--last-n", "10", "--all-paper-rows"])
    md = (tmp_path / "table1.md").read_text()
    assert "| sat_gspo_r3 (SAT-GSPO + R3) | 8 | sat_gspo_r3-lag8 | 37.50 | 15 | 34.79 | +2.71 | 0.0080 | 0.0076 |" in md
    assert "| grpo (GRPO) | 8 | baseline_run | 31.25 | 10 | 30.17 | +1.08 | 0.0110 | 0.0110 | +0.0000 |" in md
    assert "| yes (reward, acc) | yes |" in md
    assert "| sat_grpo (SAT-GRPO) | 1 | – | – | – | 32.71 |" in md  # a paper row without a run
    assert len(table) == 14 * 2  # every (method, lag) of the paper; our 3 runs fill 3 of them
    for name in ("fig4_dbar_pi.png", "fig5_aime24.png", "reward.png", "aime24_curve.png", "sat_gate.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    check_figures(saved_figures, [load_run(p) for p in RUN_DIRS], table)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["last_n"] == 10 and len(written["rows"]) == len(table)
    csv = pd.read_csv(tmp_path / "table1.csv")
    assert csv.columns.tolist()[:3] == ["method", "lag", "run"]
    for rows in (written["rows"], csv.to_dict("records")):
        ours = {row["run"]: row for row in rows if row["run"] != "–"}
        for run_dir in RUN_DIRS:
            acc = raw_acc(raw_metrics(run_dir))
            best = max(v for _, v in acc)
            row = ours[load_run(run_dir).name]
            assert (row["best_acc"], row["best_step"]) == (pytest.approx(best), min(s for s, v in acc if v == best))
    assert all(row["best_acc"] is None for row in written["rows"] if row["run"] == "–")
    assert "AIME24" in capsys.readouterr().out


def check_figures(figures: dict, runs: list[Run], table) -> None:
    """Each run's curve sits on its lag's panel with its metric per step (no smoothing: --smooth 0);
    Figure 4 marks the paper's dbar_pi at the run's last step, Figure 5's bars are each row's best
    AIME24 beside the paper's, sat_gate.png holds the gate rate above q."""

    def curves(ax) -> dict:
        return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}

    def panels(name: str) -> dict:
        return {ax.get_title(): ax for ax in figures[name].axes if ax.get_title()}

    raw = {run.name: raw_metrics(run.path) for run in runs}
    metrics = {
        "fig4_dbar_pi.png": lambda r: sorted(raw[r.name][report.DBAR_PI_KEY].items()),
        "reward.png": lambda r: sorted(raw[r.name]["critic/score/mean"].items()),
        "aime24_curve.png": lambda r: raw_acc(raw[r.name]),
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
        assert (max(raw[run.name][report.DBAR_PI_KEY]), last) in [tuple(points(s)) for s in stars], run.name
    bars = panels("fig5_aime24.png")
    for lag in (1, 8):
        panel = table[(table.lag == lag) & (table.best_acc.notna() | table.paper_acc.notna())]
        ours, paper = bars[f"AIME24, lag {lag}"].containers
        assert [ours.get_label(), paper.get_label()] == ["ours (best)", "paper"]
        assert [b.get_height() for b in ours] == pytest.approx(panel.best_acc.fillna(0.0).tolist())
        assert [b.get_height() for b in paper] == pytest.approx(panel.paper_acc.tolist())
        drawn = {run.name: max(v for _, v in raw_acc(raw[run.name])) for run in runs if run.lag == lag}
        assert sorted(h for h in (b.get_height() for b in ours) if h) == pytest.approx(sorted(drawn.values()))
    gate = figures["sat_gate.png"].axes
    for run in runs:
        column = 0 if run.lag == 1 else 1
        for row, key in enumerate((report.GATE_KEY, report.Q_KEY)):
            drawn = curves(gate[2 * row + column] if len(gate) == 4 else gate[row])
            if key in raw[run.name]:
                assert points(drawn[run_label(run)]) == at(sorted(raw[run.name][key].items())), (run.name, key)
            else:
                assert run_label(run) not in drawn


def test_smooth_draws_an_exponential_moving_average(tmp_path: Path, saved_figures) -> None:
    """--smooth a: y_0 = x_0, y_t = a * y_(t-1) + (1 - a) * x_t on the training curves (weight a on the past)."""
    main([str(RUNS / "sat_gspo_r3-lag8"), "--out", str(tmp_path), "--smooth", "0.6"])
    raw = sorted(raw_metrics(RUNS / "sat_gspo_r3-lag8")[report.DBAR_PI_KEY].items())
    expected, y = [], None
    for step, x in raw:
        y = x if y is None else 0.6 * y + 0.4 * x
        expected.append((step, y))
    ax = next(ax for ax in saved_figures["fig4_dbar_pi.png"].axes if ax.get_title() == "lag 8")
    line = next(line for line in ax.get_lines() if line.get_label() == "sat_gspo_r3-lag8")
    assert points(line) == at(expected)


# ---------------------------------------------------------------------------------------------
# The collapse rule
# ---------------------------------------------------------------------------------------------


def _series(values: list[float]) -> pd.Series:
    return pd.Series(values, index=range(10, 10 + len(values)))  # steps need not start at 0


def test_collapse_rule_cases() -> None:
    rule = CollapseRule()
    assert rule.collapsed(_series([0.1, 0.2])) is None  # too short
    assert rule.collapsed(_series([0.1, 0.3, 0.5, 0.6, 0.6])) is False  # still rising
    assert rule.collapsed(_series([0.1, 0.5, 0.6, 0.3, 0.1])) is True
    assert rule.collapsed(_series([0.1, 0.5, 0.6, 0.5, 0.5])) is False  # small dip
    assert rule.collapsed(_series([0.5, 0.4, 0.3, 0.2, 0.1])) is False  # never improved
    assert rule.collapsed(_series([0.1] * 8 + [1.0, 0.0])) is False  # the peak opens the late window
    assert rule.collapsed(_series([0.1] * 7 + [1.0, 0.0, 0.0])) is True  # ... one step earlier it does not
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


dyadic = st.lists(st.integers(min_value=-8, max_value=8).map(lambda i: i / 8), min_size=2, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    dyadic,
    st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0]),
    st.integers(min_value=-16, max_value=16).map(lambda i: i / 8),
)
def test_collapse_rule_is_affine_invariant(values: list[float], scale: float, shift: float) -> None:
    # Dyadic values, scales and shifts: the transform is exact, so only exact ties may differ.
    rule = CollapseRule()
    assume(len(values) >= 5 and abs(_collapse_margin(values, rule)) > 1e-6)  # exact ties may round either way
    transformed = [scale * v + shift for v in values]
    assert rule.collapsed(_series(values)) == rule.collapsed(_series(transformed))


@settings(max_examples=150, deadline=None)
@given(
    dyadic,
    st.sampled_from([0.1, 0.2, 0.5]),
    st.sampled_from([0.05, 0.3]),
    st.sampled_from([0.25, 0.5, 1.0]),
)
def test_collapse_rule_agrees_with_the_list_oracle(values: list[float], window: float, head: float, drop: float):
    """The pandas form decides as the rule of docs/eval.md written on plain lists."""
    rule = CollapseRule(window_frac=window, head_frac=head, drop=drop)
    assume(len(values) < 5 or abs(_collapse_margin(values, rule)) > 1e-6)
    assert rule.collapsed(_series(values)) == oracle_collapsed(values, rule)


def test_every_run_is_drawn_alike_by_no_other() -> None:
    """Two runs of one method (two seeds, or an R3 run labelled like a plain one) stay apart."""
    runs = [Run(f"seed{k}", Path("."), "sat_gspo", 2) for k in range(6)] + [Run("plain", Path("."), "gspo", 2)]
    styles = run_styles(runs)
    drawn = {(s["color"], s["ls"], s.get("marker")) for s in styles}
    assert len(drawn) == len(runs)
    assert len({s["color"] for s in styles}) == 2  # a colour per method
    assert [s["label"] for s in styles][:2] == ["sat_gspo · seed0", "sat_gspo · seed1"]
    assert run_label(Run("sat_gspo_r3-lag8", Path("."), "sat_gspo_r3", 8)) == "sat_gspo_r3-lag8"
