"""What an evaluation keeps on disk while it runs, and what ``--resume`` checks before it continues.

Files in ``--out``:

- ``eval_config.json``: written before the first request; the settings the samples are drawn
  with (``eval_settings``): a digest of the problems, k, the sampling settings, the prompt
  instruction and the model (``Backend.identity()``).
- ``samples.jsonl``: one line per sample, appended and flushed as each completes, so a crash, a
  kill or Ctrl-C keeps every sample drawn; sorted by (problem, sample) once the evaluation is
  complete.
- ``summary.json``: only for a complete evaluation (an unfinished one has none).

``--resume`` (``SampleLog.open(resume=True)``) compares ``eval_config.json`` with this run's
settings key by key and refuses with the first key that differs; it then checks each kept
sample (a known problem, its ground truth, a sample index below k, the per-sample seed) and
returns them, so that only the missing (problem, sample) pairs are drawn, with the same seeds
as in an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verl_sat.eval.data import Problem
from verl_sat.eval.jobs import SamplingConfig
from verl_sat.files import append_jsonl, read_jsonl, write_json, write_jsonl

SAMPLES = "samples.jsonl"
SETTINGS = "eval_config.json"
SUMMARY = "summary.json"


class ResumeRefused(ValueError):
    """``--resume`` found samples drawn with other settings (the message names the key)."""


class UnfinishedEvaluation(FileExistsError):
    """A fresh run would overwrite the samples of an evaluation that is not complete."""


def problems_digest(problems: Sequence[Problem]) -> str:
    """sha256 over the problems' ids, questions, answers and messages, in load order."""
    rows = [
        [p.id, p.question, p.answer, None if p.messages is None else [dict(m) for m in p.messages]] for p in problems
    ]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def eval_settings(
    problems: Sequence[Problem], cfg: SamplingConfig, instruction: str, identity: Mapping[str, Any]
) -> dict[str, Any]:
    """The settings samples are drawn with, flat, in the order ``--resume`` checks them."""
    return {
        "data": problems_digest(problems),
        "n_problems": len(problems),
        **asdict(cfg),
        "instruction": instruction,
        **identity,
    }


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The samples of a ``samples.jsonl``. A torn last line (the process died while writing it: no
    newline after it) is dropped and cut from the file, so appends start clean; any other line that
    is not a JSON object is an error naming it (``verl_sat.files.read_jsonl``, strict)."""
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8")
    head, _, last = text.rpartition("\n")
    if last.strip():  # no newline after the last line
        try:
            json.loads(last)
            text += "\n"  # complete but for its newline
        except ValueError:
            text = head + "\n" if head else ""
        path.write_text(text, encoding="utf-8")
    try:
        return read_jsonl(path, strict=True)
    except ValueError as err:
        raise ValueError(f"{err}; fix or delete the line, then --resume") from None


def check_settings(saved: Mapping[str, Any], current: Mapping[str, Any], where: Path) -> None:
    """Refuse when any setting differs, naming the first key that does."""
    for key in [*current, *(k for k in saved if k not in current)]:
        if saved.get(key) != current.get(key):
            raise ResumeRefused(
                f"--resume refused: {where} was drawn with {key}={saved.get(key)!r}, this run has "
                f"{key}={current.get(key)!r}; rerun with the same {key}, or pass another --out for a new evaluation"
            )


def check_kept(
    records: Iterable[Mapping[str, Any]], problems: Sequence[Problem], cfg: SamplingConfig, where: Path
) -> dict[tuple[int, int], dict[str, Any]]:
    """Kept samples by (problem index, sample index), each checked against the data and the seeds.
    A (problem, sample) pair that appears twice keeps its first line."""
    index = {p.id: i for i, p in enumerate(problems)}
    kept: dict[tuple[int, int], dict[str, Any]] = {}
    for record in records:
        pid, j = str(record.get("problem_id")), record.get("sample_index")
        if pid not in index:
            raise ResumeRefused(
                f"--resume refused: {where} holds a sample of problem {pid!r}, which is not in the data"
            )
        i = index[pid]
        if not isinstance(j, int) or not 0 <= j < cfg.k:
            raise ResumeRefused(f"--resume refused: {where} holds sample_index={j!r} of problem {pid!r}; k is {cfg.k}")
        if record.get("ground_truth") != problems[i].answer:
            raise ResumeRefused(
                f"--resume refused: {where} scored problem {pid!r} against "
                f"ground_truth={record.get('ground_truth')!r}, the data has {problems[i].answer!r}"
            )
        if "seed" in record and record["seed"] != cfg.sample_seed(i, j):
            raise ResumeRefused(
                f"--resume refused: {where} drew problem {pid!r} sample {j} with seed={record['seed']!r}, "
                f"this run would use {cfg.sample_seed(i, j)!r}"
            )
        kept.setdefault((i, j), dict(record))
    return kept


class SampleLog:
    """``<out>/samples.jsonl``, appended one flushed line per sample, and its ``eval_config.json``."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out = Path(out_dir)
        self.path = self.out / SAMPLES
        self.settings_path = self.out / SETTINGS

    def open(
        self, settings: Mapping[str, Any], resume: bool, problems: Sequence[Problem], cfg: SamplingConfig
    ) -> dict[tuple[int, int], dict[str, Any]]:
        """Start (or, with ``resume``, continue) the log; returns the kept samples by (problem, sample).

        Raises:
            ResumeRefused: ``resume`` and the kept samples were drawn with other settings.
            UnfinishedEvaluation: not ``resume``, and ``out`` holds an evaluation without a summary.
        """
        self.out.mkdir(parents=True, exist_ok=True)
        kept: dict[tuple[int, int], dict[str, Any]] = {}
        if resume:
            kept = self._kept(settings, problems, cfg)
        else:
            self._refuse_unfinished()
            self.path.write_text("", encoding="utf-8")
        (self.out / SUMMARY).unlink(missing_ok=True)
        write_json(self.settings_path, dict(settings), indent=2)
        return kept

    def _kept(
        self, settings: Mapping[str, Any], problems: Sequence[Problem], cfg: SamplingConfig
    ) -> dict[tuple[int, int], dict[str, Any]]:
        records = read_samples(self.path)
        if not self.settings_path.is_file():
            if records:
                raise ResumeRefused(
                    f"--resume refused: {self.path} has no {SETTINGS} beside it, so the settings it was drawn "
                    "with cannot be checked"
                )
            return {}
        check_settings(json.loads(self.settings_path.read_text(encoding="utf-8")), settings, self.path)
        return check_kept(records, problems, cfg, self.path)

    def _refuse_unfinished(self) -> None:
        if self.path.is_file() and self.path.stat().st_size and not (self.out / SUMMARY).is_file():
            n = sum(1 for line in self.path.read_bytes().split(b"\n") if line.strip())
            raise UnfinishedEvaluation(
                f"{self.path} holds {n} samples of an evaluation that did not finish: add --resume to draw "
                "only the missing ones, or delete the file (or pass another --out) to start over"
            )

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one sample (the file is closed after each line, so it survives the process)."""
        append_jsonl(self.path, [dict(record)])

    def finish(self, records: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> None:
        """A complete evaluation: rewrite the samples in (problem, sample) order, then the summary."""
        write_jsonl(self.path, records)
        write_json(self.out / SUMMARY, dict(summary), indent=2)
