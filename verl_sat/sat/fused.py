"""SAT's clipped surrogates in few passes, with a closed-form backward (docs/sat.md#the-rule, step 7).

verl's ``vanilla`` and ``gspo`` build -S from about ten autograd ops, and autograd walks them
all back. Per token, -S is a product -A * r_eff with r_eff one of r, a clip endpoint or the dual
clip's c, so (-A) * r_eff equals verl's max/min chain bit for bit (a product with a fixed factor
is monotone in fp). Its gradient in log pi is

    d(-S)/d log pi = (g * -A) * r   where r_eff = r (not clipped),   0 elsewhere,

the very products, in the very order, that autograd forms for verl's loss (g: the gradient of the
aggregated loss at the token, from verl's own ``agg_loss``). Only at exact rounding ties of
max/min (r within one ulp of a clip endpoint, where two products round equal) does autograd split
the gradient in half; here it flows whole or not at all. ``losses.py`` therefore calls verl's
own loss when no token is gated, so that case stays bit-identical even there.

The two forward paths below compute the SAT terms on the gated tokens only (token level) or on
the sequences (sequence level, docs/sat.md#sequence-level: the score is constant along a response,
so q is a length-weighted quantile of B values), and read every metric from tensors the loss needs
anyway, in one device-to-host transfer (``GatedStats.read``). Device-agnostic: plain torch ops,
no host loops over tokens.

Paper: https://arxiv.org/abs/2607.18722 (SAT); GSPO: https://arxiv.org/abs/2507.18071
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from verl_sat.sat.rule import RuleSettings, SATFactors, gated_bounds, kernel_psi, padded_factors, quantile_rank

LOG_RATIO_CLAMP = 20.0  # verl's vanilla clamps log r to [-20, 20] before exp
GSPO_LOG_RATIO_MAX = 10.0  # verl's gspo clamps log s_{b,t} at 10 before exp


class ClippedSurrogate(torch.autograd.Function):
    """-S_{b,t} as a function of log pi_{b,t}; forward hands back the precomputed per-token loss.

    backward: d(-S)/d log pi = (g * neg_adv) * ratio_kept, with ratio_kept = r where the token
    is active and not clipped (and inside verl's log-ratio clamp), 0 elsewhere.
    """

    @staticmethod
    def forward(ctx, log_prob, loss, neg_adv, ratio_kept):  # noqa: ARG004 (log_prob: the grad's target)
        ctx.save_for_backward(neg_adv, ratio_kept)
        return loss

    @staticmethod
    def backward(ctx, grad):
        neg_adv, ratio_kept = ctx.saved_tensors
        return grad * neg_adv * ratio_kept, None, None, None


@dataclass
class StepScore:
    """The optimizer step's score and reference (``sat_quantile_scope=step``, docs/sat.md#the-rule, step 2).

    ``log_prob``: log pi of the score from the step's scoring pass (None: this micro-batch's
    own log pi); ``q``: the step's q (None: take q over this micro-batch).
    """

    log_prob: torch.Tensor | None = None
    q: torch.Tensor | None = None


@dataclass
class Surrogate:
    """One micro-batch's fused forward: the per-token loss, the rule's factors, the metrics
    (None stands for a micro-batch without active tokens)."""

    loss: torch.Tensor | None  # (B, T) -S, differentiable in log pi; None: no token gated
    factors: SATFactors  # q and the gated tokens (dense views on demand)
    n_gated: int  # |{active tokens with q > 0, |d| > q}|
    metrics: dict[str, float]  # verl's three loss metrics and SAT's (docs/sat.md#diagnostics)
    clean_padding: bool = True  # False: padding held -inf or NaN log-probs


def endpoints(dtype: torch.dtype, device: torch.device, eps_low: float, eps_high: float):
    """1 - eps_low and 1 + eps_high, cast as verl's clamp casts its Python-scalar bounds."""
    lo = torch.tensor(1.0 - eps_low, dtype=dtype, device=device)
    hi = torch.tensor(1.0 + eps_high, dtype=dtype, device=device)
    return lo, hi


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


