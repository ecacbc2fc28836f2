"""The job's own processes register themselves for the driver's supervisor (``verl_sat.trainer.supervisor``).

Every HF rollout server and every verl-sat actor worker writes one file in ``<run_dir>/processes/``
when it starts (``register``): its kind, name, pid and host, and, for a Ray actor, its actor id,
through which the driver asks Ray whether it is still alive on whatever node it runs. verl's own
rollout servers (vLLM, SGLang) and the processes under them are found by the supervisor itself,
in Ray's actor table and with psutil. Lower than ``trainer/`` and ``rollout/``, which both register.

``Watchdog`` is the driver thread both watches of a job are: the supervisor (a dead process,
exit 4) and the placement watch (``verl_sat.preflight.cluster``, a pool Ray cannot place, exit 5).
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
from typing import Any, TextIO

RUN_DIR_ENV = "VERL_SAT_RUN_DIR"
PROCESSES_DIR = "processes"
GRACE_S = 20.0  # how long a watch waits for the interrupted driver before it ends the process itself


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


class Watchdog(threading.Thread):
    """A driver thread that calls ``check`` every ``interval`` seconds. On its first finding it
    ``report``s it (one line), interrupts the driver, which shuts Ray down and exits ``exit_code``,
    and ends the process with that code itself if the driver is still there ``grace_s`` later."""

    exit_code: int  # each watch's own (the supervisor's 4, the placement watch's 5)
    grace_s: float = GRACE_S

    def __init__(self, name: str, interval: float, out: TextIO | None) -> None:
        super().__init__(daemon=True, name=name)
        self.interval, self.out = interval, out
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # no interrupt of the driver once __exit__ has stopped the checks
        self.failure: Any = None

    def check(self) -> Any:
        """The finding that ends the job, else None."""
        raise NotImplementedError

    def report(self, failure: Any) -> None:
        """Record ``failure`` as ``self.failure`` and print its one line."""
        raise NotImplementedError

    def enabled(self) -> bool:
        return True

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            failure = self.check()
            if failure is None:
                continue
            with self.lock:
                if self.stopped.is_set():  # the driver is already leaving: __exit__ reports it
                    return
                self.report(failure)
                _thread.interrupt_main()
            if not self.stopped.wait(self.grace_s):
                os._exit(self.exit_code)
            return

    def stop(self) -> None:
        self.stopped.set()

    def __enter__(self) -> Watchdog:
        # _thread.interrupt_main() does nothing while SIGINT is ignored, which is how a job started
        # with `&` by a non-interactive shell (an sbatch script, nohup ... &) inherits it: the driver
        # would then skip Ray's shutdown and end only by the forced exit. SIGINT raises here instead.
        self._sigint = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            self._sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.enabled():
            self.start()
        return self

    def on_driver_error(self, exc_type: Any) -> None:
        """What the driver's own exception (not the watch's interrupt) may still tell the watch."""

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            with self.lock:
                self.stop()
            if self.is_alive():
                self.join()
        except KeyboardInterrupt:  # the watch's interrupt, issued just before the driver got here
            if self.failure is None:
                raise
            self.stop()
            self.join()
        if self._sigint is not None:
            signal.signal(signal.SIGINT, self._sigint)
        if self.failure is None and exc_type is not None and not issubclass(exc_type, KeyboardInterrupt):
            self.on_driver_error(exc_type)
        if self.failure is not None:
            raise SystemExit(self.exit_code) from exc
        return False
