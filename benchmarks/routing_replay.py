"""Forward+backward time with routing replay vs without (verl_sat.routing.gates), side by side.

    python benchmarks/routing_replay.py [--repeats 5] [--tokens 256]

Two Qwen3-MoE configs: the tiny default (4 layers x 8 experts, top-2) and a wide-routing one
(48 layers x 128 experts, top-8, hidden 64). Each repeat times one forward+backward without
replay and one replaying routes recorded from the same input, alternating; prints the medians
and the ratio replay / plain. The replay cost is one softmax + gather per layer (the router's
own top-k still runs) plus aligning the routes; the route memory is layers x top_k x 4 bytes
per token.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from verl_sat.default.model import MODEL_KWARGS
from verl_sat.routing.gates import record_routes, replay_routes

LARGE = dict(
    MODEL_KWARGS,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=128,
    num_experts_per_tok=8,
)
CONFIGS = {"tiny (4L x 8E, top-2)": MODEL_KWARGS, "large (48L x 128E, top-8, h64)": LARGE}


def build(kwargs: dict[str, Any], vocab: int = 512) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab, pad_token_id=0, **kwargs)
    config._attn_implementation, config._experts_implementation = "sdpa", "grouped_mm"
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).float().train()


def step(model: Any, ids: torch.Tensor, mask: torch.Tensor, routes: torch.Tensor | None) -> float:
    """Seconds for one forward + backward (optionally replaying ``routes``)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if routes is None:
        loss = model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).mean()
    else:
        with replay_routes(model, routes, mask):
            loss = model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).mean()
    loss.backward()
    return time.perf_counter() - start


def bench(name: str, kwargs: dict[str, Any], batch: int, tokens: int, repeats: int) -> dict[str, float]:
    model = build(kwargs)
    ids = torch.randint(1, 512, (batch, tokens), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    routes = rec.recorded(batch)
    step(model, ids, mask, None)  # warm-up
    step(model, ids, mask, routes)
    plain, replay = [], []
    for _ in range(repeats):
        plain.append(step(model, ids, mask, None))
        replay.append(step(model, ids, mask, routes))
    result = {"plain_s": statistics.median(plain), "replay_s": statistics.median(replay)}
    result["ratio"] = result["replay_s"] / result["plain_s"]
    result["route_bytes_per_token"] = routes.shape[2] * routes.shape[3] * 4
    print(
        f"{name:34s} {batch}x{tokens} tokens | plain {result['plain_s'] * 1e3:8.1f} ms | "
        f"replay {result['replay_s'] * 1e3:8.1f} ms | ratio {result['ratio']:.3f} | "
        f"routes {result['route_bytes_per_token']} B/token",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name, kwargs in CONFIGS.items():
        bench(name, kwargs, args.batch, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