def _masked(x: torch.Tensor, response_mask: torch.Tensor, fallback) -> tuple[torch.Tensor, int, bool]:
    """(x * mask, n active, clean) in one transfer, or ``fallback()`` where padding held -inf or
    NaN (which x * mask turns into NaN). ``x`` is multiplied in place when the dtypes allow."""
    x = x.mul_(response_mask) if x.dtype == torch.promote_types(x.dtype, response_mask.dtype) else x * response_mask
    n, total = torch.stack([response_mask.sum(dtype=torch.float64), x.sum(dtype=torch.float64)]).tolist()
    clean = math.isfinite(total)
    return (x if clean else fallback().to(x.dtype)), int(n), clean


def ungated_metrics(eps_low: float, eps_high: float, q: float = 0.0, mismatch: float = 0.0) -> dict[str, float]:
    """SAT's metrics of a micro-batch in which SAT gates nothing (docs/sat.md#diagnostics).

    No token gated: the radii stay eps_low and eps_high, nothing is intercepted. ``q``: the batch
    reference; ``mismatch``: dbar_pi. The one source of this dict (``_ungated``, ``losses.empty_batch``).
    """
    return {
        "actor/sat_q": q,
        "actor/sat_gate_rate": 0.0,
        "actor/sat_c_min": 1.0,
        "actor/sat_eps_low_mean": eps_low,
        "actor/sat_eps_high_mean": eps_high,
        "actor/sat_intercepted_frac": 0.0,
        "actor/mismatch_abs_mean": mismatch,  # dbar_pi (paper Eq. 52)
    }


def _ungated(f: SATFactors, n: int, abs_d: torch.Tensor, clean: bool, eps_low: float, eps_high: float) -> Surrogate:
    """No token gated: SAT's metrics only; the loss is the base loss itself (``losses._finish``)."""
    q, abs_sum = torch.stack([f.q.double(), abs_d.sum().double()]).tolist()
    metrics = ungated_metrics(eps_low, eps_high, q=q, mismatch=abs_sum / n)
    return Surrogate(loss=None, factors=f, n_gated=0, metrics=metrics, clean_padding=clean)


