"""Build the paper's math data in verl's parquet format (docs/reproduce.md).

Training set: DAPO-Math-17k de-duplicated by prompt, united with Dolci-RL-Zero-Math-7B (a
question present in both is kept once). Validation set: AIME 2024 (30 problems). Every prompt is
re-written in DAPO's style (a last ``Answer:`` line), which verl-sat's verifier
(``verl_sat.eval.verify``, the paper recipe's reward) reads, as verl's ``math_dapo`` scorer does::

    python recipes/sat_paper/prepare_math.py --out ~/data/sat_math
    python recipes/sat_paper/prepare_math.py --out DIR --dapo dapo.parquet --dolci dolci.jsonl \
        --aime aime24.jsonl

Each source is a Hugging Face hub id (loaded with ``datasets.load_dataset``, the default) or a
local ``.parquet`` / ``.jsonl`` / ``.json`` file. Output: ``DIR/train.parquet`` and
``DIR/aime24.parquet`` with verl's columns ``data_source``, ``prompt`` (chat messages),
``ability``, ``reward_model`` ``{style: rule, ground_truth}`` and ``extra_info``
``{index, split, source}``.

Runs by path, as verl's own data preprocessing in ``examples/`` does; it is not installed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

DAPO_HUB_ID = "BytedTsinghua-SIA/DAPO-Math-17k"
DOLCI_HUB_ID = "allenai/Dolci-RL-Zero-Math-7B"
AIME24_HUB_ID = "HuggingFaceH4/aime_2024"

# DAPO's prompt style (docs/reproduce.md); {question} is the bare problem statement.
PROMPT_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
PROMPT_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
PROMPT_TEMPLATE = PROMPT_PREFIX + "{question}" + PROMPT_SUFFIX

# Labels only for the paper recipe, whose custom reward ignores them; verl's default reward (with
# reward.custom_reward_function.path=null) routes "math_dapo" and "aime*" to its math_dapo scorer.
TRAIN_DATA_SOURCE = "math_dapo"
AIME_DATA_SOURCE = "aime24"
ABILITY = "math"

# Columns tried, in order, for the question and the final answer of each source schema.
QUESTION_COLUMNS = ("question", "problem", "Problem", "prompt", "messages", "query")
ANSWER_COLUMNS = ("answer", "Answer", "ground_truth", "reward_model", "final_answer", "label")

LOCAL_SUFFIXES = (".parquet", ".jsonl", ".json")


class SchemaError(ValueError):
    """A source lacks a column we need, or holds a value we cannot read."""


@dataclass(frozen=True)
class Problem:
    """One math problem: its bare question text, its final answer, and where it came from."""

    question: str
    answer: str
    source: str


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def is_local(source: str) -> bool:
    """A source is a local file when it exists or ends like one; otherwise a hub id."""
    return Path(source).expanduser().exists() or source.endswith(LOCAL_SUFFIXES)


def load_records(source: str, split: str = "train") -> list[dict[str, Any]]:
    """Rows of a local parquet / JSONL / JSON file, or of a hub dataset's ``split``.

    Raises:
        FileNotFoundError: a local path that does not exist.
        SchemaError: an unsupported file type.
    """
    if not is_local(source):
        return _load_hub(source, split)
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{source}: no such file")
    if path.suffix == ".parquet":
        return pd.read_parquet(path).to_dict(orient="records")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, list):
            raise SchemaError(f"{source}: a .json source must hold a list of records")
        return data
    raise SchemaError(f"{source}: unsupported file type {path.suffix!r}; use one of {list(LOCAL_SUFFIXES)}")


def _load_hub(hub_id: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"loading {hub_id!r} from the hub needs the 'datasets' package (pip install datasets), "
            "or pass a local .parquet/.jsonl path instead"
        ) from err
    return list(datasets.load_dataset(hub_id, split=split))


# ---------------------------------------------------------------------------------------------
# reading one record, whatever its schema
# ---------------------------------------------------------------------------------------------
def strip_template(text: str) -> str:
    """The bare question inside a DAPO-style prompt (DAPO-Math-17k ships its prompts templated)."""
    text = text.strip()
    if text.startswith(PROMPT_PREFIX.strip()):
        text = text[len(PROMPT_PREFIX.strip()) :]
        if text.endswith(PROMPT_SUFFIX.strip()):
            text = text[: -len(PROMPT_SUFFIX.strip())]
    return text.strip()


def _user_content(messages: Any, where: str) -> str:
    """The last user message of a chat list (a list of ``{role, content}``)."""
    if hasattr(messages, "tolist"):  # numpy arrays from parquet
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise SchemaError(f"{where}: expected a non-empty list of chat messages, got {type(messages).__name__}")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise SchemaError(f"{where}: the chat messages hold no user message with text content")
    return users[-1]["content"]


def read_question(record: dict[str, Any], where: str) -> str:
    """The bare question of a record: a text column, or the last user message of a chat column.

    Raises:
        SchemaError: naming the columns tried and the columns found.
    """
    for column in QUESTION_COLUMNS:
        value = record.get(column)
        if value is None:
            continue
        if isinstance(value, str):
            text = value
        else:
            text = _user_content(value, f"{where}, column {column!r}")
        question = strip_template(text)
        if question:
            return question
    raise SchemaError(f"{where}: no question column; expected one of {list(QUESTION_COLUMNS)}, found {sorted(record)}")


def normalize_answer(value: Any, where: str) -> str:
    """A final answer as text; integers lose leading zeros (AIME's "025" -> "25").

    Lists (Dolci's ``ground_truth``) give their first element; a JSON-encoded list is decoded.
    """
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if isinstance(value, list):
        if not value:
            raise SchemaError(f"{where}: empty answer list")
        value = value[0]
    if isinstance(value, bool) or value is None:
        raise SchemaError(f"{where}: unreadable answer {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if not text:
        raise SchemaError(f"{where}: empty answer")
    if re.fullmatch(r"[+-]?\d+", text):
        text = str(int(text))
    return text


def read_answer(record: dict[str, Any], where: str) -> str:
    """The final answer of a record (``reward_model.ground_truth`` for verl-format sources).

    Raises:
        SchemaError: naming the columns tried and the columns found.
    """
    for column in ANSWER_COLUMNS:
        value = record.get(column)
        if value is None:
            continue
        if column == "reward_model":
            if not isinstance(value, dict) or value.get("ground_truth") is None:
                continue
            value = value["ground_truth"]
        return normalize_answer(value, f"{where}, column {column!r}")
    raise SchemaError(f"{where}: no answer column; expected one of {list(ANSWER_COLUMNS)}, found {sorted(record)}")


def read_problems(source: str, name: str, split: str = "train") -> list[Problem]:
    """Every problem of a source (hub id or local file), in its order.

    Args:
        source: hub id or local path.
        name: a short label kept in ``extra_info.source`` (``dapo``, ``dolci``, ``aime24``).
        split: the hub split to read.
    """
    records = load_records(source, split=split)
    if not records:
        raise SchemaError(f"{source}: no records")
    return [
        Problem(
            question=read_question(record, f"{source} row {i}"),
            answer=read_answer(record, f"{source} row {i}"),
            source=name,
        )
        for i, record in enumerate(records)
    ]


# ---------------------------------------------------------------------------------------------
# de-duplication, union and verl rows
# ---------------------------------------------------------------------------------------------
def question_key(question: str) -> str:
    """The de-duplication key: the question with its whitespace collapsed."""
    return " ".join(question.split())


def unique(problems: Iterable[Problem], seen: set[str] | None = None) -> list[Problem]:
    """Problems whose question was not seen before (first occurrence wins); updates ``seen``."""
    seen = set() if seen is None else seen
    kept = []
    for problem in problems:
        key = question_key(problem.question)
        if key not in seen:
            seen.add(key)
            kept.append(problem)
    return kept


def union(*sources: Sequence[Problem]) -> list[Problem]:
    """The union of several problem lists, each question once, in source order."""
    seen: set[str] = set()
    merged: list[Problem] = []
    for problems in sources:
        merged.extend(unique(problems, seen))
    return merged


def chat_prompt(question: str) -> list[dict[str, str]]:
    """DAPO-style single-turn chat prompt for a bare question."""
    return [{"role": "user", "content": PROMPT_TEMPLATE.format(question=question)}]


def to_frame(problems: Sequence[Problem], data_source: str, split: str) -> pd.DataFrame:
    """verl's RL parquet schema, one row per problem."""
    rows = [
        {
            "data_source": data_source,
            "prompt": chat_prompt(problem.question),
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": problem.answer},
            "extra_info": {"index": index, "split": split, "source": problem.source},
        }
        for index, problem in enumerate(problems)
    ]
    return pd.DataFrame(rows, columns=["data_source", "prompt", "ability", "reward_model", "extra_info"])


def build_train(dapo: str = DAPO_HUB_ID, dolci: str = DOLCI_HUB_ID) -> tuple[pd.DataFrame, dict[str, int]]:
    """DAPO-Math-17k (de-duplicated by prompt) ∪ Dolci-RL-Zero-Math-7B, and the counts."""
    dapo_all = read_problems(dapo, "dapo")
    dolci_all = read_problems(dolci, "dolci")
    dapo_unique = unique(dapo_all)
    merged = union(dapo_unique, dolci_all)
    stats = {
        "dapo_rows": len(dapo_all),
        "dapo_unique": len(dapo_unique),
        "dolci_rows": len(dolci_all),
        "dolci_added": len(merged) - len(dapo_unique),
        "train": len(merged),
    }
    return to_frame(merged, TRAIN_DATA_SOURCE, "train"), stats


def build_aime(aime: str = AIME24_HUB_ID) -> pd.DataFrame:
    """AIME 2024 as the validation set (hub id or local file, e.g. shared/data/aime24.jsonl)."""
    return to_frame(read_problems(aime, AIME_DATA_SOURCE), AIME_DATA_SOURCE, "test")


def write_parquet(frame: pd.DataFrame, path: Path) -> Path:
    """Write ``frame`` to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(path, index=False)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write ``OUT/train.parquet`` and ``OUT/aime24.parquet``."""
    parser = argparse.ArgumentParser(
        prog="python recipes/sat_paper/prepare_math.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--dapo", default=DAPO_HUB_ID, help=f"hub id or local file (default {DAPO_HUB_ID})")
    parser.add_argument("--dolci", default=DOLCI_HUB_ID, help=f"hub id or local file (default {DOLCI_HUB_ID})")
    parser.add_argument("--aime", default=AIME24_HUB_ID, help=f"hub id or local file (default {AIME24_HUB_ID})")
    args = parser.parse_args(argv)

    train, stats = build_train(args.dapo, args.dolci)
    aime = build_aime(args.aime)
    out = args.out.expanduser()
    train_path = write_parquet(train, out / "train.parquet")
    aime_path = write_parquet(aime, out / "aime24.parquet")
    print(
        f"DAPO-Math-17k: {stats['dapo_rows']} rows, {stats['dapo_unique']} unique prompts; "
        f"Dolci-RL-Zero-Math-7B: {stats['dolci_rows']} rows, {stats['dolci_added']} new; "
        f"train: {stats['train']} prompts -> {train_path}"
    )
    print(f"AIME24: {len(aime)} problems -> {aime_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
