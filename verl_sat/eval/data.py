"""Load evaluation problems (AIME24) from a local JSONL / parquet file or a hub dataset id.

Accepted row layouts (the first key present wins):

- plain: ``question`` | ``problem`` | ``Problem`` and ``answer`` | ``Answer`` | ``solution``,
  optional ``id`` | ``ID`` | ``problem_id`` (else the row index) — /work/shared/data/aime24.jsonl,
  ``HuggingFaceH4/aime_2024``, ``Maxwell-Jia/AIME_2024``;
- verl parquet: ``prompt`` (a list of chat messages) and ``reward_model.ground_truth``,
  optional ``extra_info.index``; the messages are used as the prompt unchanged.

A string that names an existing file, or looks like one (``.jsonl``, ``.json``, ``.parquet``,
or starts with ``/``, ``.``, ``~``), is a path; anything else is a hub dataset id loaded with
``datasets.load_dataset`` (network access; never exercised in the tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_sat.files import read_jsonl

QUESTION_KEYS = ("question", "problem", "Problem", "Question")
ANSWER_KEYS = ("answer", "Answer", "solution", "Solution")
ID_KEYS = ("id", "ID", "problem_id", "idx")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Problem:
    """One evaluation problem.

    Args:
        id: stable identifier (the row's id field, else its 0-based index, as a string).
        question: the problem statement (for verl rows: the text of the last user message).
        answer: the reference answer, as in the source (AIME: zero-padded, e.g. ``"025"``).
        messages: chat messages to send unchanged (verl parquet rows), else None.
    """

    id: str
    question: str
    answer: str
    messages: tuple[Mapping[str, str], ...] | None = None


def _first(row: Mapping[str, Any], keys: Iterable[str]) -> Any:
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    return None


def problem_from_row(row: Mapping[str, Any], index: int, where: str) -> Problem:
    """A ``Problem`` from one row; ``where`` (e.g. ``"file.jsonl line 3"``) names it in errors."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    reward_model = row.get("reward_model")
    messages = None
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        answer = reward_model["ground_truth"]
        prompt = row.get("prompt")
        if prompt is None:
            raise ValueError(f"{where}: verl row has reward_model.ground_truth but no 'prompt'")
        messages = tuple({"role": str(m["role"]), "content": str(m["content"])} for m in list(prompt))
        users = [m["content"] for m in messages if m["role"] == "user"]
        question = users[-1] if users else messages[-1]["content"]
        extra = row.get("extra_info") or {}
        row_id = _first(row, ID_KEYS)
        if row_id is None and isinstance(extra, Mapping):
            row_id = extra.get("index")
    else:
        question = _first(row, QUESTION_KEYS)
        answer = _first(row, ANSWER_KEYS)
        row_id = _first(row, ID_KEYS)
        if question is None or answer is None:
            raise ValueError(
                f"{where}: needs a question field {list(QUESTION_KEYS)} and an answer field {list(ANSWER_KEYS)} "
                f"(or verl's prompt + reward_model.ground_truth); found keys {sorted(row)}"
            )
    if isinstance(answer, (list, tuple)) and len(answer) == 1:
        answer = answer[0]
    return Problem(
        id=str(index if row_id is None else row_id), question=str(question), answer=str(answer), messages=messages
    )


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL, JSON (list of objects) or parquet file."""
    if path.suffix == ".parquet":
        import pandas as pd

        return pd.read_parquet(path).to_dict(orient="records")
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json dataset must be a list of objects, got {type(data).__name__}")
        return data
    return read_jsonl(path, strict=True)


def is_path_like(source: str) -> bool:
    """Whether ``source`` should be read as a local path rather than a hub dataset id."""
    return Path(source).expanduser().exists() or source.endswith(FILE_SUFFIXES) or source.startswith(("/", ".", "~"))


def _load_hub(dataset_id: str) -> list[dict[str, Any]]:
    """Rows of a hub dataset's ``train`` split (network access; ``datasets`` is one of verl's requirements)."""
    import datasets

    dataset = datasets.load_dataset(dataset_id, split="train")
    return [dict(row) for row in dataset]


def load_problems(source: str | Path, limit: int | None = None) -> list[Problem]:
    """Problems from a local file (JSONL / JSON / parquet) or a hub dataset id.

    Args:
        source: a path, or a hub dataset id such as ``HuggingFaceH4/aime_2024``.
        limit: keep only the first ``limit`` problems.

    Returns:
        list[Problem], in file order.
    """
    source_str = str(source)
    if is_path_like(source_str):
        path = Path(source_str).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"evaluation data file not found: {path}")
        rows, label = _read_rows(path), str(path)
        where = "line" if path.suffix == ".jsonl" else "row"
    else:
        rows, label, where = _load_hub(source_str), source_str, "row"
    if limit is not None:
        rows = rows[:limit]
    problems = [problem_from_row(row, i, f"{label} {where} {i + 1}") for i, row in enumerate(rows)]
    if not problems:
        raise ValueError(f"no problems in {label}")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{label}: problem ids are not unique")
    return problems
