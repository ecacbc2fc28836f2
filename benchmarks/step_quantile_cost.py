"""What ``sat_quantile_scope=step`` costs: the scoring pass beside the training pass, side by side.

    python benchmarks/step_quantile_cost.py [--repeats 15] [--micro-batches 4] [--seqs 2] [--length 128]

One optimizer step of the embedded tiny Qwen3-MoE (verl_sat.default.model), split into
micro-batches, is timed two ways, interleaved so both see the same machine noise:

    micro_batch scope: forward+backward of every micro-batch (the loss takes q per micro-batch)
    step scope:        no-grad forward of every micro-batch (the scoring pass: log pi at the
                       step's weights -> |d| -> exact q, verl_sat.sat.quantile), then the same
                       forward+backward

each timed separately in interleaved repeats, and step / micro_batch = 1 + scoring / training
(ratio of medians) is printed. This is the model's part of verl's ``update_actor``; FSDP on
one rank adds only its own bookkeeping. In a verl run the same cost is logged every step as
``actor/sat_score_pass_seconds`` beside verl's ``timing_s/update_actor``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl_sat.default import model as tiny
from verl_sat.sat.quantile import exact_quantile


def step_batches(n_micro: int, seqs: int, length: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (seqs, length), generator=g) for _ in range(n_micro)]


def token_log_probs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def train_pass(model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    for ids in batches:
        token_log_probs(model, ids).mean().backward()
    model.zero_grad(set_to_none=True)


def scoring_pass(model: torch.nn.Module, batches: list[torch.Tensor], mu: list[torch.Tensor]) -> float:
    with torch.no_grad():
        d = [(token_log_probs(model, ids) - m).abs().reshape(-1) for ids, m in zip(batches, mu, strict=True)]
    return float(exact_quantile(torch.cat(d), 0.9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--length", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tiny.build_config(tokenizer), seed=0)
    model.train()
    batches = step_batches(args.micro_batches, args.seqs, args.length, len(tokenizer))
    with torch.no_grad():
        mu = [token_log_probs(model, ids) + 0.01 * torch.randn(ids.shape[0], ids.shape[1] - 1) for ids in batches]

    scoring_pass(model, batches, mu), train_pass(model, batches)  # burn-in
    times: dict[str, list[float]] = {"scoring": [], "training": []}
    for _ in range(args.repeats):  # interleaved: both passes see the same machine noise
        for name, fn in (
            ("scoring", lambda: scoring_pass(model, batches, mu)),
            ("training", lambda: train_pass(model, batches)),
        ):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.micro_batches * args.seqs * args.length
    print(
        f"tiny Qwen3-MoE, {args.micro_batches} micro-batches x {args.seqs} x {args.length} tokens "
        f"({tokens} per step), {args.threads} threads, median of {args.repeats} interleaved repeats"
    )
    print(f"training pass (forward+backward, what micro_batch scope costs): {med['training']:.3f} s")
    print(f"scoring pass (no-grad forward + exact q, what step scope adds):  {med['scoring']:.3f} s")
    print(f"step / micro_batch = 1 + scoring / training = {1 + med['scoring'] / med['training']:.3f}")


if __name__ == "__main__":
    main()
