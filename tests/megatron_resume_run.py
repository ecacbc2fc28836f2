"""Worker script of tests/test_megatron_resume_on_cpu.py: a Megatron optimizer across verl's checkpoint.

``python tests/megatron_resume_run.py MODEL_DIR CKPT_DIR`` initialises torch.distributed (gloo, world
size 1) and builds verl's own ``MegatronEngineWithLMHead`` for the tiny Qwen3-MoE (mbridge, local
layers, fp32, torch's AdamW: no TransformerEngine), takes ``STEPS`` optimizer steps under a warm-up
schedule, and saves verl's checkpoint. Then, each into a fresh engine, through verl's
``MegatronCheckpointManager.load_checkpoint`` (megatron-core's ``dp_reshardable`` load, verl's
default): ``fixed``, with verl-sat's plugin as installed (``keep_adam_step``) and
``use_checkpoint_opt_param_scheduler=true``, then one more step; ``unfixed``, with megatron-core's
own ``load_state_dict`` and verl's default scheduler setting. Prints one JSON line with the
optimizer state of each (``optimizer_state.optimizer_state``).

The paper cell's offloaded optimizer (``HybridDeviceOptimizer``, precision-aware) does not run on
CPU (docs/gpu_path.md says why), so it is not built here.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VERL_PLATFORM"] = "cpu"
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
    os.environ.setdefault(key, value)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import verl  # noqa: E402, F401  (loads verl-sat's plugin: the CPU platform and its Megatron patches)
from megatron_engine_run import PROMPT_LENS, engine_batch, left_right_batch  # noqa: E402
from optimizer_state import optimizer_state  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402

from verl_sat.cpu.megatron import TRANSFORMER_OVERRIDES  # noqa: E402
from verl_sat.cpu.megatron_config import CPUMcoreEngineConfig  # noqa: E402
from verl_sat.verl_fixes import ADAM_STEP_MARKER  # noqa: E402

STEPS = 3


def build_engine(model_dir: str, restore_scheduler: bool = False) -> object:
    engine_config = CPUMcoreEngineConfig(
        dtype="float32",
        vanilla_mbridge=True,
        override_transformer_config=dict(TRANSFORMER_OVERRIDES),
        micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    optim = McoreOptimizerConfig(
        lr=1e-3,
        total_training_steps=10,
        lr_warmup_steps=STEPS + 2,  # the lr still rises at the resume: a restarted schedule shows
        use_checkpoint_opt_param_scheduler=restore_scheduler,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=model_dir),
        engine_config=engine_config,
        optimizer_config=optim,
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def nll_loss(model_output: dict, data: TensorDict, dp_group: object = None) -> tuple[torch.Tensor, dict]:
    values = model_output["log_probs"]
    return -(values.values() if values.is_nested else values).mean(), {}


def train_step(engine: object) -> None:
    raw = left_right_batch(engine.model_config.hf_config.vocab_size)
    data = engine_batch(raw, True)
    tu.assign_non_tensor(data, global_batch_size=len(PROMPT_LENS), num_micro_batch=2)
    with engine.train_mode():
        engine.train_batch(data, loss_function=nll_loss)
    engine.lr_scheduler_step()


def main(model_dir: str, ckpt_dir: str) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    dist.init_process_group("gloo")
    first = build_engine(model_dir)
    for _ in range(STEPS):
        train_step(first)
    saved = optimizer_state(first)
    first.save_checkpoint(ckpt_dir, global_step=STEPS)
    fixed = build_engine(model_dir, restore_scheduler=True)
    fixed.load_checkpoint(ckpt_dir, del_local_after_load=False)
    loaded = optimizer_state(fixed)
    train_step(fixed)
    after = optimizer_state(fixed)
    wrapped = DistributedOptimizer.load_state_dict
    DistributedOptimizer.load_state_dict = wrapped.__wrapped__  # megatron-core's own
    try:
        unfixed = build_engine(model_dir)
        unfixed.load_checkpoint(ckpt_dir, del_local_after_load=False)
    finally:
        DistributedOptimizer.load_state_dict = wrapped
    result = {
        "optimizer": type(first.optimizer).__name__,
        "inner": sorted({type(o.optimizer).__name__ for o in first.optimizer.chained_optimizers}),
        "fix_installed": getattr(wrapped, ADAM_STEP_MARKER, False),
        "saved": saved,
        "loaded": loaded,
        "after_one_more_step": after,
        "unfixed": optimizer_state(unfixed),
    }
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
