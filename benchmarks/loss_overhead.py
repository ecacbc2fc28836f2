"""Forward+backward time of ``sat`` / ``vanilla`` and ``sat_gspo`` / ``gspo``, side by side.

    python benchmarks/loss_overhead.py [--repeats 30] [--threads 1]

Each shape is measured with the losses interleaved (burn-in, then alternating timed calls), so
both see the same machine noise; the ratio of medians is printed. Shapes: 64 x 8192 and
4 x 32768 response tokens, fp32, CPU, ~10% padding, GRPO-style advantages, rollout/trainer
mismatch of 0.05 nats (so SAT's gate fires on ~10% of tokens, as in training).
Target (issue 2): ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config.actor import ActorConfig

import verl_sat  # noqa: F401  (registers sat, sat_gspo)
from verl_sat import SATPolicyLossConfig

PAIRS = [("sat", "vanilla", "token-mean"), ("sat_gspo", "gspo", "seq-mean-token-mean")]
SHAPES = [(64, 8192), (4, 32768)]


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 3
    new = old + torch.randn(batch, length, generator=g) * 0.05
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    lengths = (length * (0.8 + 0.2 * torch.rand(batch, generator=g))).long()
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return {"old_log_prob": old, "log_prob": new, "advantages": adv, "response_mask": mask}


def config(loss_mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=SATPolicyLossConfig(loss_mode=loss_mode),
    )


def step_seconds(name: str, b: dict[str, torch.Tensor], agg: str, cfg: ActorConfig) -> float:
    """One forward + backward of the loss alone, in seconds."""
    log_prob = b["log_prob"].clone().requires_grad_(True)
    start = time.perf_counter()
    loss, _ = get_policy_loss_fn(name)(b["old_log_prob"], log_prob, b["advantages"], b["response_mask"], agg, cfg)
    loss.backward()
    return time.perf_counter() - start


def compare(sat: str, base: str, agg: str, shape: tuple[int, int], repeats: int) -> tuple[float, float]:
    b = make_batch(*shape)
    cfgs = {sat: config(sat), base: config(base)}
    times: dict[str, list[float]] = {sat: [], base: []}
    for _ in range(3):  # burn-in
        for name in (sat, base):
            step_seconds(name, b, agg, cfgs[name])
    for i in range(repeats):
        order = (sat, base) if i % 2 == 0 else (base, sat)
        for name in order:
            times[name].append(step_seconds(name, b, agg, cfgs[name]))
    return statistics.median(times[sat]), statistics.median(times[base])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 CPU, median of {args.repeats} interleaved runs")
    print(f"{'shape':>12} {'loss':>9} {'base':>8} {'loss ms':>9} {'base ms':>9} {'ratio':>6}")
    for shape in SHAPES:
        for sat, base, agg in PAIRS:
            t_sat, t_base = compare(sat, base, agg, shape, args.repeats)
            label = f"{shape[0]}x{shape[1]}"
            print(f"{label:>12} {sat:>9} {base:>8} {t_sat * 1e3:9.2f} {t_base * 1e3:9.2f} {t_sat / t_base:6.3f}")


if __name__ == "__main__":
    main()
