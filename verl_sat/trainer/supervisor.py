"""Supervising the job's processes: a rollout server or trainer worker that dies ends the job.

verl 0.9.1 does not notice a rollout server that dies: each request to it fails, the replay
buffer evicts the failed group and refills it with a fresh prompt, which fails again, and the
trainer waits for samples that never come. A trainer worker that dies mid-step surfaces as an
exception only once verl next calls it. So the driver (``verl_sat.main``) runs a ``Supervisor``
thread that checks, once a second, the HF rollout servers and verl-sat actor workers (registered
in ``<run_dir>/processes/``, ``verl_sat.processes``), verl's own rollout server actors (this job's
actors of class ``*HttpServer``: vLLM's, SGLang's) and the engine processes under any rollout
server (those an engine titles ``<engine>::<role>``: vLLM's engine core, SGLang's scheduler and
detokenizer; never an untitled helper that exits by design, such as vLLM's model inspection at
start-up or a compiler). A Ray actor is checked through Ray's GCS (``ray._private.state.actors``: the actor
table of every node; it needs no dashboard, unlike ``ray.util.state``, whose queries go through
the dashboard's API server), any other process with psutil, on this node.

When one is gone, the supervisor prints one error line naming the process, the global step in
progress and what was lost, records it in ``run.json`` (``fault``), and interrupts the driver,
which shuts Ray down and exits with ``EXIT_PROCESS_DIED``; if the driver has not exited 20 s
later, the process exits anyway. So the job never hangs on a dead replica and never exits 0.
Resume with the same command: verl restarts from the newest checkpoint (docs/faults.md).

An engine's child process on another host is not checked (its pid means nothing here); its
server actor is.
"""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import psutil

from verl_sat.files import read_json, read_jsonl, update_run_record
from verl_sat.processes import PROCESSES_DIR, Watchdog
from verl_sat.trainer.faults import read_sentinel_record, read_tracker

EXIT_PROCESS_DIED = 4
SERVER_CLASS_SUFFIX = "HttpServer"  # verl 0.9.1's vLLMHttpServer, SGLangHttpServer, TRTLLMHttpServer
# verl's server actor names: "<engine>_server_<replica>_<node>" (vLLM, SGLang), "trtllm_server_<replica>"
SERVER_NAME = re.compile(r"(?P<engine>[a-z]+)_server_(?P<replica>\d+)(?:_(?P<node>\d+))?")


def job_actors() -> list[dict[str, Any]] | None:
    """This job's actors, on every node, from Ray's GCS (its actor-table entries, ``here``: on this
    node); None when this process is not connected to Ray (before verl's ``ray.init``, after its shutdown)."""
    import ray

    if not ray.is_initialized():
        return None
    from ray._private import state

    try:
        actors = state.actors(job_id=ray.JobID.from_hex(ray.get_runtime_context().get_job_id()))
        here = ray.get_runtime_context().get_node_id()
    except Exception:  # Ray shutting down under us
        return None
    return [{**actor, "here": actor["Address"]["NodeID"] == here} for actor in actors.values()]


def server_entry(actor: dict[str, Any]) -> dict[str, Any]:
    """verl's rollout server actor ``<engine>_server_<r>_<k>`` as rollout replica ``<engine><r>``
    (``<engine><r>.node<k>`` on a replica's node k > 0); another name is kept as it is."""
    match = SERVER_NAME.fullmatch(actor["Name"])
    name = match and match["engine"] + match["replica"] + (f".node{match['node']}" if int(match["node"] or 0) else "")
    host = socket.gethostname() if actor["here"] else actor["Address"]["IPAddress"]
    name = name or actor["Name"] or actor["ActorID"]
    entry = {"kind": "rollout replica", "name": name, "pid": int(actor["Pid"]), "host": host}
    return {**entry, "actor_id": actor["ActorID"]}


