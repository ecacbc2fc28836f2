"""The default tiny task for CPU runs: a synthetic arithmetic dataset, a Qwen3-MoE of 1.09M
parameters with a tokenizer built in code, a rule-based reward and a short SFT warm-up.

Nothing is downloaded. ``python -m verl_sat.default.warmup --out DIR`` builds everything.
"""
