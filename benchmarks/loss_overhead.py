"""Forward+backward time of ``sat`` / ``vanilla`` and ``sat_gspo`` / ``gspo``, side by side.

    python benchmarks/loss_overhead.py [--repeats 30] [--threads 1]

Each shape is measured with the losses interleaved (burn-in, then alternating timed calls), so
both see the same machine noise; the ratio of medians is printed. Shapes: 64 x 8192 and
4 x 32768 response tokens, fp32, CPU, ~10% padding, GRPO-style advantages, rollout/trainer
mismatch of 0.05 nats (so SAT's gate fires on ~10% of tokens, as in training).
Each SAT loss runs twice: with q taken over its own micro-batch (``sat_quantile_scope=
micro_batch``), and with the step's q handed in, as the default ``step`` scope does (a step of
16 micro-batches of the shape; the scoring pass that takes it is priced separately by
benchmarks/step_quantile_cost.py). At 4 x 32768 a micro-batch's own q gates no sequence (each
holds > 10% of the tokens), so SAT-GSPO there is verl's gspo after the quantile.
Target: ratio <= 1.10.
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
from verl_sat.sat.losses import loss_context
from verl_sat.sat.quantile import exact_quantile
from verl_sat.sat.step_q import step_scores

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


STEP_MICRO_BATCHES = 16  # the step that hands its q to one micro-batch (sat_quantile_scope=step)


def step_q(loss_mode: str, shape: tuple[int, int]) -> float:
    """q of a step of 16 micro-batches of this shape (seeds 0..15), as the scoring pass takes it."""
    values, weights = [], []
    for seed in range(STEP_MICRO_BATCHES):
        b = make_batch(*shape, seed=seed)
        v, w = step_scores(loss_mode, b["log_prob"], b["old_log_prob"], b["response_mask"])
        values.append(v)
        weights.append(torch.ones_like(v, dtype=torch.long) if w is None else w)
    return float(exact_quantile(torch.cat(values), 0.9, torch.cat(weights)))


def step_seconds(name: str, b: dict[str, torch.Tensor], agg: str, cfg: ActorConfig, q: float | None) -> float:
    """One forward + backward of the loss alone, in seconds (``q``: the step's, handed in)."""
    log_prob = b["log_prob"].clone().requires_grad_(True)
    start = time.perf_counter()
    with loss_context(step_q=q):
        loss, _ = get_policy_loss_fn(name)(b["old_log_prob"], log_prob, b["advantages"], b["response_mask"], agg, cfg)
    loss.backward()
    return time.perf_counter() - start


def compare(
    sat: str, base: str, agg: str, shape: tuple[int, int], repeats: int, q: float | None
) -> tuple[float, float]:
    b = make_batch(*shape)
    cfgs = {sat: config(sat), base: config(base)}
    times: dict[str, list[float]] = {sat: [], base: []}
    for _ in range(3):  # burn-in
        for name in (sat, base):
            step_seconds(name, b, agg, cfgs[name], q if name == sat else None)
    for i in range(repeats):
        order = (sat, base) if i % 2 == 0 else (base, sat)
        for name in order:
            times[name].append(step_seconds(name, b, agg, cfgs[name], q if name == sat else None))
    return statistics.median(times[sat]), statistics.median(times[base])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 CPU, median of {args.repeats} interleaved runs")
    print(f"{'shape':>12} {'loss':>9} {'q over':>11} {'base':>8} {'loss ms':>9} {'base ms':>9} {'ratio':>6}")
    for shape in SHAPES:
        for sat, base, agg in PAIRS:
            for scope, q in (("micro_batch", None), ("step", step_q(sat, shape))):
                t_sat, t_base = compare(sat, base, agg, shape, args.repeats, q)
                label = f"{shape[0]}x{shape[1]}"
                ratio = t_sat / t_base
                print(f"{label:>12} {sat:>9} {scope:>11} {base:>8} {t_sat * 1e3:9.2f} {t_base * 1e3:9.2f} {ratio:6.3f}")


if __name__ == "__main__":
    main()
