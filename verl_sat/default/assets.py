"""The embedded default's assets: built once into a cache, and filled into what the user left unset.

The tiny Qwen3-MoE, its tokenizer and the arithmetic task's parquet splits are built by
``verl_sat.default.warmup`` (~2-3 min) into ``~/.cache/verl-sat/tiny_moe_v5`` (or
``sat.assets_dir``) the first time a job needs them. Four keys are filled from them, and only
when left null: a value the user passed (command line, their own config, a recipe) always wins.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

MODEL_PATH_KEY = "actor_rollout_ref.model.path"
TRAIN_FILES_KEY = "data.train_files"
VAL_FILES_KEY = "data.val_files"
REWARD_PATH_KEY = "reward.custom_reward_function.path"
REWARD_NAME_KEY = "reward.custom_reward_function.name"
LEGACY_REWARD_PATH_KEY = "custom_reward_function.path"  # verl's old top-level node, migrated by verl
REWARD_FUNCTION = "compute_score"
CACHE_NAME = "tiny_moe_v5"  # bump when the warm-up changes what it builds


def is_unset(cfg: DictConfig, key: str) -> bool:
    """The user left ``key`` unset: null, ``???`` or absent (our default configs leave these null)."""
    return OmegaConf.select(cfg, key, default=None) is None


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


def keys_to_fill(cfg: DictConfig) -> list[str]:
    """The embedded default's keys the user left unset (the reward also counts as set through
    verl's legacy top-level ``custom_reward_function.path``)."""
    keys = [k for k in (MODEL_PATH_KEY, TRAIN_FILES_KEY, VAL_FILES_KEY) if is_unset(cfg, k)]
    if is_unset(cfg, REWARD_PATH_KEY) and is_unset(cfg, LEGACY_REWARD_PATH_KEY):
        keys.append(REWARD_PATH_KEY)
    return keys


def ensure_default_assets(cfg: DictConfig, assets_dir: str | None = None) -> dict[str, str]:
    """Fill each key of the embedded default that the user left unset; returns ``{key: value}`` filled.

    A value the user passed is kept, whatever it is; our default configs leave the four keys null
    so that "null" is what "unset" means. The tiny model and data are built (once) only when the
    model or a data split is to be filled. The reward's function name defaults to
    ``compute_score``; a name the user set must exist in the embedded reward module.
    """
    from verl_sat.default import reward

    fill = keys_to_fill(cfg)
    assets = Path(assets_dir) if assets_dir else default_assets_dir()
    if any(k != REWARD_PATH_KEY for k in fill) and not assets_complete(assets):
        build_assets_once(assets)
    values = default_values(assets)
    filled = {key: values[key] for key in fill}
    if REWARD_PATH_KEY in fill:
        name = OmegaConf.select(cfg, REWARD_NAME_KEY, default=None)
        if name is None:
            filled[REWARD_NAME_KEY] = REWARD_FUNCTION
        elif not callable(getattr(reward, str(name), None)):
            raise ValueError(
                f"{REWARD_NAME_KEY}={name!r} is not a function of the embedded reward {reward.__file__} "
                f"(it has {REWARD_FUNCTION!r}); set {REWARD_PATH_KEY}= to your own reward file or drop the name"
            )
    with open_dict(cfg):
        for key, value in filled.items():
            OmegaConf.update(cfg, key, value, merge=False)
    return filled
