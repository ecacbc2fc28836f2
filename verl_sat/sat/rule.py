"""The SAT rule: staleness score -> batch reference q -> kernel -> contraction (docs/sat.md#the-rule).

One rule, shared by the token-level loss ``sat`` and the sequence-level loss ``sat_gspo``;
only the score ``d`` differs (token log-ratio vs. GSPO's length-normalised sequence log-ratio
broadcast to the response's tokens, docs/sat.md#sequence-level).

Paper: "Stale but Stable: Staleness-Adaptive Trust Regions for Stabilizing Asynchronous
Reinforcement Learning", https://arxiv.org/abs/2607.18722
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from verl_sat.sat.quantile import quantile_rank

LOG_RATIO_CLAMP = 20.0  # verl's vanilla clamps log r to [-20, 20] before exp

# Integer/low-precision dtypes are selected in fp32: every bf16/fp16 value is exact in fp32,
# so the selected element, cast back, is bit-exact.
_SELECT_DTYPES = (torch.float32, torch.float64)


def top_m(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The m largest entries of the flat x and their flat indices, unordered: the selection step.

    ``torch.topk`` is a selection (no full sort, no 16M-element limit unlike ``torch.quantile``);
    we do not use ``torch.kthvalue``, whose CPU quickselect degrades to O(n^2) on descending input
    (30 s for 1M elements, measured). This is the one place a faster exact selection plugs in.
    """
    work = x.reshape(-1)
    work = work if work.dtype in _SELECT_DTYPES else work.float()
    top = torch.topk(work, m, sorted=False)
    return top.values, top.indices


def padded_log_ratio(lp: torch.Tensor, ref: torch.Tensor, response_mask: torch.Tensor, clamp: bool) -> torch.Tensor:
    """log pi - log ref at active tokens (clamped to +-20 if asked), 0 at padding, whatever it holds."""
    x = lp - ref
    if clamp:
        x = x.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.where(response_mask.bool(), x, 0.0)


