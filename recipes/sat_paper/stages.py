"""One stage of a staged GPU check (docs/reproduce.md): run a command, say PASS or FAIL with its time, keep a
JSON summary, and on failure show the command's last lines.

``recipes/sat_paper/smoke_1gpu.sh`` runs each of its stages through this file, by path (it imports
only the standard library, so a stage costs no ``import verl``)::

    python recipes/sat_paper/stages.py --summary RUN_DIR/smoke_summary.json --name offload --timeout 1800 -- CMD...

The command's output goes to the console and to ``<summary dir>/stages/<name>.log``. The summary
(``{"ok", "failed", "seconds", "stages": [{name, status, seconds, returncode, timeout, command,
log, tail}]}``) is rewritten after every stage, so a stopped run still says how far it got. The
exit code is the command's (127 when it cannot be started). A stage that outlives ``--timeout``
seconds is ended with its whole process group (SIGTERM, then SIGKILL after ``KILL_GRACE`` s: Ray,
SGLang and their children go with it), prints ``[smoke] FAIL <name> (timeout after N s)`` and
exits 124, as coreutils' ``timeout`` does. The script stops at the first non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

PREFIX = "[smoke]"
# Lines of the failing command's output repeated under its FAIL line.
TAIL_LINES = 40
# Exit code of a stage ended by its timeout (coreutils' timeout uses the same).
TIMED_OUT = 124
# Seconds between SIGTERM and SIGKILL of a timed-out stage's process group.
KILL_GRACE = 10.0


def read_summary(path: Path) -> dict:
    """The summary so far, or an empty one (no stage yet)."""
    if path.is_file():
        return json.loads(path.read_text())
    return {"ok": True, "failed": None, "seconds": 0.0, "stages": []}


def record(path: Path, stage: dict) -> dict:
    """Append one stage's record to the summary at ``path`` and rewrite it."""
    summary = read_summary(path)
    summary["stages"].append(stage)
    summary["seconds"] = round(sum(s["seconds"] for s in summary["stages"]), 1)
    if stage["status"] == "FAIL" and summary["ok"]:
        summary["ok"], summary["failed"] = False, stage["name"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def end_group(proc: subprocess.Popen, grace: float = KILL_GRACE) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL after ``grace`` seconds if it is still there."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(
    command: Sequence[str], log: Path, tail_lines: int = TAIL_LINES, timeout: float | None = None
) -> tuple[int, list[str], bool]:
    """Run ``command`` in its own process group, echoing its merged stdout/stderr and writing it to ``log``.

    Returns the exit code (127 when it cannot be started, ``TIMED_OUT`` when it ran past
    ``timeout`` seconds and was ended), its last ``tail_lines`` lines, and whether it timed out."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=tail_lines)
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(
                list(command),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
        except OSError as err:
            line = f"cannot start {command[0]}: {err}"
            out.write(line + "\n")
            return 127, [line], False

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
                tail.append(line.rstrip("\n"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            end_group(proc)
            code, timed_out = TIMED_OUT, True
        reader.join(timeout=KILL_GRACE)
        return code, list(tail), timed_out


def run_stage(
    name: str,
    command: Sequence[str],
    summary_path: Path,
    tail_lines: int = TAIL_LINES,
    timeout: float | None = None,
) -> int:
    """Run one stage: its command, then a PASS/FAIL line with the time, recorded in the summary.
    ``timeout`` (seconds, None: none) ends the stage with a FAIL line saying so."""
    log = summary_path.parent / "stages" / f"{name}.log"
    limit = f" (timeout {timeout:g} s)" if timeout else ""
    print(f"{PREFIX} stage {name}{limit}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    code, tail, timed_out = run_command(command, log, tail_lines, timeout)
    seconds = round(time.monotonic() - start, 1)
    status = "PASS" if code == 0 else "FAIL"
    record(
        summary_path,
        {
            "name": name,
            "status": status,
            "seconds": seconds,
            "returncode": code,
            "timeout": timeout if timed_out else None,
            "command": list(command),
            "log": str(log),
            "tail": [] if code == 0 else tail,
        },
    )
    if code == 0:
        print(f"{PREFIX} PASS {name} ({seconds} s)", flush=True)
    elif timed_out:
        print(f"{PREFIX} FAIL {name} (timeout after {timeout:g} s); the last {len(tail)} lines of {log}:", flush=True)
        for line in tail:
            print(f"{PREFIX}   | {line}", flush=True)
        print(f"{PREFIX} stopped at {name}; summary: {summary_path}", flush=True)
    else:
        print(f"{PREFIX} FAIL {name} ({seconds} s, exit {code}); the last {len(tail)} lines of {log}:", flush=True)
        for line in tail:
            print(f"{PREFIX}   | {line}", flush=True)
        print(f"{PREFIX} stopped at {name}; summary: {summary_path}", flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", required=True, type=Path, help="the JSON summary to append to")
    parser.add_argument("--name", required=True, help="the stage's name (also its log's name)")
    parser.add_argument("--tail", type=int, default=TAIL_LINES, help="lines shown when the stage fails")
    parser.add_argument("--timeout", type=float, default=0, help="seconds before the stage is ended (0: none)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    if args.timeout < 0:
        parser.error(f"--timeout must be >= 0 seconds, got {args.timeout:g}")
    return run_stage(args.name, command, args.summary, args.tail, args.timeout or None)


if __name__ == "__main__":
    sys.exit(main())
