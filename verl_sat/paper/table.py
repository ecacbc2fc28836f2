"""The paper's Table 1 as data (docs/reproduce.md), and the canonical method names used by the report.

Yang et al. 2026, "Stale but Stable: Staleness-Adaptive Trust Regions for Stabilizing
Asynchronous Reinforcement Learning", arXiv 2607.18722, Table 1: Qwen3-30B-A3B-Base, AIME24
avg@k in percent (16 samples per problem, best checkpoint) and the last-epoch mean absolute
token log-ratio ``dbar_pi``, at lag 1 and lag 8. Each cell is a single seed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

LAGS = (1, 8)


@dataclass(frozen=True)
class PaperRow:
    """One row of the paper's Table 1.

    Args:
        method: canonical key (``grpo``, ``sat_gspo_r3``, ...).
        label: the row's name in the paper.
        aime24: AIME24 avg@k in percent, by lag.
        dbar_pi: last-epoch mean |log r|, by lag (absent for the base model).
        collapses_later: lags at which the paper notes the run collapses after its best checkpoint.
    """

    method: str
    label: str
    aime24: dict[int, float]
    dbar_pi: dict[int, float] = field(default_factory=dict)
    collapses_later: frozenset[int] = frozenset()


def _row(method: str, label: str, a1: float, a8: float, d1: float | None, d8: float | None, collapse=()) -> PaperRow:
    dbar = {} if d1 is None or d8 is None else {1: d1, 8: d8}
    return PaperRow(method, label, {1: a1, 8: a8}, dbar, frozenset(collapse))


PAPER_TABLE1: dict[str, PaperRow] = {
    row.method: row
    for row in (
        _row("base", "base model", 9.38, 9.38, None, None),
        _row("grpo", "GRPO", 31.25, 30.17, 0.0103, 0.0110, collapse=(8,)),
        _row("gspo", "GSPO", 32.25, 31.46, 0.0097, 0.0109, collapse=(8,)),
        _row("grpo_r3", "GRPO + R3", 31.83, 29.58, 0.0058, 0.0218),
        _row("gspo_r3", "GSPO + R3", 34.00, 33.13, 0.0091, 0.0158),
        _row("grpo_tis", "GRPO + TIS", 31.62, 31.46, 0.0108, 0.0169),
        _row("gspo_tis", "GSPO + TIS", 32.88, 31.21, 0.0151, 0.0208),
        _row("grpo_tis_r3", "GRPO + TIS + R3", 31.79, 31.79, 0.0048, 0.0081),
        _row("gspo_tis_r3", "GSPO + TIS + R3", 31.88, 32.92, 0.0054, 0.0068),
        _row("dppo", "DPPO (DTV, delta 1e-3)", 33.96, 32.71, 0.0108, 0.0118),
        _row("sat_grpo", "SAT-GRPO", 32.71, 32.08, 0.0101, 0.0108),
        _row("sat_gspo", "SAT-GSPO", 34.17, 32.71, 0.0095, 0.0107),
        _row("sat_grpo_r3", "SAT-GRPO + R3", 33.75, 33.13, 0.0056, 0.0079),
        _row("sat_gspo_r3", "SAT-GSPO + R3", 35.83, 34.79, 0.0056, 0.0076),
    )
}

# Names of the base objective (verl's loss_mode "vanilla" is the GRPO clip), mapped onto the paper's.
_BASE_ALIASES = {"grpo": "grpo", "vanilla": "grpo", "gspo": "gspo"}


def normalize_method(name: str) -> str:
    """Canonical method key: ``"SAT-GSPO+R3"`` -> ``"sat_gspo_r3"``, ``"gspo_r3_tis"`` -> ``"gspo_tis_r3"``.

    Token order and separators (``-``, ``_``, ``+``, space) do not matter. Names that are not
    combinations of {sat, grpo|gspo, tis, r3}, ``dppo*`` (+ tis, r3) or ``base*`` come back lower-cased with
    ``_`` separators (the report shows them without paper numbers).
    """
    tokens = [t for t in re.split(r"[-_+\s]+", name.strip().lower()) if t]
    if not tokens:
        raise ValueError(f"empty method name {name!r}")
    if tokens[0] == "base":
        return "base"
    if tokens[0] == "dppo":  # "dppo_tv", "DPPO-Binary-TV": the variant is dropped, stabilizers kept
        return "_".join(["dppo"] + [t for t in ("tis", "r3") if t in tokens])
    objectives = [_BASE_ALIASES[t] for t in tokens if t in _BASE_ALIASES]
    known = {"sat", "tis", "r3", *_BASE_ALIASES}
    if len(objectives) != 1 or any(t not in known for t in tokens):
        return "_".join(tokens)
    parts = (["sat"] if "sat" in tokens else []) + objectives
    if "tis" in tokens:
        parts.append("tis")
    if "r3" in tokens:
        parts.append("r3")
    return "_".join(parts)
