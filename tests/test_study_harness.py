"""studies/lib/harness.py: the run spec, the worker pool (two real workers on a tiny model, and a
rerun that skips what is complete) and the moving average."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, ClassVar

import pytest

from studies.lib import harness

ARMS = {
    "grpo": {"loss_mode": "sat", "sat_enabled": False, "loss_agg_mode": "token-mean"},
    "sat_grpo": {"loss_mode": "sat", "loss_agg_mode": "token-mean"},
}
TINY = {"steps": 2, "prompts_per_step": 2, "rollout_n": 2, "max_response_length": 4}


class Spec(harness.Spec):
    arms: ClassVar[dict[str, dict[str, Any]]] = ARMS


def spec(arm: str = "sat_grpo", lag: int = 4, seed: int = 3, tag: str = "", **settings: Any) -> Spec:
    return Spec(arm, lag, seed, tuple(sorted({**TINY, **settings}.items())), tag)


def test_a_spec_names_its_run_and_builds_its_config():
    assert spec().name == "sat_grpo-lag4-seed3" and spec(tag="quick").name == "quick-sat_grpo-lag4-seed3"
    cfg = spec(lr=1e-2, eval_at=[0, 1], seed=7).config()
    assert (cfg.loss_mode, cfg.sat_enabled, cfg.lag, cfg.seed, cfg.lr) == ("sat", True, 4, 7, 1e-2)
    assert cfg.eval_at == (0, 1)  # a spec read back from JSON holds a list
    assert not spec("grpo").config().sat_enabled
    assert spec(loss_mode="vanilla").config().loss_mode == "sat"  # the arm's fields override the settings
    assert "arms" not in asdict(spec()) and Spec(**asdict(spec())) == spec()  # the table is not a field


def test_an_unknown_arm_is_named():
    with pytest.raises(ValueError, match="unknown arm 'ppo'; known: \\['grpo', 'sat_grpo'\\]"):
        spec("ppo").config()
    with pytest.raises(ValueError, match="unknown arm"):
        harness.Spec("grpo", 1, 1, ()).config()  # the base spec has no arms of its own


def test_smooth_is_a_trailing_moving_average():
    assert harness.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert harness.smooth([2.0, 4.0], 10) == [2.0, 3.0]  # the first points average what exists
    assert harness.smooth([], 3) == []


def test_a_run_is_complete_once_it_holds_every_step(tmp_path):
    assert not harness.complete(tmp_path, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n')
    assert not harness.complete(tmp_path, 2) and harness.complete(tmp_path, 1)


def test_a_worker_needs_its_start_up(tmp_path):
    with pytest.raises(RuntimeError, match="worker_init"):
        harness.run_in_worker(spec().config(), str(tmp_path / "r"), "sat_grpo")


def test_two_workers_run_the_specs_and_a_rerun_skips_them(tmp_path: Path):
    """Two worker processes, one start-up each, a run apiece; the rerun finds both complete."""
    from verl_sat.default import model as tiny

    tiny.create(tmp_path / "assets" / "model", seed=0)
    specs = [spec("grpo", lag=2, seed=1), spec("sat_grpo", lag=2, seed=1)]
    timings = harness.run_all(specs, tmp_path / "s", tmp_path / "assets", jobs=2)
    assert [t["name"] for t in timings] == [s.name for s in specs]
    assert all(t["startup_s"] < t["run_s"] for t in timings)
    for s in specs:
        run_dir = tmp_path / "s" / "runs" / s.name
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        assert [r["step"] for r in rows] == [1, 2] and "critic/score/mean" in rows[0]["data"]
        assert json.loads((run_dir / "run.json").read_text())["method"] == s.arm
    assert harness.run_all(specs, tmp_path / "s", tmp_path / "assets", jobs=2) == []
