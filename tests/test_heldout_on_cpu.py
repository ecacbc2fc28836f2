"""``sat.heldout``: the study's held-out metric in the product (verl_sat.default.heldout, verl_sat.trainer.heldout).

The end-to-end check (the worker's number before training equals the study's definition on the
same weights; after the named step it lands on that step's row, the console and reward.png)
shares the snapshot launch of tests/test_snapshots_on_cpu.py (CI time).
"""

from __future__ import annotations

import pandas as pd
import pytest

from verl_sat.default import data as task
from verl_sat.default.heldout import HeldoutConfig, heldout_problems, train_overlap
from verl_sat.trainer.heldout import optimizer_step
from verl_sat.trainer.launch import overlap_warning
from verl_sat.trainer.recipe import SATRecipeConfig, check_heldout


def test_the_loop_and_the_product_share_one_definition():
    from studies.lib import loop
    from verl_sat.trainer import heldout as product

    assert loop.heldout_problems is heldout_problems
    assert product.HELDOUT_KEY == loop.HELDOUT_KEY == "eval/heldout_acc"
    # the study's held-out set: 512 distinct sums from its seed, the same list every time
    problems = heldout_problems(512, 20261201)
    assert len({(p.a, p.b) for p in problems}) == 512 and problems == heldout_problems(512, 20261201)


def test_optimizer_steps_count_as_the_loop_counts_them():
    # lag 8: global step 1 holds optimizer steps 1..8, global step 8 steps 57..64
    assert [optimizer_step(1, 8, i) for i in range(8)] == list(range(1, 9))
    assert optimizer_step(8, 8, 3) == 60 and optimizer_step(30, 8, 7) == 240
    assert optimizer_step(5, 1, 0) == 5  # sat.lag=auto: one optimizer step per global step


def test_the_config_refuses_what_it_cannot_honour_naming_the_key():
    with pytest.raises(ValueError, match=r"sat\.heldout\.problems must be an integer in \[0, 5000\], got -1"):
        HeldoutConfig(problems=-1)
    with pytest.raises(ValueError, match=r"sat\.heldout\.samples must be an integer >= 1, got 0"):
        HeldoutConfig(problems=8, samples=0)
    with pytest.raises(ValueError, match=r"sat\.heldout\.at must list optimizer steps >= 0, got \[-3\]"):
        HeldoutConfig(problems=8, at=[-3])
    with pytest.raises(ValueError, match=r"unknown key\(s\) under sat\.heldout: sat\.heldout\.every"):
        SATRecipeConfig.from_node({"heldout": {"every": 10}})
    with pytest.raises(ValueError, match=r"sat\.heldout\.problems > 0 needs sat\.actor=true"):
        SATRecipeConfig.from_node({"actor": False, "sentinel": {"enabled": False}, "heldout": {"problems": 8}})
    study = HeldoutConfig(problems=512, at=[240, 60, 120, 180, 60])
    assert study.at == [60, 120, 180, 240]
    check_heldout(study, 8, 30, "fsdp")  # the study's steps at lag 8 fall in global steps 8, 15, 23, 30
    with pytest.raises(ValueError, match=r"steps 60 and 62 fall in the same global step 8"):
        check_heldout(HeldoutConfig(problems=8, at=[60, 62]), 8, 30, "fsdp")
    with pytest.raises(ValueError, match=r"step\(s\) \[300\] come after the run's last optimizer step 240"):
        check_heldout(HeldoutConfig(problems=8, at=[300]), 8, 30, "fsdp")
    with pytest.raises(ValueError, match=r"sat\.heldout needs sat\.strategy=fsdp"):
        check_heldout(HeldoutConfig(problems=8), 2, 4, "megatron")
    with pytest.raises(ValueError, match=r"sat\.heldout .* needs trainer\.device=cpu, got 'cuda'"):
        check_heldout(HeldoutConfig(problems=8), 8, 30, "fsdp", "cuda")
    check_heldout(HeldoutConfig(problems=0, at=[300]), 8, 30, "megatron", "cuda")  # off: nothing to refuse
    due = HeldoutConfig(problems=8, at=[0, 60])
    assert [s for s in range(0, 241) if due.due(s, 240)] == [0, 60, 240]


def test_a_training_set_without_the_heldout_sums(tmp_path):
    """The default's parquet shares sums with the held-out set; ``--exclude-heldout`` removes them,
    keeps the row count, and leaves the default (no exclusion) byte for byte as it was."""
    plain_dir, clean_dir, again_dir = tmp_path / "plain", tmp_path / "clean", tmp_path / "again"
    task.write_parquet(plain_dir, n_train=600, n_val=8)
    task.write_parquet(again_dir, n_train=600, n_val=8)
    task.write_parquet(clean_dir, n_train=600, n_val=8, exclude_heldout=512)
    assert (plain_dir / "train.parquet").read_bytes() == (again_dir / "train.parquet").read_bytes()
    problems = heldout_problems(512)

    def questions(path):
        return [e["question"] for e in pd.read_parquet(path)["extra_info"]]

    plain, clean = questions(plain_dir / "train.parquet"), questions(clean_dir / "train.parquet")
    assert len(clean) == len(plain) == 600
    assert train_overlap(plain, problems) > 0 and train_overlap(clean, problems) == 0
    held = HeldoutConfig(problems=512)
    warning = overlap_warning(held, str(plain_dir / "train.parquet"))
    assert warning and warning.startswith(f"{train_overlap(plain, problems)} of the 512 held-out problems")
    assert overlap_warning(held, [str(clean_dir / "train.parquet")]) is None
    assert overlap_warning(HeldoutConfig(), str(plain_dir / "train.parquet")) is None  # off
    assert overlap_warning(held, str(tmp_path / "missing.parquet")) is None  # unreadable: nothing said
