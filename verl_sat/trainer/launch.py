"""Before Ray starts: every path checked, the run directory made (or resumed), the workers'
environment set, and ``run.json`` written. :func:`prepare_run` does these in order, on the config
``verl_sat.trainer.recipe.resolve`` made (``verl_sat.main.prepare`` calls the two).

- :func:`fill_defaults`: what the user left unset, from the embedded default (``sat.default_assets``,
  built by ``verl_sat.default.assets``), the micro-batch sizes from the data-parallel size;
- :func:`check_paths`: the keys a run cannot start without, and every local path the config
  names, fail here with the key and the path (and :func:`overlap_warning` for ``sat.heldout``);
- :func:`make_run_dir`: ``sat.run_dir`` (printed at start) with verl's file logger and
  checkpoints pointed into it; a directory that already holds metrics is resumed from its newest
  complete checkpoint (``trainer.resume_mode=auto``) or refused, and nothing is overwritten;
- :func:`set_platform_env`, :func:`pass_env_to_ray`: what the Ray workers need from the driver,
  through the job's runtime environment (a cluster started beforehand does not inherit ours);
- ``verl_sat.preflight.cluster.prepare_cluster``: on a cluster started beforehand, the layout
  checked against the nodes and every path checked on every node;
- :func:`write_run_record`: the record of what ran.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from verl_sat.default.assets import (
    LEGACY_REWARD_PATH_KEY,
    MODEL_PATH_KEY,
    REWARD_FUNCTION,
    REWARD_NAME_KEY,
    REWARD_PATH_KEY,
    TRAIN_FILES_KEY,
    VAL_FILES_KEY,
    assets_complete,
    build_assets_once,
    default_assets_dir,
    default_values,
)
from verl_sat.default.heldout import HeldoutConfig
from verl_sat.files import METRICS_FILE, RUN_RECORD, write_json
from verl_sat.processes import RUN_DIR_ENV
from verl_sat.trainer import auto_lag
from verl_sat.trainer.accounting import prepare_resume
from verl_sat.trainer.faults import check_writable, latest_checkpoint
from verl_sat.trainer.recipe import ACTOR_KEY, ROLLOUT_KEY, SATRecipeConfig, rank_share, resolve

TOKENIZER_PATH_KEY = "actor_rollout_ref.model.tokenizer_path"
# Keys a run cannot start without (checked whether or not the embedded default fills them).
REQUIRED_KEYS = (MODEL_PATH_KEY, TRAIN_FILES_KEY, VAL_FILES_KEY)
# A Hugging Face Hub id ("org/name"): verl downloads it, so it need not exist locally.
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Environment the Ray workers need from the driver, passed through Ray's runtime environment too:
# on a cluster started beforehand (`ray start`), workers inherit the raylet's environment, not ours.
# The platform variables (set_platform_env) and the plugin's (verl's VERL_USE_EXTERNAL_*) go too, with
# every VERL_SAT_* variable (the rollout's knobs, the run directory): what a driver-side `export` sets.
RAY_ENV_VARS = (
    "VERL_FILE_LOGGER_PATH",
    RUN_DIR_ENV,
    "VERL_PLATFORM",
    "VERL_ENGINE_DEVICE",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "RAY_DEDUP_LOGS",
    "VERL_USE_EXTERNAL_MODULES",
    "VERL_USE_EXTERNAL_PLUGINS",
)
RAY_ENV_PREFIX = "VERL_SAT_"
RAY_ENV_KEY = "ray_kwargs.ray_init.runtime_env.env_vars"  # verl's run_ppo passes it to ray.init


# ---------------------------------------------------------------------------------------------
# the embedded default
# ---------------------------------------------------------------------------------------------


def is_unset(cfg: DictConfig, key: str) -> bool:
    """The user left ``key`` unset: null, ``???`` or absent (our default configs leave these null)."""
    return OmegaConf.select(cfg, key, default=None) is None


def keys_to_fill(cfg: DictConfig) -> list[str]:
    """The embedded default's keys the user left unset (the reward also counts as set through
    verl's legacy top-level ``custom_reward_function.path``)."""
    keys = [k for k in (MODEL_PATH_KEY, TRAIN_FILES_KEY, VAL_FILES_KEY) if is_unset(cfg, k)]
    if is_unset(cfg, REWARD_PATH_KEY) and is_unset(cfg, LEGACY_REWARD_PATH_KEY):
        keys.append(REWARD_PATH_KEY)
    return keys


