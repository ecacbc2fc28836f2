"""The main job's closing report: the step-time split from verl's timing metrics, and reward.png."""

from __future__ import annotations

import pytest

from verl_sat import job_summary
from verl_sat.main import summary


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


def test_reward_png_is_written(tmp_path):
    rows = [dict(timed_row(s, 1.0, 2.0, 4.0, 0.1 * s), **{"actor/sat_gate_rate": 0.1}) for s in range(1, 6)]
    path = job_summary.plot_job(rows, tmp_path / "reward.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert job_summary.quarter_means(rows) == pytest.approx((0.1, 0.5))
