"""The embedded default's assets: built once into a cache, and filled into what the user left unset.

The tiny Qwen3-MoE, its tokenizer and the arithmetic task's parquet splits are built by
``verl_sat.default.warmup`` (~2-3 min) into ``~/.cache/verl-sat/tiny_moe_v5`` (or
``sat.assets_dir``) the first time a job needs them. Four keys are filled from them
(:func:`default_values`), and only when left null, by ``verl_sat.trainer.launch.fill_defaults``: a
value the user passed (command line, their own config, a recipe) always wins.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

MODEL_PATH_KEY = "actor_rollout_ref.model.path"
TRAIN_FILES_KEY = "data.train_files"
VAL_FILES_KEY = "data.val_files"
REWARD_PATH_KEY = "reward.custom_reward_function.path"
REWARD_NAME_KEY = "reward.custom_reward_function.name"
LEGACY_REWARD_PATH_KEY = "custom_reward_function.path"  # verl's old top-level node, migrated by verl
REWARD_FUNCTION = "compute_score"
CACHE_NAME = "tiny_moe_v5"  # bump when the warm-up changes what it builds


def default_assets_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    return Path(root) / "verl-sat" / CACHE_NAME


def assets_complete(assets: Path) -> bool:
    """The model and both data splits are there."""
    return all((assets / p).exists() for p in ("model/config.json", "data/train.parquet", "data/val.parquet"))


def build_assets_once(assets: Path) -> None:
    """Build the default's assets unless complete (~2-3 min); safe when several jobs start at once.

    Builders queue on a lock file beside ``assets`` and re-check after taking it, so one builds
    and the others reuse its result. A fresh build goes to a temporary directory renamed into
    place, so no job ever sees half-written weights. An existing, incomplete directory (one the
    user pointed ``sat.assets_dir`` at) is completed in place, never deleted.
    """
    from verl_sat.default import warmup

    assets.parent.mkdir(parents=True, exist_ok=True)
    with open(assets.parent / f".{assets.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if assets_complete(assets):
            return
        print(f"[verl-sat] building the embedded tiny MoE and task in {assets} (once, ~2-3 min)", flush=True)
        for stale in assets.parent.glob(f".{assets.name}.building-*"):  # a crashed build; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        target = assets if assets.exists() else assets.parent / f".{assets.name}.building-{os.getpid()}"
        info = warmup.build(target)
        if target != assets:
            os.replace(target, assets)
        accuracy, steps = info["sampled_accuracy"], info.get("steps", "?")
        greedy = f" (greedy {info['greedy_accuracy']:.2f})" if "greedy_accuracy" in info else ""
        print(f"[verl-sat] warm-up done: sampled accuracy {accuracy:.2f}{greedy} after {steps} steps", flush=True)


def default_values(assets: Path) -> dict[str, str]:
    """What the embedded default puts in each key (``assets``: the built model and data)."""
    from verl_sat.default import reward

    return {
        MODEL_PATH_KEY: str(assets / "model"),
        TRAIN_FILES_KEY: str(assets / "data" / "train.parquet"),
        VAL_FILES_KEY: str(assets / "data" / "val.parquet"),
        REWARD_PATH_KEY: reward.__file__,
    }
