"""Rule-based reward for the arithmetic task, usable as verl's ``custom_reward_function``.

``reward.custom_reward_function.path=<this file> reward.custom_reward_function.name=compute_score``.
Score 1.0 when the integer on the last ``Answer:`` line equals the ground truth, else 0.0.
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


def extract_answer(text: str) -> int | None:
    """The integer after the last ``Answer:`` in ``text``, or None."""
    matches = _ANSWER_RE.findall(text)
    return int(matches[-1]) if matches else None


def compute_score(
    data_source: str | None = None,
    solution_str: str = "",
    ground_truth: str | int = "",
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float:
    """verl reward signature: ``(data_source, solution_str, ground_truth, extra_info) -> float``."""
    predicted = extract_answer(solution_str)
    try:
        return float(predicted is not None and predicted == int(str(ground_truth).strip()))
    except ValueError:
        return 0.0
