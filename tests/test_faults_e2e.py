"""Faults in asynchronous training, end to end: verl's real v1 trainer on CPU (docs/faults.md).

Each job is ``python -m verl_sat.main`` started by the test in its own session (its own process
group), killed only by the process ids the test started or found registered under the run's
``processes/``. About 7 min on 2 idle cores: the two-fault rollback run ~2.5 min, the kill/resume chain ~4 min
(three starts). Two deaths share other files' launches to save CI time: the dead trainer worker
is in tests/test_routing_replay_e2e.py (its R3 run on two ranks), the dead vLLM engine in
tests/test_vllm_e2e.py (its R3 launch).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_main_e2e import check_sat_rows, step_gate_rate

from verl_sat.files import read_jsonl
from verl_sat.trainer.accounting import summarize
from verl_sat.trainer.faults import read_tracker
from verl_sat.trainer.supervisor import EXIT_PROCESS_DIED

pytestmark = pytest.mark.e2e

TIMEOUT_S = 900


def command(assets: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "verl_sat.main", f"sat.assets_dir={assets}", f"sat.run_dir={run_dir}", *overrides]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("VERL_FILE_LOGGER", "VERL_SAT_RUN_DIR"))}


def start(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """Start a job in a new session: its pid is its process group's id."""
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env(), cwd=cwd, start_new_session=True
    )


