"""Exact inverse-CDF quantile by radix selection on the float bits, across data-parallel ranks.

docs/sat.md#the-rule step 2: q is the smallest x with F(x) >= alpha over the active tokens of the optimizer
step, i.e. the k-th smallest value with k = ceil(alpha n). Over many micro-batches and ranks the
values are never in one place, and gathering every token (tens of millions at the paper's
scale) is what we must avoid. Radix selection needs only histograms:

    key(x)  = the IEEE bits of x, re-ordered so that integer order = float order
    round r: hist_r[j] = #{candidates whose r-th 16-bit digit of key is j}   (all-reduced: SUM)
             j*      = the first j with cumsum(hist_r)[j] >= k;  k -= cumsum(hist_r)[j* - 1]
             candidates = those with digit j*
    after the last round the digits j*_1 .. j*_R spell key(q) exactly.

fp32 keys have 2 digits (2 rounds), fp64 keys 4; bf16/fp16 are selected in fp32 (exact). Every
rank reaches the same digits, so every rank gets the same q bit for bit, whatever its share of
the tokens (none included). Counts are int64 (exact far beyond 16M tokens). A value may carry an
integer weight (its multiplicity): SAT-GSPO's sequence score, broadcast to |y_b| tokens, is one
value of weight |y_b| (docs/sat.md#sequence-level), so nothing is expanded. Cost: one pass over the values per
round (a bincount), and R + 1 all-reduces of 64K counters.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

DIGIT_BITS = 16
_BINS = 1 << DIGIT_BITS
_DIGIT_MASK = _BINS - 1
# (key dtype, bits) per selection dtype; everything narrower than fp32 is selected in fp32
_KEY = {torch.float32: (torch.int32, 32), torch.float64: (torch.int64, 64)}


def quantile_rank(alpha: float, n: int) -> int:
    """k = ceil(alpha * n): the 1-based rank of the inverse-CDF alpha-quantile of n values.

    F(v_(k)) = k / n >= alpha first holds at k = ceil(alpha n) (docs/sat.md#the-rule step 2). alpha is read
    as the decimal the user wrote (0.07 -> 7/100), so 0.07 with n = 100 gives rank 7, not the 8 of
    the float product 0.07 * 100 = 7.000000000000001.
    """
    exact = Fraction(alpha).limit_denominator(10**9)
    return max(1, math.ceil(exact * n))


def selection_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values are selected in: fp64 stays, everything else is exact in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """Integer keys (int32 for fp32, int64 for fp64) whose order is the float order of ``x`` (fp32 or fp64).

    Non-negative floats: the bits themselves. Negative floats: sign kept, magnitude bits flipped,
    so a larger magnitude gives a smaller key. (-0.0 sorts just below +0.0.)
    """
    key_dtype, bits = _KEY[x.dtype]
    b = x.contiguous().view(key_dtype)
    flip = (1 << (bits - 1)) - 1
    return torch.where(b < 0, b ^ flip, b)


def keys_to_float(key: int, dtype: torch.dtype) -> float:
    """The inverse of :func:`ordered_keys` for one key."""
    key_dtype, bits = _KEY[dtype]
    if key < 0:
        key ^= (1 << (bits - 1)) - 1
    return torch.tensor([key], dtype=torch.int64).to(key_dtype).view(dtype).item()


def _digit(keys: torch.Tensor, r: int, rounds: int) -> torch.Tensor:
    """The r-th 16-bit digit (0 = most significant) of the keys, in [0, 65536).

    The top digit is signed in two's complement: offset by 2^15 so that digit order is key order.
    Lower digits compare as unsigned within an equal prefix.
    """
    shift = DIGIT_BITS * (rounds - 1 - r)
    d = keys >> shift
    return d + (_BINS // 2) if r == 0 else d & _DIGIT_MASK


def _all_reduce(t: torch.Tensor, group: object | None) -> torch.Tensor:
    if group is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM, group=group)
    return t


def _histogram(digits: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return torch.bincount(digits, minlength=_BINS)
    # float64 sums of integer weights are exact up to 2^53 tokens
    return torch.bincount(digits, weights=weights, minlength=_BINS).round().to(torch.int64)


def radix_select(
    values: torch.Tensor, k: int, weights: torch.Tensor | None = None, group: object | None = None
) -> torch.Tensor:
    """The k-th smallest (1-based, counting multiplicities) of ``values`` over every rank of ``group``.

    ``values`` 1-D fp32/fp64 (this rank's share, possibly empty); ``weights`` optional float64
    integer multiplicities of the same length. Every rank must call with the same k.
    """
    keys = ordered_keys(values)
    w = weights
    rounds = _KEY[values.dtype][1] // DIGIT_BITS
    digits_found = []
    for r in range(rounds):
        d = _digit(keys, r, rounds)
        hist = _all_reduce(_histogram(d, w), group)
        cum = torch.cumsum(hist, 0)
        j = int(torch.searchsorted(cum, torch.tensor([k], dtype=cum.dtype, device=cum.device)).item())
        if j >= _BINS:
            raise ValueError(f"radix_select: rank k={k} exceeds the {int(cum[-1])} values selected from")
        if j > 0:
            k -= int(cum[j - 1].item())
        digits_found.append(j)
        keep = d == j
        keys = keys[keep]
        w = None if w is None else w[keep]
    key = digits_found[0] - _BINS // 2
    for j in digits_found[1:]:
        key = (key << DIGIT_BITS) | j
    return torch.tensor(keys_to_float(key, values.dtype), dtype=values.dtype, device=values.device)


def global_count(n: int | torch.Tensor, device: torch.device, group: object | None = None) -> int:
    """sum over the ranks of ``group`` of n (int64)."""
    t = torch.as_tensor(n, dtype=torch.int64, device=device).reshape(1).clone()
    return int(_all_reduce(t, group).item())


def exact_quantile(
    values: torch.Tensor,
    alpha: float,
    weights: torch.Tensor | None = None,
    group: object | None = None,
) -> torch.Tensor:
    """q = the inverse-CDF alpha-quantile of ``values`` (with multiplicities ``weights``) over all
    ranks of ``group``, bit-exact (docs/sat.md#the-rule step 2). Returns 0 (in ``values.dtype``) when there
    are no values on any rank.

    ``values``: this rank's 1-D values (any float dtype); ``weights``: non-negative integer
    multiplicities (any dtype), or None for 1 each.
    """
    work = selection_dtype(values.dtype)
    v = values.detach().reshape(-1).to(work)
    w = None if weights is None else weights.detach().reshape(-1).to(device=v.device, dtype=torch.float64)
    local = v.numel() if w is None else int(w.sum().round().item())
    n = global_count(local, v.device, group)
    if n == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return radix_select(v, quantile_rank(alpha, n), w, group).to(values.dtype)
