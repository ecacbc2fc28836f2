"""A readable console for the main job: verl-sat's lines, verl's progress bar and errors.

During training the driver's ``sys.stdout`` / ``sys.stderr`` are replaced by a
:class:`ConsoleSplitter`: every line goes to ``<run_dir>/console.log``, and only the lines a
:class:`LineFilter` keeps reach the terminal. The driver's streams carry its own prints and
everything Ray forwards from the workers (``(ActorName pid=N) message``: TaskRunner's config
dump, TransferQueue's and verl's warnings, ...). Kept:

- verl-sat's own lines (``[verl-sat] ...``, from the driver or a worker; shown without Ray's prefix);
- verl's ``Training Progress`` bar (the latest bar of a line, without what tqdm ran into);
- verl's console-logger lines (``step:N - ...``, when ``trainer.logger`` includes ``console``);
- errors, in full: a traceback from its first line to the exception line (per worker), lines
  at ERROR / CRITICAL / FATAL level, exception lines, fatal signals, OOM kills, and all of
  Ray's raylet lines. Repeats are capped: a worker's first MAX_FULL_TRACEBACKS tracebacks show
  whole, later ones by their exception line if it is new; an error line shows MAX_REPEATS
  times, then one notice (everything stays in console.log).

An exception that ends the run is raised in the driver after the streams are restored, so its
whole traceback (with the worker's, which Ray attaches) prints as usual. ``sat.verbose=true``
leaves the streams alone. The root logger's stream handlers (Hydra's, which verl's driver-side
``logging`` reaches) are pointed at the splitters too; Ray's own logger keeps the real stream,
unfiltered (two lines at start-up, and its errors about dead workers).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

CONSOLE_LOG = "console.log"
# A worker's first tracebacks show in full; after that only exception lines not seen before
# (a failing reward function retried for every sample would otherwise print thousands).
MAX_FULL_TRACEBACKS = 3
# An error line (same text up to numbers and ids) shows this many times, then once a notice.
MAX_REPEATS = 3
# Numbers, hex ids and UUID parts, blanked when errors are compared.
NUMBERS_RE = re.compile(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{4,}\b|[0-9a-fA-F]*\d[0-9a-fA-F]*")

ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
# Ray's prefix of a forwarded worker line: "(TaskRunnerV1 pid=123)" or "(pid=123, ip=10.0.0.1)".
RAY_PREFIX_RE = re.compile(r"^\((?P<source>[^()]*pid=[^()]*|raylet[^()]*)\) ?(?P<message>.*)$", re.DOTALL)
VERL_SAT_RE = re.compile(r"\[verl-sat\]")
PROGRESS_RE = re.compile(r"Training Progress:\s*\d+%\|[^|]*\|\s*\d+/\d+(?: \[[^\]]*\])?")
STEP_LOG_RE = re.compile(r"^step:\d+ - ")
# Lines that open (or continue a chained) traceback.
TRACEBACK_START = (
    "Traceback (most recent call last):",
    "During handling of the above exception",
    "The above exception",
)
ERROR_RE = re.compile(
    r"\b(ERROR|CRITICAL|FATAL)\b"  # logging levels (Python, Ray, TransferQueue)
    # exception lines: "ValueError: ...", "ray.exceptions.RayTaskError(ValueError): ..."
    r"|^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b(?:\([^)]*\))?:"
    r"|(?:^|\]:)[EF]\d{4} \d\d:\d\d"  # glog / torch C++ errors: "E1201 09:34:31", "[rank0]:E1201 ..."
    r"|Fatal Python error|Segmentation fault|SIGSEGV|SIGABRT|SIGBUS|core dumped|\bKilled\b|[Oo]ut of memory|OOM"
)


@dataclass
class LineFilter:
    """Decides, line by line, what reaches the terminal (module docstring).

    Tracebacks are followed per (stream, worker), since Ray interleaves the lines of several
    workers: from ``Traceback ...`` through the frames (indented lines) to the exception line;
    indented lines right after an exception line continue the block (Ray's ``RayTaskError(X):``
    line is followed by the remote worker's frames), as do chained tracebacks and further
    exception lines. Blank lines inside a block are dropped.
    """

    # (stream, source) -> "frames" (inside a traceback) | "exception" (just after an exception line)
    # | "chained" (after "The above exception ..." / "During handling ...")
    blocks: dict[tuple[str, str], str] = field(default_factory=dict)
    # tracebacks started per (stream, source); past MAX_FULL_TRACEBACKS only new exception lines show
    tracebacks: Counter = field(default_factory=Counter)
    # error lines (and exception lines) shown, by their text with numbers and ids blanked
    errors: Counter = field(default_factory=Counter)

    def console_text(self, line: str, stream: str = "stderr") -> str | None:
        """The text to show for ``line`` (without its newline), or None to keep it off the console.

        ``stream``: the driver stream it came on (Ray prints a worker's stdout and stderr on the
        driver's), so that a worker's stdout does not join its stderr's traceback.
        """
        plain = ANSI_RE.sub("", line)
        match = RAY_PREFIX_RE.match(plain)
        message = match["message"] if match else plain
        source = (stream, match["source"] if match else "driver")
        if source in self.blocks:
            shown = self._in_block(source, message, line)
            if shown is not False:
                return shown
        if message.lstrip().startswith(TRACEBACK_START):
            self.blocks[source] = "frames"
            self.tracebacks[source] += 1
            if self.tracebacks[source] == MAX_FULL_TRACEBACKS + 1:
                notice = f"[verl-sat] more tracebacks from ({source[1]}): only new exception lines"
                return f"{notice} (every one in full: {CONSOLE_LOG})"
            return self._full(source, line)
        if VERL_SAT_RE.search(message):
            return message[VERL_SAT_RE.search(message).start() :]
        if source[1].startswith("raylet") or ERROR_RE.search(message):
            return self._repeat(message, line)
        bars = PROGRESS_RE.findall(message)
        if bars:
            return bars[-1]
        if STEP_LOG_RE.match(message):
            return message
        return None

    def _in_block(self, source: tuple[str, str], message: str, line: str) -> str | None | bool:
        """Inside a traceback: the text to show, None (a blank line), or False (the block ended)."""
        if not message.strip():
            return None
        if message.startswith(TRACEBACK_START[0]) and self.blocks[source] == "exception":
            return False  # a new traceback, not a chained one: counted as such below
        if message.startswith(TRACEBACK_START[1:]):
            self.blocks[source] = "chained"
            return self._full(source, line)
        if message[:1].isspace() or message.startswith(TRACEBACK_START):
            self.blocks[source] = "frames"
            return self._full(source, line)
        if self.blocks[source] != "exception" or ERROR_RE.search(message):
            self.blocks[source] = "exception"  # the exception line (whatever its form)
            key = NUMBERS_RE.sub("#", message)
            self.errors[key] += 1
            return line if self.tracebacks[source] <= MAX_FULL_TRACEBACKS or self.errors[key] == 1 else None
        del self.blocks[source]
        return False

    def _full(self, source: tuple[str, str], line: str) -> str | None:
        """A traceback line: shown while this worker has had at most MAX_FULL_TRACEBACKS."""
        return line if self.tracebacks[source] <= MAX_FULL_TRACEBACKS else None

    def _repeat(self, message: str, line: str) -> str | None:
        """An error line: shown the first MAX_REPEATS times its text (numbers and ids blanked) comes."""
        key = NUMBERS_RE.sub("#", message)
        self.errors[key] += 1
        if self.errors[key] <= MAX_REPEATS:
            return line
        if self.errors[key] == MAX_REPEATS + 1:
            return f"[verl-sat] (this error repeats; every occurrence is in {CONSOLE_LOG}) {message[:120]}"
        return None


class ConsoleSplitter(io.TextIOBase):
    """A text stream that writes every line to ``log`` and the filtered lines to ``console``."""

    def __init__(
        self, console: TextIO, log: TextIO, line_filter: LineFilter, lock: threading.Lock, name: str = "stderr"
    ) -> None:
        super().__init__()
        self.console, self.log, self.filter, self.lock, self.name = console, log, line_filter, lock, name
        self.pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                self._emit(line)
        return len(text)

    def _emit(self, line: str) -> None:
        self.log.write(ANSI_RE.sub("", line) + "\n")
        shown = self.filter.console_text(line, self.name)
        if shown is not None:
            self.console.write(shown + "\n")

    def flush(self) -> None:
        with self.lock:
            self.log.flush()
            self.console.flush()

    def close_pending(self) -> None:
        """Emit a last line that has no newline yet."""
        with self.lock:
            if self.pending:
                self._emit(self.pending)
                self.pending = ""

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.console, "encoding", None) or "utf-8"


@contextlib.contextmanager
def quiet_console(log_path: Path, verbose: bool = False) -> Iterator[Path | None]:
    """Route the driver's stdout / stderr through :class:`ConsoleSplitter` into ``log_path``.

    ``verbose``: leave the streams alone (everything on the console) and yield None.
    """
    if verbose:
        yield None
        return
    lock, line_filter = threading.Lock(), LineFilter()
    with open(log_path, "a", encoding="utf-8", buffering=1) as log:
        saved = sys.stdout, sys.stderr
        out = ConsoleSplitter(saved[0], log, line_filter, lock, "stdout")
        err = ConsoleSplitter(saved[1], log, line_filter, lock, "stderr")
        sys.stdout, sys.stderr = out, err
        handlers = redirect_root_handlers({id(saved[0]): out, id(saved[1]): err})
        try:
            yield log_path
        finally:
            for handler, stream in handlers:
                handler.setStream(stream)
            for splitter in (out, err):
                splitter.close_pending()
                splitter.flush()
            sys.stdout, sys.stderr = saved


def redirect_root_handlers(streams: dict[int, TextIO]) -> list[tuple[logging.StreamHandler, TextIO]]:
    """Point the root logger's stream handlers (Hydra's console handler: verl's driver-side
    ``logging``) at the splitters; returns ``(handler, old stream)`` pairs to restore."""
    redirected = []
    for handler in logging.getLogger().handlers:
        stream = getattr(handler, "stream", None)
        if isinstance(handler, logging.StreamHandler) and id(stream) in streams:
            redirected.append((handler, stream))
            handler.setStream(streams[id(stream)])
    return redirected


def quiet_sources() -> None:
    """Silence a warning at its source, without changing what runs: TransferQueue asks torch for
    ``TQ_NUM_THREADS`` (8) threads and, on a machine with fewer physical cores, warns on every
    put/get (hundreds of lines a step on 2 cores) before using the core count. Setting the
    variable to that count (inherited by the Ray workers) gives the same threads, silently."""
    import os

    import psutil

    cores = psutil.cpu_count(logical=False) or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, cores)))
