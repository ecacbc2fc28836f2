"""verl_sat.trainer.console: of the workers' output Ray forwards, the terminal gets verl-sat's lines,
the progress bar and every error; console.log gets every line. One test runs a real Ray cluster."""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path

import pytest

from verl_sat.trainer.console import WorkerOutput, quiet_console

CHATTER = [
    "2026-12-01 09:34:21,044 - WARNING - transfer_queue.utils.common - target_num_threads 8 should not exceed",
    "{'actor_rollout_ref': {'actor': {'_target_': 'verl.workers.config.FSDPActorConfig',",
    "                                  'use_remove_padding': False,",
    "/venv/verl/workers/engine/__init__.py:69: UserWarning: megatron engine is not available",
    '  warnings.warn(f"megatron engine is not available: {e!r}", stacklevel=1)',
    "INFO:2026-12-01 09:33:25,369:Platform override from VERL_PLATFORM: cpu",
]

WORKER_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/venv/verl/workers/fsdp_workers.py", line 10, in update_actor',
    "    loss = self.loss_fn(batch)",
    "KeyError: 'old_log_probs'",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "/venv/ray/_private/worker.py", line 5, in main_loop',
    "RuntimeError: update_actor failed",
]


def record(lines: list[str], pid: int | str = 2, name: str = "WorkerDict", is_err: bool = True) -> dict:
    """A record as Ray's driver receives it (``ray._private.worker.print_logs``)."""
    return {"ip": "10.0.0.1", "pid": pid, "job": "01000000", "is_err": is_err, "actor_name": name, "lines": lines}


def shown(records: list[dict], verbose: bool = False) -> tuple[list[str], list[str]]:
    """(terminal lines, console.log lines) after ``records``."""
    log, terminal = io.StringIO(), io.StringIO()
    handler = WorkerOutput(log, terminal, verbose)
    for data in records:
        handler(data)
    return terminal.getvalue().splitlines(), log.getvalue().splitlines()


def test_chatter_stays_off_the_terminal_and_every_line_is_logged():
    terminal, log = shown([record(CHATTER), record(CHATTER, pid=3, name="TaskRunnerV1", is_err=False)])
    assert terminal == []
    assert log == [f"(WorkerDict pid=2) {line}" for line in CHATTER] + [f"(TaskRunnerV1 pid=3) {x}" for x in CHATTER]


def test_a_worker_traceback_reaches_the_terminal_whole_amid_other_workers_output():
    """Interleaved with another worker's chatter and with the same worker's stdout."""
    records = []
    for i, line in enumerate(WORKER_TRACEBACK):
        records += [
            record([line], pid=9),
            record([CHATTER[i % len(CHATTER)]], pid=8),
            record(["len: 64"], 9, "W", False),
        ]
    terminal, _ = shown([*records, record(["Total steps: 4"], pid=9)])
    assert terminal == [f"(WorkerDict pid=9) {line}" for line in WORKER_TRACEBACK if line]  # blank lines dropped


def test_a_remote_traceback_inside_a_ray_task_error_is_kept_whole():
    """Ray's RayTaskError line, then the remote worker's frames, then its exception line."""
    block = [
        "Traceback (most recent call last):",
        '  File "/venv/verl/experimental/agent_loop/agent_loop.py", line 1026, in _compute_score',
        "ray.exceptions.RayTaskError(ValueError): ray::RewardLoopWorker.compute_score() (pid=23483, ip=192.0.2.2)",
        '  File "/tmp/badreward/reward.py", line 2, in compute_score',
        "    raise ValueError('deliberate')",
        "MyFault",  # an exception line in no usual form still ends the frames
    ]
    terminal, _ = shown([record([*block, "Using dataset class: RLHFDataset", "Total steps: 4"])])
    assert terminal == [f"(WorkerDict pid=2) {line}" for line in block]


@pytest.mark.parametrize(
    "message",
    [
        "2026-12-01 09:34:21,044 - ERROR - transfer_queue.storage - put failed",
        "[rank0]:E1201 09:34:31.611000 12928 torch/distributed/c10d.cpp:56] FATAL process group failed",
        "Fatal Python error: Aborted",
        "torch.OutOfMemoryError: CPU out of memory",
    ],
)
def test_error_lines_are_kept(message):
    assert shown([record([message])])[0] == [f"(WorkerDict pid=2) {message}"]


