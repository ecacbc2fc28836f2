"""SAT-GRPO against GRPO at the token level, diagnosed (issue 46, part 2c)."""
