"""The job's own processes register themselves for the driver's supervisor (``verl_sat.trainer.supervisor``).

Every HF rollout server and every verl-sat actor worker writes one file in ``<run_dir>/processes/``
when it starts (``register``): its kind, name, pid and host, and, for a Ray actor, its actor id,
through which the driver asks Ray whether it is still alive on whatever node it runs. verl's own
rollout servers (vLLM, SGLang) and the processes under them are found by the supervisor itself,
in Ray's actor table and with psutil. Lower than ``trainer/`` and ``rollout/``, which both register.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

RUN_DIR_ENV = "VERL_SAT_RUN_DIR"
PROCESSES_DIR = "processes"


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
