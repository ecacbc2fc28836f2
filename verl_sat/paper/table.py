"""The paper's Table 1 as data (docs/reproduce.md), and the canonical method names used by the report.

Yang et al. 2026, "Stale but Stable: Staleness-Adaptive Trust Regions for Stabilizing
Asynchronous Reinforcement Learning", arXiv 2607.18722, Table 1: Qwen3-30B-A3B-Base, AIME24
avg@k in percent (16 samples per problem, best checkpoint) and the last-epoch mean absolute
token log-ratio ``dbar_pi``, at lag 1 and lag 8. Each cell is a single seed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

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


def paper_row(method: str) -> PaperRow | None:
    """The paper's row for a method name (any spelling ``normalize_method`` accepts), or None."""
    return PAPER_TABLE1.get(normalize_method(method))


# verl's loss_mode -> the paper's objective (SAT losses with sat_enabled=false are their base loss).
_OBJECTIVES = {"vanilla": "grpo", "gspo": "gspo", "sat": "grpo", "sat_gspo": "gspo"}
_SAT_LOSSES = ("sat", "sat_gspo")


def _select(cfg: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(cfg, key, default=default)
    return default if value is None else value


def rollout_correction_label(correction: Any) -> str | None:
    """The stabilizer verl's ``algorithm.rollout_correction`` applies, or None.

    verl's v1 trainer applies IS weights and rejection sampling only in decoupled mode
    (``bypass_mode=false``). Token-level IS with one threshold is the paper's TIS; sequence-level
    IS is ``seq_tis``, a ``"lower_upper"`` threshold is IcePop; rejection sampling adds ``rs``.
    """
    if not correction or correction.get("bypass_mode", False):
        return None
    parts = []
    level = correction.get("rollout_is")
    if level is not None:
        threshold = correction.get("rollout_is_threshold")
        if isinstance(threshold, str) and "_" in threshold:
            parts.append("icepop" if level == "token" else f"{level}_icepop")
        else:
            parts.append("tis" if level == "token" else "seq_tis")
    if correction.get("rollout_rs") is not None:
        parts.append("rs")
    return "_".join(parts) or None


def routing_replay_mode(cfg: Any) -> str:
    """``sat.routing_replay``, else the actor engine's own ``router_replay.mode`` (docs/routing_replay.md)."""
    mode = str(_select(cfg, "sat.routing_replay", "disabled"))
    if mode != "disabled":
        return mode
    strategy = str(_select(cfg, "actor_rollout_ref.actor.strategy", ""))
    node = {"megatron": "megatron", "veomni": "veomni"}.get(strategy, "fsdp_config")
    return str(_select(cfg, f"actor_rollout_ref.actor.{node}.router_replay.mode", "disabled"))


def derive_method(cfg: Any) -> str:
    """The method a composed config runs, named as Table 1 names it: ``sat_gspo_r3``, ``grpo_tis``.

    From ``actor_rollout_ref.actor.policy_loss.loss_mode`` and ``sat_enabled`` (the objective),
    ``algorithm.rollout_correction`` (TIS, :func:`rollout_correction_label`) and the routing
    replay mode (``r2`` / ``r3``, :func:`routing_replay_mode`). ``dppo_*`` losses are ``dppo``;
    any other verl loss keeps its loss_mode. ``normalize_method`` leaves the result unchanged.
    """
    loss_mode = str(_select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"))
    sat_on = loss_mode in _SAT_LOSSES and bool(_select(cfg, "actor_rollout_ref.actor.policy_loss.sat_enabled", True))
    objective = "dppo" if loss_mode.startswith("dppo") else _OBJECTIVES.get(loss_mode, loss_mode)
    parts = (["sat"] if sat_on else []) + [objective]
    correction = rollout_correction_label(_select(cfg, "algorithm.rollout_correction"))
    if correction:
        parts.append(correction)
    routing = routing_replay_mode(cfg)
    if routing != "disabled":
        parts.append(routing.lower())
    return "_".join(parts)
