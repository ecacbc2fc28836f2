"""AIME24 evaluation (docs/reproduce.md): the rule-based verifier, data loading, avg@k / pass@k sampling.

``verify`` and ``compute_score`` are the same verifier used as the training reward. Heavy
dependencies (torch, transformers, datasets) are imported only by the functions that need them.
See docs/eval.md.
"""

from verl_sat.eval.metrics import avg_at_k, pass_at_k, pass_at_k_per_problem
from verl_sat.eval.verify import compute_score, extract_answer, is_equivalent, normalize_answer, verify

__all__ = [
    "avg_at_k",
    "compute_score",
    "extract_answer",
    "is_equivalent",
    "normalize_answer",
    "pass_at_k",
    "pass_at_k_per_problem",
    "verify",
]
