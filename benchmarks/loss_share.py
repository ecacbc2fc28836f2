"""The SAT loss's cost as a share of verl's ``update_actor``, side by side in one run.

    python benchmarks/loss_share.py [--repeats 15] [--threads 1] [--fused-rev abfc720] [--device cuda]

Two settings, each timed with every variant interleaved (A, B, C, then B, C, A, ...) so all see
the same machine noise; medians are printed, and each cost as a share of each denominator.

1. The CPU default (hydra_configs/sat_gspo_cpu.yaml): one micro-batch is the whole optimizer step,
   32 sequences x (28 prompt + 8 response) tokens, loss ``sat_gspo``, ``seq-mean-token-mean``.
   The denominator is **update_actor's stand-in, measured**: the tiny Qwen3-MoE of
   ``verl_sat.default.model`` (built in code), forward, the response's log-probs (log_softmax +
   gather, as verl's ``logprobs_from_logits``), the registered ``sat_gspo`` loss, backward and one
   AdamW step. It leaves out what verl's worker adds around it (FSDP2, data movement, metrics), so
   it is smaller than the real ``update_actor`` and every share printed is an upper bound. The
   same share against the ``update_actor`` a CPU default run logged (``PUBLISHED_UPDATE_ACTOR_S``,
   benchmarks/README.md) is printed beside it.
2. 32,768-token micro-batches (the paper's ``ppo_max_token_len_per_gpu``): the loss on 4 x 8192
   response tokens (~10% padding), q handed in as ``sat_quantile_scope=step`` does. Two
   denominators: **measured**, the tiny MoE's forward+backward+AdamW step on 32 x 1024 = 32,768
   tokens on this CPU; **estimated**, the paper's model on its GPUs (``estimated_paper_seconds``:
   Qwen3-30B-A3B, matmul FLOPs only, at a stated throughput, so a lower bound). Against it the
   loss's time is printed twice: as timed at 32,768 tokens (on a CPU an upper bound: a GPU does
   the arithmetic faster), and as timed at the CPU default's 256 tokens ("dispatch-bound": at
   32,768 elements a GPU kernel's work is well under a microsecond, so a GPU pays per op about
   what a CPU pays at 256 tokens, op dispatch; an estimate). ``--device cuda`` times it on a GPU.

Each loss variant is the forward+backward of the loss alone on leaf log-probs: the registered
``sat`` / ``sat_gspo`` (the autograd form), verl's ``vanilla`` / ``gspo``, and with ``--fused-rev``
the fused surrogates as of that git revision (``verl_sat/sat/fused.py``, removed after it; loaded
from ``git show`` beside the package). The fused path's saving is autograd minus fused.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config.actor import ActorConfig

import verl_sat  # noqa: F401  (registers sat, sat_gspo)
from verl_sat import SATPolicyLossConfig
from verl_sat.default import model as tiny
from verl_sat.sat.losses import loss_context
from verl_sat.sat.quantile import exact_quantile
from verl_sat.sat.step_q import step_scores

# update_actor of a CPU default run (benchmarks/README.md): 1.54 s per global step, which at lag 2 holds
# two optimizer steps of one micro-batch each
PUBLISHED_UPDATE_ACTOR_S = 1.54 / 2
DEFAULT_SEQS, DEFAULT_PROMPT, DEFAULT_RESPONSE = 32, 28, 8  # hydra_configs/sat_gspo_cpu.yaml
LONG_LOSS_SHAPE = (4, 8192)  # 32,768 response tokens
LONG_MODEL_SHAPE = (32, 1024)  # 32,768 tokens; the tiny MoE's max_position_embeddings is 1024

# the estimate for the paper's model (hydra_configs/model/qwen3_30b_a3b.yaml, sat_paper.yaml)
PAPER_ACTIVE_PARAMS = 3.3e9  # Qwen3-30B-A3B: 3.3B activated parameters per token
PAPER_FLOPS_PER_PARAM_TOKEN = 8  # forward 2 + backward 4 + full recompute 2 (recompute_granularity: full)
PAPER_GPUS = 4  # trainer GPUs sharing one micro-batch (tensor_model_parallel_size 4)
PAPER_GPU_FLOPS = 400e12  # bf16 FLOP/s per GPU: Megatron-Core's best published (dense, H100, ~47% MFU)


def estimated_paper_seconds(tokens: int) -> float:
    """A lower bound on one micro-batch's forward+backward for the paper's model, in seconds:
    8 * N_active * tokens FLOPs (no attention, no MoE routing, no optimizer step) over 4 GPUs at
    400 TFLOP/s each. The loss runs on every tensor-parallel rank over the whole micro-batch."""
    return PAPER_FLOPS_PER_PARAM_TOKEN * PAPER_ACTIVE_PARAMS * tokens / (PAPER_GPUS * PAPER_GPU_FLOPS)


DEVICE = torch.device("cpu")  # --device: where the model and the losses run


def sync() -> None:
    """Wait for the device's queued work, so a timer reads the work and not its launch."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Log-probs with a rollout/trainer mismatch of 0.05 nats (SAT gates ~10% of tokens, as in
    training), GRPO-style advantages (one per response), responses 80-100% of the row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=g) * 3
    new = old + torch.randn(batch, length, generator=g) * 0.05
    adv = torch.randn(batch, 1, generator=g).expand(batch, length).contiguous()
    lengths = (length * (0.8 + 0.2 * torch.rand(batch, generator=g))).long().clamp(min=1)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    b = {"old_log_prob": old, "log_prob": new, "advantages": adv, "response_mask": mask}
    return {key: value.to(DEVICE) for key, value in b.items()}


