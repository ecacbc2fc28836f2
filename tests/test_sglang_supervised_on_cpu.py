"""A dead SGLang scheduler ends the job with exit 4 and one line (verl_sat.trainer.supervisor).

A fresh interpreter without ``VERL_PLATFORM`` plays verl's SGLang server actor: it runs verl
0.9.1's own ``SGLangHttpServer.launch_server`` (as the server of node 1 of a two-node replica,
whose launch returns once SGLang's processes are up, before the HTTP server), with SGLang's modules
as import scaffolding (tests/sglang_stub.py) and an ``Engine._launch_subprocesses`` that starts a
scheduler the way SGLang 0.5.12 does: a ``multiprocessing`` child of the server actor under the
``spawn`` start method (entrypoints/engine.py ``_launch_scheduler_processes``). The plugin's
wrapper must register both; killing the scheduler must stop the driver's ``Supervisor`` with
``EXIT_PROCESS_DIED``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import verl_sat
from verl_sat.processes import PROCESSES_DIR, RUN_DIR_ENV
from verl_sat.trainer.supervisor import EXIT_PROCESS_DIED, Supervisor

pytestmark = pytest.mark.gpu_branch

TESTS = Path(__file__).resolve().parent
CLEARED = ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS", "VERL_USE_EXTERNAL_MODULES")

SERVER = r"""
import asyncio, dataclasses, json, multiprocessing, os, sys, time
from types import SimpleNamespace
assert "VERL_PLATFORM" not in os.environ
import sglang_stub
sglang_stub.install()
http_server = sys.modules["sglang.srt.entrypoints.http_server"]

@dataclasses.dataclass
class ServerArgs:  # ServerArgs(**args) keeps verl's arguments
    kwargs: dict = dataclasses.field(default_factory=dict)
    def __init__(self, **kwargs):
        self.kwargs = kwargs

class Engine:
    @classmethod
    def _launch_subprocesses(cls, server_args, **funcs):
        # SGLang 0.5.12: the scheduler is an mp.Process child of this process (spawn start method).
        scheduler = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
        scheduler.start()
        return None, None, None, None, None

http_server.ServerArgs, http_server.Engine = ServerArgs, Engine
import verl.workers.rollout.sglang_rollout.async_sglang_server as server_module
from verl.workers.config import RolloutConfig
from verl.workers.rollout.replica import RolloutMode

cls = server_module.SGLangHttpServer
assert getattr(cls.launch_server, "__verl_sat_supervised__", False), "the plugin did not wrap launch_server"
server = object.__new__(cls)
server.config = RolloutConfig(name="sglang", enable_rollout_routing_replay=True)
server.model_config = SimpleNamespace(local_path="/model", trust_remote_code=False, lora_rank=0, lora={},
                                      target_modules=None, hf_config=None)
server.rollout_mode = RolloutMode.STANDALONE
server.replica_rank, server.node_rank, server.nnodes, server.base_gpu_id = 0, 1, 2, 0
server._disaggregation_role = "null"
asyncio.run(server.launch_server(master_address="127.0.0.1", master_port=29500))
print(json.dumps({"server": os.getpid(), "children": [p.pid for p in multiprocessing.active_children()]}), flush=True)
time.sleep(600)
"""


def start_server(run_dir: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    source = str(Path(verl_sat.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([source, str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    env[RUN_DIR_ENV] = str(run_dir)
    return subprocess.Popen(
        [sys.executable, "-c", SERVER], env=env, cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def registered(run_dir: Path) -> dict[str, dict]:
    folder = run_dir / PROCESSES_DIR
    entries = [json.loads(p.read_text()) for p in folder.glob("*.json")] if folder.is_dir() else []
    return {e["name"]: e for e in entries}


def test_a_dead_sglang_scheduler_stops_the_job_with_exit_4(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {}}) + "\n")
    server = None
    try:
        with pytest.raises(SystemExit) as stopped:
            with Supervisor(tmp_path, total_steps=8, interval=0.2):
                server = start_server(tmp_path)
                line = server.stdout.readline()
                assert line, server.stderr.read()[-3000:]
                pids = json.loads(line)
                entries = registered(tmp_path)
                assert entries["sglang0.node1"]["pid"] == pids["server"]
                schedulers = [e for name, e in entries.items() if name.startswith("sglang0.node1.")]
                assert [e["pid"] for e in schedulers] == pids["children"] and len(schedulers) == 1
                os.kill(schedulers[0]["pid"], 9)
                for _ in range(600):  # the supervisor interrupts this wait (between two short sleeps)
                    time.sleep(0.1)
        assert stopped.value.code == EXIT_PROCESS_DIED
    finally:
        if server is not None:
            for pid in pids.get("children", []) if "pids" in locals() else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            server.kill()
            server.wait()
    fault = json.loads((tmp_path / "run.json").read_text())["fault"]
    assert fault["name"] == schedulers[0]["name"] and fault["kind"] == "rollout replica" and fault["step"] == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[verl-sat] error:")]
    assert len(lines) == 1 and f"rollout replica {fault['name']}" in lines[0] and "exit 4" in lines[0]
