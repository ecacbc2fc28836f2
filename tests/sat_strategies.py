"""One hypothesis strategy for SAT's invariants, and the paper's formulas (docs/sat.md) written out.

``sat_cases(level)`` draws a micro-batch (log-probs, advantages, response mask, alpha, radii,
kernel) whose log-ratios are built in units of the clip radii: a background of small mismatches
(which sets the batch reference q) and a few stale tokens (token level) or short stale responses
(sequence level) placed, most of the time, beyond q with their ratio inside PPO's range but
outside SAT's: the newly clipped bands

    {A > 0, 1 + eps_high~ < r < 1 + eps_high}   and   {A < 0, 1 - eps_low < r < 1 - eps_low~}

where every property of docs/sat.md#the-rule (Proposition 4.1) bites. The other draws are the
controls: stale tokens beyond PPO's range too, just above q, of the sign opposite to A, more stale
tokens than 1 - alpha of the batch can hold, q = 0, ties.

Whether a draw bites is decided by ``spec_rule``, which restates docs/sat.md#the-rule, steps 1-6,
and docs/sat.md#sequence-level with numpy and elementwise torch ops (inverse-CDF quantile by
sorting, the kernels, the radii, the bands), using no verl_sat code. Every property test collects
that flag per draw and asserts with ``assert_biting_share`` that at least a third of its draws
bite, so a generator that drifts away from the bands fails instead of passing vacuously.

alpha has one reading in every test: ``alpha_level``, the decimal as written (docs/sat.md, "alpha
is read as written"); ``alpha_rank`` and ``inverse_cdf`` build the quantile's rank and definition
on it, with no verl_sat code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# 500 examples, the same ones on every machine and every run (no example database)
PROPERTY = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
MIN_BITING_SHARE = 1 / 3
LEVELS = ("token", "sequence")
LOSSES = {"token": ("sat", "vanilla"), "sequence": ("sat_gspo", "gspo")}  # (SAT loss, verl's base loss)
# every loss_agg_mode of verl 0.9.1's agg_loss (tests/test_losses_on_cpu.py checks the list is complete)
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RADII = ((0.2, 0.2), (0.2, 0.28), (0.1, 0.05), (3e-4, 4e-4))  # (eps_low, eps_high): paper, DAPO-like, GSPO's
ALPHAS = (0.5, 0.75, 0.8, 0.9, 0.95)
KERNELS = (("hill", 2.0), ("hill", 2.0), ("hill", 2.0), ("hill", 1.0), ("exponential", 2.0))  # paper: Hill, p = 2
DUAL_CLIP_C = 3.0  # verl's clip_ratio_c default, also conftest.actor_config's


@dataclass(frozen=True)
class SATCase:
    """One drawn micro-batch and the SAT settings it is scored with.

    ``mu``: log mu of the decoupled score (docs/sat.md#which-log-probs: the ratio against
    ``old_log_prob``, the score against mu); None: the score is against ``old_log_prob`` (the
    default, mu itself in bypass mode).
    ``n_stale``: how many stale tokens (token level) or responses (sequence level) were placed.
    """

    level: str
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    alpha: float
    eps_low: float
    eps_high: float
    kernel: str
    exponent: float
    mu: torch.Tensor | None = None
    n_stale: int = 0

    @property
    def loss_name(self) -> str:
        return LOSSES[self.level][0]

    @property
    def base_name(self) -> str:
        return LOSSES[self.level][1]

    @property
    def dtype(self) -> torch.dtype:
        return self.log_prob.dtype

    @property
    def mask(self) -> torch.Tensor:
        return self.response_mask.bool()

    def batch(self) -> dict[str, torch.Tensor]:
        return {
            "old_log_prob": self.old_log_prob.clone(),
            "log_prob": self.log_prob.clone(),
            "advantages": self.advantages.clone(),
            "response_mask": self.response_mask.clone(),
        }

    def sat_settings(self) -> dict[str, object]:
        """conftest.actor_config keyword arguments for this case."""
        return {
            "eps_low": self.eps_low,
            "eps_high": self.eps_high,
            "sat_alpha": self.alpha,
            "sat_kernel": self.kernel,
            "sat_kernel_exponent": self.exponent,
        }


# ---------------------------------------------------------------------------------------------
# the paper's formulas (docs/sat.md#the-rule, steps 1-7; docs/sat.md#sequence-level), independent of verl_sat
# ---------------------------------------------------------------------------------------------
def alpha_level(alpha: float) -> Fraction:
    """The one reading of alpha in these tests: the decimal as written (docs/sat.md, "alpha is read as
    written"), exactly. ``repr`` is the shortest decimal that reads back as the float: 0.7 -> 7/10,
    not the binary 0.6999999999999999556..., and 0.7 * 10 is 7, not 7.000000000000001."""
    return Fraction(repr(float(alpha)))


def alpha_rank(alpha: float, n: int) -> int:
    """k = ceil(alpha n), alpha read by ``alpha_level``: the smallest k with k / n >= alpha, the
    1-based rank of the inverse-CDF alpha-quantile of n values (docs/sat.md#the-rule, step 2)."""
    return max(1, math.ceil(alpha_level(alpha) * n))


def on_cdf_step(alpha: float, n: int) -> bool:
    """alpha n is a whole number: the empirical CDF equals alpha exactly at the k-th value, the
    case where reading alpha another way (a float product, a tolerance) moves the rank by one."""
    return n > 0 and (alpha_level(alpha) * n).denominator == 1


def inverse_cdf(values: Sequence[float], alpha: float, weights: Sequence[int] | None = None) -> float | None:
    """docs/sat.md#the-rule, step 2, by definition: the smallest v among ``values`` with
    #{x <= v} / n >= alpha (each x counted ``weights`` times), alpha read by ``alpha_level``.
    None when there is no value (n = 0)."""
    counts = [1] * len(values) if weights is None else [int(w) for w in weights]
    counted = list(zip(values, counts, strict=True))
    n = sum(counts)
    if n == 0:
        return None
    level = alpha_level(alpha)
    for v in sorted(v for v, w in counted if w > 0):
        if Fraction(sum(w for x, w in counted if x <= v), n) >= level:
            return v
    raise AssertionError("the CDF reaches 1 at the largest value")


def spec_quantile(values: np.ndarray, alpha: float) -> float:
    """docs/sat.md#the-rule, step 2: the smallest x >= 0 with empirical CDF(x) >= alpha; 0 when there
    is no value. Sorted, that is the k-th smallest, k = ``alpha_rank`` (``inverse_cdf`` without its
    quadratic count)."""
    if values.size == 0:
        return 0.0
    return float(np.sort(values)[alpha_rank(alpha, values.size) - 1])


def gate_capacity(n: int, alpha: float) -> int:
    """n - ceil(alpha n): how many of n active tokens can lie strictly above the alpha-quantile."""
    return n - alpha_rank(alpha, n) if n > 0 else 0


# alphas as a user writes them: at most 3 decimals (docs/sat.md, "alpha is read as written")
WRITTEN_ALPHAS = (
    st.sampled_from((0.5, 0.7, 0.75, 0.8, 0.9, 0.95, 0.99))
    | st.integers(1, 99).map(lambda m: m / 100)
    | st.integers(1, 999).map(lambda m: m / 1000)
)


def draw_alpha(draw, n: int) -> float:
    """A written alpha for n values; three times in four, where n allows a two-decimal one, one
    with alpha n whole (``on_cdf_step``)."""
    g = math.gcd(n, 100)
    if g > 1 and draw(st.integers(0, 3)) > 0:
        step = 100 // g
        return draw(st.integers(1, 99 // step)) * step / 100
    return draw(WRITTEN_ALPHAS)


def spec_psi(u: np.ndarray, q: float, kernel: str, exponent: float) -> np.ndarray:
    """docs/sat.md#the-rule, step 4: Hill psi = 1 / (1 + (u/q)^p) (paper, p = 2), or exponential psi = 2^-(u/q)^p."""
    z = (u / q) ** exponent
    return 1.0 / (1.0 + z) if kernel == "hill" else np.exp2(-z)


def _log_ratio(case: SATCase, ref: torch.Tensor) -> torch.Tensor:
    """log pi - log ref in the case's dtype: per token (docs/sat.md#setting), or GSPO's length-normalised
    sequence log-ratio broadcast to the response's tokens (docs/sat.md#sequence-level); float64, 0 at padding.
    The sequence mean is summed in float64, then rounded to the dtype: an fp32 sum's last bit depends
    on the machine's reduction order (an ulp of q apart on two CPUs)."""
    m = case.response_mask.double()
    x = case.log_prob - ref
    if case.level == "token":
        x = x.clamp(-20.0, 20.0)  # verl's clamp of log r (never reached by these draws)
    else:
        x = ((x.double() * m).sum(-1) / m.sum(-1).clamp(min=1)).to(case.dtype).unsqueeze(-1).expand_as(x)
    return torch.where(case.mask, x, 0.0).double()


def spec_score(case: SATCase) -> torch.Tensor:
    """The detached staleness score d (docs/sat.md#the-rule, step 1; docs/sat.md#sequence-level at
    sequence level; against mu in docs/sat.md#which-log-probs)."""
    return _log_ratio(case, case.old_log_prob if case.mu is None else case.mu)


def spec_ratio(case: SATCase) -> torch.Tensor:
    """The clipped ratio r (token) or rho_b (sequence), against ``old_log_prob``
    (docs/sat.md#which-log-probs), float64."""
    return torch.exp(_log_ratio(case, case.old_log_prob))


@dataclass
class SpecRule:
    """What docs/sat.md#the-rule says about one case; numpy arrays of the batch's shape."""

    q: float
    gate: np.ndarray  # 1{active, q > 0, |d| > q}
    c_plus: np.ndarray
    c_minus: np.ndarray
    lower: np.ndarray  # 1 - eps_low~
    upper: np.ndarray  # 1 + eps_high~
    ratio: np.ndarray
    band: np.ndarray  # the newly clipped bands, active tokens only
    ambiguous: np.ndarray  # r within a few ulps of an endpoint: the dtype's rounding decides

    @property
    def bites(self) -> bool:
        """A token the spec says SAT clips and PPO does not, clear of rounding."""
        return bool((self.band & ~self.ambiguous).any())


def spec_rule(case: SATCase, q: float | None = None) -> SpecRule:
    """docs/sat.md#the-rule, steps 1-6, and the bands of Proposition 4.1; ``q`` overrides the batch reference."""
    mask = case.mask.numpy()
    d = spec_score(case).numpy()
    a = np.abs(d)
    if q is None:
        q = spec_quantile(a[mask], case.alpha)
    gate = mask & (q > 0) & (a > q)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        c_plus = np.where(gate, spec_psi(np.maximum(d, 0.0), q, case.kernel, case.exponent), 1.0)
        c_minus = np.where(gate, spec_psi(np.maximum(-d, 0.0), q, case.kernel, case.exponent), 1.0)
    lower = 1.0 - case.eps_low * c_minus
    upper = 1.0 + case.eps_high * c_plus
    r = spec_ratio(case).numpy()
    adv = case.advantages.double().numpy()
    lo, hi = 1.0 - case.eps_low, 1.0 + case.eps_high
    band = mask & (((adv > 0) & (upper < r) & (r < hi)) | ((adv < 0) & (lo < r) & (r < lower)))
    margin = 8 * torch.finfo(case.dtype).eps
    ambiguous = mask & np.any([np.abs(r - e) <= margin for e in (lo, hi, lower, upper)], axis=0)
    return SpecRule(q, gate, c_plus, c_minus, lower, upper, r, band, ambiguous)


def spec_token_loss(case: SATCase, rule: SpecRule) -> np.ndarray:
    """-S per token (docs/sat.md#the-rule, step 7), float64:
    S = min(r A, clip(r, 1 - eps_low~, 1 + eps_high~) A), with verl's dual clip (-S <= -A c where
    A < 0) at token level; 0 at padding."""
    r, adv = rule.ratio, case.advantages.double().numpy()
    loss = -np.minimum(r * adv, np.clip(r, rule.lower, rule.upper) * adv)
    if case.level == "token":
        loss = np.where(adv < 0, np.minimum(loss, -adv * DUAL_CLIP_C), loss)
    return np.where(case.mask.numpy(), loss, 0.0)


def assert_biting_share(
    flags: Sequence[bool], what: str, minimum: float = MIN_BITING_SHARE, maximum: float = 1.0
) -> float:
    """The share of draws where the property bites; fails below ``minimum`` (the generator drifted
    away from the case), above ``maximum`` (the controls are no longer drawn), or when fewer than
    ``PROPERTY.max_examples`` examples ran. Returns the share.

    Called after the hypothesis test ran (``flags = []``, ``@PROPERTY @given def check``, ``check()``),
    so the share is over every example it ran; a failing example never gets here."""
    assert len(flags) >= PROPERTY.max_examples, f"{what}: only {len(flags)} examples ran"
    share = sum(map(bool, flags)) / len(flags)
    print(f"{what}: {len(flags)} examples, biting share {share:.3f}")
    assert share >= minimum, f"{what}: only {share:.1%} of {len(flags)} draws bite (need {minimum:.1%})"
    assert share <= maximum, f"{what}: {share:.1%} of {len(flags)} draws bite, the controls are missing"
    return share


# ---------------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------------
# Hypothesis draws the structure (dtype, radii, alpha, kernel, sizes, how many stale tokens, the
# background); a seeded generator fills in the values, which keeps a draw to ~15 choices.
STALE_KINDS = ("band", "beyond", "near", "free")
STALE_KIND_P = (0.75, 0.1, 0.05, 0.1)
FOLLOW_P = 0.85  # the stale log-ratio has the sign of the response's advantage (the bands need both)


@dataclass(frozen=True)
class _Scale:
    """Magnitudes of the log-ratio in units of the radii: ``reach[s]`` = |log r| at PPO's endpoint
    on the side of sign s; background |d| <= ``background``."""

    reach: dict[int, float]
    background: float
    background_kind: str  # "uniform", "ties" (a dyadic grid: exactly equal |d|) or "zeros" (q = 0)


def _stale(rng: np.random.Generator, adv: float, scale: _Scale) -> float:
    """One stale log-ratio: ``band`` beyond q, inside PPO's range and, the background being small,
    outside SAT's contracted one; ``beyond`` clipped by both; ``near`` just above the background
    (contracted by about 1/2, rarely clipped); ``free`` anywhere up to 3x PPO's reach."""
    kind = rng.choice(STALE_KINDS, p=STALE_KIND_P)
    sign = (1 if adv > 0 else -1) if adv != 0 else int(rng.choice([-1, 1]))
    sign = sign if rng.random() < FOLLOW_P else -sign
    f = rng.uniform(0.3, 0.95)
    magnitude = {
        "band": f * scale.reach[sign],
        "beyond": (1.0 + 2.0 * f) * scale.reach[sign],
        "near": scale.background * (1.0 + f),
        "free": 3.0 * f * scale.reach[sign],
    }[kind]
    return sign * magnitude


def _background(rng: np.random.Generator, size: int, scale: _Scale) -> np.ndarray:
    if scale.background_kind == "zeros":
        return np.zeros(size)
    if scale.background_kind == "ties":
        unit = 2.0 ** math.floor(math.log2(scale.background / 4))
        return rng.integers(-4, 5, size) * unit
    return rng.uniform(-1.0, 1.0, size) * scale.background


def _advantages(rng: np.random.Generator, rows: int) -> np.ndarray:
    """GRPO-style, one per response: +-[0.25, 2] (dyadic), 0 about one time in sixteen."""
    sign = rng.choice([-1.0, 0.0, 1.0], rows, p=[0.47, 0.06, 0.47])
    return sign * np.round(rng.uniform(0.25, 2.0, rows) * 64) / 64


def _lengths(rng: np.random.Generator, rows: int, width: int) -> list[int]:
    full = rng.random(rows) < 0.6
    return [width if f else int(rng.integers(0, width + 1)) for f in full]


# the strategies drawn from, built once
_RADII, _ALPHAS, _KERNELS = st.sampled_from(RADII), st.sampled_from(ALPHAS), st.sampled_from(KERNELS)
_SEEDS = st.integers(0, 2**32 - 1)
_BACKGROUND = st.sampled_from([0.02, 0.05, 0.1])
_BG_KIND = st.sampled_from(["uniform"] * 5 + ["ties"] * 4 + ["zeros"])
_STALE_COUNTS = st.sampled_from([1, 2, 2, 3, 3, 0, -1])
_TOKEN_ROWS, _TOKEN_WIDTH = st.integers(2, 6), st.integers(6, 12)
_SEQ_ROWS, _SEQ_WIDTH = st.integers(3, 8), st.integers(6, 12)
_JITTER = st.integers(0, 2)
_DECOUPLED_K = st.sampled_from([1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.0, -0.5])


def _stale_count(draw, capacity: int) -> int:
    """How many stale units: usually as many as the gate can take (1..3), sometimes none, sometimes
    more than the 1 - alpha share the strict gate can pass (then q lies among them)."""
    want = draw(_STALE_COUNTS)  # -1: over capacity
    if want < 0:
        return capacity + 1
    return min(want, capacity) if capacity > 0 else want


def _token_layout(draw, rng: np.random.Generator, scale: _Scale, alpha: float):
    """(d, lengths, advantages, n_stale): single stale tokens among a background of tokens."""
    rows, width = draw(_TOKEN_ROWS), draw(_TOKEN_WIDTH)
    lengths = _lengths(rng, rows, width)
    lengths[0] = max(lengths[0], 1)
    adv = _advantages(rng, rows)
    active = [(b, t) for b in range(rows) for t in range(lengths[b])]
    n_stale = min(_stale_count(draw, gate_capacity(len(active), alpha)), len(active))
    d = np.zeros((rows, width))
    for (b, t), value in zip(active, _background(rng, len(active), scale), strict=True):
        d[b, t] = value
    for i in rng.choice(len(active), n_stale, replace=False):
        b, t = active[i]
        d[b, t] = _stale(rng, adv[b], scale)
    return d, lengths, adv, n_stale


def _sequence_layout(draw, rng: np.random.Generator, scale: _Scale, alpha: float):
    """(d, lengths, advantages, n_stale): short stale responses (1-2 tokens) among longer background
    ones; each response's tokens hold its sequence log-ratio plus zero-mean jitter. The quantile is
    length-weighted (docs/sat.md#sequence-level), so the stale responses fit in n - ceil(alpha n)
    tokens unless the draw asks for more than fit."""
    rows, width = draw(_SEQ_ROWS), draw(_SEQ_WIDTH)
    lengths = _lengths(rng, rows, width)
    want = draw(_STALE_COUNTS)
    n_stale = min(rows - 1, 4 if want < 0 else want)
    lengths[:n_stale] = [int(x) for x in rng.choice([1, 2], n_stale, p=[0.7, 0.3])]
    if sum(lengths) == 0:
        lengths[-1] = width
    capacity = gate_capacity(sum(lengths), alpha)
    while want >= 0 and n_stale > 0 and sum(lengths[:n_stale]) > capacity:
        n_stale -= 1  # the last stale response becomes a (short) background one
    adv = _advantages(rng, rows)
    jitter = [0.0, scale.background, min(scale.reach.values())][draw(_JITTER)]
    if scale.background_kind != "uniform":
        jitter = 0.0  # every token on the grid (exact sums: exact ties) or exactly 0 (q = 0)
    d = np.zeros((rows, width))
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        target = _stale(rng, adv[b], scale) if b < n_stale else _background(rng, 1, scale)[0]
        noise = rng.uniform(-1.0, 1.0, length) * jitter
        d[b, :length] = target + noise - noise.mean()
    return d, lengths, adv, n_stale


@st.composite
def sat_cases(
    draw,
    level: str,
    decoupled: bool = False,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64),
    radii: tuple[tuple[float, float], ...] = RADII,
) -> SATCase:
    """A micro-batch where SAT's bands are reached in most draws (see the module docstring).

    ``decoupled`` (docs/sat.md#which-log-probs): the score d = log pi - log mu carries the staleness
    layout, and the ratio against ``old_log_prob`` is k d plus noise, k in {1 (4 times in 8), 3/4,
    1/2, 0, -1/2} (k = 0: the trainer's recomputed old log-probs are at the current weights, r = 1).
    """
    dtype = dtypes[draw(st.integers(0, len(dtypes) - 1))]
    eps_low, eps_high = draw(_RADII if radii is RADII else st.sampled_from(radii))
    alpha = draw(_ALPHAS)
    kernel, exponent = draw(_KERNELS)
    rng = np.random.default_rng(draw(_SEEDS))
    reach = {1: math.log1p(eps_high), -1: -math.log1p(-eps_low)}
    scale = _Scale(reach=reach, background=draw(_BACKGROUND) * min(reach.values()), background_kind=draw(_BG_KIND))
    layout = _token_layout if level == "token" else _sequence_layout
    d, lengths, adv, n_stale = layout(draw, rng, scale, alpha)
    rows, width = d.shape
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    base = -np.round(rng.uniform(0.1, 3.0, d.shape) * 64) / 64  # dyadic: exact in every dtype used
    log_ratio = d
    if decoupled:
        k = draw(_DECOUPLED_K)
        log_ratio = k * d + rng.uniform(-1.0, 1.0, d.shape) * scale.background * draw(st.booleans())
    log_prob = np.where(mask, base, base + rng.normal(0.0, 1.0, d.shape))  # padding: anything finite
    old = np.where(mask, log_prob - log_ratio, base)
    mu = np.where(mask, log_prob - d, base) if decoupled else None

    def tensor(x: np.ndarray) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.float64).to(dtype)

    return SATCase(
        level=level,
        old_log_prob=tensor(old),
        log_prob=tensor(log_prob),
        advantages=tensor(np.repeat(adv[:, None], width, axis=1)),
        response_mask=torch.tensor(mask, dtype=dtype),
        alpha=alpha,
        eps_low=eps_low,
        eps_high=eps_high,
        kernel=kernel,
        exponent=exponent,
        mu=None if mu is None else tensor(mu),
        n_stale=n_stale,
    )


# ---------------------------------------------------------------------------------------------
# variants in which SAT gates nothing (docs/sat.md#the-rule: identity when no token is gated)
# ---------------------------------------------------------------------------------------------
UNGATED_MODES = ("step_q", "q_zero", "ties")


def ungated_variant(case: SATCase, mode: str) -> tuple[SATCase, float | None, float]:
    """(case', step_q, q_bite): a coupled case in which SAT gates no token, and the q under which
    the very same tokens would have been clipped (for the biting flag).

    step_q: the tensors unchanged, the optimizer step's q handed over as max |d| (nothing lies
        strictly above it); q_bite = the micro-batch's own q.
    q_zero: d set to 0 on all but n - ceil(alpha n) active tokens (token level) or all but the
        responses that fit in that many tokens (sequence level), so q = 0 (docs/sat.md#the-rule, edge case);
        q_bite -> 0+ (contraction ~ full).
    ties: every active |d| equal to one dyadic c ~ 3/4 of PPO's reach (exact in every dtype used),
        so q = c and the strict |d| > q gates nothing; q_bite just below c (contraction ~ 1/2).
    """
    assert case.mu is None
    mask = case.mask
    d = spec_score(case)
    if mode == "step_q":
        own = spec_rule(case).q
        return case, float(d.abs()[mask].max()) if mask.any() else 0.0, own
    keep = torch.zeros_like(mask)
    if mode == "q_zero":
        capacity = gate_capacity(int(mask.sum()), case.alpha)
        if case.level == "token":
            order = torch.argsort(d.abs().reshape(-1), descending=True)[:capacity]
            keep.view(-1)[order] = True
        else:
            lengths = mask.sum(-1)
            used = 0
            for b in torch.argsort(d[:, 0].abs(), descending=True).tolist():
                if 0 < int(lengths[b]) <= capacity - used:
                    keep[b] = mask[b]
                    used += int(lengths[b])
        log_prob = torch.where(mask & ~keep, case.old_log_prob, case.log_prob)
        return replace(case, log_prob=log_prob), None, 1e-300
    reach = min(math.log1p(case.eps_high), -math.log1p(-case.eps_low))
    grid = 2.0 ** (math.floor(math.log2(reach)) - 8)
    c = math.floor(0.75 * reach / grid) * grid  # 8 significant bits: r inside PPO's range, beyond eps/2
    sign = torch.where(d < 0, -1.0, 1.0).to(case.dtype)
    if case.level == "sequence":
        sign = sign[:, :1].expand_as(sign)
    old = torch.where(mask, torch.round(case.old_log_prob.double() * 64).to(case.dtype) / 64, case.old_log_prob)
    log_prob = torch.where(mask, old + sign * c, case.log_prob)  # dyadic: d = +-c exactly, sums exact
    return replace(case, old_log_prob=old, log_prob=log_prob), None, c * (1 - 1e-9)


def stale_tokens(case: SATCase) -> int:
    """Active tokens placed stale: n_stale tokens, or the tokens of the n_stale stale responses."""
    if case.level == "token":
        return case.n_stale
    return int(case.response_mask[: case.n_stale].sum())


# ---------------------------------------------------------------------------------------------
# running a registered loss
# ---------------------------------------------------------------------------------------------
@dataclass
class LossRun:
    loss: torch.Tensor
    metrics: dict[str, float]
    grad: torch.Tensor  # d loss / d log_prob
    token_loss: torch.Tensor | None  # d loss / d w with all-ones rollout_is_weights w: -S times agg's weight
    gate: torch.Tensor | None  # the gate the SAT loss applied (LossContext), None for other losses


def run_loss(
    name: str,
    batch: dict[str, torch.Tensor],
    config,
    agg: str = "token-sum",
    weights: bool = True,
    mu: torch.Tensor | None = None,
    step_q: float | None = None,
) -> LossRun:
    """One call of the loss registered as ``name`` through verl's ``get_policy_loss_fn``, inside a
    ``LossContext`` carrying mu (docs/sat.md#which-log-probs) and the optimizer step's q
    (docs/sat.md#the-rule, step 2), if given.

    With ``loss_agg_mode="token-sum"`` and all-ones ``rollout_is_weights`` that require grad,
    d loss / d w_{b,t} is the token's -S_{b,t} (0 at padding), for SAT and for the base loss alike.
    """
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from verl_sat.sat.losses import loss_context

    log_prob = batch["log_prob"].clone().requires_grad_(True)
    w = torch.ones_like(log_prob, requires_grad=True) if weights else None
    args = (batch["old_log_prob"], log_prob, batch["advantages"], batch["response_mask"], agg, config, w)
    with loss_context(rollout_log_prob=mu, step_q=step_q) as ctx:
        loss, metrics = get_policy_loss_fn(name)(*args)
    loss.backward()
    token_loss = None if w is None else (w.grad if w.grad is not None else torch.zeros_like(w))
    return LossRun(loss.detach(), metrics, log_prob.grad, token_loss, ctx.gate)