def descendants(server: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine processes under rollout replica ``server`` on this host, at any depth: those
    titled ``<engine>::<role>`` (setproctitle, as vLLM and SGLang title theirs), as rollout replicas
    ``<server>.<role>`` (``VLLM::EngineCore``: ``vllm0.EngineCore``); neither one already dead nor a
    fork that still bears its parent's title (a Ray worker's ``ray::...``, or a compiler's that has not
    yet run its own program: both exit by design) is taken."""
    found = []
    try:
        for child in psutil.Process(int(server["pid"])).children(recursive=True):
            title = child.name()
            forked = title.startswith("ray::") or title == (child.parent() or child).name()  # a parent's title
            if "::" in title and not forked and child.status() != psutil.STATUS_ZOMBIE:
                name = f"{server['name']}.{title.split('::')[-1]}"
                found.append({**server, "name": name, "pid": child.pid, "actor_id": None})
    except psutil.Error:  # a process gone meanwhile: judged at the next check
        pass
    return found


def is_dead(entry: dict[str, Any], dead: set[str] | None) -> bool:
    """A watched process is gone: its actor is DEAD (any node), or its pid on this host is gone
    or a zombie (psutil). Both are asked: the driver can learn of a killed worker (Ray's
    ``ActorDiedError``) before the GCS lists its actor as DEAD."""
    if entry.get("actor_id") and dead is not None and entry["actor_id"] in dead:
        return True
    if entry.get("host") != socket.gethostname():
        return False
    try:
        return psutil.Process(int(entry["pid"])).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def last_step(run_dir: Path) -> int:
    """The last global step in ``metrics.jsonl`` (0 if none)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return max((int(r["step"]) for r in rows), default=0)


def in_flight(run_dir: Path) -> int:
    """Prompts handed to the rollout and not yet trained, from ``samples.jsonl``."""
    handed, trained = set(), set()
    for row in read_jsonl(run_dir / "samples.jsonl"):
        if row.get("event") == "submitted":
            handed.update(uid for uid, _ in row["prompts"])
        elif row.get("event") == "trained":
            trained.update(p.get("uid") for p in row["prompts"])
    return len(handed - trained)


class Supervisor(Watchdog):
    """Checks the watched processes of the job every ``interval`` seconds (module docstring)."""

    exit_code = EXIT_PROCESS_DIED

    def __init__(
        self, run_dir: Path, total_steps: int | None = None, interval: float = 1.0, out: TextIO | None = None
    ) -> None:
        super().__init__("verl-sat-supervisor", interval, out)
        self.run_dir, self.total_steps = Path(run_dir), total_steps
        self.started_at = time.time()
        self.engine_processes: dict[int, dict[str, Any]] = {}  # pid -> the process under a rollout server

    def processes(self) -> list[dict[str, Any]]:
        folder = self.run_dir / PROCESSES_DIR
        entries = []
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            entry = read_json(path)
            if entry is not None and entry.get("since", 0) >= self.started_at - 1:
                entries.append(entry)
        return entries

    def finished(self) -> bool:
        """Training is over (the last step is logged, or the sentinel gave its verdict): verl may
        now stop its actors, which is no fault."""
        if self.total_steps is not None and last_step(self.run_dir) >= int(self.total_steps):
            return True
        return "final_step" in ((read_sentinel_record(self.run_dir) or {}).get("verdict") or {})

    def watched(self, actors: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The registered processes, verl's rollout server actors and the engine processes under
        them, remembered once seen (a dead one is no longer under its server)."""
        servers = [a for a in actors or [] if a["ActorClassName"].endswith(SERVER_CLASS_SUFFIX) and a["Pid"]]
        entries = self.processes() + [server_entry(actor) for actor in servers]
        for server in entries:
            if server["kind"] == "rollout replica" and server["host"] == socket.gethostname():
                for entry in descendants(server):  # named when first seen alive (a zombie's name is cut)
                    self.engine_processes.setdefault(entry["pid"], entry)
        return entries + list(self.engine_processes.values())

    def check(self) -> dict[str, Any] | None:
        """The first watched process of this job that is gone, with what was lost; else None."""
        if self.finished():
            return None
        actors = job_actors()
        dead = None if actors is None else {a["ActorID"] for a in actors if a["State"] == "DEAD"}
        for entry in self.watched(actors):
            if is_dead(entry, dead):
                step = last_step(self.run_dir) + 1
                return {**entry, "step": step, "in_flight_prompts": in_flight(self.run_dir)}
        return None

    def describe(self, failure: dict[str, Any]) -> str:
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
        self.failure = failure
        print(self.describe(failure), file=self.out or sys.stdout, flush=True)
        try:
            update_run_record(self.run_dir, fault=failure)
        except OSError:
            pass

    def on_driver_error(self, exc_type: Any) -> None:
        """The driver often learns of a dead worker first (Ray's ``ActorDiedError`` from the call
        in flight), before the next once-a-second check: an exception is checked against the
        watched processes once more, so the job still exits ``EXIT_PROCESS_DIED``."""
        failure = self.check()
        if failure is not None:
            self.report(failure)
