"""Faults in asynchronous training, end to end: verl's real v1 trainer on CPU (docs/faults.md).

Each job is ``python -m verl_sat.main`` started by the test in its own session (its own process
group), killed only by the process ids the test started or found registered under the run's
``processes/``. About 8 min on 2 idle cores: the rollback run ~2 min, the kill/resume chain ~4 min
(three starts), the dead trainer worker ~2 min. The dead vLLM engine is in tests/test_vllm_e2e.py
(it shares that file's R3 launch).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_sat.accounting import read_jsonl, summarize
from verl_sat.faults import read_tracker
from verl_sat.rollout.supervisor import EXIT_PROCESS_DIED

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


def logged_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in read_jsonl(run_dir / "metrics.jsonl")]


def trained_ids(run_dir: Path) -> list:
    return [p["id"] for r in read_jsonl(run_dir / "samples.jsonl") if r.get("event") == "trained" for p in r["prompts"]]


def test_rollback_undoes_a_transient_training_fault(cached_default_assets, tmp_path):
    """An lr spike (x100) at step 9 wrecks the weights; the sentinel alarms, rolls back to a
    checkpoint saved before it, halves the lag, and the run completes with its reward back."""
    run_dir = tmp_path / "run"
    cmd = command(
        cached_default_assets,
        run_dir,
        "trainer.total_training_steps=22",
        "trainer.save_freq=2",
        "sat.sentinel.action=rollback",
        "sat.faults.lr_spike_steps=[9]",
    )
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=tmp_path)
    console = out.stdout + out.stderr
    assert out.returncode == 0, console[-6000:]
    rows = {int(r["step"]): r["data"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(rows) == list(range(1, 23))
    record = json.loads((run_dir / "run.json").read_text())
    rollback = record["sentinel"]["rollbacks"][0]
    assert rollback["target"] <= 8 and rollback["step"] > 9  # a checkpoint from before the spike
    assert rollback["setting_changed"]["sat.lag"] == [2, 1] and "collapse signature" in rollback["reason"]
    assert f"restored the checkpoint of step {rollback['target']}; changed: sat.lag 2 -> 1" in console
    assert record["sentinel"]["verdict"]["collapsed"] is False
    reward = {s: r["critic/score/mean"] for s, r in rows.items()}
    pre = sum(reward[s] for s in range(3, 9)) / 6
    assert min(reward[s] for s in range(10, rollback["step"] + 1)) < pre / 2  # it did collapse
    assert sum(reward[s] for s in range(19, 23)) / 4 >= pre - 0.05  # and came back
    # after the rollback every sample is at most 1 optimizer step stale (the halved lag)
    assert all(rows[s]["training/sat/staleness_steps/max"] <= 1 for s in range(rollback["step"] + 3, 23))
    samples = record["samples"]
    assert samples["steps"] == 22 and samples["repeated"] == [] and samples["lost_in_flight"] == []


def test_killed_job_resumes_and_a_dead_rollout_server_stops_the_job(cached_default_assets, tmp_path):
    """SIGKILL of the job's process group after the checkpoint of step 2; the same command
    resumes; in that attempt the HF rollout server is killed (by its registered pid) after the
    checkpoint of step 4: the job exits 4 within 60 s with one line; the same command then runs
    to the end. One timeline of steps 1-6, and no prompt trained twice or skipped."""
    run_dir = tmp_path / "run"
    cmd = command(cached_default_assets, run_dir, "trainer.total_training_steps=6", "trainer.save_freq=2")
    # attempt 1: killed like a pre-empted node once step 2's checkpoint is complete and step 3 logged
    first = start(cmd, tmp_path, tmp_path / "a1.log")
    wait_for(lambda: read_tracker(run_dir / "checkpoints") == 2 and 3 in logged_steps(run_dir), first)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=60)
    # attempt 2: resumes from 2; its rollout server dies once step 4's checkpoint is written
    second = start(cmd, tmp_path, tmp_path / "a2.log")
    wait_for(lambda: read_tracker(run_dir / "checkpoints") == 4 and 5 in logged_steps(run_dir), second)
    (server,) = [json.loads(p.read_text()) for p in (run_dir / "processes").glob("rollout_replica_*.json")]
    os.kill(server["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    rc = second.wait(timeout=120)
    assert time.monotonic() - killed_at < 60
    console2 = (tmp_path / "a2.log").read_text()
    assert rc == EXIT_PROCESS_DIED, console2[-4000:]
    errors = [line for line in console2.splitlines() if "[verl-sat] error: rollout replica" in line]
    assert len(errors) == 1 and f"(pid {server['pid']}) died during global step" in errors[0], console2[-4000:]
    assert "prompt(s) in flight" in errors[0] and "resumes from the checkpoint of step 4" in errors[0]
    assert "resuming from the checkpoint of step 2" in console2
    # attempt 3: resumes from 4 and completes
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env(), cwd=tmp_path)
    assert third.returncode == 0, (third.stdout + third.stderr)[-6000:]
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
    assert json.loads((run_dir / "run.json").read_text())["samples"]["prompts_trained"] == len(ids)


def test_a_dead_trainer_worker_stops_the_job_within_a_minute(cached_default_assets, tmp_path):
    """The trainer worker (verl's actor, registered by the SAT worker's init_model) is killed by its
    registered pid after step 1: the job never hangs and never exits 0; it exits 4 within 60 s with
    one line naming the worker and the step, and what it lost is in run.json."""
    run_dir = tmp_path / "run"
    record = run_dir / "processes" / "trainer_worker_rank0.json"
    job = start(command(cached_default_assets, run_dir, "trainer.total_training_steps=8"), tmp_path, tmp_path / "a.log")
    wait_for(lambda: 1 in logged_steps(run_dir) and record.is_file(), job)
    worker = json.loads(record.read_text())
    assert worker["pid"] not in (job.pid, os.getpid())
    os.kill(worker["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        rc = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # only the job this test started
    assert time.monotonic() - killed_at < 60
    console = (tmp_path / "a.log").read_text()
    assert rc == EXIT_PROCESS_DIED, console[-4000:]
    errors = [line for line in console.splitlines() if "[verl-sat] error: trainer worker rank0" in line]
    assert len(errors) == 1 and f"(pid {worker['pid']}) died during global step" in errors[0], console[-4000:]
    fault = json.loads((run_dir / "run.json").read_text())["fault"]
    assert fault["kind"] == "trainer worker" and fault["pid"] == worker["pid"]
    assert logged_steps(run_dir)[-1] < 8  # stopped, not finished
