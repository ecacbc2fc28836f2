"""R3 end to end on CPU: the HF rollout's routes replayed by the FSDP trainer lower dbar_pi.

Both runs perturb the rollout's *routing* (``engine_kwargs.hf.router_noise_std``: top-k chosen
from noisy router logits, weights from the clean ones), so the trainer, routing on its own,
computes other experts than the rollout did. With ``sat.routing_replay=R3`` the trainer reuses
the rollout's experts and ``actor/mismatch_abs_mean`` (dbar_pi, measured against the rollout's
log-probs) falls. Sync mode, lag 1: no staleness, so the mismatch is the rollout/trainer one.
"""

from __future__ import annotations

import pytest
from test_main_e2e import assets, run_main  # noqa: F401  (the session fixture and the launcher)

pytestmark = pytest.mark.e2e

NOISE = "actor_rollout_ref.rollout.engine_kwargs.hf.router_noise_std=1.0"  # declared in sat_gspo_cpu.yaml
SYNC = ("trainer.v1.trainer_mode=sync", "sat.lag=1")


def mean_mismatch(rows: list[dict]) -> float:
    return sum(r["actor/mismatch_abs_mean"] for r in rows) / len(rows)


def test_r3_lowers_the_rollout_trainer_mismatch(assets, tmp_path):  # noqa: F811
    plain, _ = run_main(assets, tmp_path / "plain", NOISE, *SYNC)
    r3, stdout = run_main(assets, tmp_path / "r3", NOISE, *SYNC, "sat.routing_replay=R3")
    assert [r["step"] for r in r3] == [1, 2]
    plain_mismatch, r3_mismatch = mean_mismatch(plain), mean_mismatch(r3)
    print(f"dbar_pi without replay {plain_mismatch:.4f}, with R3 {r3_mismatch:.4f}")
    assert r3_mismatch < 0.5 * plain_mismatch
    assert all(r["actor/sat_old_vs_rollout_logprob_gap"] == 0.0 for r in r3)  # ratio still against mu
    assert "[verl-sat] routing replay R3: replaying recorded routes" in stdout


def test_r2_records_in_compute_log_prob_and_replays_in_the_update(assets, tmp_path):  # noqa: F811
    """R2 (decoupled mode): the trainer's own routes of compute_log_prob, replayed in update_actor.

    The engine raises if an update micro-batch arrives without routes or a MoE layer is not
    replayed, so a finished run with both log lines is the end-to-end evidence. R2 does not touch
    the rollout's routing, so dbar_pi against mu stays at the routing-noise level.
    """
    rows, stdout = run_main(
        assets, tmp_path / "r2", NOISE, *SYNC, "sat.routing_replay=R2", "algorithm.rollout_correction.bypass_mode=false"
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert "[verl-sat] routing replay R2: recording routes (forward only)" in stdout
    assert "[verl-sat] routing replay R2: replaying recorded routes" in stdout
    assert all(r["actor/sat_old_vs_rollout_logprob_gap"] > 0.0 for r in rows)  # the ratio is against the recomputation
