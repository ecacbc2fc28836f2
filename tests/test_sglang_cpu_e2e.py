"""The main job and the paper's cell through verl's own SGLang rollout, on SGLang 0.5.12's real engine
on this CPU (``bash recipes/cpu/install_sglang_cpu.sh``; docs/cpu.md, "verl's SGLang rollout on a CPU").

``extended`` (tests/README.md): SGLang is installed beside the test extra, not by it, and each launch
takes 7-20 min on 2 shared cores (SGLang's start-up, its two processes, each importing verl-sat).
Without SGLang they skip, naming the script.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
import pytest
from test_faults_e2e import command, env, kill_and_wait, logged_steps, one_error_line, running, trained_ids, wait_for
from test_main_e2e import check_sat_rows

from verl_sat.cpu import sglang as cpu_sglang
from verl_sat.files import read_jsonl
from verl_sat.trainer.accounting import summarize
from verl_sat.trainer.supervisor import EXIT_PROCESS_DIED

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.extended,  # tests/README.md: left out of the default run (SGLang installed beside the test extra)
    pytest.mark.skipif(
        cpu_sglang.installed_version("sglang") != cpu_sglang.WRITTEN_FOR,
        reason=f"needs sglang=={cpu_sglang.WRITTEN_FOR}: bash recipes/cpu/install_sglang_cpu.sh",
    ),
]

SGLANG = "actor_rollout_ref.rollout.name=sglang"


def rows_of(run_dir: Path) -> list[dict]:
    return [{"step": r["step"], **r["data"]} for r in read_jsonl(run_dir / "metrics.jsonl")]


def title(process: psutil.Process) -> str:
    """A process's title as SGLang and Ray set it ("" once it is gone)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def check_r3_rows(rows: list[dict], lag: int) -> None:
    """SGLang's routes replayed on every step: a route for every row the loss depends on (SGLang, like
    vLLM, returns ``prompt + response - 1`` rows: the last token never passes through the model and
    reaches no loss term), SAT active, and fresh samples at fp32 agreement (so the synced weights are
    the ones SGLang samples with)."""
    check_sat_rows(rows, lag)
    for row in rows:
        assert row["actor/routing_replay/replayed_frac"] == 1.0, row["actor/routing_replay/replayed_frac"]
        assert 0.9 < row["actor/routing_replay/topk_agreement"] <= 1.0
        assert 0.0 < row["actor/sat_gate_rate"] <= 0.1 + 1e-6
        fresh = row.get("actor/sat_by_staleness/0/mismatch_abs_mean")
        assert fresh is None or fresh < 1e-3, fresh


def test_the_main_job_trains_on_sglang_with_r3_then_its_scheduler_dies(assets: Path, tmp_path: Path) -> None:
    """The CPU default (FSDP, separate_async at lag 2, fp32) with R3 on verl's SGLang rollout: SGLang's
    base64 routes reach the replay engine through verl's agent loop on every step, weights reach SGLang
    through verl's ``update_weights`` after each sync. After 4 steps SGLang's scheduler (a process under
    verl's ``SGLangHttpServer`` actor, found by the supervisor with psutil) is killed, its server actor
    left up: the job exits 4 with one line naming it and the step, and samples.jsonl loses nothing."""
    run_dir = tmp_path / "run"
    cmd = command(assets, run_dir, SGLANG, "sat.routing_replay=R3", "trainer.total_training_steps=12")
    with running(cmd, tmp_path, tmp_path / "job.log") as job:
        wait_for(lambda: len(logged_steps(run_dir)) >= 4, job)
        (scheduler,) = [p for p in psutil.Process(job.pid).children(recursive=True) if "sglang::scheduler" in title(p)]
        assert any("SGLangHttpServer" in title(p) for p in scheduler.parents())
        pid = scheduler.pid
        rc = kill_and_wait(job, pid)
    console = (tmp_path / "job.log").read_text()
    rows = rows_of(run_dir)
    check_r3_rows(rows[:4], lag=2)
    assert max(r["training/sat/staleness_steps/max"] for r in rows[:4]) == 2  # the lag is realised
    assert rc == EXIT_PROCESS_DIED, console[-4000:]
    one_error_line(console, "rollout replica sglang0.", pid)
    fault = json.loads((run_dir / "run.json").read_text())["fault"]
    assert fault["kind"] == "rollout replica" and fault["pid"] == pid
    assert fault["name"] == "sglang0.scheduler" and fault["in_flight_prompts"] > 0  # the line names what was lost
    # samples.jsonl keeps every completed step's prompts, each once (2 x 8 prompts a step at lag 2);
    # what was in flight died with the job's queue, so it is counted in the line, not listed
    summary = summarize(run_dir)
    assert summary["skipped"] == [] and summary["repeated"] == [] and summary["lost_in_flight"] is None
    trained = trained_ids(run_dir)
    assert len(trained) == len(set(trained)) == summary["prompts_trained"] >= 4 * 16


@pytest.mark.parametrize(
    ("overrides", "lag", "stalest", "strategy"),
    [
        # one broadcast cycle of 8 optimizer steps: its last batch was sampled 7 steps before
        (("sat.lag=8", "trainer.total_training_steps=1"), 8, 7, "fsdp2"),
        (("sat.strategy=megatron", "trainer.total_training_steps=4"), 2, 2, "megatron"),
    ],
    ids=["fsdp-lag8", "megatron-lag2"],
)
def test_the_main_job_on_sglang_exits_0_at_lag_8_and_on_megatron(
    assets: Path, tmp_path: Path, overrides: tuple[str, ...], lag: int, stalest: int, strategy: str
) -> None:
    """The same job to its end at the other lag and on the other engine: exit 0, SGLang's routes replayed
    on every step (verl's Megatron router replay for ``sat.strategy=megatron``), SAT active."""
    run_dir = tmp_path / "run"
    cmd = command(assets, run_dir, SGLANG, "sat.routing_replay=R3", *overrides)
    out = subprocess.run(cmd, env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    rows = rows_of(run_dir)
    check_r3_rows(rows, lag)
    assert max(r["training/sat/staleness_steps/max"] for r in rows) == stalest  # the lag is realised
    config = json.loads((run_dir / "run.json").read_text())["config"]
    assert config["actor_rollout_ref"]["actor"]["strategy"] == strategy
    assert config["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == lag


def test_the_papers_cell_runs_on_cpu(tmp_path: Path) -> None:
    """``recipes/cpu/paper_cell_cpu.sh sat_gspo_r3 8``: the cell as recipes/sat_paper/run.sh composes it
    (Megatron, SGLang, R3, separate_async, SAT-GSPO, lag 8) with hydra_configs/overlay/cpu.yaml: one
    broadcast cycle of 8 optimizer steps, R3 replayed by verl's Megatron router replay, SAT active."""
    runs = tmp_path / "runs"
    out = subprocess.run(
        ["bash", str(REPO / "recipes/cpu/paper_cell_cpu.sh"), "sat_gspo_r3", "8"],
        env=env() | {"RUNS_ROOT": str(runs)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    run_dir = runs / "sat_gspo_r3-lag8"
    rows = rows_of(run_dir)
    check_r3_rows(rows, lag=8)
    assert [r["step"] for r in rows] == [1]
    config = json.loads((run_dir / "run.json").read_text())["config"]
    assert config["actor_rollout_ref"]["rollout"]["name"] == "sglang"
    assert config["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    assert config["trainer"]["v1"]["separate_async"]["parameter_sync_step"] == 8
