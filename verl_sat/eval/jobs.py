"""What an evaluation draws: the sampling settings, one job per (problem, sample), the prompt.

Sample ``j`` of problem ``i`` (in load order) is drawn with seed ``seed + i * k + j``, so a seeded
server never repeats a sample, and a resumed evaluation asks for exactly the seeds an
uninterrupted one would have asked for (docs/eval.md, docs/reproduce.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl_sat.eval.data import Problem

DEFAULT_INSTRUCTION = (
    "Please reason step by step, and put your final answer within \\boxed{}. "
    "The last line of your response should be of the form Answer: <answer>."
)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings (defaults: the paper's evaluation, docs/reproduce.md).

    Args:
        k: samples per problem (paper: 16).
        temperature: sampling temperature (paper: 1.0); 0 means greedy.
        top_p: nucleus mass in (0, 1] (paper: 1.0).
        top_k: top-k cut-off, -1 for none (paper: -1).
        max_tokens: most new tokens per response: 30720, training's ``max_response_length``, so that
            a prompt of up to 2047 tokens + the response fit Qwen3-30B-A3B-Base's 32768-token context
            (docs/reproduce.md, "Context length"; the paper says "32k").
        seed: base seed; sample ``j`` of problem ``i`` uses ``seed + i * k + j`` (None: unseeded).
    """

    k: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 30720
    seed: int | None = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"sampling.k must be >= 1, got {self.k}")
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"sampling.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")

    def sample_seed(self, problem_index: int, sample_index: int) -> int | None:
        """The seed of sample ``sample_index`` of problem ``problem_index``: ``seed + i * k + j``."""
        return None if self.seed is None else self.seed + problem_index * self.k + sample_index


@dataclass(frozen=True)
class Job:
    """One sample to draw: problem ``problem_index`` (in load order, id ``problem_id``), sample ``sample_index``."""

    problem_index: int
    sample_index: int
    messages: tuple[Mapping[str, str], ...]
    seed: int | None
    problem_id: str = ""

    @property
    def name(self) -> str:
        """``problem <id> sample <j>``, for messages."""
        return f"problem {self.problem_id or self.problem_index} sample {self.sample_index}"


@dataclass(frozen=True)
class Completion:
    """A generated response; ``finish_reason`` is ``"stop"`` or ``"length"`` (truncated)."""

    text: str
    finish_reason: str


def build_messages(problem: Problem, instruction: str = DEFAULT_INSTRUCTION) -> tuple[dict[str, str], ...]:
    """Chat messages for a problem: verl rows keep their own messages, others get question + instruction."""
    if problem.messages is not None:
        return tuple(dict(m) for m in problem.messages)
    content = f"{problem.question}\n\n{instruction}" if instruction else problem.question
    return ({"role": "user", "content": content},)


def render_prompt(messages: Sequence[Mapping[str, str]], tokenizer: Any | None = None) -> str:
    """Prompt text: the tokenizer's chat template when it has one, else the message contents joined."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages) + "\n\n"


def make_jobs(
    problems: Sequence[Problem],
    cfg: SamplingConfig,
    instruction: str = DEFAULT_INSTRUCTION,
    skip: frozenset[tuple[int, int]] = frozenset(),
) -> list[Job]:
    """``k`` jobs per problem, each with its own seed, leaving out the (problem, sample) pairs in ``skip``
    (those a resumed evaluation already has); the seeds do not depend on what is skipped."""
    jobs = []
    for i, problem in enumerate(problems):
        messages = build_messages(problem, instruction)
        for j in range(cfg.k):
            if (i, j) not in skip:
                jobs.append(Job(i, j, messages, cfg.sample_seed(i, j), problem.id))
    return jobs
