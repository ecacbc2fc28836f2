"""verl_sat.trainer.console: the console keeps verl-sat's lines, the progress bar and every error line;
the rest of Ray's forwarded worker output goes to console.log only."""

from __future__ import annotations

import io
import sys
import threading

import pytest

from verl_sat.trainer.console import ConsoleSplitter, LineFilter, quiet_console

CYAN, RESET = "\x1b[36m", "\x1b[0m"


def ray_line(source: str, message: str) -> str:
    """A worker line as Ray's driver prints it (coloured prefix)."""
    return f"{CYAN}({source}){RESET} {message}"


CHATTER = [
    ray_line(
        "SimpleStorageUnit pid=12756",
        "2026-12-01 09:34:21,044 - WARNING - transfer_queue.utils.common - target_num_threads 8 should not "
        "exceed total physical CPU cores 2. Setting to 2.\x1b[32m [repeated 137x across cluster]\x1b[0m",
    ),
    ray_line(
        "TaskRunnerV1 pid=1", "{'actor_rollout_ref': {'actor': {'_target_': 'verl.workers.config.FSDPActorConfig',"
    ),
    ray_line("TaskRunnerV1 pid=1", "                                  'use_remove_padding': False,"),
    ray_line(
        "WorkerDict pid=2",
        "/venv/verl/workers/engine/__init__.py:69: UserWarning: megatron engine is not available: "
        "ModuleNotFoundError(\"No module named 'megatron'\")",
    ),
    ray_line("WorkerDict pid=2", '  warnings.warn(f"megatron engine is not available: {e!r}", stacklevel=1)'),
    ray_line("pid=3", "INFO:2026-12-01 09:33:25,369:Platform override from VERL_PLATFORM: cpu"),
    "ray init kwargs: {'num_cpus': 8}",
    "[validate_config] All configuration checks passed successfully!",
]

WORKER_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/venv/verl/workers/fsdp_workers.py", line 10, in update_actor',
    "    loss = self.loss_fn(batch)",
    "           ^^^^^^^^^^^^^^^^^^^",
    "KeyError: 'old_log_probs'",
    "",
    "The above exception was the direct cause of the following exception:",
    "",
    "Traceback (most recent call last):",
    '  File "/venv/ray/_private/worker.py", line 5, in main_loop',
    "RuntimeError: update_actor failed",
]


def shown(lines: list[str | tuple[str, str]]) -> list[str]:
    """What the console shows of ``lines`` (a line, or ``(line, stream)``; stderr by default)."""
    f = LineFilter()
    items = [(x, "stderr") if isinstance(x, str) else x for x in lines]
    return [text for line, stream in items if (text := f.console_text(line, stream)) is not None]


def test_chatter_stays_off_the_console():
    assert shown(CHATTER) == []
    assert shown([(line, "stdout") for line in CHATTER]) == []


def test_a_worker_traceback_reaches_the_console_in_full_amid_other_output():
    """Interleaved with other workers' chatter and with the same worker's stdout."""
    source = "RewardLoopWorker pid=9"
    own_stdout = (ray_line(source, "dataset len: 64"), "stdout")
    lines: list = []
    for i, message in enumerate(WORKER_TRACEBACK):
        lines += [ray_line(source, message), CHATTER[i % len(CHATTER)], own_stdout]
    kept = shown(lines + [ray_line(source, "Total steps: 4, num_warmup_steps: 0")])
    assert kept == [ray_line(source, m) for m in WORKER_TRACEBACK if m], kept  # blank lines dropped


def test_a_remote_traceback_inside_a_ray_task_error_is_kept_whole():
    """Ray's RayTaskError line, then the remote worker's frames, then its exception line."""
    source = "AgentLoopWorkerTQ pid=7"
    block = [
        "Traceback (most recent call last):",
        '  File "/venv/verl/experimental/agent_loop/agent_loop.py", line 1026, in _compute_score',
        "    result = await selected_reward_loop_worker_handle.compute_score.remote(data)",
        "ray.exceptions.RayTaskError(ValueError): ray::RewardLoopWorker.compute_score() (pid=23483, ip=192.0.2.2)",
        '  File "/venv/verl/trainer/ppo/reward.py", line 38, in _call_with_kwargs',
        "    return raw_fn(*args, **merged_kwargs)",
        '  File "/tmp/badreward/reward.py", line 2, in compute_score',
        "    raise ValueError('deliberate')",
        "MyFault",  # an exception line in no usual form still ends the frames
    ]
    after = [ray_line(source, "Using dataset class: RLHFDataset"), ray_line(source, "Total steps: 4")]
    assert shown([ray_line(source, m) for m in block] + after) == [ray_line(source, m) for m in block]


@pytest.mark.parametrize(
    "message",
    [
        "2026-12-01 09:34:21,044 - ERROR - transfer_queue.storage - put failed",
        "ERROR:2026-12-01 09:34:21,044:reward loop worker died",
        "ray.exceptions.RayTaskError(ValueError): ray::TaskRunner.run() (pid=1, ip=127.0.0.1)",
        "[rank0]:E1201 09:34:31.611000 12928 torch/distributed/c10d.cpp:56] process group failed",
        "*** SIGSEGV received at time=1733046871 on cpu 1 ***",
        "Fatal Python error: Aborted",
    ],
)
def test_error_lines_are_kept(message):
    assert shown([ray_line("WorkerDict pid=2", message)]) == [ray_line("WorkerDict pid=2", message)]
    assert shown([message]) == [message]  # from the driver too


