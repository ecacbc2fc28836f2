"""Which tokens SAT-GRPO's gate contracts, the sign of their advantages, and their share of the update.

The definitions of studies/token_level/study_protocol_token.md, as functions of one optimizer
step's tensors (all (B, R) over the response tokens):

    class(t)   = eos     if t is an end-of-turn id
                 format  if t is a token of the ``Answer: `` scaffold (the ids of DAPO's answer prefix)
                 digit   if t decodes to decimal digits only (the answer's digits)
                 other   otherwise
    d          = clamp(log pi - log mu, -20, 20)                 (SAT's token score, docs/sat.md#the-rule)
    gated      = 1{q > 0, |d| > q},  q = the alpha-quantile of |d| (the arm's alpha and kernel exponent)
    g_base_t   = d loss_GRPO / d log pi_t                        (PPO's clipped surrogate, SAT off)
    g_sat_t    = d loss_SAT  / d log pi_t                        (the same loss with SAT's contracted clip)
    delta_t    = g_base_t - g_sat_t                              (nonzero exactly at SAT's intercepted tokens)
    removed weight share      = sum_t |delta_t| / sum_t |g_base_t|  (per class: the class's |delta| over the total)
    parameter gradients       G_base = J^T g_base, G_I = J^T delta,  J = d log pi / d theta
    removed gradient share    = ||G_I|| / ||G_base||
    projected removed share   = <G_I, G_base> / ||G_base||^2     (the part of GRPO's step SAT takes away)

With SAT on, the arm's gradient is G_base - G_I; with SAT off, delta is what SAT would remove
(the counterfactual). The losses are verl's registered ones (``sat`` with ``sat_enabled``
false is verl's ``vanilla`` bit for bit, tests/test_losses_on_cpu.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

TOKEN_CLASSES = ("digit", "format", "eos", "other")
DIGIT, FORMAT, EOS, OTHER = range(len(TOKEN_CLASSES))
ANSWER_PREFIX = "Answer: "
"""the scaffold of DAPO's answer line (verl_sat.default.data.Problem.solution without the number)"""
PREFIX = "token/"


def class_table(tokenizer: Any, eos_ids: Iterable[int]) -> torch.Tensor:
    """(V,) long: the class index of every vocabulary id (the module docstring's rule, eos first)."""
    size = len(tokenizer)
    table = torch.full((size,), OTHER, dtype=torch.long)
    for i in range(size):
        text = tokenizer.decode([i]).strip()
        if text and text.isdecimal():
            table[i] = DIGIT
    for i in tokenizer(ANSWER_PREFIX, add_special_tokens=False)["input_ids"]:
        if table[i] == OTHER:
            table[i] = FORMAT
    for i in eos_ids:
        table[i] = EOS
    return table


def classify(response_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(B, R) class index of each response token (ids outside the table: ``other``)."""
    ids = response_ids.long()
    inside = (ids >= 0) & (ids < table.numel())
    return torch.where(inside, table[ids.clamp(0, table.numel() - 1)], torch.full_like(ids, OTHER))


def token_gradient(
    loss_fn: Any,
    old: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    agg: str,
    config: Any,
) -> torch.Tensor:
    """d loss / d log pi_t for every token of the step (a leaf copy of log pi; the network untouched)."""
    leaf = log_prob.detach().clone().requires_grad_(True)
    loss, _ = loss_fn(old, leaf, advantages, mask, agg, config, None)
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad.detach()


def class_metrics(
    classes: torch.Tensor,
    mask: torch.Tensor,
    gated: torch.Tensor,
    d: torch.Tensor,
    advantages: torch.Tensor,
    g_base: torch.Tensor,
    delta: torch.Tensor,
) -> dict[str, float]:
    """Per class c (``token/<key>_<c>``): active, gated (and gated with d > 0; with A > 0, A < 0, A = 0),
    intercepted (delta != 0) with A > 0 and A < 0, |g_base| and |delta| summed; totals without suffix."""
    active = mask.bool()
    gated = gated & active
    icpt = (delta != 0) & active
    out: dict[str, float] = {}
    for c, name in enumerate(TOKEN_CLASSES):
        in_c = active & (classes == c)
        g = gated & in_c
        i = icpt & in_c
        cells = {
            "active": in_c,
            "gated": g,
            "gated_dpos": g & (d > 0),
            "gated_apos": g & (advantages > 0),
            "gated_aneg": g & (advantages < 0),
            "gated_azero": g & (advantages == 0),
            "icpt_apos": i & (advantages > 0),
            "icpt_aneg": i & (advantages < 0),
        }
        out.update({f"{PREFIX}{k}_{name}": float(v.sum()) for k, v in cells.items()})
        out[f"{PREFIX}wbase_{name}"] = float(g_base.abs()[in_c].sum())
        out[f"{PREFIX}wrem_{name}"] = float(delta.abs()[in_c].sum())
    wbase = float(g_base.abs()[active].sum())
    wrem = float(delta.abs()[active].sum())
    out.update(
        {
            f"{PREFIX}active": float(active.sum()),
            f"{PREFIX}gated": float(gated.sum()),
            f"{PREFIX}intercepted": float(icpt.sum()),
            f"{PREFIX}wbase": wbase,
            f"{PREFIX}wrem": wrem,
            f"{PREFIX}removed_weight_share": wrem / wbase if wbase > 0 else 0.0,
        }
    )
    return out


def parameter_shares(
    log_prob: torch.Tensor, g_base: torch.Tensor, delta: torch.Tensor, params: Sequence[torch.Tensor]
) -> dict[str, float]:
    """||G_I|| / ||G_base|| and <G_I, G_base> / ||G_base||^2 with G = J^T g (log_prob in the graph, kept)."""
    params = [p for p in params if p.requires_grad]
    base = torch.autograd.grad(log_prob, params, grad_outputs=g_base, retain_graph=True, allow_unused=True)
    removed = torch.autograd.grad(log_prob, params, grad_outputs=delta, retain_graph=True, allow_unused=True)
    return shares_of(base, removed)


def shares_of(base: Sequence[torch.Tensor | None], removed: Sequence[torch.Tensor | None]) -> dict[str, float]:
    """The two parameter-space shares of the protocol from per-parameter gradients (None: zero)."""
    nb = nr = dot = 0.0
    for b, r in zip(base, removed, strict=True):
        if b is not None:
            nb += float(b.double().pow(2).sum())
        if r is not None:
            nr += float(r.double().pow(2).sum())
        if b is not None and r is not None:
            dot += float((b.double() * r.double()).sum())
    return {
        f"{PREFIX}grad_base_norm": nb**0.5,
        f"{PREFIX}grad_removed_norm": nr**0.5,
        f"{PREFIX}grad_removed_share": (nr / nb) ** 0.5 if nb > 0 else 0.0,
        f"{PREFIX}grad_removed_proj": dot / nb if nb > 0 else 0.0,
    }
