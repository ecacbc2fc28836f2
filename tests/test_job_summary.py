"""The main job's closing report: the step-time split from verl's timing metrics, and reward.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_sat.trainer import progress as job_summary
from verl_sat.trainer.progress import summary


def timed_row(step: int, gen: float, update: float, total: float, reward: float) -> dict:
    return {
        "step": step,
        "timing_s/step": total,
        "timing_s/gen": gen,
        "timing_s/old_log_prob": 0.1,
        "timing_s/update_actor": update,
        "timing_s/update_weights": 0.2,
        "critic/score/mean": reward,
    }


def test_split_leaves_out_the_first_step_and_accounts_for_the_rest():
    rows = [timed_row(1, 9.0, 9.0, 30.0, 0.1), timed_row(2, 1.0, 2.0, 4.0, 0.2), timed_row(3, 2.0, 1.0, 4.0, 0.3)]
    split = job_summary.timing_split(rows)
    assert split["step"] == pytest.approx(4.0)
    assert split["wait_rollout"] == pytest.approx(1.5) and split["update_actor"] == pytest.approx(1.5)
    assert split["adv"] == 0.0  # never logged
    assert split["other"] == pytest.approx(4.0 - 1.5 - 0.1 - 1.5 - 0.2)
    text = job_summary.format_split(split, lag=2)
    assert text.startswith("step 4.00 s = 2.00 s/optimizer step") and "wait_rollout 1.50" in text


def test_summary_line_carries_the_split_and_quarters():
    rows = [timed_row(s, 1.0, 2.0, 4.0, 0.1 * s) for s in range(1, 9)]
    line = summary(rows, 60.0, lag=2)
    assert "reward first-quarter 0.150 -> last-quarter 0.750" in line
    assert "2.00 s/optimizer step" in line
    assert job_summary.timing_split([]) == {} and job_summary.format_split({}, 2) == ""


@pytest.fixture
def saved_figures(monkeypatch) -> dict:
    return capture_figures(monkeypatch)


def capture_figures(monkeypatch) -> dict:
    """Every matplotlib figure written while the test runs, by file name: its Axes still hold what
    was drawn (line data, offsets, titles, legend entries), so a test reads the figure's content
    back instead of trusting that a PNG exists."""
    from matplotlib.figure import Figure

    figures: dict = {}
    save = Figure.savefig

    def record(fig, fname, *args, **kwargs):
        figures[Path(fname).name] = fig
        return save(fig, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return figures


def points(artist) -> list[float]:
    """A line's (x, y) data, or a scatter's offsets, flat: x0, y0, x1, y1, ..."""
    data = artist.get_xydata() if hasattr(artist, "get_xydata") else artist.get_offsets()
    return [float(v) for xy in data for v in xy]


def at(pairs) -> object:
    """``points`` of the (x, y) pairs, to compare with ``==`` (pytest.approx)."""
    return pytest.approx([float(v) for xy in pairs for v in xy])


def legend_labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


def test_reward_png_shows_each_panels_metric_per_step_the_quarters_and_the_broadcasts(tmp_path, saved_figures):
    """reward.png: each panel's line is its metric per step, read from the rows it was drawn from
    (a step without the metric is left out); the reward panel's two quarter lines sit at
    ``quarter_means``; the dbar_pi panel carries one red line per sat.lag=auto broadcast."""
    rows = [
        dict(
            timed_row(s, 1.0, 2.0, 4.0, 0.1 * s),
            **{
                "actor/sat_gate_rate": 0.1,
                "actor/mismatch_abs_mean": 0.01 * s,
                "training/sat/auto_lag/broadcast": float(s % 2 == 0),
            },
        )
        for s in range(1, 6)
    ]
    del rows[2]["actor/mismatch_abs_mean"]
    path = job_summary.plot_job(rows, tmp_path / "reward.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert job_summary.quarter_means(rows) == pytest.approx((0.1, 0.5))
    reward, dbar_pi, gate, intercepted = saved_figures["reward.png"].axes
    assert points(reward.get_lines()[0]) == at((s, 0.1 * s) for s in range(1, 6))
    assert [line.get_ydata()[0] for line in reward.get_lines()[1:]] == pytest.approx([0.1, 0.5])
    assert legend_labels(reward) == ["first quarter 0.10", "last quarter 0.50"]
    curve, *marks = dbar_pi.get_lines()
    assert points(curve) == at((s, 0.01 * s) for s in (1, 2, 4, 5))  # step 3 has none
    assert [m.get_xdata()[0] for m in marks] == [2, 4]  # the broadcasts, at their steps
    assert dbar_pi.get_title() == "dbar_pi (red: the 2 broadcasts of sat.lag=auto)"
    assert points(gate.get_lines()[0]) == at((s, 0.1) for s in range(1, 6))
    assert gate.get_title() == "SAT gate rate"
    assert not intercepted.get_lines() and [t.get_text() for t in intercepted.texts] == ["no data"]


def sat_rows(qs: list[float], intercepted: float = 0.0) -> list[dict]:
    return [
        {"step": s, "actor/sat_q": q, "actor/sat_intercepted_frac": intercepted, "critic/score/mean": 0.5}
        for s, q in enumerate(qs, 1)
    ]


def test_sat_inert_warning_fires_when_q_is_beyond_the_clip_radius_on_most_recent_steps():
    radius = 0.18232155679395462  # log(1.2)
    inert = sat_rows([0.1] * 10 + [radius * 2] * 11 + [0.1] * 9)  # 11 of the last 20 above the radius
    warning = job_summary.inert_warning(inert, eps_high=0.2)
    assert warning and "11 of the last 20" in warning and "0.182" in warning
    assert job_summary.inert_warning(sat_rows([radius * 2] * 10 + [0.1] * 10), eps_high=0.2) is None  # 10/20
    assert job_summary.inert_warning(sat_rows([radius * 2] * 19), eps_high=0.2) is None  # too few steps yet
    # the radius is the run's own eps_high: q = 0.3 is inside log(1 + 0.5)
    assert job_summary.inert_warning(sat_rows([0.3] * 20), eps_high=0.5) is None
    assert job_summary.inert_warning(sat_rows([0.3] * 20), eps_high=0.2) is not None
    assert job_summary.inert_warning([{"step": s} for s in range(30)], eps_high=0.2) is None  # a baseline: no q


def test_the_step_line_and_reward_png_show_the_intercepted_fraction(tmp_path, saved_figures):
    from verl_sat.trainer.progress import ProgressPrinter, progress_line

    row = {"step": 3, "critic/score/mean": 0.5, "actor/sat_intercepted_frac": 0.0123}
    assert "intercepted 0.0123" in progress_line(row)
    assert "intercepted -" in progress_line({"step": 3})
    path = tmp_path / "metrics.jsonl"
    rows = sat_rows([0.5] * 25, intercepted=0.001)
    path.write_text("".join(json.dumps({"step": r.pop("step"), "data": r}) + "\n" for r in rows))
    printer = ProgressPrinter(path, eps_high=0.2)
    printed = []
    import builtins

    real = builtins.print
    builtins.print = lambda *a, **k: printed.append(" ".join(map(str, a)))
    try:
        printer.flush()
        printer.flush()
    finally:
        builtins.print = real
    assert sum("SAT is inert" in line for line in printed) == 1  # once, however often it flushes
    assert job_summary.plot_job(job_summary_rows(), tmp_path / "reward.png").is_file()
    panel = saved_figures["reward.png"].axes[3]
    assert panel.get_title() == "intercepted (SAT clips, PPO does not)"
    assert points(panel.get_lines()[0]) == at((s, 0.01 * s) for s in range(1, 5))


def job_summary_rows() -> list[dict]:
    return [{"step": s, "critic/score/mean": 0.1, "actor/sat_intercepted_frac": 0.01 * s} for s in range(1, 5)]


def test_reward_png_gains_the_heldout_panel_from_the_rows(tmp_path, saved_figures):
    """With ``sat.heldout`` the figure has a fifth panel: the held-out accuracy by optimizer step,
    step 0 from the ``_initial`` keys, each later point at its row's ``eval/heldout_step``."""
    rows = [timed_row(s, 1.0, 2.0, 4.0, 0.1 * s) for s in range(1, 5)]
    rows[0].update({"eval/heldout_acc_initial": 0.05, "eval/heldout_greedy_acc_initial": 0.9})
    rows[1].update({"eval/heldout_acc": 0.2, "eval/heldout_greedy_acc": 0.92, "eval/heldout_step": 16.0})
    rows[3].update({"eval/heldout_acc": 0.4, "eval/heldout_greedy_acc": 0.95, "eval/heldout_step": 32.0})
    job_summary.plot_job(rows, tmp_path / "reward.png")
    *_, heldout = saved_figures["reward.png"].axes
    assert len(saved_figures["reward.png"].axes) == 5 and heldout.get_title() == "held-out accuracy (sat.heldout)"
    sampled, greedy = heldout.get_lines()
    assert points(sampled) == at([(0, 0.05), (16, 0.2), (32, 0.4)])
    assert points(greedy) == at([(0, 0.9), (16, 0.92), (32, 0.95)])
    assert "held-out 0.200" in job_summary.progress_line(rows[1]) and "held-out" not in job_summary.progress_line(
        rows[2]
    )
