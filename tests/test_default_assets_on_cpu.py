"""The CPU default's lengths fit its data: no prompt is truncated, no solution cut short."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from verl_sat.default.data import make_prompt, sample_problems
from verl_sat.default.model import build_tokenizer

CONFIG = Path(__file__).resolve().parents[1] / "hydra_configs" / "sat_gspo_cpu.yaml"


def test_prompts_and_solutions_fit_the_default_lengths():
    cfg = OmegaConf.load(CONFIG)
    tokenizer = build_tokenizer()
    problems = sample_problems(2048, seed=0)  # the train split's size and seed (data.write_parquet)
    chats = [[{"role": "user", "content": make_prompt(p)}] for p in problems]
    prompt_lens = [len(tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in chats]
    solution_lens = [len(tokenizer(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in problems]  # + EOS
    # verl's agent loop left-truncates a prompt longer than data.max_prompt_length
    assert max(prompt_lens) <= cfg.data.max_prompt_length, (max(prompt_lens), cfg.data.max_prompt_length)
    assert max(solution_lens) <= cfg.data.max_response_length, (max(solution_lens), cfg.data.max_response_length)
