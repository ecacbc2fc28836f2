"""A tiny Qwen3-MoE (1.09M parameters, 8 experts, top-2) and a tokenizer built in code.

The tokenizer is a byte-level BPE trained on the synthetic task's text (digits split
individually so numbers stay compositional), wrapped as ``PreTrainedTokenizerFast`` with a
Qwen-style chat template; ``<|im_end|>`` ends a turn (EOS), ``<|endoftext|>`` pads.
The model uses ``attn_implementation="sdpa"`` and ``_experts_implementation="eager"``
(``grouped_mm`` also works on CPU, slightly slower at this size; ``batched_mm`` is very slow).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_sat.default.data import make_prompt, sample_problems

PAD, EOS, IM_START = "<|endoftext|>", "<|im_end|>", "<|im_start|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Sizes: hidden 96, 4 layers, 8 experts of width 96, top-2: 1,092,832 parameters with the built-in vocabulary.
MODEL_KWARGS: dict[str, Any] = dict(
    hidden_size=96,
    intermediate_size=192,
    moe_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vLLM's CPU attention kernel takes head sizes 32, 64, 80, ... (not 24)
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
)


def _corpus(n: int = 300, seed: int = 1234) -> list[str]:
    """Texts the BPE is trained on: chat-formatted prompts and solutions of the task."""
    texts = []
    for p in sample_problems(n, seed):
        messages = [{"role": "user", "content": make_prompt(p)}, {"role": "assistant", "content": p.solution}]
        texts.append("".join(f"{m['role']}\n{m['content']}\n" for m in messages))
    return texts


def build_tokenizer(vocab_size: int = 512) -> Any:
    """Train a byte-level BPE in memory and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_config(tokenizer: Any, experts_implementation: str = "eager") -> Any:
    """A ``Qwen3MoeConfig`` sized by :data:`MODEL_KWARGS` for ``tokenizer``."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **MODEL_KWARGS,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    return config


def build_model(config: Any, seed: int = 0) -> Any:
    """A randomly initialised fp32 ``Qwen3MoeForCausalLM``."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).float()


def save(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Save model (safetensors), tokenizer and a generation config stopping on ``<|im_end|>``."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def create(out_dir: str | Path, seed: int = 0, experts_implementation: str = "eager") -> Path:
    """Build tokenizer + random model and save both to ``out_dir``."""
    tokenizer = build_tokenizer()
    model = build_model(build_config(tokenizer, experts_implementation), seed)
    return save(model, tokenizer, out_dir)
