"""Exact radix selection (verl_sat.sat.quantile), alone and across data-parallel ranks (gloo)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from sat_strategies import PROPERTY

from verl_sat.sat.quantile import exact_quantile, keys_to_float, ordered_keys, quantile_rank

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def by_sorting(values: torch.Tensor, alpha: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The k-th smallest, k = ceil(alpha n), counting multiplicities: the definition, by a full sort."""
    work = values.double() if values.dtype == torch.float64 else values.float()
    if weights is not None:
        work = work.repeat_interleave(weights.long())
    if work.numel() == 0:
        return torch.zeros((), dtype=values.dtype)
    return torch.sort(work).values[quantile_rank(alpha, work.numel()) - 1].to(values.dtype)


@PROPERTY
@given(
    values=st.lists(st.floats(allow_nan=False, width=32), min_size=0, max_size=80),
    alpha=st.floats(0.01, 0.99),
    dtype=st.sampled_from(DTYPES),
)
def test_matches_the_sorted_definition_at_every_dtype(values, alpha, dtype):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert torch.equal(exact_quantile(x, alpha), by_sorting(x, alpha))


@PROPERTY
@given(
    pairs=st.lists(st.tuples(st.floats(0, 5, width=32), st.integers(0, 50)), min_size=1, max_size=40),
    alpha=st.floats(0.01, 0.99),
)
def test_multiplicities_count_like_repeated_values(pairs, alpha):
    values = torch.tensor([v for v, _ in pairs], dtype=torch.float32)
    weights = torch.tensor([w for _, w in pairs])
    assert torch.equal(exact_quantile(values, alpha, weights), by_sorting(values, alpha, weights))


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
    assert exact_quantile(x, 0.9).item() == quantile_rank(0.9, n) - 1


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