def test_a_flood_of_one_error_is_capped_and_a_new_error_still_shows():
    """A failing reward retried for every sample: thousands of identical tracebacks."""
    source = "AgentLoopWorkerTQ pid=7"
    one = [ray_line(source, m) for m in WORKER_TRACEBACK if m]
    error = "ERROR:2026-12-01 09:47:44,814:Error in _run_prompt for uid="  # verl logs each failing prompt's uuid
    errors = [ray_line(source, f"{error}{i:08x}-{'abcdef'[i % 6] * 4}-41ee-b9b8-bf1c09047c99") for i in range(50)]
    lines = [line for error in errors for line in [*one, error]]
    new = [ray_line(source, m) for m in ("Traceback (most recent call last):", "  File x", "OSError: disk full")]
    kept = shown(lines + new)
    full = [line for error in errors[:3] for line in [*one, error]]
    assert kept[: len(full)] == full  # the first three in full
    assert len(kept) == len(full) + 2 and kept[-1] == new[-1]  # a notice, then only the new exception line
    assert "more tracebacks from (AgentLoopWorkerTQ pid=7)" in kept[len(full)]


def test_a_repeated_error_line_shows_three_times_then_a_notice():
    errors = [f"2026-12-01 09:47:{i:02d},814 - ERROR - transfer_queue - put failed for key {i}" for i in range(20)]
    kept = shown(errors + ["2026-12-01 09:48:00,000 - ERROR - transfer_queue - controller gone"])
    assert kept[:3] == errors[:3] and "this error repeats" in kept[3]
    assert kept[4:] == ["2026-12-01 09:48:00,000 - ERROR - transfer_queue - controller gone"]


def test_raylet_lines_are_kept():
    line = ray_line("raylet", "[2026-12-01 09:40:00] A worker was killed due to memory pressure")
    assert shown([line]) == [line]


def test_verl_sat_lines_lose_rays_prefix_and_the_bar_what_tqdm_ran_into():
    lines = [
        "[verl-sat] step    1 | reward 0.109",
        ray_line("TaskRunnerV1 pid=1", "[verl-sat] sentinel: collapse signature at step 9"),
        ray_line(
            "TaskRunnerV1 pid=1",
            "Training Progress:  50%|█████     | 1/2 [00:12<00:12, 12.03s/it]2026-12-01 09:34:33,024 - WARNING - "
            "transfer_queue.utils.common - target_num_threads 8 should not exceed",
        ),
        ray_line("TaskRunnerV1 pid=1", "step:3 - critic/score/mean:0.5 - actor/pg_loss:0.1"),
    ]
    assert shown(lines) == [
        "[verl-sat] step    1 | reward 0.109",
        "[verl-sat] sentinel: collapse signature at step 9",
        "Training Progress:  50%|█████     | 1/2 [00:12<00:12, 12.03s/it]",
        "step:3 - critic/score/mean:0.5 - actor/pg_loss:0.1",
    ]


def test_splitter_logs_every_line_and_joins_partial_writes():
    console, log = io.StringIO(), io.StringIO()
    splitter = ConsoleSplitter(console, log, LineFilter(), threading.Lock())
    print(CHATTER[0], file=splitter)  # print(): the text, then "\n", in two writes
    splitter.write("[verl-sat] st")
    splitter.write("ep 1\nno newline yet")
    assert console.getvalue() == "[verl-sat] step 1\n"
    splitter.close_pending()
    assert log.getvalue().splitlines() == [
        "(SimpleStorageUnit pid=12756) "
        + CHATTER[0].split(f"{RESET} ", 1)[1].replace("\x1b[32m", "").replace(RESET, ""),
        "[verl-sat] step 1",
        "no newline yet",
    ]


def test_quiet_console_restores_the_streams_before_an_error_propagates(tmp_path):
    saved = sys.stdout, sys.stderr
    with pytest.raises(ValueError, match="boom"), quiet_console(tmp_path / "console.log") as path:
        assert sys.stdout is not saved[0] and sys.stderr is not saved[1]
        print(CHATTER[1])
        raise ValueError("boom")
    assert (sys.stdout, sys.stderr) == saved
    assert "FSDPActorConfig" in path.read_text()


def test_the_root_loggers_console_handler_is_filtered_too(tmp_path):
    """Hydra's handler writes verl's driver-side logging to the real stdout."""
    import logging

    console = io.StringIO()
    handler = logging.StreamHandler(console)
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))  # Hydra's, less the time
    root = logging.getLogger()
    root.addHandler(handler)
    saved = sys.stdout
    sys.stdout = console
    try:
        with quiet_console(tmp_path / "console.log"):
            root.warning("Platform override from VERL_PLATFORM: cpu")
            root.error("reward worker died")
        root.warning("after")
    finally:
        sys.stdout = saved
        root.removeHandler(handler)
    assert console.getvalue().splitlines() == ["[root][ERROR] - reward worker died", "[root][WARNING] - after"]
    assert "Platform override" in (tmp_path / "console.log").read_text()


def test_verbose_leaves_the_streams_alone(tmp_path):
    saved = sys.stdout, sys.stderr
    with quiet_console(tmp_path / "console.log", verbose=True) as path:
        assert (sys.stdout, sys.stderr) == saved and path is None
    assert not (tmp_path / "console.log").exists()