def sequence_score(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """log rho_b = sum_t x_{b,t} / max(|y_b|, 1) for SAT's score (docs/sat.md#sequence-level), summed in float64.

    An fp32 row sum's rounding depends on how far the row is padded (tried: 30% of rows differ in
    the last bit between two widths), and the step's q pads to the mini-batch while the loss pads
    to its micro-batch: a response scored exactly at q could then be gated in the loss and break
    the 1 - alpha bound. In float64 the sum is width-independent in all but ~1e-9 of cases.
    """
    return (x.double().sum(-1) / lengths.clamp(min=1).double()).to(x.dtype)


def staleness_score(level: str, log_prob: torch.Tensor, ref: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The detached score d (docs/sat.md#the-rule, step 1), 0 at padding, whatever padding holds.

    token:    d_{b,t} = clamp(log pi_{b,t} - log ref_{b,t}, -20, 20)          (verl's vanilla clamp)
    sequence: d_{b,t} = log rho_b = sum_t (log pi - log ref) / |y_b| on each active t of response b
              (docs/sat.md#sequence-level: broadcast, then the quantile is length-weighted)
    """
    x = padded_log_ratio(log_prob.detach(), ref, response_mask, clamp=level == "token")
    if level == "token":
        return x
    score = sequence_score(x, torch.sum(response_mask, dim=-1))
    return torch.where(response_mask.bool(), score.unsqueeze(-1), 0.0)


def kernel_psi(u: torch.Tensor, q: torch.Tensor, kernel: str, exponent: float) -> torch.Tensor:
    """psi(u; q) with psi(0) = 1, psi(q) = 1/2, non-increasing in u (docs/sat.md#the-rule, step 4).

    hill:        psi = 1 / (1 + (u/q)^p)        (paper: "Hill kernel, exponent 2")
    exponential: psi = 2^(-(u/q)^p)
    """
    z = (u / q) ** exponent
    if kernel == "hill":
        return 1.0 / (1.0 + z)
    if kernel == "exponential":
        return torch.exp2(-z)
    raise ValueError(f"unknown SAT kernel {kernel!r}; expected 'hill' or 'exponential'")


@dataclass
class SATFactors:
    """What the rule computes for one (micro)batch, all detached.

    Only gated tokens (at most a fraction 1 - alpha of T_act) carry a contraction, so the
    factors are kept at those tokens: ``idx`` indexes the flattened score, ``c`` = psi(|d|; q)
    there, ``positive`` = sign(d) > 0 there (c_plus = c where positive, c_minus = c elsewhere,
    both 1 off the gate). ``gate`` gives the dense view of the score's ``shape``, built only when read.
    """

    q: torch.Tensor  # () the batch reference
    idx: torch.Tensor  # (G,) flat indices of the gated tokens
    c: torch.Tensor  # (G,) psi(|d|; q) at the gated tokens, in (0, 1/2); fp32 or wider
    positive: torch.Tensor  # (G,) bool, d > 0 at the gated tokens
    shape: torch.Size  # the score's shape

    @functools.cached_property
    def gate(self) -> torch.Tensor:
        """bool, shape of d: 1{mask, q > 0, |d| > q}."""
        out = torch.zeros(self.shape, dtype=torch.bool, device=self.idx.device).reshape(-1)
        out[self.idx] = True
        return out.view(self.shape)


def sat_factors(
    d: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    kernel: str,
    exponent: float,
    q: torch.Tensor | None = None,
) -> SATFactors:
    """Staleness score d -> (q, gate, c_plus, c_minus) (docs/sat.md#the-rule, steps 1-5).

    ``q``: the batch reference when it was taken over more than this micro-batch (the optimizer
    step, ``sat_quantile_scope=step``); None takes it over ``mask`` here (``micro_batch``).

    d_sg    = stopgrad(d)
    q       = stopgrad(alpha-quantile of |d_sg| over T_act)
    u_plus  = max(d_sg, 0),  u_minus = max(-d_sg, 0)
    gate    = 1{q > 0 and |d_sg| > q}
    c_plus  = psi(u_plus; q)  if gate else 1
    c_minus = psi(u_minus; q) if gate else 1
    A gated token has exactly one of u_plus, u_minus equal to |d_sg| > 0 and the other 0, where
    psi(0) = 1: so only the endpoint on the side of sign(d) can move.

    Padding is set to |d| = 0, below every active value, so the k-th smallest active |d| is the
    minimum of the m = n - k + 1 largest of all positions: the selection needs no mask, and its
    indices are the candidates for the gate (the gated tokens are among the m largest).
    """
    mask = mask.bool()
    d = d.detach().masked_fill(~mask, 0.0)  # padding may hold anything, -inf and NaN included
    n = int(mask.sum().item())
    a = d.abs()
    if q is not None:  # the optimizer step's q (sat_quantile_scope=step): gate against it here
        q = q.to(device=d.device, dtype=d.dtype)
        idx = ((a > q) & (q > 0)).reshape(-1).nonzero().squeeze(-1)
    elif n == 0:
        q = torch.zeros((), dtype=d.dtype, device=d.device)
        idx = torch.zeros(0, dtype=torch.long, device=d.device)
    else:
        values, indices = top_m(a, n - quantile_rank(alpha, n) + 1)
        q_sel = values.min()
        q = q_sel.to(d.dtype)
        idx = indices[(values > q_sel) & (q_sel > 0)]
    d_gated = d.reshape(-1)[idx]
    # the kernel in at least fp32: in bf16, u/q just above 1 rounds psi up to exactly 1/2
    work = torch.promote_types(d.dtype, torch.float32)
    c = kernel_psi(d_gated.abs().to(work), q.to(work), kernel, exponent)
    return SATFactors(q=q, idx=idx, c=c, positive=d_gated > 0, shape=d.shape)


def gated_bounds(f: SATFactors, eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[1 - eps_low~, 1 + eps_high~] at the gated tokens (docs/sat.md#the-rule, step 6); (G,) each.

    The one place the adaptive radii are written; every clip endpoint SAT moves comes from here.
    Only the endpoint on the side of sign(d) moves inward (c < 1/2 there, 1 on the other side):

    eps_low~  = eps_low * c_minus,   c_minus = c where d < 0, else 1
    eps_high~ = eps_high * c_plus,   c_plus  = c where d > 0, else 1
    """
    lower = torch.where(f.positive, 1.0 - eps_low, 1.0 - eps_low * f.c)
    upper = torch.where(f.positive, 1.0 + eps_high * f.c, 1.0 + eps_high)
    return lower, upper


def sat_clip(ratio: torch.Tensor, f: SATFactors, eps_low: float, eps_high: float) -> torch.Tensor:
    """clip(r, 1 - eps_low~, 1 + eps_high~), differentiable in r (docs/sat.md#the-rule, step 7).

    PPO's clip with scalar radii everywhere (the very op verl's losses use, so ungated tokens
    are bit-identical), then the gated tokens re-clipped to their contracted interval.
    """
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    if f.idx.numel() == 0:
        return clipped
    lower_g, upper_g = gated_bounds(f, eps_low, eps_high)
    r_gated = ratio.reshape(-1)[f.idx]
    reclipped = torch.clamp(r_gated, lower_g.to(ratio.dtype), upper_g.to(ratio.dtype))
    return clipped.reshape(-1).index_put((f.idx,), reclipped).view_as(ratio)


def intercepted(
    ratio: torch.Tensor, advantages: torch.Tensor, f: SATFactors, eps_low: float, eps_high: float
) -> torch.Tensor:
    """Number of tokens in a band clipped by SAT and not by PPO (docs/sat.md#the-rule, exact locus of change).

    {A > 0, 1 + eps_high~ < r < 1 + eps_high}  or  {A < 0, 1 - eps_low < r < 1 - eps_low~}
    Only gated tokens have a contracted interval, so only they are examined. The endpoints are
    cast to the ratio's dtype, as ``sat_clip`` casts them: in bf16 a contracted endpoint within
    an ulp of r rounds onto it, and the clip then does not bind there.
    """
    r = ratio.detach().reshape(-1)[f.idx]
    lower_g, upper_g = (bound.to(r.dtype) for bound in gated_bounds(f, eps_low, eps_high))
    adv = advantages.reshape(-1)[f.idx]
    upper_band = (adv > 0) & (r > upper_g) & (r < 1.0 + eps_high)
    lower_band = (adv < 0) & (r < lower_g) & (r > 1.0 - eps_low)
    return (upper_band | lower_band).sum()
