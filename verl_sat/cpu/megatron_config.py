"""fp32 parameters for verl's Megatron engine on CPU, through verl's config seam (``_target_``).

verl 0.9.1's ``McoreEngineConfig.__post_init__`` accepts only ``dtype`` bfloat16 / float16, yet the
engine itself builds fp32 parameters when given ``float32`` (``PrecisionType.to_dtype``, bf16 / fp16
flags off, megatron's FP32 optimizer path). The CPU default computes in fp32 on both sides, so the
rollout's log-probs mu and the trainer's agree to fp32 noise (docs/cpu.md); in bf16 they differ by
about 2.5e-3, a mismatch the run did not ask for. ``actor_rollout_ref.actor.megatron._target_`` names
:class:`CPUMcoreEngineConfig` in ``hydra_configs/strategy/megatron_cpu.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.workers.config import McoreEngineConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class CPUMcoreEngineConfig(McoreEngineConfig):
    """verl's ``McoreEngineConfig`` that also accepts ``dtype=float32``; every other check is verl's."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"actor_rollout_ref.actor.megatron.dtype must be one of {list(DTYPES)}, got {self.dtype!r}"
            )
        requested = self.dtype
        object.__setattr__(self, "dtype", "bfloat16" if requested == "float32" else requested)
        try:
            super().__post_init__()
        finally:
            object.__setattr__(self, "dtype", requested)
