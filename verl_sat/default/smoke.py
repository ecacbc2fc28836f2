"""Assets and checks of the one-GPU smoke run, ``recipes/sat_paper/smoke_1gpu.sh`` (docs/reproduce.md).

``build``: a tiny Qwen3-MoE (bf16, about 16M parameters, 8 experts, top-2, head_dim 64 for
SGLang's attention kernels) with the embedded tokenizer, saved with ``save_pretrained``, and the
synthetic arithmetic task (``verl_sat.default.data``) as verl parquet. Random weights: the reward
is about 0, so the smoke checks the pipeline, not learning.

``check``: after the script's two invocations (steps 1-2, then a resume for step 3), that both
wrote their steps, that the second resumed from the first's checkpoint, and that the step metrics
hold what the recipe promises (SAT loss active, staleness within the lag, nothing evicted).

    python -m verl_sat.default.smoke build --out DIR
    python -m verl_sat.default.smoke check --run-dir DIR --lag 2 --steps 2 --resumed-steps 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from verl_sat.default.model import MODEL_KWARGS
from verl_sat.files import read_metrics

# Sizes: hidden 512, 4 layers, 8 experts of width 256, top-2 (16.1M parameters with the
# 512-token vocabulary). head_dim 64: SGLang's FlashInfer / FA3 kernels take 64, 128 or 256.
SMOKE_MODEL_KWARGS: dict[str, Any] = {
    **MODEL_KWARGS,  # the CPU default's tiny Qwen3-MoE (8 experts, top-2, 4 layers), wider
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
# Megatron pads the vocabulary to a multiple of 128 anyway; padding it here keeps SGLang's and
# Megatron's embedding shapes equal.
VOCAB_MULTIPLE = 128
EVICTION_PREFIXES = ("training/off_policy/", "training/rollout_failure/", "training/filter_groups/")


def padded_vocab(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def build(out_dir: str | Path, seed: int = 0) -> dict[str, str]:
    """Write ``out_dir/model`` (config, bf16 safetensors, tokenizer) and ``out_dir/data/{train,val}.parquet``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from verl_sat.default import data as task
    from verl_sat.default import model as tiny

    out = Path(out_dir)
    tokenizer = tiny.build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=padded_vocab(len(tokenizer)),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
        **SMOKE_MODEL_KWARGS,
    )
    torch.manual_seed(seed)
    tiny.save(Qwen3MoeForCausalLM(config).to(torch.bfloat16), tokenizer, out / "model")  # its generation config too
    train, val = task.write_parquet(out / "data", n_train=512, n_val=16, seed=seed)
    return {"model": str(out / "model"), "train": str(train), "val": str(val)}


def check(run_dir: str | Path, lag: int, steps: int, resumed_steps: int) -> list[str]:
    """What the smoke must show; returns the failures (empty: passed), one line each."""
    run = Path(run_dir)
    first, second = read_metrics(run / "metrics.part1.jsonl"), read_metrics(run / "metrics.jsonl")
    failures = []
    if [r["step"] for r in first] != list(range(1, steps + 1)):
        failures.append(f"metrics.part1.jsonl: steps {[r['step'] for r in first]}, expected 1..{steps}")
    expected = list(range(steps + 1, steps + resumed_steps + 1))
    if [r["step"] for r in second] != expected:
        failures.append(f"metrics.jsonl: steps {[r['step'] for r in second]}, expected {expected} (a resume)")
    latest = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    if not latest.exists() or latest.read_text().strip() != str(steps + resumed_steps):
        failures.append(f"{latest}: missing or not {steps + resumed_steps}")
    for row in first + second:
        where = f"step {row['step']}"
        for key in ("critic/score/mean", "actor/sat_gate_rate", "training/sat/staleness_steps/max"):
            if key not in row:
                failures.append(f"{where}: no {key}")
        if row.get("training/sat/staleness_steps/max", 0) > lag:
            failures.append(f"{where}: staleness {row['training/sat/staleness_steps/max']} > lag {lag}")
        if row.get("actor/sat_old_vs_rollout_logprob_gap", 0.0) != 0.0:
            failures.append(f"{where}: the ratio is not against the rollout log-probs (bypass mode)")
        evicted = {k: v for k, v in row.items() if k.startswith(EVICTION_PREFIXES) and k.endswith("_samples") and v}
        if evicted:
            failures.append(f"{where}: groups evicted: {evicted}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write the tiny MoE and the task")
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("check", help="check the run directory after both invocations")
    c.add_argument("--run-dir", required=True)
    c.add_argument("--lag", type=int, required=True)
    c.add_argument("--steps", type=int, required=True)
    c.add_argument("--resumed-steps", type=int, required=True)
    args = parser.parse_args()
    if args.command == "build":
        print(json.dumps(build(args.out, args.seed)))
        return
    failures = check(args.run_dir, args.lag, args.steps, args.resumed_steps)
    for line in failures:
        print(f"[verl-sat] smoke: FAIL {line}")
    if failures:
        raise SystemExit(1)
    print(f"[verl-sat] smoke: passed ({args.steps} steps, then {args.resumed_steps} resumed)")


if __name__ == "__main__":
    main()
