"""R3 end to end on CPU: the HF rollout's routes replayed by the FSDP trainer lower dbar_pi.

Both tests perturb the rollout's *routing* (``engine_kwargs.hf.router_noise_std``: top-k chosen
from noisy router logits, weights from the clean ones), so the trainer, routing on its own,
computes other experts than the rollout did. With ``sat.routing_replay=R3`` the trainer reuses
the rollout's experts and ``actor/mismatch_abs_mean`` (dbar_pi, measured against the rollout's
log-probs) falls. Lag 1 (R3 in sync, R2 in colocate_async, the one e2e run of that mode): no
staleness beyond one step, so the mismatch is the rollout/trainer one.
"""

from __future__ import annotations

import pytest
from test_main_e2e import assets, check_sat_run, run_main  # noqa: F401  (the session fixture and the launcher)

pytestmark = pytest.mark.e2e

NOISE = "actor_rollout_ref.rollout.engine_kwargs.hf.router_noise_std=1.0"  # declared in sat_gspo_cpu.yaml
SYNC = ("trainer.v1.trainer_mode=sync", "sat.lag=1")
R3_CEILING = 0.05  # dbar_pi with R3 under this noise; without replaying the rollout's routes: > 0.1 (R2 test)


def mean_mismatch(rows: list[dict]) -> float:
    return sum(r["actor/mismatch_abs_mean"] for r in rows) / len(rows)


def test_r3_lowers_the_rollout_trainer_mismatch(assets, tmp_path):  # noqa: F811
    """One R3 run under router noise: the trainer's own top-k differs from the rollout's on many
    tokens (actor/routing_replay/topk_agreement, measured before replay), yet dbar_pi is near 0.
    The same noise without replaying the rollout's routes (the R2 test below) leaves it > 0.1."""
    r3, stdout = run_main(assets, tmp_path / "r3", NOISE, *SYNC, "sat.routing_replay=R3")
    assert [r["step"] for r in r3] == [1, 2]
    print(f"dbar_pi with R3 {mean_mismatch(r3):.4f}")
    assert mean_mismatch(r3) < R3_CEILING
    for row in r3:
        assert row["actor/routing_replay/topk_agreement"] < 0.9  # the noise flipped routes
        assert row["actor/routing_replay/replayed_frac"] > 0.9  # all but each sequence's last token
        assert row["actor/sat_old_vs_rollout_logprob_gap"] == 0.0  # ratio still against mu
    assert "[verl-sat] routing replay R3: replaying recorded routes" in stdout


def test_r2_records_in_compute_log_prob_and_replays_in_the_update(assets, tmp_path):  # noqa: F811
    """R2 (decoupled mode) in colocate_async: the trainer's own routes of compute_log_prob, replayed
    in update_actor; the run also stands for colocate_async's SAT metrics and staleness bound.

    The engine raises if an update micro-batch arrives without routes or a MoE layer is not
    replayed, so a finished run with both log lines is the end-to-end evidence. R2 does not touch
    the rollout's routing, so dbar_pi against mu stays at the routing-noise level.
    """
    colocate_async = ("trainer.v1.trainer_mode=colocate_async", "sat.lag=1")
    rows, stdout = run_main(
        assets,
        tmp_path / "r2",
        NOISE,
        *colocate_async,
        "sat.routing_replay=R2",
        "algorithm.rollout_correction.bypass_mode=false",
    )
    check_sat_run(rows, lag=1, bypass=False)
    assert "[verl-sat] routing replay R2: recording routes (forward only)" in stdout
    assert "[verl-sat] routing replay R2: replaying recorded routes" in stdout
    assert all(r["actor/sat_old_vs_rollout_logprob_gap"] > 0.0 for r in rows)  # the ratio is against the recomputation
    # R2 replays the trainer's own routes, not the rollout's: dbar_pi keeps the routing noise
    assert mean_mismatch(rows) > 0.1 > R3_CEILING
    assert all(r["actor/routing_replay/replayed_frac"] > 0.99 for r in rows)  # every token was recorded
