"""Exact radix selection (verl_sat.sat.quantile), alone and across data-parallel ranks (gloo).

The reference is the inverse-CDF definition (``sat_strategies.inverse_cdf``, alpha read as written
by ``sat_strategies.alpha_level``), or a full sort at that rank for large inputs; never the code's
own ``quantile_rank``.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import PROPERTY, alpha_rank, assert_biting_share, draw_alpha, inverse_cdf, on_cdf_step

from verl_sat.sat.quantile import exact_quantile, keys_to_float, ordered_keys

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def by_sorting(values: torch.Tensor, alpha: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The k-th smallest, k = ceil(alpha n) with alpha as written (``sat_strategies.alpha_rank``),
    counting multiplicities: the definition, by a full sort (for inputs too large for ``inverse_cdf``)."""
    work = values.double() if values.dtype == torch.float64 else values.float()
    if weights is not None:
        work = work.repeat_interleave(weights.long())
    if work.numel() == 0:
        return torch.zeros((), dtype=values.dtype)
    return torch.sort(work).values[alpha_rank(alpha, work.numel()) - 1].to(values.dtype)


def expected(values: torch.Tensor, alpha: float, weights: list[int] | None = None) -> torch.Tensor:
    """``sat_strategies.inverse_cdf`` of the values as the dtype holds them, in that dtype; 0 when n = 0."""
    q = inverse_cdf(values.tolist(), alpha, weights)
    return torch.tensor(0.0 if q is None else q, dtype=values.dtype)


@st.composite
def valued(draw):
    """(values, alpha, dtype): up to 80 fp32 values (infinities and signed zeros included), an alpha
    as written for their number (mostly with alpha n whole), a dtype to cast them to."""
    values = draw(st.lists(st.floats(allow_nan=False, width=32), min_size=0, max_size=80))
    return values, draw_alpha(draw, len(values)), draw(st.sampled_from(DTYPES))


@st.composite
def weighted(draw):
    """(pairs of value and multiplicity, alpha): an alpha as written for the total multiplicity."""
    pairs = draw(st.lists(st.tuples(st.floats(0, 5, width=32), st.integers(0, 50)), min_size=1, max_size=40))
    return pairs, draw_alpha(draw, sum(w for _, w in pairs))


def test_matches_the_sorted_definition_at_every_dtype():
    """``exact_quantile`` is the inverse-CDF alpha-quantile by definition (``inverse_cdf``), bit for
    bit and in the input's dtype, at every dtype, no value included. Bites where alpha n is whole:
    the CDF meets alpha exactly at the k-th value, where a rank off by one shows."""
    step = []

    @PROPERTY
    @given(drawn=valued())
    def check(drawn) -> None:
        values, alpha, dtype = drawn
        x = torch.tensor(values, dtype=torch.float32).to(dtype)
        q = exact_quantile(x, alpha)
        assert q.dtype == dtype and torch.equal(q, expected(x, alpha))
        step.append(on_cdf_step(alpha, len(values)))

    check()
    assert_biting_share(step, "radix quantile = inverse CDF, alpha n whole", minimum=0.25, maximum=0.9)


def test_multiplicities_count_like_repeated_values():
    """A value of integer weight w counts as w copies of it (SAT-GSPO's length-weighted sequence
    score). Bites where the weights move the answer away from the unweighted quantile of the same
    values, and where alpha n is whole."""
    moved, step = [], []

    @PROPERTY
    @given(drawn=weighted())
    def check(drawn) -> None:
        pairs, alpha = drawn
        values = torch.tensor([v for v, _ in pairs], dtype=torch.float32)
        weights = [w for _, w in pairs]
        q = exact_quantile(values, alpha, torch.tensor(weights))
        assert torch.equal(q, expected(values, alpha, weights))
        present = [v for v, w in zip(values.tolist(), weights, strict=True) if w > 0]
        moved.append(bool(present) and float(q) != inverse_cdf(present, alpha))
        step.append(on_cdf_step(alpha, sum(weights)))

    check()
    assert_biting_share(moved, "multiplicities, the weights move the quantile", minimum=0.15)
    assert_biting_share(step, "multiplicities, alpha n whole", minimum=0.25, maximum=0.9)


def test_keys_order_like_floats_and_invert():
    x = torch.tensor([-float("inf"), -3.5, -1e-30, -0.0, 0.0, 1e-38, 2.0, float("inf")])
    for dtype in (torch.float32, torch.float64):
        keys = ordered_keys(x.to(dtype))
        assert torch.all(keys[1:] >= keys[:-1])
        back = [keys_to_float(int(k), dtype) for k in keys]
        assert back == x.to(dtype).tolist()


def test_exact_beyond_sixteen_million_values():
    n = 17_000_000
    x = torch.arange(n, dtype=torch.float64).flip(0)
    assert exact_quantile(x, 0.9).item() == alpha_rank(0.9, n) - 1


def test_ties_and_empty():
    assert exact_quantile(torch.zeros(100), 0.9).item() == 0.0
    assert exact_quantile(torch.empty(0), 0.9).item() == 0.0
    assert exact_quantile(torch.tensor([1.0, 1.0, 2.0]), 0.5).item() == 1.0


# ---------------------------------------------------------------------------------------------
# across ranks: two gloo processes, unequal shares (one of them empty), every dtype
# ---------------------------------------------------------------------------------------------
def _shares(seed: int) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]]:
    """Cases of (rank-0 values, rank-0 weights, rank-1 values, rank-1 weights)."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for dtype in DTYPES:
        a = (torch.randn(1000, generator=g) * 0.05).abs().to(dtype)
        b = (torch.randn(37, generator=g) * 0.3).abs().to(dtype)
        cases.append((a, None, b, None))
        cases.append((a, None, b[:0], None))  # rank 1 holds no token
    seq_a, seq_b = torch.rand(3, generator=g), torch.rand(2, generator=g)  # SAT-GSPO: a few long sequences
    cases.append((seq_a, torch.tensor([3000, 12, 7]), seq_b, torch.tensor([5000, 1])))
    return cases


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results = []
        for a, wa, b, wb in _shares(0):
            values, weights = (a, wa) if rank == 0 else (b, wb)
            for alpha in (0.5, 0.9, 0.99):
                results.append(exact_quantile(values, alpha, weights, group=dist.group.WORLD))
        out[rank] = results
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_across_two_ranks_equals_the_quantile_of_the_union():
    """Each rank holds its share; both get, bit for bit, the quantile of all the tokens."""
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=True)
    expected = []
    for a, wa, b, wb in _shares(0):
        union = torch.cat([a, b])
        weights = None if wa is None else torch.cat([wa, wb])
        for alpha in (0.5, 0.9, 0.99):
            expected.append(by_sorting(union, alpha, weights))
    for rank in (0, 1):
        got = out[rank]
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype and torch.equal(g, e), (rank, g, e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_result_keeps_the_input_dtype(dtype):
    assert exact_quantile(torch.rand(10).to(dtype), 0.9).dtype == dtype
