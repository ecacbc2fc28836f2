"""The README's promise, end to end: ``verl-sat`` runs verl's real v1 trainer on CPU.

Each test launches ``python -m verl_sat.main`` in a subprocess (its own Ray cluster, shut down
by the job) for two verl steps and checks the run's own metrics.jsonl: SAT diagnostics,
per-sample staleness never above ``sat.lag``, and the loss's ratio taken against the rollout
log-probs (SPEC §4). A few minutes in all on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

TIMEOUT_S = 600


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The embedded tiny MoE and task, with a short warm-up (tests need no reward signal)."""
    from verl_sat.default.warmup import WarmupArgs, build

    out = tmp_path_factory.mktemp("assets")
    build(out, WarmupArgs(steps=20, eval_samples=8))
    return out


def run_main(
    assets: Path, run_dir: Path, *overrides: str, returncode: int = 0, steps: int = 2
) -> tuple[list[dict], str]:
    """Run the main job for ``steps`` verl steps; returns the metrics rows ({"step", **data}) and
    its console (stdout, then stderr)."""
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.main",
        f"sat.assets_dir={assets}",
        f"sat.run_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FILE_LOGGER")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=run_dir.parent)
    assert out.returncode == returncode, out.stdout[-3000:] + out.stderr[-5000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [{"step": r["step"], **r["data"]} for r in map(json.loads, lines)]
    return rows, out.stdout + out.stderr


def check_sat_run(rows: list[dict], lag: int, bypass: bool = True) -> None:
    """SAT's metrics, the staleness bound and the per-staleness rates of a 2-step run; ``bypass``:
    the ratio's denominator is mu (false: the decoupled option, against the recomputation)."""
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("actor/sat_q", "actor/sat_gate_rate", "actor/mismatch_abs_mean", "actor/sat_eps_high_mean"):
            assert key in row, key
        assert 0.0 <= row["actor/sat_gate_rate"] <= 0.1 + 1e-6  # alpha = 0.9
        # staleness is measured per sample and never exceeds the configured lag
        assert 0 <= row["training/sat/staleness_steps/max"] <= lag
        # the loss's denominator is the rollout's log-prob mu, bit for bit (SPEC §4), in bypass mode
        assert (row["actor/sat_old_vs_rollout_logprob_gap"] == 0.0) == bypass
        # per-staleness rates over the whole step: the token shares partition the step's tokens
        fracs = [v for k, v in row.items() if k.startswith("actor/sat_by_staleness/") and k.endswith("/token_frac")]
        assert fracs and sum(fracs) == pytest.approx(1.0)
        assert not any(k.endswith(("/tokens", "/gated", "/abs_d")) for k in row)  # sums turned into rates


def step_gate_rate(row: dict) -> float:
    """The step's token-weighted gate rate, from the exact per-staleness rates."""
    prefix = "actor/sat_by_staleness/"
    buckets = {k[len(prefix) :].split("/")[0] for k in row if k.startswith(prefix)}
    return sum(row[f"{prefix}{s}/token_frac"] * row[f"{prefix}{s}/gate_rate"] for s in buckets)


def test_default_job_separate_async_lag2(assets, tmp_path):
    """The main job, with one response per micro-batch: SPEC §2 step 2 at the paper's shape in
    miniature. A per-micro-batch q would be each response's own score and gate nothing; the
    step's q gates about 1 - alpha of the step's tokens, at the step's weights (score drift 0).
    (The default's own shape, one micro-batch per step, runs in the sentinel and R3 e2e tests.)"""
    rows, stdout = run_main(assets, tmp_path / "run", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1")
    check_sat_run(rows, lag=2)
    for row in rows:
        assert row["actor/sat_seqs_per_micro_batch"] == 1.0
        assert 0.04 <= step_gate_rate(row) <= 0.1 + 1e-9, row
        assert row["actor/sat_score_drift"] == 0.0  # the scoring pass ran at the step's weights
        assert row["actor/sat_score_pass_seconds"] > 0
    assert max(r["training/sat/staleness_steps/max"] for r in rows) == 2  # the lag is realised, not just bounded
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["lag"] == 2 and run["method"] == "sat_gspo"
    assert run["config"]["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 2
    # dropless sampling: nothing evicted, and metrics.jsonl says so (verl_sat.actor.EVICTION_COUNTERS)
    assert run["config"]["trainer"]["v1"]["sampler"]["max_off_policy_strategy"] == "wait"
    assert all(r["training/off_policy/evicted_samples"] == 0 for r in rows)
    assert "[verl-sat] step    2 |" in stdout and "[verl-sat] 2 steps in" in stdout
    # a readable console: Ray's and the workers' output (TaskRunner's config dump) is in console.log
    assert len(stdout.splitlines()) <= 30, stdout
    assert "FSDPActorConfig" in (tmp_path / "run" / "console.log").read_text() and "FSDPActorConfig" not in stdout


def test_auto_lag_broadcasts_when_the_mismatch_asks_and_keeps_its_bound(assets, tmp_path):
    """sat.lag=auto through verl's separate_async: one optimizer step per global step, verl's weight
    sync only where the rule says (dbar_pi above a tiny target, within [2, 4] steps of the last
    broadcast), the staleness it leaves up to max and above 1, logged per step and in run.json."""
    rule = ["sat.lag=auto", "sat.auto_lag.target=1e-6", "sat.auto_lag.min=2", "sat.auto_lag.max=4"]
    rows, stdout = run_main(assets, tmp_path / "run", *rule, steps=8)
    assert [r["step"] for r in rows] == list(range(1, 9))
    decided = [(int(r["training/sat/auto_lag/lag"]), r["training/sat/auto_lag/broadcast"]) for r in rows]
    gaps = [k for k, broadcast in decided if broadcast]
    assert gaps and all(2 <= k <= 4 for k in gaps), decided
    assert any(k < 4 for k in gaps), decided  # the signal, not only max, triggered a broadcast
    assert all(k < 4 for k, broadcast in decided if not broadcast)
    staleness = [r["training/sat/staleness_steps/max"] for r in rows]
    assert max(staleness) <= 4 and max(staleness) >= 2, staleness  # skipped syncs leave the rollout behind
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 1
    assert run["auto_lag"]["broadcasts"] == len(gaps) and run["auto_lag"]["lags"] == gaps
    assert f"sat.lag=auto (dbar_pi > 1e-06, lag in [2, 4]): {len(gaps)} broadcasts in 8 optimizer steps" in stdout
    assert "-> broadcast" in stdout


def test_sync_with_two_data_parallel_ranks(assets, tmp_path):
    """sync runs with two data-parallel trainer ranks and one response per micro-batch: the
    step's q is all-reduced across ranks (verl_sat.quantile) inside verl's FSDP engine.
    (colocate_async runs end to end in tests/test_routing_replay_e2e.py, with R2.)"""
    dp2 = ["trainer.n_gpus_per_node=2", "ray_kwargs.ray_init.num_gpus=2"]
    dp2 += ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    rows, _ = run_main(assets, tmp_path / "run", "trainer.v1.trainer_mode=sync", "sat.lag=1", *dp2)
    check_sat_run(rows, lag=1)
    assert all(r["training/sat/staleness_steps/max"] == 0 for r in rows)  # on-policy: fresh weights
    for row in rows:  # the step's exact gate rate over both ranks' tokens, at the step's weights
        assert 0.04 <= row["actor/sat_gate_rate"] <= 0.1 + 1e-9
        assert row["actor/sat_seqs_per_micro_batch"] == 1.0 and row["actor/sat_score_drift"] == 0.0


# SPEC §4's decoupled option (ratio against recomputed old log-probs, SAT score against mu) runs
# end to end on verl's vLLM rollout with a bf16 rollout: tests/test_vllm_e2e.py.


@pytest.fixture(scope="session")
def default_assets(cached_default_assets: Path) -> Path:
    """The default's assets as `verl-sat` builds them (the full warm-up: a reward signal to lose),
    the one build the whole suite shares (tests/conftest.py); jobs only read them."""
    return cached_default_assets


def test_sentinel_quiet_on_the_default_then_fires_on_an_induced_collapse(default_assets, tmp_path):
    """The default job (sentinel on) with a rollout fault from weight version 8: stop on the alarm."""
    fault, total = 8, 16
    rows, stdout = run_main(
        default_assets,
        tmp_path / "run",
        "sat.sentinel.action=stop",
        f"actor_rollout_ref.rollout.engine_kwargs.hf.fault_step={fault}",
        returncode=3,  # a run the sentinel stopped is a collapse, never a success (docs/faults.md)
        steps=total,
    )
    steps = [r["step"] for r in rows]
    alarms = [r["step"] for r in rows if r.get("sentinel/alarm") == 1.0]
    assert all("sentinel/low_run" in r for r in rows)  # scored every step
    assert alarms and all(s >= fault for s in alarms), (alarms, stdout[-2000:])  # quiet before the fault
    alarm = alarms[0]
    assert alarm <= fault + 6 and steps[-1] == alarm < total  # caught within a few steps, and stopped there
    by_step = {r["step"]: r for r in rows}
    assert by_step[alarm]["sentinel/stop"] == 1.0
    assert by_step[alarm]["critic/score/mean"] < by_step[alarm]["sentinel/reward_band_low"]
    pre = sorted(by_step[s]["actor/mismatch_abs_mean"] for s in steps if s < fault)
    assert max(by_step[s]["actor/mismatch_abs_mean"] for s in steps if s >= fault) > 10 * pre[len(pre) // 2]
    assert f"[verl-sat] sentinel: collapse signature at step {alarm}" in stdout
    assert f"[verl-sat] error: the run ended collapsed: the sentinel stopped training after step {alarm}" in stdout