def test_a_flood_of_one_error_is_capped_and_a_new_error_still_shows():
    """A failing reward retried for every sample: thousands of identical tracebacks."""
    one = [line for line in WORKER_TRACEBACK if line]
    new = ["Traceback (most recent call last):", "  File x", "OSError: disk full"]
    terminal, log = shown([record(one) for _ in range(50)] + [record(new)])
    full = [f"(WorkerDict pid=2) {line}" for line in one] * 3
    assert terminal == full + ["(WorkerDict pid=2) OSError: disk full"]  # then only a new exception line
    assert len(log) == 50 * len(one) + len(new)


def test_raylet_lines_are_kept_and_verl_sat_lines_the_bar_and_step_lines_lose_rays_prefix():
    oom = "[2026-12-01 09:40:00] A worker was killed due to memory pressure"
    bar = "Training Progress:  50%|#####     | 1/2 [00:12<00:12, 12.03s/it]"
    records = [
        record([oom], pid="raylet", name=""),
        record(["[verl-sat] sentinel: collapse signature at step 9"], pid=1, name="TaskRunnerV1", is_err=False),
        record([f"Training Progress:   0%|          | 0/2\r{bar}"], pid=1, name="TaskRunnerV1"),
        record(["step:3 - critic/score/mean:0.5 - actor/pg_loss:0.1"], pid=1, name="TaskRunnerV1", is_err=False),
    ]
    terminal, _ = shown(records)
    assert terminal == [
        f"(pid=raylet) {oom}",
        "[verl-sat] sentinel: collapse signature at step 9",
        bar,
        "step:3 - critic/score/mean:0.5 - actor/pg_loss:0.1",
    ]


def test_verbose_leaves_the_terminal_to_rays_printer_and_still_logs():
    terminal, log = shown([record(CHATTER)], verbose=True)
    assert terminal == [] and len(log) == len(CHATTER)


def test_the_driver_streams_and_the_root_loggers_handler_go_to_the_log_and_come_back(tmp_path, monkeypatch):
    """verl's driver-side ``logging`` reaches Hydra's handler on the real stream: into console.log
    while the job runs (with the driver's prints), back to the terminal after."""
    import logging

    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    handler = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with quiet_console(tmp_path / "console.log") as out:
            print("ray init kwargs: {}")
            root.warning("Platform override from VERL_PLATFORM: cpu")
            print("[verl-sat] step 1", file=out)
        root.warning("after")
    finally:
        root.removeHandler(handler)
    assert terminal.getvalue().splitlines() == ["[verl-sat] step 1", "after"]
    log = (tmp_path / "console.log").read_text().splitlines()
    assert log[0] == "ray init kwargs: {}" and "Platform override from VERL_PLATFORM: cpu" in log


def wait_for(path: Path, text: str, seconds: float = 60.0) -> str:
    """Ray forwards a worker's output a moment after it is written."""
    deadline = time.monotonic() + seconds
    while text not in (content := path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return content


def test_a_real_ray_cluster_logs_workers_output_and_a_worker_error_carries_its_traceback(tmp_path, monkeypatch):
    """One ``ray.init`` (1 CPU, no dashboard): a task that prints and a task that raises.

    The terminal gets the worker's verl-sat line and nothing of its chatter or of the driver's
    own stdout; console.log gets all of it; the failing task's ``RayTaskError`` carries the
    worker's traceback (its frame and its exception line) to the driver."""
    import ray

    monkeypatch.setenv("RAY_DEDUP_LOGS", "0")
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    log = tmp_path / "console.log"
    try:
        with quiet_console(log) as out:
            assert out is terminal and sys.stdout is not terminal
            print("ray init kwargs: {'num_cpus': 1}")  # verl's run_ppo, on the driver
            ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")

            @ray.remote
            def talk() -> None:
                print("[verl-sat] hello from a worker", flush=True)
                print("worker chatter", flush=True)

            @ray.remote
            def fail() -> None:
                raise ValueError("deliberate failure in a worker")

            ray.get(talk.remote())
            with pytest.raises(ray.exceptions.RayTaskError) as caught:
                ray.get(fail.remote())
            content = wait_for(log, "worker chatter")
    finally:
        ray.shutdown()
    assert "in fail" in str(caught.value) and "ValueError: deliberate failure in a worker" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert "[verl-sat] hello from a worker" in content and "worker chatter" in content
    assert "ray init kwargs" in content
    assert terminal.getvalue().splitlines() == ["[verl-sat] hello from a worker"]