# Micro-batch key -> (verl's older global form, which replaces it; the dynamic-batching switch, which makes it unused).
MICRO_BATCH_KEYS = {
    f"{ACTOR_KEY}.ppo_micro_batch_size_per_gpu": (f"{ACTOR_KEY}.ppo_micro_batch_size", f"{ACTOR_KEY}.use_dynamic_bsz"),
    f"{ROLLOUT_KEY}.log_prob_micro_batch_size_per_gpu": (
        f"{ROLLOUT_KEY}.log_prob_micro_batch_size",
        f"{ROLLOUT_KEY}.log_prob_use_dynamic_bsz",
    ),
}


def fill_micro_batches(cfg: DictConfig) -> dict[str, int]:
    """The micro-batch keys left unset (neither their global form nor dynamic batching set): one
    micro-batch per rank's share of a mini-batch, ``ppo_mini_batch_size × rollout.n / DP``, so a
    mini-batch splits evenly over any number of trainer nodes (verl: "data size must be divisible by
    force_group_size * micro_batch_size_per_gpu"). Returns ``{key: value}`` filled."""
    per_rank = rank_share(cfg)
    filled = {
        key: per_rank
        for key, (global_key, dynamic_key) in MICRO_BATCH_KEYS.items()
        if is_unset(cfg, key) and is_unset(cfg, global_key) and not OmegaConf.select(cfg, dynamic_key, default=False)
    }
    with open_dict(cfg):
        for key, value in filled.items():
            OmegaConf.update(cfg, key, value, merge=False)
    return filled


def fill_defaults(cfg: DictConfig, assets_dir: str | None = None, build: bool = True) -> dict[str, str | int]:
    """Fill each key of the embedded default that the user left unset; returns ``{key: value}`` filled.

    A value the user passed is kept, whatever it is; our default configs leave the four keys null
    so that "null" is what "unset" means. The tiny model and data are built (once) only when the
    model or a data split is to be filled. The micro-batch sizes left null follow the
    data-parallel size (:func:`fill_micro_batches`). The reward's function name defaults to
    ``compute_score``; a name the user set must exist in the embedded reward module. ``build=False``
    names the paths without building them (a print of the config).
    """
    from verl_sat.default import reward

    fill = keys_to_fill(cfg)
    assets = Path(assets_dir) if assets_dir else default_assets_dir()
    if build and any(k != REWARD_PATH_KEY for k in fill) and not assets_complete(assets):
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
    return {**filled, **fill_micro_batches(cfg)}


def fill_launch(cfg: DictConfig, sat: SATRecipeConfig, build: bool = True) -> dict[str, str | int]:
    """What the launch fills into ``cfg`` before verl sees it: the embedded default's keys left unset
    (``sat.default_assets``, :func:`fill_defaults`); returns ``{key: value}`` filled."""
    return fill_defaults(cfg, sat.assets_dir, build=build) if sat.default_assets else {}


def config_verl_receives(cfg: DictConfig, log: Callable[[str], None] = print, build: bool = False) -> DictConfig:
    """``cfg`` changed as the launch changes it for verl, launching nothing: ``recipe.resolve``, then
    :func:`fill_launch` (the embedded default's paths named; built only when ``build``). What
    ``verl-sat --cfg job`` and ``python -m verl_sat.paper.grid --print`` print and the preflight
    checks (it builds); the run directory's keys are set at launch."""
    sat, _ = resolve(cfg, log=log)
    fill_launch(cfg, sat, build=build)
    return cfg


# ---------------------------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------------------------
def is_remote(path: str) -> bool:
    """A URL (``hdfs://``, ``s3://``, ...): verl copies it, so it is not checked here."""
    return "://" in path


def check_local_path(key: str, value: Any, hub_ok: bool = False) -> None:
    """``value`` (a path or a list of paths) exists; ``hub_ok``: a Hub id ``org/name`` may be remote."""
    for item in value if isinstance(value, (list, tuple, ListConfig)) else [value]:
        path = str(item)
        if is_remote(path) or Path(path).expanduser().exists():
            continue
        if hub_ok and HUB_ID_RE.match(path):
            continue  # a Hub id, downloaded by verl
        raise FileNotFoundError(f"{key}: {path} does not exist (resolved: {Path(path).expanduser().resolve()})")