def actor_config(loss_mode: str) -> ActorConfig:
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=SATPolicyLossConfig(loss_mode=loss_mode),
    )


def load_fused(rev: str) -> types.ModuleType:
    """``verl_sat/sat/losses.py`` as of git ``rev`` with its fused surrogates and rule, as the
    package ``fused_at_rev`` (not registered in verl; call its functions directly)."""
    root = Path(__file__).resolve().parent.parent
    package = types.ModuleType("fused_at_rev")
    package.__path__ = []
    sys.modules["fused_at_rev"] = package
    for name in ("quantile", "config", "rule", "fused", "losses"):
        cmd = ["git", "-C", str(root), "show", f"{rev}:verl_sat/sat/{name}.py"]
        source = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        source = source.replace("from verl_sat.sat.", "from fused_at_rev.")
        if name == "losses":
            source = source.replace("\nregister_sat_losses()\n", "\n")
        module = types.ModuleType(f"fused_at_rev.{name}")
        sys.modules[module.__name__] = module
        exec(compile(source, f"{rev}:verl_sat/sat/{name}.py", "exec"), module.__dict__)  # noqa: S102
    return sys.modules["fused_at_rev.losses"]


def loss_call(fn: Callable, context: Callable, b: dict, agg: str, cfg: ActorConfig, q: float | None) -> Callable:
    """One forward+backward of a loss on leaf log-probs, inside ``context`` (the step's q, if any)."""

    def run() -> None:
        log_prob = b["log_prob"].clone().requires_grad_(True)
        with context(step_q=q) if q is not None else contextlib.nullcontext():
            loss, _ = fn(b["old_log_prob"], log_prob, b["advantages"], b["response_mask"], agg, cfg)
        loss.backward()

    return run


def model_call(model: torch.nn.Module, opt: torch.optim.Optimizer, shape: tuple[int, int], response: int) -> Callable:
    """update_actor's stand-in: forward, the response's log-probs, ``sat_gspo``, backward, AdamW step."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, shape, generator=g).to(DEVICE)
    b = make_batch(shape[0], response)
    loss_fn, cfg = get_policy_loss_fn("sat_gspo"), actor_config("sat_gspo")

    def run() -> None:
        logits = model(input_ids=ids).logits[:, -response - 1 : -1].float()
        log_prob = torch.log_softmax(logits, -1).gather(-1, ids[:, -response:, None]).squeeze(-1)
        old = log_prob.detach() + (b["old_log_prob"] - b["log_prob"])  # the batch's mismatch
        with loss_context(whole_step=True):
            loss, _ = loss_fn(old, log_prob, b["advantages"], b["response_mask"], "seq-mean-token-mean", cfg)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def interleaved(calls: dict[str, Callable], repeats: int, model: str | None = None, inner: int = 1) -> dict[str, float]:
    """Median seconds of each call; each round runs every call once in a rotating order, the
    cheap ones (all but ``model``) ``inner`` times, so that all share the same noise."""
    for fn in calls.values():  # burn-in
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            for _ in range(1 if name == model else inner):
                sync()
                start = time.perf_counter()
                calls[name]()
                sync()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


STEP_MICRO_BATCHES = 16  # the optimizer step whose q is handed to one micro-batch (sat_quantile_scope=step)


def step_reference(loss_mode: str, shape: tuple[int, int]) -> float:
    """q of a step of 16 micro-batches of this shape (seeds 0..15), as verl-sat's scoring pass takes it."""
    values, weights = [], []
    for seed in range(STEP_MICRO_BATCHES):
        b = make_batch(*shape, seed=seed)
        v, w = step_scores(loss_mode, b["log_prob"], b["old_log_prob"], b["response_mask"])
        values.append(v)
        weights.append(torch.ones_like(v, dtype=torch.long) if w is None else w)
    return float(exact_quantile(torch.cat(values), 0.9, torch.cat(weights)))


