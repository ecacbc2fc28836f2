"""The studies' in-process asynchronous RL loop, its statistics and the harness that runs many
seeds in worker processes (docs/study.md)."""