def check_paths(cfg: DictConfig) -> None:
    """Fail before Ray starts when a required key is unset or a path the config names is missing."""
    for key in REQUIRED_KEYS:
        if is_unset(cfg, key):
            raise ValueError(f"{key} is not set: pass {key}=PATH (or sat.default_assets=true for the embedded default)")
    check_local_path(TRAIN_FILES_KEY, OmegaConf.select(cfg, TRAIN_FILES_KEY))
    check_local_path(VAL_FILES_KEY, OmegaConf.select(cfg, VAL_FILES_KEY))
    check_local_path(MODEL_PATH_KEY, OmegaConf.select(cfg, MODEL_PATH_KEY), hub_ok=True)
    if not is_unset(cfg, TOKENIZER_PATH_KEY):
        check_local_path(TOKENIZER_PATH_KEY, OmegaConf.select(cfg, TOKENIZER_PATH_KEY), hub_ok=True)
    for key in (REWARD_PATH_KEY, LEGACY_REWARD_PATH_KEY):
        if not is_unset(cfg, key):
            check_local_path(key, OmegaConf.select(cfg, key))


def training_questions(train_files: Any) -> list[str] | None:
    """The ``extra_info.question`` of every row of verl's parquet ``data.train_files`` (None: unreadable
    or not the default task's format, so nothing can be said about overlap)."""
    import pandas as pd

    files = [train_files] if isinstance(train_files, str) else list(train_files or [])
    questions: list[str] = []
    try:
        for path in files:
            extra = pd.read_parquet(str(path), columns=["extra_info"])["extra_info"]
            questions.extend(str(e["question"]) for e in extra)
    except (OSError, KeyError, TypeError, ValueError):
        return None
    return questions


def overlap_warning(heldout: HeldoutConfig, train_files: Any) -> str | None:
    """A line when held-out problems are also training prompts (the study never trains on them)."""
    if not heldout.enabled:
        return None
    questions = training_questions(train_files)
    if questions is None:
        return None
    from verl_sat.default.heldout import heldout_problems, train_overlap

    shared = train_overlap(questions, heldout_problems(heldout.problems, heldout.seed))
    if not shared:
        return None
    return (
        f"{shared} of the {heldout.problems} held-out problems (sat.heldout) are also in data.train_files: "
        "the study never trains on them; `python -m verl_sat.default.data --out DIR --exclude-heldout "
        f"{heldout.problems}` writes a training set without them"
    )


