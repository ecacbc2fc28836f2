"""Synthetic verifiable arithmetic (two-digit addition) with DAPO's ``Answer:`` line, as verl parquet.

Each row: ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model``
(``{"style": "rule", "ground_truth": "<int>"}``), ``extra_info``. The prompt keeps DAPO-Math-17k's
request for a last line ``Answer: $Answer`` in a one-line instruction: DAPO's full template is
80 tokens of instruction for a 12-token answer, and a tiny model pays for every prompt token in
generation, log-probs and update alike.

Usage: ``python -m verl_sat.default.data --out DIR`` writes ``DIR/train.parquet`` and
``DIR/val.parquet``.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_SOURCE = "verl_sat/arith"

TEMPLATE = "{problem} End with the line Answer: $Answer"
"""The user message: the question, then DAPO's answer-format instruction."""

MAX_OPERAND = 99
"""Operands are drawn from [0, MAX_OPERAND]."""

HELDOUT_SEED = 20261201
"""Seed of the study's held-out set (``sat.heldout.seed``'s default, verl_sat.default.heldout)."""


@dataclass(frozen=True)
class Problem:
    """One arithmetic question ``a op b`` and its integer answer."""

    a: int
    b: int
    op: str

    @property
    def text(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a * self.b

    @property
    def solution(self) -> str:
        """The supervised response: the ``Answer:`` line alone (a working line would only add
        tokens to sample, and every sampled token is a chance to go wrong at temperature 1)."""
        return f"Answer: {self.answer}"


def sample_problem(rng: random.Random) -> Problem:
    """Addition of two numbers in [0, MAX_OPERAND].

    A ~1M-parameter model learns the digits' pattern in a few minutes of SFT but still samples
    wrong digits at temperature 1, so RL starts near 0.2-0.4 and has room to climb.
    """
    return Problem(rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND), "+")


def make_prompt(problem: Problem) -> str:
    """The user message: the question and the ``Answer:`` instruction."""
    return TEMPLATE.format(problem=problem.text)


def prompt_ids(tokenizer: Any, problem: Problem) -> list[int]:
    """Token ids of the problem's chat prompt, generation prompt included (what the rollout sees)."""
    messages = [{"role": "user", "content": make_prompt(problem)}]
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])


def to_row(problem: Problem, split: str, index: int) -> dict:
    """A verl RL-dataset row."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": make_prompt(problem)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "question": problem.text},
    }


def sample_problems(
    n: int, seed: int, excluded: frozenset[tuple[int, int]] | set[tuple[int, int]] = frozenset(), distinct: bool = False
) -> list[Problem]:
    """``n`` problems from a seeded generator, skipping every ``(a, b)`` in ``excluded`` (and, if
    ``distinct``, every one already drawn)."""
    rng, out, skipped = random.Random(seed), [], set(excluded)
    while len(out) < n:
        problem = sample_problem(rng)
        if (problem.a, problem.b) not in skipped:
            if distinct:
                skipped.add((problem.a, problem.b))
            out.append(problem)
    return out


def heldout_problems(n: int, seed: int = HELDOUT_SEED) -> list[Problem]:
    """``n`` distinct sums from a seeded generator: the fixed held-out set (never trained on)."""
    return sample_problems(n, seed, distinct=True)


def write_parquet(
    out_dir: str | Path, n_train: int = 2048, n_val: int = 64, seed: int = 0, exclude_heldout: int = 0
) -> tuple[Path, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir`` and return their paths.
    ``exclude_heldout`` = N > 0: no training problem is one of the N held-out sums
    (:func:`heldout_problems`, its default seed), as in the study."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    excluded: set[tuple[int, int]] = set()
    if exclude_heldout > 0:
        excluded = {(p.a, p.b) for p in heldout_problems(exclude_heldout)}
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1)):
        problems = sample_problems(n, split_seed, excluded if split == "train" else frozenset())
        rows = [to_row(p, split, i) for i, p in enumerate(problems)]
        path = out / f"{split}.parquet"
        pd.DataFrame(rows).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exclude-heldout", type=int, default=0, help="keep the first N held-out sums (sat.heldout) out of train"
    )
    args = parser.parse_args()
    print(write_parquet(args.out, args.n_train, args.n_val, args.seed, args.exclude_heldout))


if __name__ == "__main__":
    main()
