"""The study's held-out metric, one definition for the study loop and the product (docs/study.md).

    problems  = ``problems`` distinct sums from ``random.Random(seed)``, never trained on
    accuracy  = mean_i R(y_i), y_i ~ pi_theta(. | x_i) at temperature 1, ``samples`` per problem,
                the sampling generator seeded with ``seed`` at every evaluation
    greedy    = mean_i R(argmax decoding of x_i)

pi_theta is the *trainer's* policy: its current weights, no rollout mismatch (no logit or router
bias, no noise, no routing replay). R is the default task's rule reward. The same problems and
the same random numbers at every step and in every run, so two runs differ only by their weights.
The study loop (``studies/lib/loop.py``) calls :func:`heldout_accuracy` on its policy; the product
calls it on the actor worker's model (``sat.heldout``, ``verl_sat.trainer.heldout``). The problems
are the task's (:func:`verl_sat.default.data.heldout_problems`, which the parquet writer excludes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_sat.config_node import check_fields, checked, integer
from verl_sat.default import data as task
from verl_sat.default.data import heldout_problems  # noqa: F401  (sat.heldout's problems: one definition)

HELDOUT_KEY = "eval/heldout_acc"
HELDOUT_GREEDY_KEY = "eval/heldout_greedy_acc"


@dataclass
class HeldoutConfig:
    """``sat.heldout``: the study's held-out accuracy in the product (off while ``problems`` is 0).

    Args:
        problems: held-out sums (0: off; the confirmatory study: 512), at most 5000 of the 10,000.
        samples: temperature-1 samples per problem (the study: 2).
        at: optimizer steps after which to evaluate, besides the last one (0: before training,
            logged on step 1's row as ``eval/heldout_acc_initial``). At a lag n > 1 one global
            step holds n optimizer steps; two named steps may not fall in the same global step.
        seed: the held-out set's and its sampling's seed (the study's: 20261201).
    """

    problems: int = checked(0, lambda value: type(value) is int and 0 <= value <= 5000, "an integer in [0, 5000]")
    samples: int = integer(2, low=1)
    at: list[int] = field(default_factory=list)
    seed: int = checked(task.HELDOUT_SEED, lambda value: type(value) is int, "an integer")

    def __post_init__(self) -> None:
        check_fields(self, "sat.heldout")
        steps = list(self.at)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"sat.heldout.at must list optimizer steps >= 0, got {steps!r}")
        self.at = sorted(set(steps))

    @property
    def enabled(self) -> bool:
        return self.problems > 0

    def due(self, step: int, last: int) -> bool:
        """Whether the held-out accuracy is taken after optimizer step ``step`` of ``last``."""
        return self.enabled and (step in self.at or step == last)


def heldout_accuracy(
    model: Any,
    tokenizer: Any,
    problems: list[Any],
    samples: int,
    seed: int,
    max_response_length: int,
) -> dict[str, float]:
    """``{HELDOUT_KEY, HELDOUT_GREEDY_KEY}`` of ``model`` (left in eval mode's caller state:
    the caller switches train/eval) on ``problems``, from a fresh generator seeded ``seed``."""
    from verl_sat.rollout.engine import EngineOptions, HFEngine

    engine = HFEngine.from_model(model, tokenizer, EngineOptions(seed=seed))
    sampled = _score(engine, tokenizer, problems, samples, 1.0, max_response_length)
    greedy = _score(engine, tokenizer, problems, 1, 0.0, max_response_length)
    return {HELDOUT_KEY: sampled, HELDOUT_GREEDY_KEY: greedy}


def _score(
    engine: Any, tokenizer: Any, problems: list[Any], samples: int, temperature: float, max_response_length: int
) -> float:
    """mean R over ``samples`` responses per problem at ``temperature`` (0: greedy)."""
    from verl_sat.default.reward import compute_score
    from verl_sat.rollout.engine import GenerationRequest
    from verl_sat.rollout.sampling import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=-1, top_p=1.0)
    repeated = [p for p in problems for _ in range(samples)]
    requests = [GenerationRequest(task.prompt_ids(tokenizer, p), params, max_response_length) for p in repeated]
    results = engine.generate_batch(requests)
    texts = tokenizer.batch_decode([r.token_ids for r in results], skip_special_tokens=True)
    return sum(compute_score(None, t, p.answer) for t, p in zip(texts, repeated, strict=True)) / len(repeated)


def train_overlap(questions: list[str], problems: list[Any]) -> int:
    """How many held-out problems appear among the training set's ``questions`` (their text)."""
    held = {p.text for p in problems}
    return len(held & set(questions))
