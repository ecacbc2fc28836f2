"""Batched autoregressive generation with a transformers model and a KV cache (no Ray here).

:class:`HFEngine.generate_batch` left-pads the prompts of a batch, runs one prefill and then one
decode step per new token for all rows together, with per-row sampling settings and budgets.
Position ids are ``cumsum(mask) - 1`` so a padded row sees the same positions as it would
alone (and as verl's training forward uses). ``should_abort`` is polled before every step, so
an abort returns the tokens generated so far with ``stop_reason="aborted"``.

With ``record_routes`` on (``rollout.enable_rollout_routing_replay``), each result also carries
the MoE routing of its sequence in SGLang's ``routed_experts`` layout (``verl_sat.routing.gates``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from verl_sat.rollout.sampling import RowSampling, SamplingParams, sample_next
from verl_sat.rollout.weights import load_named_tensors
from verl_sat.routing.gates import perturb_routing, record_routes


@dataclass
class GenerationRequest:
    """One prompt with its sampling settings and token budget."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int


@dataclass
class GenerationResult:
    """Generated ids (EOS included when hit), their log-probs, and why generation stopped."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    stop_reason: str | None = None  # "completed" (EOS) | "length" | "aborted"
    routed_experts: np.ndarray | None = None
    """int32 (prompt + generated - 1, layers, top_k): token t's experts per MoE layer (SGLang's layout)"""


@dataclass
class EngineOptions:
    """Knobs of the HF engine (``actor_rollout_ref.rollout.engine_kwargs.hf.*``)."""

    logit_noise_std: float = 0.0
    """std of Gaussian noise added to rollout logits before sampling (induces rollout/trainer mismatch)"""
    batch_wait_ms: float = 5.0
    """how long the server collects concurrent requests before starting one batched decode"""
    num_threads: int = 1
    """torch intra-op threads of the rollout process"""
    experts_implementation: str = "eager"
    """transformers MoE experts kernel: eager | grouped_mm"""
    seed: int = 0
    """seed of the sampling generator"""
    router_noise_std: float = 0.0
    """std of Gaussian noise on the router logits when choosing experts (induces a routing mismatch)"""
    fault_step: int = -1
    """induced collapse: from weight version (verl ``global_steps``) >= ``fault_step`` on, the logit
    noise becomes ``fault_logit_noise_std`` (-1: never). Rewards fall and dbar_pi jumps: the collapse
    signature on demand, for the sentinel's end-to-end test (docs/sentinel.md)"""
    fault_logit_noise_std: float = 3.0
    """the logit noise std from ``fault_step`` on"""
    logit_bias_std: float = 0.0
    """std of a fixed per-token offset b ~ N(0, std^2) added to every rollout logit (drawn once from
    ``seed``): a systematic rollout/trainer mismatch, unlike the i.i.d. ``logit_noise_std``"""
    router_bias_std: float = 0.0
    """std of a fixed per-layer, per-expert offset on the router logits when choosing experts (drawn
    once from ``seed``): a systematic routing mismatch, which routing replay R3 removes"""


def logit_noise_for(options: EngineOptions, version: int | None) -> float:
    """The rollout's logit noise std for weights of ``version``: the fault's from ``fault_step`` on."""
    faulty = options.fault_step >= 0 and version is not None and version >= options.fault_step
    return options.fault_logit_noise_std if faulty else options.logit_noise_std


def fixed_logit_bias(model: Any, options: EngineOptions) -> torch.Tensor | None:
    """b ~ logit_bias_std * N(0, 1) over the vocabulary, from its own generator (``seed + 2``), or None."""
    if options.logit_bias_std <= 0:
        return None
    vocab = int(model.get_output_embeddings().weight.shape[0])
    generator = torch.Generator().manual_seed(options.seed + 2)
    return options.logit_bias_std * torch.randn(vocab, generator=generator)


