"""A readable console for the main job: verl-sat's lines, verl's progress bar and errors.

Ray forwards the output of every worker of the job to the driver (``ray.init(log_to_driver=True)``,
Ray's default) as records: which process (``pid``, ``actor_name`` or ``task_name``), which stream
(``is_err``) and its lines. A Ray post-init hook puts :class:`WorkerOutput` in place of Ray's
printer of those records, right after verl's ``ray.init``. Every line goes to
``<run_dir>/console.log`` with Ray's ``(name pid=N)`` prefix; the terminal gets only:

- verl-sat's own lines (``[verl-sat] ...``), verl's ``Training Progress`` bar (the latest bar of
  a line) and its console-logger lines (``step:N - ...``, when ``trainer.logger`` includes
  ``console``), all three without Ray's prefix;
- errors: a worker's traceback from its first line to the exception line, lines at ERROR /
  CRITICAL / FATAL level, fatal signals and OOM kills, and all of Ray's raylet lines. Repeats are
  capped: a worker's first MAX_FULL_TRACEBACKS tracebacks show whole, later ones by their
  exception line if it is new; an error line shows MAX_REPEATS times (all of it stays in console.log).

The driver's own stdout and stderr (verl's ``ray init kwargs``, its config check) and the root
logger's stream handlers (Hydra's, which verl's driver-side ``logging`` reaches) go to console.log
too; verl-sat's driver-side lines are written to the terminal stream this context yields. A
worker's exception that ends the run reaches the driver as ``RayTaskError``, which carries the
worker's traceback, and prints whole once the streams are restored. Ray's own logger keeps the real
stream (its start-up lines, its errors about dead workers). ``sat.verbose=true`` keeps Ray's
printer and the driver's streams: everything shows, and console.log still gets the workers' lines.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

CONSOLE_LOG = "console.log"
# A worker's first tracebacks show in full; later ones only in console.log (a failing reward
# function retried for every sample would otherwise print thousands).
MAX_FULL_TRACEBACKS = 3
# An error line (the same text) shows this many times on the terminal.
MAX_REPEATS = 3
VERL_SAT = "[verl-sat]"
PROGRESS = "Training Progress"
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception")
STEP_LOG = "step:"  # verl's console logger (``trainer.logger`` with ``console``): "step:3 - key:value - ..."
OWN_LINES = (VERL_SAT, PROGRESS, STEP_LOG)  # shown without Ray's prefix; errors keep theirs
# What marks a line as an error: logging levels (Python, Ray, TransferQueue, glog), fatal signals, OOM.
ERROR_MARKS = ("ERROR", "CRITICAL", "FATAL", "Fatal Python error", "Segmentation fault", "core dumped", "Killed")
ERROR_MARKS += ("out of memory", "OutOfMemory")
RAY_PRINTER = "ray_print_logs"  # the name Ray's own printer has in its dispatcher
HANDLER = "verl_sat_console"


@dataclass
class WorkerOutput:
    """Ray's records of the workers' output: every line to ``log``, the kept ones to ``terminal``
    (module docstring). ``verbose``: only the log (Ray's printer shows everything)."""

    log: TextIO
    terminal: TextIO
    verbose: bool = False
    # (pid, is_err) -> "frames" (inside a traceback) | "exception" (just after its exception line)
    blocks: dict = field(default_factory=dict)
    tracebacks: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)

    def __call__(self, data: dict[str, Any]) -> None:
        """One record of Ray's (``global_worker_stdstream_dispatcher``)."""
        pid = data.get("pid")
        if pid == "autoscaler":  # Ray's cluster-status dumps (``ray status`` shows them)
            return
        source = f"{data.get('actor_name') or data.get('task_name') or ''} pid={pid}".lstrip()
        for line in data.get("lines", []):
            self.log.write(f"({source}) {line}\n")
            shown = None if self.verbose else self.console_text(line, (pid, bool(data.get("is_err"))))
            if shown is not None:
                self.terminal.write((shown if shown.startswith(OWN_LINES) else f"({source}) {shown}") + "\n")
        self.log.flush()
        self.terminal.flush()

    def console_text(self, line: str, worker: tuple[Any, bool]) -> str | None:
        """The text to show for ``line`` of ``worker``, or None to keep it off the terminal.

        A traceback runs from ``Traceback ...`` through its frames (indented lines) to the exception
        line; indented lines right after it continue the block (Ray's ``RayTaskError(X): ...`` line
        is followed by the remote worker's frames), as does a chained traceback.
        """
        full = self.tracebacks[worker] <= MAX_FULL_TRACEBACKS
        state = self.blocks.get(worker)
        if state is not None:
            if not line.strip():
                return None
            if line[:1].isspace() or line.startswith(CHAINED) or (state == "frames" and line.startswith(TRACEBACK)):
                self.blocks[worker] = "frames"
                return line if full else None
            if state == "frames":  # the exception line, whatever its form
                self.blocks[worker] = "exception"
                self.errors[line] += 1
                return line if full or self.errors[line] == 1 else None  # past the full ones: only new ones
            del self.blocks[worker]
        if line.startswith(TRACEBACK):
            self.blocks[worker] = "frames"
            self.tracebacks[worker] += 1
            return line if self.tracebacks[worker] <= MAX_FULL_TRACEBACKS else None
        if VERL_SAT in line:
            return line[line.index(VERL_SAT) :]
        if PROGRESS in line:
            return line.rsplit("\r", 1)[-1]
        if line.startswith(STEP_LOG) or worker[0] == "raylet" or any(mark in line for mark in ERROR_MARKS):
            return line if line.startswith(STEP_LOG) else self.repeat(line)
        return None

    def repeat(self, line: str) -> str | None:
        """An error line: shown the first MAX_REPEATS times its text comes."""
        self.errors[line] += 1
        return line if self.errors[line] <= MAX_REPEATS else None


@contextlib.contextmanager
def quiet_console(log_path: Path, verbose: bool = False) -> Iterator[TextIO]:
    """Send the workers' output (through Ray) and the driver's streams into ``log_path``; yields
    the terminal's stream, for verl-sat's own driver-side lines (module docstring)."""
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    terminal, terminal_err = sys.stdout, sys.stderr
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        handler = WorkerOutput(log, terminal, verbose)

        def attach() -> None:  # after ray.init (a Ray post-init hook)
            if not verbose:
                dispatcher.remove_handler(RAY_PRINTER)
            dispatcher.add_handler(HANDLER, handler)

        ray_worker._post_init_hooks.append(attach)
        try:
            with contextlib.ExitStack() as streams:
                if not verbose:
                    streams.enter_context(contextlib.redirect_stdout(log))
                    streams.enter_context(contextlib.redirect_stderr(log))
                    for root_handler in logging.getLogger().handlers:  # Hydra's console handler
                        stream = getattr(root_handler, "stream", None)
                        if isinstance(root_handler, logging.StreamHandler) and stream in (terminal, terminal_err):
                            streams.callback(root_handler.setStream, root_handler.setStream(log))
                yield terminal
        finally:
            ray_worker._post_init_hooks.remove(attach)
            dispatcher.remove_handler(HANDLER)


def quiet_sources() -> None:
    """Silence a warning at its source, without changing what runs: TransferQueue asks torch for
    ``TQ_NUM_THREADS`` (8) threads and, on a machine with fewer physical cores, warns on every
    put/get (hundreds of lines a step on 2 cores) before using the core count. Setting the
    variable to that count (inherited by the Ray workers) gives the same threads, silently."""
    import os

    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, cores)))
