"""The Adam state of verl's Megatron engine as plain numbers, in memory and in verl's checkpoint files.

``optimizer_state(engine)``: for each of megatron's chained optimizers, the distinct Adam steps of
its parameters (``steps``), its param groups' ``step`` and lr, and a sample of the moments: for the
first, middle and last parameter of each grad-buffer bucket, its offset in the bucket, its first
values and its sum, of ``exp_avg`` and ``exp_avg_sq``; and the lr scheduler's ``num_steps``.

``saved_state(actor_dir)`` reads the same numbers from the checkpoint verl wrote
(``global_step_k/actor``, ``optimizer/dist_ckpt``; ``saved_moments`` samples it where
``memory_moments`` sampled the engine): megatron's ``dp_reshardable`` format (verl's
default) stores each bucket's moments as one tensor (``...bucket_idx_<b>.exp_avg``, the parameters
at their offsets in the bucket, padding between them) and the param groups and lr scheduler as
objects. The tensors and objects are read with ``torch.distributed.checkpoint``'s reader (the
``torch_dist`` format megatron writes), the common file with ``torch.load``: the reader the 1-GPU
smoke checks its resume with (``recipes/sat_paper/smoke.py``). With one data-parallel rank a
bucket's offsets are the world's, so both samples compare value for value.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "sat_paper"
SAMPLE = 4  # values taken from each sampled parameter's start
MOMENTS = ("exp_avg", "exp_avg_sq")


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def sampled(bucket: list[dict]) -> list[dict]:
    """The first, middle and last parameter entries of one bucket (megatron's bucket state)."""
    return [bucket[i] for i in sorted({0, len(bucket) // 2, len(bucket) - 1})]


def param_sample(start: int, values: torch.Tensor) -> dict[str, Any]:
    flat = values.detach().reshape(-1).double().cpu()
    return {"start": int(start), "n": flat.numel(), "head": flat[:SAMPLE].tolist(), "sum": float(flat.sum())}


def memory_moments(dist_optimizer: Any) -> dict[str, list[dict]]:
    """Per bucket key (as the checkpoint names it, without the state key), the sampled parameters' moments."""
    out: dict[str, list[dict]] = {}
    state = dist_optimizer.get_parameter_state_dp_reshardable()
    for gbuf_idx in range(len(dist_optimizer.gbuf_ranges)):
        for dtype, buckets in state[gbuf_idx].items():
            for bucket_idx, bucket in enumerate(buckets):
                key = f"gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}"
                out[key] = [{m: param_sample(t["gbuf_local_start"], t[m]) for m in MOMENTS} for t in sampled(bucket)]
    return out


def optimizer_state(engine: Any) -> dict[str, Any]:
    """The Adam state ``engine`` (verl's MegatronEngine) holds now: see the module docstring."""
    chained = []
    for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = sub.optimizer
        chained.append(
            {
                "steps": sorted({_float(s["step"]) for s in inner.state.values() if "step" in s}),
                "group_steps": sorted({_float(g["step"]) for g in inner.param_groups if "step" in g}),
                "lr": [g["lr"] for g in inner.param_groups],
                "moments": memory_moments(sub),
            }
        )
    return {"lr_scheduler_num_steps": int(engine.lr_scheduler.num_steps), "chained": chained}


def saved_state(actor_dir: str | Path) -> dict[str, Any]:
    """What verl's checkpoint in ``actor_dir`` holds: the lr scheduler's ``num_steps``, the param
    groups (Adam's ``step``, lr) and every state tensor by key (the smoke's reader,
    ``recipes/sat_paper/smoke.py``)."""
    sys.path.insert(0, str(RECIPE))
    try:
        import smoke
    finally:
        sys.path.remove(str(RECIPE))
    return smoke.saved_optimizer(actor_dir, tensors=True)


def saved_moments(saved: dict[str, Any], memory: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The checkpoint's values at the offsets and lengths ``memory`` (``memory_moments``) sampled."""
    out: dict[str, list[dict]] = {}
    for bucket_key, params in memory.items():
        full = {m: _bucket_tensor(saved["tensors"], bucket_key, m) for m in MOMENTS}
        out[bucket_key] = [
            {m: param_sample(p[m]["start"], full[m][p[m]["start"] : p[m]["start"] + p[m]["n"]]) for m in MOMENTS}
            for p in params
        ]
    return out


def _bucket_tensor(tensors: dict[str, torch.Tensor], bucket_key: str, moment: str) -> torch.Tensor:
    (match,) = [t for k, t in tensors.items() if k.endswith(f".{bucket_key}.{moment}")]
    return match