def load_model(path: str, experts_implementation: str = "eager") -> Any:
    """Load an fp32 causal LM from ``path`` with sdpa attention, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32, experts_implementation=experts_implementation
    )
    return model.eval()


class HFEngine:
    """A transformers model plus batched sampling; weights replaceable in place."""

    def __init__(self, model: Any, eos_token_ids: Iterable[int], pad_token_id: int, options: EngineOptions) -> None:
        self.model = model
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.options = options
        self.generator = torch.Generator().manual_seed(options.seed)
        self.logit_noise_std = options.logit_noise_std  # the server sets it per weight version (logit_noise_for)
        self.record_routes = False  # return routed_experts (routing replay R3)
        self.logit_bias = fixed_logit_bias(model, options)
        if options.router_noise_std > 0 or options.router_bias_std > 0:
            self._router_noise = torch.Generator().manual_seed(options.seed + 1)
            perturb_routing(model, options.router_noise_std, self._router_noise, options.router_bias_std)

    @classmethod
    def from_pretrained(cls, path: str, options: EngineOptions) -> HFEngine:
        """Build from a local HF directory (model, tokenizer, generation config)."""
        from transformers import AutoTokenizer

        model = load_model(path, options.experts_implementation)
        return cls.from_model(model, AutoTokenizer.from_pretrained(path), options)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, options: EngineOptions) -> HFEngine:
        """Around a loaded model: it stops at the generation config's and the tokenizer's end ids, and
        pads with the tokenizer's pad id (else the smallest end id)."""
        eos = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
        return cls(model, eos, pad, options)

    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Replace the weights (names as sent by verl's FSDP engine)."""
        with torch.no_grad():
            load_named_tensors(self.model, named)

    @torch.no_grad()
    def generate_batch(
        self, requests: list[GenerationRequest], should_abort: Callable[[], bool] = lambda: False
    ) -> list[GenerationResult]:
        """Generate for all ``requests`` together; see the module docstring."""
        results = [GenerationResult() for _ in requests]
        budgets = [max(0, r.max_tokens) for r in requests]
        for result, budget in zip(results, budgets, strict=True):
            if budget == 0:
                result.stop_reason = "length"
        if all(r.stop_reason for r in results):
            return results
        if not self.record_routes:
            return self._decode(requests, results, budgets, should_abort)
        with record_routes(self.model) as recorder:
            self._decode(requests, results, budgets, should_abort)
        routes = recorder.recorded(len(requests))
        width = max(len(r.prompt_ids) for r in requests)
        for row, (request, result) in enumerate(zip(requests, results, strict=True)):
            result.routed_experts = _sequence_routes(routes[row], width, len(request.prompt_ids), len(result.token_ids))
        return results

    def _decode(
        self,
        requests: list[GenerationRequest],
        results: list[GenerationResult],
        budgets: list[int],
        should_abort: Callable[[], bool],
    ) -> list[GenerationResult]:
        """Prefill and decode step by step, filling ``results`` (see the module docstring)."""
        input_ids, attention_mask = self._left_pad([r.prompt_ids for r in requests])
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        rows = RowSampling.stack([r.params for r in requests])
        cache = _new_cache(self.model)
        step_ids = input_ids
        for _ in range(max(budgets)):
            if should_abort():
                _mark_unfinished(results, "aborted")
                break
            logits = self._forward(step_ids, attention_mask, position_ids, cache)
            tokens, log_probs = sample_next(logits, rows, self.generator, self.logit_noise_std, self.logit_bias)
            self._append(results, budgets, tokens.tolist(), log_probs.tolist())
            if all(r.stop_reason for r in results):
                break
            step_ids = tokens.unsqueeze(-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(requests), 1)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        return results

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) ids left-padded with ``pad_token_id`` and the matching attention mask."""
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
        ids = pad_sequence(rows, batch_first=True, padding_value=self.pad_token_id, padding_side="left")
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
        return ids, mask

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits (B, V) of the last position, extending ``cache``."""
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _append(
        self, results: list[GenerationResult], budgets: list[int], tokens: list[int], log_probs: list[float]
    ) -> None:
        """Record one new token for every unfinished row and set stop reasons."""
        for result, budget, token, log_prob in zip(results, budgets, tokens, log_probs, strict=True):
            if result.stop_reason:
                continue
            result.token_ids.append(token)
            result.log_probs.append(log_prob)
            if token in self.eos_token_ids:
                result.stop_reason = "completed"
            elif len(result.token_ids) >= budget:
                result.stop_reason = "length"


def _sequence_routes(routes: torch.Tensor, width: int, prompt_len: int, generated: int) -> np.ndarray | None:
    """One row's routes (SGLang layout) from its left-padded ``[T, L, k]`` recording.

    Token t of the sequence (prompt then generated) sits at column ``width - prompt_len + t``
    (``width``: the padded prompt width); every token but the last generated one went through
    the model, so the sequence has ``prompt_len + generated - 1`` rows.
    """
    if routes.shape[0] == 0:
        return None  # aborted before the prefill
    start = width - prompt_len
    return routes[start : start + max(0, prompt_len + generated - 1)].numpy()


def _mark_unfinished(results: list[GenerationResult], reason: str) -> None:
    for result in results:
        if not result.stop_reason:
            result.stop_reason = reason


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the generation config and the tokenizer."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if value is None:
            continue
        ids.update(value if isinstance(value, list | tuple) else [value])
    return ids
