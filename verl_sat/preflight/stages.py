"""One stage of a staged GPU check (docs/reproduce.md): run a command, say PASS or FAIL with its time, keep a
JSON summary, and on failure show the command's last lines.

``recipes/sat_paper/smoke_1gpu.sh`` runs each of its stages through this file, by path (it imports
only the standard library, so a stage costs no ``import verl``)::

    python verl_sat/preflight/stages.py --summary RUN_DIR/smoke_summary.json --name offload -- CMD...

The command's output goes to the console and to ``<summary dir>/stages/<name>.log``. The summary
(``{"ok", "failed", "seconds", "stages": [{name, status, seconds, returncode, command, log,
tail}]}``) is rewritten after every stage, so a stopped run still says how far it got. The exit
code is the command's (127 when it cannot be started): the script stops at the first non-zero.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

PREFIX = "[smoke]"
# Lines of the failing command's output repeated under its FAIL line.
TAIL_LINES = 40


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


def run_command(command: Sequence[str], log: Path, tail_lines: int = TAIL_LINES) -> tuple[int, list[str]]:
    """Run ``command``, echoing its merged stdout/stderr and writing it to ``log``.

    Returns the exit code (127 when it cannot be started) and its last ``tail_lines`` lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=tail_lines)
    with log.open("w") as out:
        try:
            proc = subprocess.Popen(
                list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
        except OSError as err:
            line = f"cannot start {command[0]}: {err}"
            out.write(line + "\n")
            return 127, [line]
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            out.write(line)
            tail.append(line.rstrip("\n"))
        return proc.wait(), list(tail)


def run_stage(name: str, command: Sequence[str], summary_path: Path, tail_lines: int = TAIL_LINES) -> int:
    """Run one stage: its command, then a PASS/FAIL line with the time, recorded in the summary."""
    log = summary_path.parent / "stages" / f"{name}.log"
    print(f"{PREFIX} stage {name}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    code, tail = run_command(command, log, tail_lines)
    seconds = round(time.monotonic() - start, 1)
    status = "PASS" if code == 0 else "FAIL"
    record(
        summary_path,
        {
            "name": name,
            "status": status,
            "seconds": seconds,
            "returncode": code,
            "command": list(command),
            "log": str(log),
            "tail": [] if code == 0 else tail,
        },
    )
    if code == 0:
        print(f"{PREFIX} PASS {name} ({seconds} s)", flush=True)
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
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    return run_stage(args.name, command, args.summary, args.tail)


if __name__ == "__main__":
    sys.exit(main())
