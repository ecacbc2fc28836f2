"""AIME24 evaluation (docs/reproduce.md): the rule-based verifier, data loading, avg@k / pass@k sampling.

``verify`` and ``compute_score`` are the same verifier used as the training reward. Heavy
dependencies (torch, transformers, datasets) are imported only by the functions that need them.
See docs/eval.md.
"""
