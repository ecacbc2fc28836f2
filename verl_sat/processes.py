"""The job's processes register themselves for the driver's supervisor (``verl_sat.trainer.supervisor``).

Every HF rollout server, every process of verl's vLLM server (``register_vllm_process``, a vLLM
plugin), every process of verl's SGLang server (``register_sglang_processes``: the server actor
and the scheduler and detokenizer processes it starts) and every verl-sat actor worker writes one
file in ``<run_dir>/processes/`` when it starts (``register``): its kind, name, pid and host, and,
for a Ray actor, its actor id, through which the driver asks Ray whether it is still alive on
whatever node it runs. Lower than ``trainer/`` and ``rollout/``, which both register.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "VERL_SAT_RUN_DIR"
PROCESSES_DIR = "processes"
SGLANG_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"


def current_actor_id() -> str | None:
    """The Ray actor id of this process (None outside a Ray actor)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_actor_id()


def register(kind: str, name: str, pid: int | None = None) -> None:
    """Record process ``pid`` (this one by default; ``kind``: "rollout replica" or "trainer
    worker") for the supervisor; this process's Ray actor id goes with it."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    folder = Path(run_dir) / PROCESSES_DIR
    actor_id = current_actor_id() if pid is None else None
    pid = os.getpid() if pid is None else int(pid)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        entry = {"kind": kind, "name": name, "pid": pid, "host": socket.gethostname(), "since": time.time()}
        entry["actor_id"] = actor_id
        (folder / f"{kind.replace(' ', '_')}_{name}.json").write_text(json.dumps(entry))
    except OSError:
        return


def vllm_role() -> str | None:
    """Which process of verl's vLLM server this is: the server actor, its engine core, or None.

    verl's ``vLLMHttpServer`` (a Ray actor) sets ``VERL_REPLICA_RANK``; vLLM starts the engine core
    as a ``multiprocessing`` child named ``EngineCore...``. A short-lived helper that also loads
    vLLM's plugins (its model-inspection subprocess, run with ``subprocess``) is neither, and is not
    watched: it exits by design.
    """
    import multiprocessing

    if os.environ.get("VERL_REPLICA_RANK") is None:
        return None
    name = multiprocessing.current_process().name
    if name.startswith("EngineCore"):
        return name
    ray = sys.modules.get("ray")
    if multiprocessing.parent_process() is None and ray is not None and ray.is_initialized():
        return "server"
    return None


def register_vllm_process() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``, loaded by vLLM in each of its
    processes, on every platform): register the server actor and engine core of replica ``r`` as
    rollout replica ``vllm<r>`` / ``vllm<r>.EngineCore``."""
    role = vllm_role()
    if role is None:
        return
    rank = os.environ["VERL_REPLICA_RANK"]
    register("rollout replica", f"vllm{rank}" if role == "server" else f"vllm{rank}.{role}")


def register_sglang_processes(server: Any) -> None:
    """After verl's ``SGLangHttpServer.launch_server``: register the server actor of replica ``r``
    (node ``k``) as rollout replica ``sglang<r>`` (``sglang<r>.node<k>``) and every process it has
    started (SGLang 0.5.12's ``Engine._launch_subprocesses``: the scheduler(s) and the detokenizer,
    ``multiprocessing`` children of the actor) as ``sglang<r>.<process name>``."""
    import multiprocessing

    name = f"sglang{server.replica_rank}" + (f".node{server.node_rank}" if int(server.node_rank) else "")
    register("rollout replica", name)
    for child in multiprocessing.active_children():
        register("rollout replica", f"{name}.{child.name}", pid=child.pid)


def supervise_sglang_servers(server_module: Any) -> None:
    """Wrap ``SGLangHttpServer.launch_server`` so that each server registers its processes."""
    from verl_sat.hooks import wrap_once

    def make(original: Any) -> Any:
        async def launch_server(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = await original(self, *args, **kwargs)
            register_sglang_processes(self)
            return result

        return launch_server

    wrap_once(server_module.SGLangHttpServer, "launch_server", "__verl_sat_supervised__", make)


def watch_sglang_servers() -> None:
    """Every platform (the plugin): supervise verl's SGLang servers once verl imports their module."""
    from verl_sat.hooks import when_imported

    when_imported(SGLANG_SERVER_MODULE, supervise_sglang_servers)
