"""Worker script of tests/test_megatron_engine.py: verl's Megatron engine on CPU, in its own process.

It initialises torch.distributed (gloo, world size 1) and Megatron's parallel state, which must not
leak into the test session, so the test runs it as a subprocess and reads the JSON it prints last.
``python tests/megatron_engine_run.py MODEL_DIR``: builds verl's ``MegatronEngineWithLMHead`` from the
tiny Qwen3-MoE through mbridge (local layers, fp32), computes log-probs of a left/right padded batch
through verl's own forward with remove-padding on (packed, thd) and off (padded, bshd), compares them
with Hugging Face's, then runs three train steps on a log-likelihood loss.
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
from tensordict import TensorDict  # noqa: E402
from verl.trainer.config import CheckpointConfig  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import HFModelConfig, McoreOptimizerConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from verl_sat.cpu.megatron import TRANSFORMER_OVERRIDES  # noqa: E402
from verl_sat.cpu.megatron_config import CPUMcoreEngineConfig  # noqa: E402

PROMPT, RESPONSE = 6, 5
PROMPT_LENS, RESPONSE_LENS = (6, 3, 5, 2), (5, 2, 4, 1)


def left_right_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses, as verl's rollout hands them to the actor."""
    g = torch.Generator().manual_seed(0)
    n = len(PROMPT_LENS)
    ids = torch.zeros(n, PROMPT + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        ids[i, PROMPT - p : PROMPT + r] = torch.randint(3, vocab, (p + r,), generator=g)
        mask[i, PROMPT - p : PROMPT + r] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def engine_batch(raw: dict[str, torch.Tensor], remove_padding: bool) -> TensorDict:
    n = raw["input_ids"].shape[0]
    data = TensorDict({k: v.clone() for k, v in raw.items()}, batch_size=n)
    data["response_mask"] = raw["attention_mask"][:, PROMPT:].clone()
    data["prompts"], data["responses"] = raw["input_ids"][:, :PROMPT].clone(), raw["input_ids"][:, PROMPT:].clone()
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(
        data,
        temperature=1.0,
        use_remove_padding=remove_padding,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        max_token_len_per_gpu=4096,
        use_fused_kernels=False,
        calculate_entropy=False,
    )
    return data


def hf_log_probs(model_dir: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(**raw).logits
    ids = raw["input_ids"]
    return torch.log_softmax(logits[:, PROMPT - 1 : -1].float(), -1).gather(-1, ids[:, PROMPT:, None]).squeeze(-1)


def main(model_dir: str) -> dict:
    dist.init_process_group("gloo")
    engine_config = CPUMcoreEngineConfig(
        dtype="float32",
        vanilla_mbridge=True,
        override_transformer_config=dict(TRANSFORMER_OVERRIDES),
        micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
    )
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="megatron",
        model_config=HFModelConfig(path=model_dir),
        engine_config=engine_config,
        optimizer_config=McoreOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    raw = left_right_batch(engine.model_config.hf_config.vocab_size)
    mask = raw["attention_mask"][:, PROMPT:].bool()
    reference = hf_log_probs(model_dir, raw)
    result: dict = {
        "engine": type(engine).__name__,
        "params_dtype": str(next(engine.module[0].parameters()).dtype),
        "attention": type(engine.module[0].module.decoder.layers[0].self_attention.core_attention).__name__,
    }

    def log_probs(remove_padding: bool) -> torch.Tensor:
        object.__setattr__(engine_config, "use_remove_padding", remove_padding)
        with engine.eval_mode():
            out = engine.infer_batch(engine_batch(raw, remove_padding))
        return no_padding_2_padding(out["model_output"]["log_probs"], engine_batch(raw, remove_padding))

    for name, remove_padding in (("packed", True), ("padded", False)):
        result[f"max_abs_diff_{name}"] = float((log_probs(remove_padding) - reference).abs()[mask].max())

    def nll_loss(model_output: dict, data: TensorDict, dp_group=None) -> tuple[torch.Tensor, dict]:
        values = model_output["log_probs"]
        return -(values.values() if values.is_nested else values).mean(), {}

    nll = []
    for _ in range(3):
        nll.append(float(-log_probs(True)[mask].mean()))
        data = engine_batch(raw, True)
        tu.assign_non_tensor(data, global_batch_size=len(PROMPT_LENS), num_micro_batch=2)
        with engine.train_mode():
            out = engine.train_batch(data, loss_function=nll_loss)
    nll.append(float(-log_probs(True)[mask].mean()))
    result["nll"] = nll
    result["grad_norm"] = float(out["metrics"]["grad_norm"])
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
