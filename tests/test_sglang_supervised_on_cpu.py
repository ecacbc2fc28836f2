"""A dead process under verl's SGLang server actor ends the job with exit 4 and one line
(verl_sat.trainer.supervisor), and so does the server actor itself.

Nothing registers them: the supervisor finds verl's server actor in Ray's actor table by its class
(``SGLangHttpServer``) and name (``sglang_server_<replica>_<node>``), and the engine processes
under it with psutil, by the titles the engines give them. One ``ray.init`` (1 CPU, no dashboard)
plays it: an actor of that class and name starts its children the way SGLang 0.5.12 does
(``Engine._launch_subprocesses``: a scheduler, a ``multiprocessing`` child under the ``spawn``
start method, titled ``sglang::scheduler_TP0`` with setproctitle), the scheduler a titled process
of its own (one level deeper, as vLLM's engine core starts its workers), and an untitled helper
that exits by design (as vLLM's model-inspection subprocess does), and a fork that keeps the actor's
title. The names the supervisor relies
on are read from verl 0.9.1's own server modules.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest

from verl_sat.trainer import supervisor
from verl_sat.trainer.supervisor import EXIT_PROCESS_DIED, Supervisor

pytestmark = pytest.mark.gpu_branch

VERL = Path(importlib.util.find_spec("verl").origin).parent

SERVER_MODULES = {  # verl 0.9.1's rollout servers: module, class, the f-string of its actor's name
    "verl.workers.rollout.vllm_rollout.vllm_async_server": (
        "vLLMHttpServer",
        'f"{prefix}server_{self.replica_rank}_{node_rank}{self.name_suffix}"',
    ),
    "verl.workers.rollout.sglang_rollout.async_sglang_server": (
        "SGLangHttpServer",
        'f"sglang_server_{self.replica_rank}_{node_rank}{self.name_suffix}"',
    ),
    "verl.workers.rollout.trtllm_rollout.trtllm_async_server": (
        "TRTLLMHttpServer",
        'f"trtllm_server_{self.replica_rank}{self.name_suffix}"',
    ),
}


def test_verls_server_actors_have_the_class_and_names_the_supervisor_looks_for() -> None:
    """Read from verl's source (importing it needs each engine): a server class or actor name
    that verl renames fails here, not silently in a job that no longer notices a dead engine."""
    for module, (cls, name) in SERVER_MODULES.items():
        source = (VERL / module.removeprefix("verl.").replace(".", "/")).with_suffix(".py").read_text()
        assert f"\nclass {cls}:" in source and cls.endswith(supervisor.SERVER_CLASS_SUFFIX), module
        assert name in source, module


@pytest.mark.parametrize(
    ("ray_name", "name"),
    [
        ("vllm_server_3_0", "vllm3"),
        ("sglang_server_0_1", "sglang0.node1"),
        ("trtllm_server_2", "trtllm2"),
        ("vllm_server_reward_0_0", "vllm_server_reward_0_0"),  # not a rollout replica's name: kept
    ],
)
def test_a_server_actor_is_named_as_its_replica(ray_name: str, name: str) -> None:
    actor = {"ActorID": "a1", "Name": ray_name, "Pid": 7, "here": False, "Address": {"IPAddress": "10.0.0.2"}}
    entry = supervisor.server_entry(actor)
    assert (entry["kind"], entry["name"], entry["pid"], entry["actor_id"], entry["host"]) == (
        "rollout replica",
        name,
        7,
        "a1",
        "10.0.0.2",
    )


# SGLang's scheduler process: titled as SGLang titles it, with a titled process of its own.
SCHEDULER = """
import subprocess, sys, time, setproctitle
setproctitle.setproctitle("sglang::scheduler_TP0")
title = "import setproctitle, time; setproctitle.setproctitle('sglang::detokenizer'); time.sleep(600)"
subprocess.run([sys.executable, "-c", title])
time.sleep(600)  # the scheduler outlives it
"""


def sglang_server_class() -> type:
    """Plays verl's server actor: its class name, and the processes SGLang starts in it (defined
    here, so that Ray ships it by value)."""

    class SGLangHttpServer:
        def launch_server(self, helper_s: float) -> dict[str, int]:
            import multiprocessing
            import subprocess
            import threading

            helper = threading.Thread(target=subprocess.run, args=(["sleep", str(helper_s)],), daemon=True)
            helper.start()  # exits by design, during start-up
            self.fork = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True)
            self.fork.start()  # keeps this actor's title, as a compiler's fork does until it runs its program
            self.scheduler = multiprocessing.get_context("spawn").Process(target=exec, args=(SCHEDULER,), daemon=True)
            self.scheduler.start()
            return {"server": os.getpid(), "scheduler": self.scheduler.pid, "fork": self.fork.pid}

    return SGLangHttpServer


def wait(predicate, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_a_dead_process_under_sglangs_server_stops_the_job_with_exit_4(tmp_path, capsys) -> None:
    """The untitled helper exits unwatched; both titled processes are watched, the scheduler's own
    two levels down; the scheduler is killed (a zombie: the actor does not reap it): exit 4, one line
    naming it, in run.json. Then, with a fresh supervisor, the server actor itself is killed: Ray's
    actor table says so."""
    import psutil
    import ray

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {}}) + "\n")
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    started: list[psutil.Process] = []  # killed on the way out
    try:
        server = ray.remote(num_cpus=0)(sglang_server_class()).options(name="sglang_server_0_1").remote()
        with pytest.raises(SystemExit) as stopped:
            with Supervisor(tmp_path, total_steps=8, interval=0.2) as watcher:
                pids = ray.get(server.launch_server.remote(helper_s=3))
                scheduler = psutil.Process(pids["scheduler"])
                started += [scheduler, psutil.Process(pids["fork"])]
                children = lambda: psutil.Process(pids["server"]).children()  # noqa: E731
                helpers = lambda: [c for c in children() if c.name() == "sleep" and c.status() != "zombie"]  # noqa: E731
                assert wait(helpers)  # the helper runs, for seconds
                assert wait(lambda: not helpers())  # and exits (gone, or a zombie the actor may not reap), unwatched
                grandchild = wait(lambda: [c for c in scheduler.children() if "::" in c.name()])[0]
                started.append(grandchild)
                names = lambda: sorted(e["name"] for e in watcher.engine_processes.values())  # noqa: E731
                expected = ["sglang0.node1.detokenizer", "sglang0.node1.scheduler_TP0"]  # not spawn's resource tracker
                assert wait(lambda: names() == expected), names()
                os.kill(scheduler.pid, signal.SIGKILL)
                for _ in range(600):  # the supervisor interrupts this wait (between two short sleeps)
                    time.sleep(0.1)
        assert stopped.value.code == EXIT_PROCESS_DIED
        fault = json.loads((tmp_path / "run.json").read_text())["fault"]
        assert (fault["kind"], fault["name"], fault["pid"], fault["step"]) == (
            "rollout replica",
            "sglang0.node1.scheduler_TP0",
            scheduler.pid,
            2,
        )
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[verl-sat] error:")]
        assert len(lines) == 1 and "rollout replica sglang0.node1.scheduler_TP0" in lines[0] and "exit 4" in lines[0]

        fresh = Supervisor(tmp_path, total_steps=8)
        assert fresh.check() is None
        ray.kill(server)
        failure = wait(fresh.check)
        assert failure is not None and (failure["name"], failure["pid"]) == ("sglang0.node1", pids["server"])
    finally:
        ray.shutdown()
        for process in started:
            with contextlib.suppress(psutil.Error):
                process.kill()