def loss_calls(shape: tuple[int, int], fused: types.ModuleType | None, step_q: bool) -> dict[str, Callable]:
    """The loss variants at this shape: SAT (autograd), verl's base loss, SAT fused (``--fused-rev``)."""
    b = make_batch(*shape)
    calls = {}
    for sat, base, agg in (("sat", "vanilla", "token-mean"), ("sat_gspo", "gspo", "seq-mean-token-mean")):
        q = step_reference(sat, shape) if step_q else None
        calls[sat] = loss_call(get_policy_loss_fn(sat), loss_context, b, agg, actor_config(sat), q)
        calls[base] = loss_call(get_policy_loss_fn(base), loss_context, b, agg, actor_config(base), None)
        if fused is not None:
            fn = fused.compute_policy_loss_sat if sat == "sat" else fused.compute_policy_loss_sat_gspo
            calls[f"{sat} fused"] = loss_call(fn, fused.loss_context, b, agg, actor_config(sat), q)
    return calls


PAIRS = (("sat", "vanilla"), ("sat_gspo", "gspo"))


def costs(med: dict[str, float]) -> dict[str, float]:
    """Seconds per micro-batch: each SAT loss whole (an upper bound on what any faster form of
    it can save), its extra over verl's base loss, and, with the fused form timed, its saving."""
    out = {}
    for sat, base in PAIRS:
        out[f"{sat} (whole loss)"] = med[sat]
        out[f"{sat} - {base}"] = med[sat] - med[base]
        if f"{sat} fused" in med:
            out[f"{sat} fused saving"] = med[sat] - med[f"{sat} fused"]
    return out


def report(title: str, med: dict[str, float], loss_costs: dict[str, float], denominators: dict[str, float]) -> None:
    """The medians, then each cost as a share of each denominator."""
    print(f"\n{title}")
    for name, seconds in med.items():
        print(f"  {name:<24} {seconds * 1e3:10.3f} ms")
    for label, seconds in denominators.items():
        print(f"  as a share of {label}, {seconds:.3f} s:")
        for name, cost in loss_costs.items():
            print(f"    {name:<24} {cost * 1e3:8.3f} ms  {cost / seconds:8.3%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the 2-core machine is shared)")
    parser.add_argument("--fused-rev", default=None, help="git revision whose fused surrogates to time beside")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the losses timed where the paper runs them")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    fused = load_fused(args.fused_rev) if args.fused_rev else None
    print(f"torch {torch.__version__}, {args.threads} thread(s), fp32 {DEVICE}, medians of interleaved repeats")
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(tiny.build_config(tokenizer), seed=0).to(DEVICE)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-4)

    # 1. the CPU default's micro-batch
    calls = loss_calls((DEFAULT_SEQS, DEFAULT_RESPONSE), fused, step_q=False)
    stand_in = "update_actor stand-in"
    calls[stand_in] = model_call(model, opt, (DEFAULT_SEQS, DEFAULT_PROMPT + DEFAULT_RESPONSE), DEFAULT_RESPONSE)
    med = interleaved(calls, args.repeats, model=stand_in, inner=5)
    small = costs(med)
    denominators = {
        "the stand-in (measured)": med[stand_in],
        "update_actor logged by a CPU default run, per micro-batch": PUBLISHED_UPDATE_ACTOR_S,
    }
    title = f"CPU default: the loss on {DEFAULT_SEQS} x {DEFAULT_RESPONSE} response tokens, q over the micro-batch"
    report(title, med, small, denominators)

    # 2. 32,768-token micro-batches
    calls = loss_calls(LONG_LOSS_SHAPE, fused, step_q=True)
    calls["tiny MoE, 32k tokens"] = model_call(model, opt, LONG_MODEL_SHAPE, LONG_MODEL_SHAPE[1] - 1)
    med = interleaved(calls, max(3, args.repeats // 5), model="tiny MoE, 32k tokens", inner=5)
    tokens = LONG_LOSS_SHAPE[0] * LONG_LOSS_SHAPE[1]
    paper = estimated_paper_seconds(tokens)
    title = (
        f"32,768-token micro-batches: the loss on {LONG_LOSS_SHAPE[0]} x {LONG_LOSS_SHAPE[1]}, the step's q handed in"
    )
    report(title, med, costs(med), {"the tiny MoE's pass (measured)": med["tiny MoE, 32k tokens"]})
    print(f"  as a share of Qwen3-30B-A3B's pass (estimated), {paper:.3f} s:")
    flops = f"{PAPER_FLOPS_PER_PARAM_TOKEN} x {PAPER_ACTIVE_PARAMS:.1e} x {tokens} FLOPs"
    print(f"    ({flops} / ({PAPER_GPUS} x {PAPER_GPU_FLOPS:.0e} FLOP/s): matmuls only, a lower bound)")
    for (name, cost), small_cost in zip(costs(med).items(), small.values(), strict=True):
        # the loss's time at 32k tokens here; at 256 tokens (dispatch-bound, as a GPU is at 32k elements)
        print(f"    {name:<24} timed at 32k {cost / paper:8.3%}, dispatch-bound (256) {small_cost / paper:8.3%}")


if __name__ == "__main__":
    main()
