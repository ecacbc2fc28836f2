"""Per-row sampling for batched decoding: temperature, top-k, top-p and optional logit noise.

The returned log-prob of a sampled token is taken from the distribution it was actually drawn
from (after noise, temperature, top-k and top-p); ``top_k <= 0`` and ``top_p >= 1`` mean full
support, so with neither truncation and no noise the log-prob equals
``log_softmax(logits / temperature)``, which is what verl's trainer recomputes.
``temperature == 0`` is greedy: the sampled token has probability 1 (log-prob 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (vLLM/SGLang-style keys)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    logprobs: bool = True

    @classmethod
    def from_request(cls, params: dict[str, Any]) -> SamplingParams:
        """Read a verl agent-loop ``sampling_params`` dict (``max_tokens`` or ``max_new_tokens``)."""
        max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
        top_k = params.get("top_k", -1)
        return cls(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=-1 if top_k is None else int(top_k),
            max_tokens=None if max_tokens is None else int(max_tokens),
            logprobs=bool(params.get("logprobs", True)),
        )


@dataclass
class RowSampling:
    """Per-row sampling tensors for a batch of B rows."""

    temperature: torch.Tensor  # (B,)
    top_p: torch.Tensor  # (B,)
    top_k: torch.Tensor  # (B,) int, <= 0 means no top-k

    @classmethod
    def stack(cls, params: list[SamplingParams]) -> RowSampling:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long),
        )


def _mask_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k to -inf (rows with k <= 0 or k >= V are untouched)."""
    vocab = logits.size(-1)
    k = torch.where((top_k <= 0) | (top_k >= vocab), torch.full_like(top_k, vocab), top_k)
    if bool((k == vocab).all()):
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values  # (B, V)
    kth = sorted_logits.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _mask_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filtering: keep the smallest prefix of sorted tokens whose mass reaches top_p."""
    if bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
    drop_sorted = (mass_before >= top_p.unsqueeze(-1)) & (top_p.unsqueeze(-1) < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    rows: RowSampling,
    generator: torch.Generator | None = None,
    noise_std: float = 0.0,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits + bias + noise_std * N(0, 1)`` (B, V); return
    ``(tokens (B,), log_probs (B,))``. ``bias`` (V,) is a fixed per-token offset: a systematic
    rollout/trainer mismatch, the same tokens favoured at every step."""
    logits = logits.float()
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    if noise_std > 0.0:
        logits = logits + noise_std * torch.randn(logits.shape, generator=generator, dtype=logits.dtype)
    greedy = rows.temperature <= 0.0
    temperature = torch.where(greedy, torch.ones_like(rows.temperature), rows.temperature)
    scaled = logits / temperature.unsqueeze(-1)
    scaled = _mask_top_p(_mask_top_k(scaled, rows.top_k), rows.top_p)
    log_probs = torch.log_softmax(scaled, dim=-1)
    sampled = torch.multinomial(log_probs.exp(), num_samples=1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, scaled.argmax(dim=-1), sampled)
    token_log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, torch.where(greedy, torch.zeros_like(token_log_probs), token_log_probs)
