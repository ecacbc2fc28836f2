"""Supervised warm-up of the tiny Qwen3-MoE on the arithmetic task, so RL has a reward signal.

AdamW steps of response-only cross-entropy on CPU until the model's most likely answer (greedy
decoding) is right on ``target_accuracy`` of fresh problems (checked every ``check_every`` steps;
at most ``steps``). Two-digit addition is learnt in jumps (the carry), at a step count that varies
with the seed, so the warm-up stops on the accuracy, not on a step count. The cross-entropy is
strongly label-smoothed (``label_smoothing``): the model learns the sums but keeps probability on
every token, so at temperature 1 it samples a right answer far less often than its greedy one.
What RL has to learn is then mostly to sample what the model already knows: the reward climbs
from the sampled accuracy towards the greedy one, a climb you can see within a few dozen steps.
``stop_on="sampled"`` stops on the sampled accuracy instead.

``python -m verl_sat.default.warmup --out DIR`` writes the model + tokenizer to ``DIR/model`` and
the parquet files to ``DIR/data``, and prints the sampled accuracy.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_sat.config_node import check_fields, checked, integer, one_of
from verl_sat.default import data as task
from verl_sat.default import model as tiny
from verl_sat.default.reward import compute_score


@dataclass
class WarmupArgs:
    """Warm-up settings."""

    steps: int = integer(1500, low=1)
    """at most this many optimizer steps"""
    target_accuracy: float = checked(0.85, lambda value: 0.0 <= value <= 1.0, "in [0, 1]")
    """stop once the ``stop_on`` accuracy reaches this (0: always run ``steps``)"""
    stop_on: str = one_of("greedy", ("greedy", "sampled"))
    """greedy | sampled: which accuracy the stop checks (greedy: the model knows the sums)"""
    check_every: int = integer(25, low=1)
    """steps between accuracy checks (the jump from ~0.1 to ~0.7 can take under 50 steps)"""
    check_samples: int = integer(64, low=1)
    """problems sampled at each check"""
    batch_size: int = 32
    """sequences per step"""
    label_smoothing: float = checked(0.3, lambda value: 0.0 <= value < 1.0, "in [0, 1)")
    """label smoothing of the cross-entropy: the model learns the sums (greedy accuracy 0.85 at
    the stop) but keeps probability on every token, so at temperature 1 it mostly samples a wrong
    one; RL has the sampling to sharpen"""
    lr: float = 3e-3
    """AdamW learning rate (cosine-free, constant after a 20-step linear warm-up)"""
    seed: int = 0
    """seed of the model init, the data and the sampling"""
    eval_samples: int = 128
    """problems sampled (temperature 1) to report the accuracy"""
    threads: int = 1
    """torch intra-op threads (1 is fastest for a model this small, and on a shared 2-core host)"""

    def __post_init__(self) -> None:
        check_fields(self, "WarmupArgs")


def encode_example(tokenizer: Any, problem: task.Problem) -> tuple[list[int], int]:
    """Token ids of chat prompt + solution + EOS, and the prompt length."""
    prompt = task.prompt_ids(tokenizer, problem)
    response_ids = tokenizer(problem.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt + response_ids, len(prompt)


def make_batch(tokenizer: Any, problems: list[task.Problem]) -> dict[str, Any]:
    """Right-padded input ids, attention mask and response-only labels (-100 elsewhere)."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    encoded = [(torch.tensor(ids), prompt_len) for ids, prompt_len in (encode_example(tokenizer, p) for p in problems)]
    input_ids = pad_sequence([ids for ids, _ in encoded], batch_first=True, padding_value=tokenizer.pad_token_id)
    attention_mask = pad_sequence([torch.ones_like(ids) for ids, _ in encoded], batch_first=True)
    labels = pad_sequence(
        [torch.cat([torch.full((n,), -100), ids[n:]]) for ids, n in encoded], batch_first=True, padding_value=-100
    )
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def response_loss(model: Any, batch: dict[str, Any], label_smoothing: float = 0.0) -> Any:
    """Mean next-token cross-entropy over the response tokens, with ``label_smoothing``."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=-100,
        label_smoothing=label_smoothing,
    )


def train(model: Any, tokenizer: Any, args: WarmupArgs) -> list[float]:
    """Run the SFT loop in place until ``args.target_accuracy`` or ``args.steps``; returns the loss curve."""
    import random

    import torch

    rng = random.Random(args.seed + 17)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    model.train()
    losses = []
    for step in range(1, args.steps + 1):
        batch = make_batch(tokenizer, [task.sample_problem(rng) for _ in range(args.batch_size)])
        loss = response_loss(model, batch, args.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if args.target_accuracy > 0 and step % args.check_every == 0 and step < args.steps:
            model.eval()
            greedy = args.stop_on == "greedy"
            accuracy = sampled_accuracy(model, tokenizer, args.check_samples, args.seed + step, greedy=greedy)
            if accuracy >= args.target_accuracy:
                break
            model.train()
    model.eval()
    return losses


def sampled_accuracy(
    model: Any, tokenizer: Any, n: int, seed: int, max_new_tokens: int = 32, greedy: bool = False
) -> float:
    """Fraction of ``n`` fresh problems answered right with temperature-1, full-support sampling
    (``greedy``: the most likely token at each position instead)."""
    import torch

    problems = task.sample_problems(n, seed + 99)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": task.make_prompt(p)}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(compute_score(None, t, p.answer) for t, p in zip(texts, problems, strict=True)) / n


def build(out_dir: str | Path, args: WarmupArgs | None = None) -> dict[str, Any]:
    """Model + tokenizer (warmed up) under ``out_dir/model``, parquet under ``out_dir/data``."""
    import torch

    args = args or WarmupArgs()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(out_dir)
    start = time.perf_counter()
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tiny.build_config(tokenizer), seed=args.seed)
    losses = train(model, tokenizer, args)
    accuracy = sampled_accuracy(model, tokenizer, args.eval_samples, args.seed)
    greedy_accuracy = sampled_accuracy(model, tokenizer, args.eval_samples, args.seed, greedy=True)
    model_dir = tiny.save(model, tokenizer, out / "model")
    train_path, val_path = task.write_parquet(out / "data", seed=args.seed)
    return {
        "model_dir": str(model_dir),
        "train_file": str(train_path),
        "val_file": str(val_path),
        "steps": len(losses),
        "final_loss": sum(losses[-10:]) / min(10, len(losses)),
        "sampled_accuracy": accuracy,
        "greedy_accuracy": greedy_accuracy,
        "target_accuracy": args.target_accuracy,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=WarmupArgs.steps)
    parser.add_argument("--seed", type=int, default=WarmupArgs.seed)
    parser.add_argument("--target-accuracy", type=float, default=WarmupArgs.target_accuracy)
    parser.add_argument("--label-smoothing", type=float, default=WarmupArgs.label_smoothing)
    cli = parser.parse_args()
    args = WarmupArgs(
        steps=cli.steps, seed=cli.seed, target_accuracy=cli.target_accuracy, label_smoothing=cli.label_smoothing
    )
    print(build(cli.out, args))


if __name__ == "__main__":
    main()
