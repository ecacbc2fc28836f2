"""recipes/sat_paper/prepare_math.py on small local fixtures (nothing is downloaded)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes/sat_paper/prepare_math.py"
sys.path.insert(0, str(SCRIPT.parent))  # the recipe's scripts, run by path
import prepare_math as pm  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"
DAPO = FIXTURES / "dapo_math_17k_sample.jsonl"
DOLCI = FIXTURES / "dolci_rl_zero_math_sample.jsonl"
# six AIME 2024 problems copied verbatim from ../shared/data/aime24.jsonl (zero-padded answers, as it ships them)
AIME24 = FIXTURES / "aime24_sample.jsonl"


def test_dapo_template_is_stripped_and_reapplied() -> None:
    problems = pm.read_problems(str(DAPO), "dapo")
    assert problems[0].question == "What is $1+1$?"
    prompt = pm.chat_prompt(problems[0].question)
    assert prompt == [{"role": "user", "content": pm.PROMPT_TEMPLATE.format(question="What is $1+1$?")}]
    assert prompt[0]["content"].startswith("Solve the following math problem step by step.")
    assert prompt[0]["content"].endswith('Remember to put your answer on its own line after "Answer:".')


def test_dapo_is_deduplicated_by_prompt() -> None:
    problems = pm.read_problems(str(DAPO), "dapo")
    assert len(problems) == 6
    kept = pm.unique(problems)
    # "What is $1+1$?" x3 (one with extra whitespace) and "What is $2+3$?" x2 -> 3 unique.
    assert [p.question for p in kept] == [
        "What is $1+1$?",
        "What is $2+3$?",
        "Find the remainder when $7^{10}$ is divided by 5.",
    ]


def test_union_with_dolci_keeps_each_question_once() -> None:
    frame, stats = pm.build_train(str(DAPO), str(DOLCI))
    assert stats == {"dapo_rows": 6, "dapo_unique": 3, "dolci_rows": 4, "dolci_added": 2, "train": 5}
    questions = [row[0]["content"] for row in frame["prompt"]]
    assert len(set(questions)) == len(questions) == 5
    assert [info["source"] for info in frame["extra_info"]] == ["dapo"] * 3 + ["dolci"] * 2
    answers = [rm["ground_truth"] for rm in frame["reward_model"]]
    assert answers == ["2", "5", "4", "6", "\\frac{5}{6}"]


def test_verl_schema_survives_parquet(tmp_path: Path) -> None:
    frame, _ = pm.build_train(str(DAPO), str(DOLCI))
    back = pd.read_parquet(pm.write_parquet(frame, tmp_path / "out" / "train.parquet"))
    assert list(back.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = back.iloc[0]
    assert row["data_source"] == pm.TRAIN_DATA_SOURCE
    assert row["ability"] == "math"
    assert list(row["prompt"])[0]["role"] == "user"
    assert row["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert row["extra_info"] == {"index": 0, "split": "train", "source": "dapo"}
    assert list(back["extra_info"].map(lambda info: info["index"])) == list(range(len(back)))


def test_parquet_source_with_verl_schema(tmp_path: Path) -> None:
    # DAPO-Math-17k on the hub is a verl-format parquet: nested prompt and reward_model columns.
    src = tmp_path / "dapo.parquet"
    pd.read_json(DAPO, lines=True).to_parquet(src, index=False)
    problems = pm.read_problems(str(src), "dapo")
    assert [p.answer for p in problems] == ["2", "5", "2", "4", "5", "2"]
    assert problems[3].question == "Find the remainder when $7^{10}$ is divided by 5."


def test_chat_only_source_and_json_encoded_answer() -> None:
    (problem,) = pm.read_problems(str(FIXTURES / "chat_only_sample.jsonl"), "chat")
    assert problem.question == "What is $3 \\cdot 4$?"
    assert problem.answer == "12"


def test_missing_answer_column_names_column_and_file() -> None:
    src = FIXTURES / "missing_answer_sample.jsonl"
    with pytest.raises(pm.SchemaError, match=r"missing_answer_sample\.jsonl row 0: no answer column.*ground_truth"):
        pm.read_problems(str(src), "bad")


def test_missing_question_column_names_column_and_file(tmp_path: Path) -> None:
    src = tmp_path / "no_question.jsonl"
    src.write_text('{"text": "hi", "answer": "1"}\n')
    with pytest.raises(
        pm.SchemaError, match=r"no_question\.jsonl row 0: no question column.*found \['answer', 'text'\]"
    ):
        pm.read_problems(str(src), "bad")


def test_missing_local_file_is_an_error() -> None:
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        pm.load_records("does/not/exist/nope.parquet")


def test_answers_are_normalized() -> None:
    assert pm.normalize_answer("025", "t") == "25"
    assert pm.normalize_answer(7.0, "t") == "7"
    assert pm.normalize_answer(["\\frac{1}{2}", "0.5"], "t") == "\\frac{1}{2}"
    with pytest.raises(pm.SchemaError, match="empty answer"):
        pm.normalize_answer("  ", "t")


def test_aime24_from_jsonl() -> None:
    """AIME24's JSONL becomes verl rows: the eval data source, unpadded answers, prompts, the test split."""
    frame = pm.build_aime(str(AIME24))
    assert len(frame) == 6
    assert set(frame["data_source"]) == {pm.AIME_DATA_SOURCE}
    answers = [rm["ground_truth"] for rm in frame["reward_model"]]
    assert answers == ["204", "113", "25", "540", "73", "80"]  # "025" -> "25": compared as integers
    assert frame["prompt"][0][0]["content"].startswith(pm.PROMPT_PREFIX + "Every morning Aya")
    assert {info["split"] for info in frame["extra_info"]} == {"test"}


def test_verl_math_dapo_verifier_scores_our_rows() -> None:
    """verl's own math_dapo scorer, reached through both data sources we write, scores our rows."""
    from verl.utils.reward_score import default_compute_score

    frame = pm.build_aime(str(AIME24))
    for source in (pm.AIME_DATA_SOURCE, pm.TRAIN_DATA_SOURCE):
        for truth in (rm["ground_truth"] for rm in frame["reward_model"]):
            right = default_compute_score(source, f"Some work.\nAnswer: {truth}", truth)
            wrong = default_compute_score(source, f"Some work.\nAnswer: {int(truth) + 1}", truth)
            assert right["acc"] and not wrong["acc"], (source, truth)


def test_cli_writes_both_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's command: the script run by path, as ``python recipes/sat_paper/prepare_math.py``."""
    aime = tmp_path / "aime.jsonl"
    aime.write_text('{"question": "What is $1+1$?", "answer": "002"}\n')
    argv = ["--out", str(tmp_path / "d"), "--dapo", str(DAPO), "--dolci", str(DOLCI), "--aime", str(aime)]
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert done.value.code == 0
    assert len(pd.read_parquet(tmp_path / "d" / "train.parquet")) == 5
    assert pd.read_parquet(tmp_path / "d" / "aime24.parquet")["reward_model"][0]["ground_truth"] == "2"
    assert "train: 5 prompts" in capsys.readouterr().out