def _kept(loss: torch.Tensor, p1: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1{-S = -A r} at active tokens, 0 elsewhere, as a float tensor of the loss's dtype."""
    return torch.eq(loss, p1, out=torch.empty_like(loss)).mul_(response_mask)


def _binding_bound(f: SATFactors, adv: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """The endpoint of ``rule.gated_bounds`` that binds at each gated token: 1 + eps_high~ for A > 0,
    1 - eps_low~ for A < 0; ``adv``: A at the gated tokens."""
    lower, upper = gated_bounds(f, eps_low, eps_high)
    return torch.where(adv > 0, upper, lower)


def _band(r: torch.Tensor, adv: torch.Tensor, bound: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """{A > 0, 1 + eps_high~ < r < 1 + eps_high} or {A < 0, 1 - eps_low < r < 1 - eps_low~}."""
    return ((adv > 0) & (r > bound) & (r < hi)) | ((adv < 0) & (r < bound) & (r > lo))


@dataclass(frozen=True)
class GatedStats:
    """The host values a gated micro-batch's metrics read (docs/sat.md#diagnostics); sums in float64."""

    unclipped: float  # active tokens with -S = -A r (not clipped)
    lower: float  # active tokens the dual clip lowers (-S < -A r); 0 in GSPO
    d_sum: float  # sum of d over T_act (verl's ppo_kl is its negated mean)
    abs_sum: float  # sum of |log pi - log mu| over T_act (dbar_pi's numerator)
    band: float  # active tokens clipped by SAT and not by the base loss
    extreme: float  # min d (token level) or max log rho_b (sequence level): whether verl's clamp binds
    q: float  # the batch reference
    c_min: float  # min c over the gated tokens
    shrink_low: float  # sum (1 - c) over the gated tokens with d < 0
    shrink_high: float  # sum (1 - c) over the gated tokens with d > 0

    @classmethod
    def read(cls, f: SATFactors, **loss_stats: torch.Tensor) -> GatedStats:
        """The loss's 0-d float64 statistics, by name, and SAT's from ``f``, in one device-to-host transfer."""
        shrink = 1.0 - f.c
        high = torch.where(f.positive, shrink, 0.0).sum(dtype=torch.float64)
        sat_stats = {
            "q": f.q.double(),
            "c_min": f.c.min().double(),
            "shrink_low": shrink.sum(dtype=torch.float64) - high,
            "shrink_high": high,
        }
        tensors = {**loss_stats, **sat_stats}
        values = torch.stack(list(tensors.values())).tolist()
        return cls(**dict(zip(tensors, values, strict=True)))

    def metrics(self, n: int, n_gated: int, eps_low: float, eps_high: float) -> dict[str, float]:
        """verl's three loss metrics and SAT's, over the n active tokens."""
        return {
            "actor/pg_clipfrac": (n - self.unclipped - self.lower) / n,
            "actor/ppo_kl": -self.d_sum / n,
            "actor/pg_clipfrac_lower": self.lower / n,
            "actor/sat_q": self.q,
            "actor/sat_c_min": self.c_min,
            "actor/sat_eps_low_mean": eps_low * (1 - self.shrink_low / n),  # mean(eps_low c_minus)
            "actor/sat_eps_high_mean": eps_high * (1 - self.shrink_high / n),  # mean(eps_high c_plus)
            "actor/sat_intercepted_frac": self.band / n,  # clipped by SAT, not by the base loss
            "actor/mismatch_abs_mean": self.abs_sum / n,  # dbar_pi (paper Eq. 52)
            "actor/sat_gate_rate": n_gated / n,  # mean 1{q > 0, |d| > q} over T_act
        }


def token_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    score_ref: torch.Tensor,
    mu: torch.Tensor,
    rule: RuleSettings,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float,
    step: StepScore | None = None,
) -> Surrogate | None:
    """SAT-PPO's -S with verl's dual clip (docs/sat.md#the-rule), as ``ClippedSurrogate``.

    d   = clamp(log pi - log pi_old, -20, 20) at active tokens, 0 at padding
    r   = exp(d)                                                    (the tensor verl exponentiates)
    -S  = clamp(-A r, -A b, c |A|),  b = 1 + eps_high~ (A > 0) or 1 - eps_low~ (A < 0)
        = max(-A r, -A clip(r, 1 - eps_low~, 1 + eps_high~)), then min(., -A c) for A < 0
    The score d (and dbar_pi) use ``score_ref`` (``mu``);
    ``step``: the step's score log pi and q, when taken over the optimizer step.
    """
    step = step or StepScore()
    with torch.no_grad():
        lp = log_prob.detach()
        d, n, clean = _masked(
            torch.sub(lp, old_log_prob).clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
            response_mask,
            lambda: padded_log_ratio(lp, old_log_prob, response_mask, clamp=True),
        )
        if n == 0:
            return None
        if step.log_prob is not None:  # the step's scoring pass: d at the step's weights
            ds = padded_log_ratio(step.log_prob, score_ref, response_mask, clamp=True)
        else:
            ds = d if score_ref is old_log_prob else padded_log_ratio(lp, score_ref, response_mask, clamp=True)
        abs_ds = ds.abs()
        f = padded_factors(ds, n, rule.alpha, rule.kernel, rule.exponent, abs_ds, q=step.q)
        if mu is score_ref and step.log_prob is None:
            abs_d = abs_ds
        else:
            abs_d = padded_log_ratio(lp, mu, response_mask, clamp=True).abs_()
        if f.idx.numel() == 0:
            return _ungated(f, n, abs_d, clean, eps_low, eps_high)
        ratio = torch.exp(d)
        lo, hi = endpoints(ratio.dtype, ratio.device, eps_low, eps_high)
        neg_adv = -advantages
        bound = torch.lerp(lo, hi, torch.sign(advantages).clamp_(min=0))  # 1 + eps_high if A > 0, else 1 - eps_low
        adv_g = advantages.reshape(-1)[f.idx]
        bound_g = _binding_bound(f, adv_g, eps_low, eps_high).to(bound.dtype)
        bound.view(-1)[f.idx] = bound_g
        n_band = _band(ratio.reshape(-1)[f.idx], adv_g, bound_g, lo, hi).sum().double()
        p1 = neg_adv * ratio  # -A r
        upper = advantages.abs().mul_(clip_ratio_c)  # -A c where A < 0 (dual clip); >= -S where A > 0
        loss = torch.clamp(p1, neg_adv.mul(bound), upper)
        kept = _kept(loss, p1, response_mask)
        n_lower = p1.sub_(loss).clamp_(min=0).sign_().sum(dtype=torch.float64)  # dual clip: -S < -A r
        f64 = torch.float64
        stats = GatedStats.read(
            f,
            unclipped=kept.sum(dtype=f64),
            lower=n_lower,
            d_sum=d.sum(dtype=f64),
            abs_sum=abs_d.sum(dtype=f64),
            band=n_band,
            extreme=d.amin().double(),
        )
        ratio_kept = ratio.mul_(kept)
        if stats.extreme <= -LOG_RATIO_CLAMP:  # verl's clamp passes no gradient below
            ratio_kept.mul_((lp - old_log_prob) >= -LOG_RATIO_CLAMP)
    loss = ClippedSurrogate.apply(log_prob, loss, neg_adv, ratio_kept)
    metrics = stats.metrics(n, f.idx.numel(), eps_low, eps_high)
    return Surrogate(loss=loss, factors=f, n_gated=f.idx.numel(), metrics=metrics)


def sequence_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    score_ref: torch.Tensor,
    mu: torch.Tensor,
    rule: RuleSettings,
    eps_low: float,
    eps_high: float,
    step: StepScore | None = None,
) -> Surrogate | None:
    """SAT-GSPO's -S (docs/sat.md#sequence-level), as ``ClippedSurrogate``.

    log rho_b = sum_t (log pi - log pi_old) m / max(|y_b|, 1)      (verl's gspo, the same ops)
    s_{b,t}   = exp(min(log rho_b, 10)), gradient form sg[rho_b] pi / sg[pi]
    -S        = max(-A s, -A b),  b = 1 + eps_high~_b (A > 0) or 1 - eps_low~_b (A < 0)
    The score is log rho_b on each of the |y_b| tokens of response b, so q is the length-weighted
    quantile of B sequence scores and the contraction is per sequence.
    """
    step = step or StepScore()
    with torch.no_grad():
        lp = log_prob.detach()
        lengths = torch.sum(response_mask, dim=-1)  # |y_b|
        d = torch.sub(lp, old_log_prob)
        d = d.mul_(response_mask) if d.dtype == torch.promote_types(d.dtype, response_mask.dtype) else d * response_mask
        row_sum = torch.sum(d, dim=-1)
        # one transfer: n active, the finiteness check (row sums are NaN where padding held -inf or
        # NaN), and the responses with an active token
        f64 = torch.float64
        n, total, n_seqs = torch.stack(
            [lengths.sum(dtype=f64), row_sum.sum(dtype=f64), (lengths > 0).sum().to(f64)]
        ).tolist()
        n, clean = int(n), math.isfinite(total)
        if n == 0:
            return None
        if not clean:
            d = padded_log_ratio(lp, old_log_prob, response_mask, False).to(d.dtype)
            row_sum = torch.sum(d, dim=-1)
        seq_lengths = lengths.clamp(min=1)
        log_rho = row_sum / seq_lengths  # log rho_b, verl's ops (the ratio)
        # log rho_b again for the gate, width-independent (sequence_score)
        if step.log_prob is not None:  # the step's scoring pass: log rho_b at the step's weights
            score = sequence_score(padded_log_ratio(step.log_prob, score_ref, response_mask, clamp=False), lengths)
        elif score_ref is not old_log_prob:
            score = sequence_score(padded_log_ratio(lp, score_ref, response_mask, clamp=False), lengths)
        else:
            score = sequence_score(d, lengths)
        per_row = sequence_factors(score, lengths, n, rule, eps_low, eps_high, q=step.q)
        f = token_factors(per_row.factors, response_mask)
        abs_d = d.abs() if mu is old_log_prob else padded_log_ratio(lp, mu, response_mask, clamp=False).abs_()
        if f.idx.numel() == 0:
            out = _ungated(f, n, abs_d, clean, eps_low, eps_high)
            out.metrics["actor/sat_seqs_per_micro_batch"] = n_seqs
            return out
        s = torch.exp(log_rho.unsqueeze(-1).expand_as(lp).contiguous().clamp_(max=GSPO_LOG_RATIO_MAX))
        neg_adv = -advantages
        # a gated token lies in a gated row: the rows and their endpoints are there
        rows, lower, upper = per_row.rows, per_row.lower.unsqueeze(-1), per_row.upper.unsqueeze(-1)
        bound = torch.lerp(lower, upper, torch.sign(advantages).clamp_(min=0))
        p1 = neg_adv * s  # -A s
        loss = torch.maximum(p1, neg_adv.mul(bound))
        kept = _kept(loss, p1, response_mask)
        lo, hi = endpoints(s.dtype, s.device, eps_low, eps_high)
        band = _band(s[rows], advantages[rows], bound[rows].to(s.dtype), lo, hi)
        n_band = (band & response_mask[rows].bool()).sum().double()
        n_lower = torch.zeros((), dtype=torch.float64, device=d.device)  # no dual clip in GSPO
        f64 = torch.float64
        stats = GatedStats.read(
            f,
            unclipped=kept.sum(dtype=f64),
            lower=n_lower,
            d_sum=d.sum(dtype=f64),
            abs_sum=abs_d.sum(dtype=f64),
            band=n_band,
            extreme=log_rho.amax().double(),
        )
        ratio_kept = s.mul_(kept)
        if stats.extreme > GSPO_LOG_RATIO_MAX:  # verl's clamp passes no gradient above
            ratio_kept.mul_((log_rho <= GSPO_LOG_RATIO_MAX).unsqueeze(-1))
    loss = ClippedSurrogate.apply(log_prob, loss, neg_adv, ratio_kept)
    metrics = stats.metrics(n, f.idx.numel(), eps_low, eps_high)
    metrics["actor/pg_clipfrac_lower"] = 0.0
    metrics["actor/sat_seqs_per_micro_batch"] = n_seqs
    return Surrogate(loss=loss, factors=f, n_gated=f.idx.numel(), metrics=metrics)


class RowFactors(NamedTuple):
    """``sequence_factors``: the rule applied per response."""

    factors: SATFactors  # per row: idx = the gated rows, shape (B,)
    rows: torch.Tensor  # (G,) the gated rows (= factors.idx)
    lower: torch.Tensor | None  # (B,) 1 - eps_low~_b, exactly 1 - eps_low on ungated rows; None: no row gated
    upper: torch.Tensor | None  # (B,) 1 + eps_high~_b, exactly 1 + eps_high on ungated rows; None: no row gated


def sequence_factors(
    score: torch.Tensor,
    lengths: torch.Tensor,
    n: int,
    rule: RuleSettings,
    eps_low: float,
    eps_high: float,
    q: torch.Tensor | None = None,
) -> RowFactors:
    """The rule on a sequence score broadcast to its |y_b| active tokens (docs/sat.md#sequence-level).

    q = the k-th smallest, k = ceil(alpha n), n >= 1, of {|score_b| repeated |y_b| times}: the B
    scores sorted once and their lengths accumulated (exact: integer counts in fp64); or ``q``
    as given (the optimizer step's). Then docs/sat.md#the-rule, steps 3-6, per row, the endpoints
    from ``rule.gated_bounds``.
    """
    a = score.abs()
    if q is None:  # over this micro-batch; the step's q is handed in (sat_quantile_scope=step)
        a_sorted, order = torch.sort(a)
        cum = torch.cumsum(lengths[order].double(), 0)
        k = torch.tensor([quantile_rank(rule.alpha, n)], dtype=cum.dtype, device=cum.device)
        q = a_sorted[torch.searchsorted(cum, k)].reshape(())
    else:
        q = q.to(device=a.device, dtype=a.dtype)
    rows = ((lengths > 0) & (a > q) & (q > 0)).nonzero().squeeze(-1)
    work = torch.promote_types(score.dtype, torch.float32)
    c_rows = kernel_psi(a[rows].to(work), q.to(work), rule.kernel, rule.exponent)
    pos_rows = score[rows] > 0
    f = SATFactors(q=q, idx=rows, c=c_rows, positive=pos_rows, shape=score.shape)  # per row
    if rows.numel() == 0:
        return RowFactors(factors=f, rows=rows, lower=None, upper=None)
    lo_rows, hi_rows = gated_bounds(f, eps_low, eps_high)
    lo = torch.full_like(score, 1.0 - eps_low)
    hi = torch.full_like(score, 1.0 + eps_high)
    hi[rows] = hi_rows.to(score.dtype)
    lo[rows] = lo_rows.to(score.dtype)
    return RowFactors(factors=f, rows=rows, lower=lo, upper=hi)


def token_factors(f: SATFactors, response_mask: torch.Tensor) -> SATFactors:
    """The per-row factors of ``sequence_factors`` at the active tokens of the gated rows."""
    rows = f.idx
    tok = response_mask[rows].bool().nonzero()
    idx = rows[tok[:, 0]] * response_mask.shape[-1] + tok[:, 1]
    return SATFactors(q=f.q, idx=idx, c=f.c[tok[:, 0]], positive=f.positive[tok[:, 0]], shape=response_mask.shape)
