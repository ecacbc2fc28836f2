"""The supervisor (verl_sat.trainer.supervisor) turns a dead registered process into exit 4,
also when the driver hears of it first, as Ray's ActorDiedError from the call in flight. A dead
actor is found through Ray's GCS whichever node it ran on, with and without Ray's dashboard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_sat import processes
from verl_sat.processes import RUN_DIR_ENV
from verl_sat.trainer.supervisor import EXIT_PROCESS_DIED, Supervisor


def registered_child(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> subprocess.Popen:
    """A child process registered as trainer worker rank0 in ``run_dir`` (as the SAT worker does)."""
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    monkeypatch.setattr(os, "getpid", lambda: child.pid)
    processes.register("trainer worker", "rank0")
    monkeypatch.undo()
    return child


def test_an_error_from_a_dead_worker_exits_4_before_the_next_check(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {}}) + "\n")
    child = registered_child(tmp_path, monkeypatch)
    child.kill()
    child.wait()
    with pytest.raises(SystemExit) as stopped:
        with Supervisor(tmp_path, total_steps=8, interval=3600):  # its thread never gets to check
            raise RuntimeError("ActorDiedError: the actor died unexpectedly")
    assert stopped.value.code == EXIT_PROCESS_DIED
    assert isinstance(stopped.value.__cause__, RuntimeError)  # the driver's error stays attached
    fault = json.loads((tmp_path / "run.json").read_text())["fault"]
    assert fault["pid"] == child.pid and fault["kind"] == "trainer worker" and fault["step"] == 2


def test_an_error_with_every_process_alive_is_the_error_itself(tmp_path, monkeypatch):
    child = registered_child(tmp_path, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            with Supervisor(tmp_path, total_steps=8, interval=3600):
                raise RuntimeError("a bug")
    finally:
        child.kill()
        child.wait()
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("dashboard", [False, True], ids=["no-dashboard", "dashboard"])
def test_a_dead_actor_is_found_through_ray_whatever_node_it_ran_on(tmp_path, monkeypatch, dashboard):
    """One ``ray.init`` (1 CPU): an actor registers itself, its entry is moved to another host
    (where this host's pid table says nothing), and ``ray.kill`` still ends the job: the
    supervisor asks Ray's GCS, which answers with or without the dashboard's API server."""
    import ray

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "data": {}}) + "\n")
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))  # inherited by the cluster's workers
    ray.init(num_cpus=1, include_dashboard=dashboard, logging_level="ERROR", log_to_driver=False)
    try:
        watcher = Supervisor(tmp_path, total_steps=8)

        @ray.remote
        class Worker:
            def register(self) -> int:
                from verl_sat.processes import register

                register("trainer worker", "rank1")
                return os.getpid()

        worker = Worker.remote()
        pid = ray.get(worker.register.remote())
        path = tmp_path / "processes" / "trainer_worker_rank1.json"
        entry = json.loads(path.read_text())
        assert entry["actor_id"] == worker._actor_id.hex() and entry["pid"] == pid
        path.write_text(json.dumps({**entry, "host": "another-node"}))
        assert watcher.check() is None
        ray.kill(worker)
        deadline = time.monotonic() + 60
        while (failure := watcher.check()) is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        ray.shutdown()
    assert failure is not None and (failure["kind"], failure["name"], failure["step"]) == ("trainer worker", "rank1", 4)
    assert watcher.check() is None  # without Ray's answer, a pid on another host is not judged


STUCK_DRIVER = """
import os, subprocess, sys, time
from pathlib import Path
from verl_sat import processes
from verl_sat.trainer import supervisor

run_dir = Path(sys.argv[1])
os.environ[processes.RUN_DIR_ENV] = str(run_dir)
supervisor.Supervisor.grace_s = 1.0
dead = subprocess.Popen([sys.executable, "-c", "pass"])
dead.wait()
processes.register("rollout replica", "hf0", pid=dead.pid)
with supervisor.Supervisor(run_dir, total_steps=10, interval=0.1):
    time.sleep(600)  # a driver stuck where the interrupt cannot reach it (a blocking C call)
print("the driver outlived the supervisor")
"""


def test_a_driver_the_interrupt_cannot_reach_is_ended_after_the_grace_period(tmp_path):
    """Guards the supervisor's forced exit (``os._exit(4)`` after ``GRACE_S``): a driver blocked
    in a call that ``interrupt_main`` cannot break still ends with exit 4, its one error line and
    the fault in run.json. Without the forced exit the child sleeps for 10 minutes and the bounded
    wait below fails."""
    run = subprocess.run(
        [sys.executable, "-c", STUCK_DRIVER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == EXIT_PROCESS_DIED, run.stdout + run.stderr
    errors = [line for line in run.stdout.splitlines() if line.startswith("[verl-sat] error: rollout replica hf0")]
    assert len(errors) == 1 and "the driver outlived" not in run.stdout
    fault = json.loads((tmp_path / "run.json").read_text())["fault"]
    assert (fault["kind"], fault["name"]) == ("rollout replica", "hf0")


IGNORED_SIGINT_DRIVER = """
import os, signal, subprocess, sys, time
from pathlib import Path
from verl_sat import processes
from verl_sat.trainer import supervisor

assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as a job started with & inherits it
run_dir = Path(sys.argv[1])
os.environ[processes.RUN_DIR_ENV] = str(run_dir)
supervisor.Supervisor.grace_s = 300.0
dead = subprocess.Popen([sys.executable, "-c", "pass"])
dead.wait()
processes.register("rollout replica", "hf0", pid=dead.pid)
try:
    with supervisor.Supervisor(run_dir, total_steps=10, interval=0.1):
        try:
            for _ in range(300):  # the interrupt lands between two short sleeps, as in a driver's poll
                time.sleep(0.1)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise
finally:
    print("the driver shut down", signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
"""


def test_a_driver_that_inherited_sigint_ignored_is_still_interrupted(tmp_path):
    """A job started with ``&`` by a non-interactive shell (an sbatch script) inherits SIGINT
    ignored, and ``interrupt_main`` then does nothing: the supervisor makes SIGINT raise while it
    runs, so the driver takes the graceful path (its ``finally`` runs, exit 4) instead of the forced
    exit, and the ignored disposition is restored after. Without it the child sleeps out its 30 s
    uninterrupted."""
    run = subprocess.run(
        [sys.executable, "-c", IGNORED_SIGINT_DRIVER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    assert run.returncode == EXIT_PROCESS_DIED, run.stdout + run.stderr
    assert "interrupted" in run.stdout and "the driver shut down True" in run.stdout, run.stdout + run.stderr