# ---------------------------------------------------------------------------------------------
# the run directory
# ---------------------------------------------------------------------------------------------
def make_run_dir(cfg: DictConfig, sat: SATRecipeConfig) -> Path:
    """The run directory (created), with verl's file logger and checkpoints pointed into it."""
    run_dir = Path(sat.run_dir or f"runs/{cfg.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = run_dir.resolve()
    check_writable(run_dir, "sat.run_dir")
    with open_dict(cfg):
        cfg.sat.run_dir = str(run_dir)
        loggers = list(cfg.trainer.logger) if cfg.trainer.logger else []
        if "file" not in loggers:
            cfg.trainer.logger = loggers + ["file"]
        if cfg.trainer.default_local_dir in (None, "") or "checkpoints/" in str(cfg.trainer.default_local_dir):
            cfg.trainer.default_local_dir = str(run_dir / "checkpoints")
    if int(cfg.trainer.get("save_freq", -1)) > 0:
        check_writable(Path(str(cfg.trainer.default_local_dir)), "trainer.default_local_dir")
    metrics = run_dir / METRICS_FILE
    if metrics.exists() and metrics.stat().st_size > 0:
        keep_earlier_metrics(cfg, run_dir, metrics)
    os.environ["VERL_FILE_LOGGER_PATH"] = str(metrics)
    os.environ[RUN_DIR_ENV] = str(run_dir)  # rollout servers and workers register their pids there
    return run_dir


def keep_earlier_metrics(cfg: DictConfig, run_dir: Path, metrics: Path) -> None:
    """A run dir that already holds metrics: resume (keeping them) or refuse.

    verl resumes (``trainer.resume_mode`` auto) from the checkpoint its tracker names; a torn
    tracker is repaired first (``verl_sat.trainer.faults.latest_checkpoint``). The rows of the steps
    after that checkpoint, which this attempt redoes, move to ``*.superseded.jsonl``, so that
    ``metrics.jsonl`` and ``samples.jsonl`` hold one row per step (``verl_sat.trainer.accounting``).
    """
    resume = str(cfg.trainer.get("resume_mode", "disable")) == "auto"
    async_mode = str(cfg.trainer.v1.trainer_mode).removeprefix("sat_") != "sync"
    step = latest_checkpoint(Path(str(cfg.trainer.default_local_dir)), async_mode) if resume else None
    if step is None:
        raise FileExistsError(
            f"{metrics} already holds a run and there is no checkpoint to resume from "
            f"(trainer.resume_mode={cfg.trainer.get('resume_mode')}); choose another sat.run_dir= "
            "(nothing was overwritten)"
        )
    moved = prepare_resume(run_dir, step)
    print(
        f"[verl-sat] resuming from the checkpoint of step {step}: {moved['superseded_metric_steps']} later "
        "step(s) will be redone (their rows kept in metrics.superseded.jsonl)",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------
# the workers' environment
# ---------------------------------------------------------------------------------------------
def set_platform_env(cfg: DictConfig) -> None:
    """CPU runs: the verl-sat CPU platform in every process (inherited by Ray workers)."""
    if str(cfg.trainer.device) == "cpu":
        os.environ.setdefault("VERL_PLATFORM", "cpu")
        os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")  # FSDP engine is registered under "cuda"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pass_env_to_ray(cfg: DictConfig, names: tuple[str, ...] = RAY_ENV_VARS, prefix: str = RAY_ENV_PREFIX) -> None:
    """Add the driver's ``names`` and ``prefix*`` variables to ``ray_kwargs.ray_init.runtime_env.env_vars``.

    verl's ``run_ppo`` merges that node over its own defaults (``get_ppo_ray_runtime_env``) and
    passes it to ``ray.init``, so every worker of the job gets the variables, on a pre-started
    cluster too. A variable the user already set there, and every other entry, is kept.
    """
    names = [*names, *sorted(n for n in os.environ if prefix and n.startswith(prefix))]
    theirs = OmegaConf.select(cfg, RAY_ENV_KEY) or {}
    ours = {name: os.environ[name] for name in names if name in os.environ and name not in theirs}
    with open_dict(cfg):
        OmegaConf.update(cfg, RAY_ENV_KEY, ours, merge=True, force_add=True)


# ---------------------------------------------------------------------------------------------
# run.json
# ---------------------------------------------------------------------------------------------
def write_run_record(
    run_dir: Path, cfg: DictConfig, sat: SATRecipeConfig, derived: str, filled: dict[str, str | int]
) -> None:
    """``run.json``: the method (explicit ``sat.method`` or derived), the lag, the values the
    embedded default filled in, and the resolved config."""
    record = {
        "method": sat.method,
        "method_derived": derived,
        "lag": sat.lag,
        "filled_by_default": filled,
        **({"auto_lag": dict(sat.auto_lag.__dict__)} if sat.lag == auto_lag.AUTO else {}),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }
    write_json(run_dir / RUN_RECORD, record)


# ---------------------------------------------------------------------------------------------
# in order
# ---------------------------------------------------------------------------------------------
def prepare_run(
    cfg: DictConfig,
    sat: SATRecipeConfig,
    derived: str,
    log: Callable[[str], None] = print,
    check_nodes: Callable | None = None,
) -> Path:
    """Fill, check every path, make the run directory, set the workers' environment, check the
    cluster's nodes and write ``run.json``, on the config ``recipe.resolve`` made; returns the run directory.

    ``check_nodes(cfg, run_dir, log)``: on a cluster started beforehand, every path checked on every
    node (``verl_sat.preflight.cluster.prepare_cluster``, handed in by ``verl_sat.main``: the preflight
    imports this module, so this module does not import it).
    """
    filled = fill_launch(cfg, sat)
    if filled:
        log(f"[verl-sat] embedded default fills what was left unset: {', '.join(filled)}")
    check_paths(cfg)
    warning = overlap_warning(sat.heldout, cfg.data.get("train_files"))
    if warning:
        log(f"[verl-sat] warning: {warning}")
    set_platform_env(cfg)
    run_dir = make_run_dir(cfg, sat)
    pass_env_to_ray(cfg)
    if check_nodes is not None:
        check_nodes(cfg, run_dir, log)
    write_run_record(run_dir, cfg, sat, derived, filled)
    return run_dir