def wait_for(predicate, proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the job ended (rc {proc.returncode}) before the awaited state"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


@contextlib.contextmanager
def running(cmd: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    """``start`` the job; on the way out, kill its process group if it is still running (only the
    job this test started), so a failed assertion never leaves a job behind."""
    job = start(cmd, cwd, log)
    try:
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def kill_and_wait(job: subprocess.Popen, pid: int, timeout: float = 120) -> int:
    """SIGKILL one process the job registered; the job's exit status. A hang guard, not a
    measurement: a job still running ``timeout`` seconds later fails the test, saying so."""
    os.kill(pid, signal.SIGKILL)
    try:
        return job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job did not exit within {timeout:g} s of the death of pid {pid}")


def one_error_line(console: str, name: str, pid: int) -> str:
    """The one ``[verl-sat] error:`` line naming the dead process ``name`` and its pid."""
    errors = [line for line in console.splitlines() if f"[verl-sat] error: {name}" in line]
    assert len(errors) == 1 and f"(pid {pid}) died during global step" in errors[0], console[-4000:]
    return errors[0]


def logged_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(run_dir / "metrics.jsonl")]


def trained_ids(run_dir: Path) -> list:
    return [p["id"] for r in read_jsonl(run_dir / "samples.jsonl") if r.get("event") == "trained" for p in r["prompts"]]


SPIKE, FAULT, TOTAL = 9, 24, 36


def test_rollback_undoes_a_transient_fault_and_a_persistent_one_ends_the_run(cached_default_assets, tmp_path):
    """The default job, sentinel action rollback, max_rollbacks 1, two faults in one launch:

    1. an lr spike (x100) at step 9 wrecks the weights: the sentinel alarms, rolls back to a
       checkpoint saved before it, halves the lag, and the reward comes back;
    2. from weight version 24 the rollout engine turns its samples to noise (``fault_step``), which
       no checkpoint can undo: the sentinel alarms again, finds its one rollback spent, and stops;
       the job exits 3 with a line saying why. A collapsed run never exits 0.
    Quiet otherwise: no alarm before the spike or between the recovery and the rollout fault."""
    run_dir = tmp_path / "run"
    cmd = command(
        cached_default_assets,
        run_dir,
        f"trainer.total_training_steps={TOTAL}",
        "trainer.save_freq=2",
        "sat.sentinel.action=rollback",
        "sat.sentinel.max_rollbacks=1",
        f"sat.faults.lr_spike_steps=[{SPIKE}]",
        f"actor_rollout_ref.rollout.engine_kwargs.hf.fault_step={FAULT}",
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=tmp_path)
    console = out.stdout + out.stderr
    assert out.returncode == 3, console[-6000:]
    rows = {int(r["step"]): r["data"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    last = max(rows)
    assert sorted(rows) == list(range(1, last + 1)) and last < TOTAL
    record = json.loads((run_dir / "run.json").read_text())
    # 1. the transient fault, undone
    (rollback,) = record["sentinel"]["rollbacks"]
    assert rollback["target"] < SPIKE and SPIKE < rollback["step"] < FAULT  # a checkpoint from before the spike
    assert rollback["setting_changed"]["sat.lag"] == [2, 1] and "collapse signature" in rollback["reason"]
    assert f"restored the checkpoint of step {rollback['target']}; changed: sat.lag 2 -> 1" in console
    reward = {s: r["critic/score/mean"] for s, r in rows.items()}
    pre = sum(reward[s] for s in range(3, SPIKE)) / (SPIKE - 3)
    assert min(reward[s] for s in range(SPIKE + 1, rollback["step"] + 1)) < pre / 2  # it did collapse
    assert sum(reward[s] for s in range(FAULT - 4, FAULT)) / 4 >= pre - 0.05  # and came back
    # after the rollback every sample is at most 1 optimizer step stale (the halved lag)
    assert all(rows[s]["training/sat/staleness_steps/max"] <= 1 for s in range(rollback["step"] + 3, last + 1))
    # 2. the persistent fault: the next alarm stops the run, its rollback spent
    assert all("sentinel/low_run" in r for r in rows.values())  # scored every step
    alarms = [s for s, r in rows.items() if r.get("sentinel/alarm") == 1.0]
    assert alarms and all(SPIKE <= s <= rollback["step"] or s >= FAULT for s in alarms), alarms  # quiet otherwise
    alarm = alarms[-1]
    assert FAULT <= alarm <= FAULT + 6 and last == alarm  # caught within a few steps, and stopped there
    assert rows[alarm]["sentinel/stop"] == 1.0
    assert rows[alarm]["critic/score/mean"] < rows[alarm]["sentinel/reward_band_low"]
    mismatch = sorted(rows[s]["actor/mismatch_abs_mean"] for s in range(1, SPIKE))
    assert max(rows[s]["actor/mismatch_abs_mean"] for s in range(FAULT, last + 1)) > 10 * mismatch[len(mismatch) // 2]
    assert f"[verl-sat] sentinel: collapse signature at step {alarm}" in console
    assert "1 rollback(s) already done and the collapse signature is back; stopping" in console
    assert f"[verl-sat] error: the run ended collapsed: the sentinel stopped training after step {alarm}" in console
    assert record["sentinel"]["verdict"]["collapsed"] is True
    samples = record["samples"]
    assert samples["steps"] == last and samples["repeated"] == []
    # what the stop left untrained is still in TransferQueue, counted, not lost or unknown
    assert samples["in_flight_at_end"] > 0 and samples["lost_in_flight"] == []


def test_killed_job_resumes_and_a_dead_rollout_server_stops_the_job(cached_default_assets, tmp_path):
    """SIGKILL of the job's process group after the checkpoint of step 2; the same command
    resumes; in that attempt the HF rollout server is killed (by its registered pid) after the
    checkpoint of step 4: the job exits 4 with one line and the fault in run.json; the tracker is
    then torn (emptied, as a kill during verl's rewrite leaves it), and the same command repairs it
    to the newest complete checkpoint and runs to the end. One timeline of steps 1-6, and no
    prompt trained twice or skipped.

    The job is the default (separate_async, lag 2) with one response per micro-batch: docs/sat.md#the-rule
    step 2 at the paper's shape in miniature, checked on every step of the timeline. A
    per-micro-batch q would be each response's own score and gate nothing; the step's q gates
    about 1 - alpha of the step's tokens, at the step's weights (score drift 0). The last
    attempt's console is the README's readable one. (One launch chain for both: CI time.)"""
    run_dir = tmp_path / "run"
    cmd = command(
        cached_default_assets,
        run_dir,
        "trainer.total_training_steps=6",
        "trainer.save_freq=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    )
    # attempt 1: killed like a pre-empted node once step 2's checkpoint is complete and step 3 logged
    with running(cmd, tmp_path, tmp_path / "a1.log") as first:
        wait_for(lambda: read_tracker(run_dir / "checkpoints") == 2 and 3 in logged_steps(run_dir), first)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    # attempt 2: resumes from 2; its rollout server dies once step 4's checkpoint is written
    with running(cmd, tmp_path, tmp_path / "a2.log") as second:
        wait_for(lambda: read_tracker(run_dir / "checkpoints") == 4 and 5 in logged_steps(run_dir), second)
        (server,) = [json.loads(p.read_text()) for p in (run_dir / "processes").glob("rollout_replica_*.json")]
        rc = kill_and_wait(second, server["pid"])  # bounded: a job that hangs fails the wait
    console2 = (tmp_path / "a2.log").read_text()
    assert rc == EXIT_PROCESS_DIED, console2[-4000:]
    error = one_error_line(console2, "rollout replica", server["pid"])
    assert "prompt(s) in flight" in error and "resumes from the checkpoint of step 4" in error
    assert "resuming from the checkpoint of step 2" in console2
    # the fault is on record, as docs/faults.md promises
    fault = json.loads((run_dir / "run.json").read_text())["fault"]
    assert (fault["kind"], fault["pid"]) == ("rollout replica", server["pid"])
    assert fault["step"] > 4 and f"died during global step {fault['step']}:" in error  # the line's step
    assert fault["in_flight_prompts"] > 0
    # a kill while verl rewrites its tracker leaves it empty: the resume repairs it first
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("")
    # attempt 3: resumes from 4 and completes
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=tmp_path)
    assert third.returncode == 0, (third.stdout + third.stderr)[-6000:]
    assert "is empty or torn; resuming from the newest complete checkpoint, global_step_4" in third.stdout
    assert "resuming from the checkpoint of step 4" in third.stdout
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # no step missing, none twice
    superseded = [int(r["step"]) for r in read_jsonl(run_dir / "metrics.superseded.jsonl")]
    assert 3 in superseded and 5 in superseded  # the redone steps' rows are kept aside
    summary = summarize(run_dir)
    ids = trained_ids(run_dir)
    assert summary["steps"] == 6 and summary["repeated"] == [] and len(ids) == len(set(ids))
    assert summary["skipped"] == [] and summary["lost_in_flight"] == []
    order = next(r["ids"] for r in read_jsonl(run_dir / "samples.jsonl") if r.get("event") == "epoch_order")
    # what an uninterrupted run of the same seed trains: a prefix of the sampler's order, less
    # what is still in flight at the end
    assert set(ids) <= set(order[: summary["prompts_submitted"]])
    run = json.loads((run_dir / "run.json").read_text())
    assert run["samples"]["prompts_trained"] == len(ids)
    # the default job's SAT, at one response per micro-batch, on every step of the timeline
    rows = [r["data"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    check_sat_rows(rows, lag=2)  # SAT's metrics, staleness <= 2, ratio against mu (bypass)
    for row in rows:
        assert row["actor/sat_seqs_per_micro_batch"] == 1.0
        assert 0.04 <= step_gate_rate(row) <= 0.1 + 1e-9, row  # the step's q, not each response's own
        assert row["actor/sat_score_drift"] == 0.0 and row["actor/sat_score_pass_seconds"] > 0
        assert row["training/off_policy/evicted_samples"] == 0  # dropless (EVICTION_COUNTERS)
    assert max(r["training/sat/staleness_steps/max"] for r in rows) == 2  # the lag is realised, not just bounded
    assert run["lag"] == 2 and run["method"] == "sat_gspo"
    assert run["config"]["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 2
    assert run["config"]["trainer"]["v1"]["sampler"]["max_off_policy_strategy"] == "wait"
    # a readable console: Ray's and the workers' output (TaskRunner's config dump) is in console.log
    stdout = third.stdout
    assert "[verl-sat] step    6 |" in stdout and "[verl-sat] 6 steps in" in stdout
    assert len(stdout.splitlines()) <= 30, stdout
    assert "FSDPActorConfig" in (run_dir / "console.log").read_text() and "FSDPActorConfig" not in stdout
