"""Assets and checks of the one-GPU smoke run, ``recipes/sat_paper/smoke_1gpu.sh`` (docs/reproduce.md).

``build``: a tiny Qwen3-MoE (bf16, about 16M parameters, 8 experts, top-2, head_dim 64 for
SGLang's attention kernels) with the embedded tokenizer, saved with ``save_pretrained``, and the
synthetic arithmetic task (``verl_sat.default.data``) as verl parquet. Random weights: the reward
is about 0, so the smoke checks the pipeline, not learning.

``check``: after the script's two invocations (steps 1-2, then a resume for step 3), that both
wrote their steps, that the second resumed from the first's checkpoint, that the step metrics
hold what the recipe promises (SAT loss active, staleness within the lag, nothing evicted), and
that the resume kept Adam's step: the checkpoint of step 3 holds the step of step 2's checkpoint
plus step 3's optimizer steps (a resume that restarts Adam, as megatron-core's own load of the
offloaded optimizer does, fails with ``resume: Adam step ...``; docs/faults.md#kill-and-resume).

Run by path, as ``smoke_1gpu.sh`` runs it (it is not part of the installed package)::

    python recipes/sat_paper/smoke.py build --out DIR
    python recipes/sat_paper/smoke.py check --run-dir DIR --lag 2 --steps 2 --resumed-steps 1
"""

from __future__ import annotations

import argparse
import io
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


def saved_optimizer(actor_dir: str | Path, tensors: bool = False) -> dict[str, Any]:
    """The optimizer in verl's Megatron checkpoint ``actor_dir`` (``global_step_k/actor``): the lr
    scheduler's ``num_steps``, every param group (with Adam's ``step``) and, with ``tensors``, the
    state tensors by key. megatron writes ``optimizer/dist_ckpt`` in torch_dist format: the param
    groups are pickled objects (``dp_reshardable``, verl's default) or sit in ``common.pt``."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader, load

    ckpt = Path(actor_dir) / "optimizer" / "dist_ckpt"
    common = torch.load(ckpt / "common.pt", weights_only=False)
    reader = FileSystemReader(str(ckpt))
    request: dict[str, Any] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if type(meta).__name__ == "BytesStorageMetadata":  # a pickled object
            request[key] = io.BytesIO()
        elif tensors:
            request[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    load(request, storage_reader=reader, no_dist=True)  # objects come back unpickled, in place
    return {
        "lr_scheduler_num_steps": (common.get("lr_scheduler") or {}).get("num_steps"),
        "param_groups": [g for value in (common, *request.values()) for g in _param_groups(value)],
        "tensors": {k: v for k, v in request.items() if isinstance(v, torch.Tensor)},
    }


def _param_groups(value: Any) -> list[dict]:
    """Every optimizer param group inside ``value`` (nested dicts and lists)."""
    if isinstance(value, dict):
        own = list(value["param_groups"]) if isinstance(value.get("param_groups"), list) else []
        return own + [g for k, v in value.items() if k != "param_groups" for g in _param_groups(v)]
    if isinstance(value, list):
        return [g for v in value for g in _param_groups(v)]
    return []


def adam_step(actor_dir: str | Path) -> int:
    """Adam's step in the checkpoint ``actor_dir``: the one ``step`` its param groups hold."""
    steps = {g["step"] for g in saved_optimizer(actor_dir)["param_groups"] if g.get("step") is not None}
    if len(steps) != 1:
        raise ValueError(f"{actor_dir}: expected one Adam step in the optimizer's param groups, found {sorted(steps)}")
    return int(steps.pop())


def check_adam_step(run_dir: str | Path, steps: int, resumed_steps: int) -> list[str]:
    """The resume kept Adam's step: step ``steps + resumed_steps``'s checkpoint holds step ``steps``'s
    step plus as many optimizer steps per global step as the first invocation took."""
    checkpoints = Path(run_dir) / "checkpoints"
    before_dir, after_dir = (checkpoints / f"global_step_{k}" / "actor" for k in (steps, steps + resumed_steps))
    try:
        before, after = adam_step(before_dir), adam_step(after_dir)
    except (OSError, ValueError, RuntimeError) as error:
        return [f"resume: cannot read Adam's step: {error}"]
    per_step, remainder = divmod(before, steps)
    expected = before + per_step * resumed_steps
    if remainder or after != expected:
        return [
            f"resume: Adam step {after} after resume (global_step_{steps + resumed_steps}), expected {expected}: "
            f"saved {before} at global_step_{steps}, {before / steps:g} per global step"
        ]
    return []


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
    return failures + check_adam_step(run, steps, resumed_steps)


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
