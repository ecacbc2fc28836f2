"""Supervising the job's processes: a rollout server or trainer worker that dies ends the job.

verl 0.9.1 does not notice a rollout server that dies: each request to it fails, the replay
buffer evicts the failed group and refills it with a fresh prompt, which fails again, and the
trainer waits for samples that never come. A trainer worker that dies mid-step surfaces as an
exception only once verl next calls it. So every HF rollout server, every process of verl's
vLLM server (``register_vllm_process``, a vLLM plugin), every process of verl's SGLang server
(``register_sglang_processes``: the server actor and the scheduler and detokenizer processes it
starts) and every verl-sat actor worker registers its process id in ``<run_dir>/processes/`` when
it starts (``register``), and the driver
(``verl_sat.main``) runs a ``Supervisor`` thread that checks them once a second.

When one is gone, the supervisor prints one error line naming the process, the global step in
progress and what was lost, records it in ``run.json`` (``fault``), and interrupts the driver,
which shuts Ray down and exits with ``EXIT_PROCESS_DIED``; if the driver has not exited 20 s
later, the process exits anyway. So the job never hangs on a dead replica and never exits 0.
Resume with the same command: verl restarts from the newest checkpoint (docs/faults.md).

Processes on another host (a multi-node cluster) are not checked; their pid means nothing here.
"""

from __future__ import annotations

import _thread
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

RUN_DIR_ENV = "VERL_SAT_RUN_DIR"
PROCESSES_DIR = "processes"
EXIT_PROCESS_DIED = 4
GRACE_S = 20.0


SGLANG_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"


def register(kind: str, name: str, pid: int | None = None) -> None:
    """Record process ``pid`` (this one by default; ``kind``: "rollout replica" or "trainer
    worker") for the supervisor."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    folder = Path(run_dir) / PROCESSES_DIR
    pid = os.getpid() if pid is None else int(pid)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        entry = {"kind": kind, "name": name, "pid": pid, "host": socket.gethostname(), "since": time.time()}
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


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def last_step(run_dir: Path) -> int:
    """The last global step in ``metrics.jsonl`` (0 if none)."""
    from verl_sat.files import read_jsonl

    rows = read_jsonl(run_dir / "metrics.jsonl")
    return max((int(r["step"]) for r in rows), default=0)


def in_flight(run_dir: Path) -> int:
    """Prompts handed to the rollout and not yet trained, from ``samples.jsonl``."""
    from verl_sat.files import read_jsonl

    handed, trained = set(), set()
    for row in read_jsonl(run_dir / "samples.jsonl"):
        if row.get("event") == "submitted":
            handed.update(uid for uid, _ in row["prompts"])
        elif row.get("event") == "trained":
            trained.update(p.get("uid") for p in row["prompts"])
    return len(handed - trained)


class Supervisor(threading.Thread):
    """Checks the registered processes of the job every ``interval`` seconds (module docstring)."""

    def __init__(self, run_dir: Path, total_steps: int | None = None, interval: float = 1.0) -> None:
        super().__init__(daemon=True, name="verl-sat-supervisor")
        self.run_dir, self.total_steps, self.interval = Path(run_dir), total_steps, interval
        self.stopped = threading.Event()
        self.failure: dict[str, Any] | None = None
        self.host = socket.gethostname()
        self.started_at = time.time()

    def processes(self) -> list[dict[str, Any]]:
        folder = self.run_dir / PROCESSES_DIR
        entries = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                entry = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if entry.get("host") == self.host and entry.get("since", 0) >= self.started_at - 1:
                entries.append(entry)
        return entries

    def finished(self) -> bool:
        """Training is over (the last step is logged, or the sentinel gave its verdict): verl may
        now stop its actors, which is no fault."""
        from verl_sat.trainer.faults import read_sentinel_record

        if self.total_steps is not None and last_step(self.run_dir) >= int(self.total_steps):
            return True
        return "final_step" in ((read_sentinel_record(self.run_dir) or {}).get("verdict") or {})

    def check(self) -> dict[str, Any] | None:
        """The first registered process of this job that is gone, with what was lost; else None."""
        if self.finished():
            return None
        for entry in self.processes():
            if not alive(int(entry["pid"])):
                step = last_step(self.run_dir) + 1
                return {**entry, "step": step, "in_flight_prompts": in_flight(self.run_dir)}
        return None

    def describe(self, failure: dict[str, Any]) -> str:
        from verl_sat.trainer.faults import read_tracker

        checkpoints = self.run_dir / "checkpoints"
        kept = read_tracker(checkpoints)
        resume = f"the checkpoint of step {kept}" if kept is not None else "no checkpoint (trainer.save_freq)"
        return (
            f"[verl-sat] error: {failure['kind']} {failure['name']} (pid {failure['pid']}) died during global step "
            f"{failure['step']}: lost step {failure['step']}'s work and {failure['in_flight_prompts']} prompt(s) in "
            f"flight; the job stops (exit {EXIT_PROCESS_DIED}); the same command resumes from {resume}"
        )

    def report(self, failure: dict[str, Any]) -> None:
        """One error line, and the fault in ``run.json``."""
        from verl_sat.files import update_run_record

        self.failure = failure
        print(self.describe(failure), flush=True)
        try:
            update_run_record(self.run_dir, fault=failure)
        except OSError:
            pass

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            failure = self.check()
            if failure is None:
                continue
            self.report(failure)
            _thread.interrupt_main()
            if not self.stopped.wait(GRACE_S):
                os._exit(EXIT_PROCESS_DIED)
            return

    def stop(self) -> None:
        self.stopped.set()

    def __enter__(self) -> Supervisor:
        # _thread.interrupt_main() does nothing while SIGINT is ignored, which is how a job started
        # with `&` by a non-interactive shell (an sbatch script, nohup ... &) inherits it: the driver
        # would then skip Ray's shutdown and end only by the forced exit. SIGINT raises here instead.
        self._sigint = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            self._sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        """The driver often learns of a dead worker first (Ray's ``ActorDiedError`` from the call
        in flight), before the next once-a-second check: an exception is checked against the
        registered processes once more, so the job still exits ``EXIT_PROCESS_DIED``."""
        self.stop()
        if self.is_alive():
            self.join()
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)
        if self.failure is None and exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            failure = self.check()
            if failure is not None:
                self.report(failure)
        if self.failure is not None:
            raise SystemExit(EXIT_PROCESS_DIED) from exc
        return False
