"""The paper's recipes (hydra_configs/, verl_sat.paper.grid, recipes/sat_paper/) against verl 0.9.1.

Every cell of the grid is composed on verl's packaged configs and checked against the paper's
hyper-parameter table (docs/reproduce.md); every key our YAML sets must exist in verl's schema.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import verl.trainer.config as verl_config_pkg
import yaml
from omegaconf import OmegaConf

from verl_sat.files import hydra_config_dir
from verl_sat.paper import grid as recipes
from verl_sat.preflight.cli import resolve

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = hydra_config_dir()
VERL_CONFIG_DIR = Path(verl_config_pkg.__file__).parent
ALL_CELLS = [(method, lag) for method in recipes.METHODS for lag in recipes.LAGS]
# Each method once, the lags alternating (instantiating verl's dataclasses costs ~0.5 s a cell).
METHOD_CELLS = [(method, recipes.LAGS[i % len(recipes.LAGS)]) for i, method in enumerate(recipes.METHODS)]

# Nodes whose children verl passes through as free-form dicts (to Megatron, HF, SGLang).
FREE_FORM = (
    "override_transformer_config",
    "override_optimizer_config",
    "override_config",
    "override_ddp_config",
    "override_mcore_model_config",
    "engine_kwargs",
)
# Keys our own configs add: the sat node and SATPolicyLossConfig's fields.
OURS = ("sat.", "actor_rollout_ref.actor.policy_loss.sat_")
GPU_ONLY = {"model/qwen3_30b_a3b.yaml", "rollout/sglang.yaml"}
CPU_GROUPS = {"model/tiny_moe_cpu.yaml", "rollout/hf.yaml"}
# Top-level (primary) configs and the verl config each one extends.
MAIN_CONFIGS = {
    "sat_paper.yaml": "_generated_ppo_megatron_trainer.yaml",
    "sat_gspo_cpu.yaml": "_generated_ppo_trainer.yaml",
}
# Keys verl reads but does not declare (a `+` on verl's command line): the FSDP mixed-precision
# dtypes, extra ray.init kwargs, per-backend engine kwargs (our "hf" rollout's; vLLM's engine
# arguments), and RolloutConfig.enable_sleep_mode (a dataclass field verl's YAML leaves out).
UNDECLARED = (
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.",
    "ray_kwargs.ray_init.",
    "actor_rollout_ref.rollout.engine_kwargs.hf.",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.",
    "actor_rollout_ref.rollout.enable_sleep_mode",
)

PAPER_PROMPTS_PER_STEP = 256
PAPER_OPTIMIZER_STEPS = 544
# Qwen3-30B-A3B-Base's context (max_position_embeddings of its config.json, in tests/fixtures).
BASE_CONTEXT = json.loads((REPO / "tests/fixtures/qwen3_30b_a3b_base/config.json").read_text())[
    "max_position_embeddings"
]


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------
def _compose_resolved(cell: tuple[str, int]) -> dict[str, Any]:
    return OmegaConf.to_container(resolve(*cell), resolve=True)


@pytest.fixture(scope="session")
def cells() -> dict[tuple[str, int], dict[str, Any]]:
    """Every (method, lag) cell as verl receives it (``resolved_cell``, what ``--print`` prints and the
    launch runs: composed, then ``recipe.resolve``), once, interpolations resolved (about a second each)."""
    return {cell: _compose_resolved(cell) for cell in ALL_CELLS}


def select(cfg: dict[str, Any], dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def leaves(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of the leaves of a YAML mapping (lists count as leaves)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1]


def our_yaml_files() -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        data.pop("defaults", None)
        data.pop("hydra", None)
        files[path.relative_to(CONFIG_DIR).as_posix()] = data
    return files


def reference_leaves(name: str) -> set[str]:
    return set(leaves(yaml.safe_load((VERL_CONFIG_DIR / name).read_text())))


def in_schema(key: str, reference: set[str]) -> bool:
    if key in reference or key.startswith(OURS) or key.startswith(UNDECLARED):
        return True
    parts = key.split(".")
    return any(part in FREE_FORM and declared(".".join(parts[: i + 1]), reference) for i, part in enumerate(parts))


def declared(path: str, reference: set[str]) -> bool:
    """verl declares ``path``: as a leaf, or as a mapping with leaves of its own."""
    return path in reference or any(key.startswith(path + ".") for key in reference)


# ---------------------------------------------------------------------------------------------
# the grid
# ---------------------------------------------------------------------------------------------
def test_methods_are_table_1() -> None:
    assert len(recipes.METHODS) == 14
    for algorithm, stabilizer in recipes.METHODS.values():
        assert (CONFIG_DIR / "algorithm" / f"{algorithm}.yaml").is_file()
        assert (CONFIG_DIR / "stabilizer" / f"{stabilizer}.yaml").is_file()
    for lag in recipes.LAGS:
        assert (CONFIG_DIR / "lag" / f"{recipes.lag_option(lag)}.yaml").is_file()


def test_grid_is_13_trained_methods_times_2_lags_plus_base() -> None:
    grid = recipes.grid()
    assert len(grid) == 27
    assert len({cell.name for cell in grid}) == 27
    assert [cell for cell in grid if cell.eval_only] == [recipes.Cell("base", 1)]


def test_unknown_cell_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        recipes.cell_overrides("ppo", 1)
    with pytest.raises(ValueError, match=r"unknown lag 4; the paper's lags are \[1, 8\]"):
        recipes.cell_overrides("grpo", 4)


# ---------------------------------------------------------------------------------------------
# every cell equals the paper's table
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_cell_matches_paper_table(cells: dict, method: str, lag: int) -> None:
    cfg = cells[(method, lag)]
    actor = select(cfg, "actor_rollout_ref.actor")
    rollout = select(cfg, "actor_rollout_ref.rollout")
    optim = actor["optim"]
    # optimizer: Adam (0.9, 0.98), lr 1e-6 constant, no warm-up
    assert optim["optimizer"] == "adam" and optim["betas"] == [0.9, 0.98]
    assert optim["lr"] == 1e-6 and optim["lr_decay_style"] == "constant"
    assert optim["lr_warmup_steps_ratio"] == 0.0 and optim["lr_warmup_steps"] <= 0
    # batch: 256 prompts x 16 samples per optimizer step, one step per batch
    assert actor["ppo_mini_batch_size"] == PAPER_PROMPTS_PER_STEP and actor["ppo_epochs"] == 1
    assert rollout["n"] == 16
    # sampling: "32k max response" within the Base model's 32768-token context (docs/reproduce.md):
    # verl's SGLang server caps a response at max_model_len - len(prompt) - 1, so nothing is cut;
    # temperature 1, top-p 1, top-k -1
    prompt, response = cfg["data"]["max_prompt_length"], cfg["data"]["max_response_length"]
    assert response == rollout["response_length"] == 30720 and prompt == rollout["prompt_length"]
    assert prompt + response + 1 == BASE_CONTEXT == 32768 and rollout["max_model_len"] is None
    assert (rollout["temperature"], rollout["top_p"], rollout["top_k"]) == (1.0, 1, -1)
    # loss: low-variance KL 1e-3, entropy 0, GRPO advantages
    assert actor["use_kl_loss"] and actor["kl_loss_coef"] == 1e-3 and actor["kl_loss_type"] == "low_var_kl"
    assert actor["entropy_coeff"] == 0
    assert cfg["algorithm"]["adv_estimator"] == "grpo"
    # Megatron TP 4 / EP 4 / PP 1 on 4 GPUs, SGLang (0.85) on the other 4
    megatron = actor["megatron"]
    assert (megatron["tensor_model_parallel_size"], megatron["expert_model_parallel_size"]) == (4, 4)
    assert megatron["pipeline_model_parallel_size"] == 1 and megatron["expert_tensor_parallel_size"] == 1
    assert actor["strategy"] == "megatron" and cfg["trainer"]["n_gpus_per_node"] == 4
    assert (rollout["name"], rollout["nnodes"], rollout["n_gpus_per_node"]) == ("sglang", 1, 4)
    assert rollout["gpu_memory_utilization"] == 0.85
    assert not cfg["actor_rollout_ref"]["hybrid_engine"]
    assert rollout["checkpoint_engine"]["backend"] != "naive"
    assert select(cfg, "actor_rollout_ref.model.path") == "Qwen/Qwen3-30B-A3B-Base"
    # dynamic batching at 32k tokens per GPU (a whole sequence must fit: verl asserts it)
    assert actor["use_dynamic_bsz"]
    assert actor["ppo_max_token_len_per_gpu"] == 32768 >= prompt + response
    # AIME24 validation: 16 samples per problem, every 5 iterations (every sync cycle at lag 8)
    assert rollout["val_kwargs"]["n"] == 16 and rollout["val_kwargs"]["do_sample"]
    assert rollout["val_kwargs"]["temperature"] == 1.0
    assert cfg["trainer"]["test_freq"] * lag <= max(5, lag)
    assert cfg["data"]["val_files"].endswith("aime24.parquet")


@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_cell_lag_maps_onto_v1_separate_async(cells: dict, method: str, lag: int) -> None:
    cfg = cells[(method, lag)]
    trainer, v1 = cfg["trainer"], cfg["trainer"]["v1"]
    assert cfg["sat"]["lag"] == lag
    assert trainer["use_v1"] and v1["trainer_mode"] == "sat_separate_async"  # separate_async, SAT's trainer
    assert v1["separate_async"]["parameter_sync_step"] == lag
    # PPOTrainerSeparateAsync: train_batch_size == parameter_sync_step * ppo_mini_batch_size
    batch = cfg["data"]["train_batch_size"]
    assert batch == lag * cfg["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"]
    # 544 optimizer steps in all; one optimizer batch in flight ahead of the trainer
    assert trainer["total_training_steps"] * lag == PAPER_OPTIMIZER_STEPS
    assert v1["separate_async"]["num_warmup_batches"] * batch == PAPER_PROMPTS_PER_STEP
    assert v1["sampler"]["max_off_policy_threshold"] == 2
    # dropless: wait for late groups instead of evicting them (verl's default "drop")
    assert v1["sampler"]["max_off_policy_strategy"] == "wait"


@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_cell_rewards_with_the_project_verifier(cells: dict, method: str, lag: int) -> None:
    # Training and validation rewards come from the verifier verl_sat.eval scores with, not from
    # verl's data_source-chosen math_dapo scorer (tests/test_verify.py loads it through verl).
    assert cells[(method, lag)]["reward"]["custom_reward_function"] == {
        "path": "pkg://verl_sat.eval.verify",
        "name": "compute_score",
    }


EXPECTED_LOSS = {
    "grpo": ("vanilla", "token-mean", "verl.workers.config.PolicyLossConfig"),
    "gspo": ("gspo", "seq-mean-token-mean", "verl.workers.config.PolicyLossConfig"),
    "dppo": ("dppo_tv", "token-mean", "verl.workers.config.PolicyLossConfig"),
    "sat_grpo": ("sat", "token-mean", "verl_sat.SATPolicyLossConfig"),
    "sat_gspo": ("sat_gspo", "seq-mean-token-mean", "verl_sat.SATPolicyLossConfig"),
}


@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_cell_loss_and_stabilizer(cells: dict, method: str, lag: int) -> None:
    cfg = cells[(method, lag)]
    algorithm, stabilizer = recipes.METHODS[method]
    actor = cfg["actor_rollout_ref"]["actor"]
    loss_mode, agg, target = EXPECTED_LOSS[algorithm]
    assert actor["policy_loss"]["loss_mode"] == loss_mode
    assert actor["loss_agg_mode"] == agg
    assert actor["policy_loss"]["_target_"] == target
    if algorithm == "dppo":  # DPPO-TV: delta = 1e-3 on |pi - mu|
        assert actor["clip_ratio"] == actor["clip_ratio_low"] == actor["clip_ratio_high"] == 1e-3
    else:  # the paper's clip (0.2, 0.2), GSPO and SAT-GSPO included
        assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.2)
    if algorithm.startswith("sat_"):
        loss = actor["policy_loss"]
        assert (loss["sat_enabled"], loss["sat_alpha"], loss["sat_kernel"], loss["sat_kernel_exponent"]) == (
            True,
            0.9,
            "hill",
            2.0,
        )
        # q over the optimizer step (docs/sat.md#the-rule step 2): per-micro-batch q starves SAT-GSPO's gate
        # at the paper's ~35k-token micro-batches of multi-thousand-token responses
        assert (loss["sat_quantile_scope"], loss["sat_step_score"]) == ("step", "forward")
    correction = cfg["algorithm"]["rollout_correction"]
    tis, r3 = stabilizer in ("tis", "tis_r3"), stabilizer in ("r3", "tis_r3")
    # TIS: decoupled mode with token-level IS truncated at 2; otherwise the ratio is pi / mu (bypass)
    assert correction["bypass_mode"] is (not tis)
    assert correction["rollout_is"] == ("token" if tis else None)
    assert correction["rollout_rs"] is None
    if tis:
        assert float(correction["rollout_is_threshold"]) == 2.0
    assert actor["megatron"]["router_replay"]["mode"] == ("R3" if r3 else "disabled")
    if r3:  # verl's Megatron R3 fails on padded batches ("Router replay tensors are not aligned")
        assert cfg["actor_rollout_ref"]["model"]["use_remove_padding"] is True
        assert actor["megatron"]["use_remove_padding"] is True
    assert cfg["actor_rollout_ref"]["rollout"]["enable_rollout_routing_replay"] is r3
    assert cfg["sat"]["routing_replay"] == ("R3" if r3 else "disabled")


@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_cell_names_and_run_dir(cells: dict, method: str, lag: int) -> None:
    cfg = cells[(method, lag)]
    name = f"{method}-lag{lag}"
    assert cfg["sat"]["method"] == method and cfg["trainer"]["experiment_name"] == name
    assert cfg["sat"]["run_dir"] == f"runs/{name}"
    assert cfg["trainer"]["default_local_dir"] == f"runs/{name}/checkpoints"
    assert cfg["trainer"]["validation_data_dir"] == f"runs/{name}/validation"
    assert cfg["sat"]["sentinel"]["enabled"] is False  # SentinelConfig's default (sat_defaults)
    assert cfg["trainer"]["val_only"] is (method in recipes.EVAL_ONLY)
    assert cfg["trainer"]["val_before_train"]


@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_derived_method_is_the_cells(cells: dict, method: str, lag: int) -> None:
    """What the config runs, read back from verl's keys, is the Table-1 row the cell is named
    after (base: the untrained model, evaluated with GRPO's settings)."""
    from verl_sat.trainer.recipe import derive_method

    assert derive_method(OmegaConf.create(cells[(method, lag)])) == ("grpo" if method == "base" else method)


@pytest.mark.gpu_branch
@pytest.mark.parametrize(("method", "lag"), METHOD_CELLS)
def test_cell_instantiates_verl_dataclasses(cells: dict, method: str, lag: int) -> None:
    from verl.trainer.config import AlgoConfig
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import McoreActorConfig, RolloutConfig

    from verl_sat import SATPolicyLossConfig

    cfg = OmegaConf.create(cells[(method, lag)])
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, McoreActorConfig)
    assert isinstance(actor.policy_loss, SATPolicyLossConfig) is method.startswith("sat_")
    assert actor.megatron.router_replay.mode == cfg.actor_rollout_ref.actor.megatron.router_replay.mode
    assert isinstance(omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout), RolloutConfig)
    assert isinstance(omega_conf_to_dataclass(cfg.algorithm), AlgoConfig)
    validate_config(cfg, use_reference_policy=True, use_critic=False)


# ---------------------------------------------------------------------------------------------
# the YAML itself
# ---------------------------------------------------------------------------------------------
def test_the_lag_is_one_key_no_yaml_repeats_what_it_derives() -> None:
    """``sat.lag`` is the one source of verl's v1 lag keys (``recipe.apply_lag``, the test above reads
    them off every cell): no lag option sets them, and no YAML of ours sets the v1 ones."""
    derived = {
        "trainer.v1.separate_async.parameter_sync_step",
        "trainer.v1.separate_async.num_warmup_batches",
        "trainer.v1.sampler.max_off_policy_threshold",
    }
    for name, data in our_yaml_files().items():
        keys = set(leaves(data))
        assert not keys & derived, name
        if name.startswith("lag/"):
            assert "data.train_batch_size" not in keys and "sat.lag" in keys, name


def test_every_key_exists_in_verl_schema() -> None:
    megatron = reference_leaves("_generated_ppo_megatron_trainer.yaml")
    fsdp = reference_leaves("_generated_ppo_trainer.yaml")
    unknown = []
    for name, data in our_yaml_files().items():
        if name in MAIN_CONFIGS:
            references = [reference_leaves(MAIN_CONFIGS[name])]
        else:
            references = [fsdp, megatron] if name in CPU_GROUPS else [megatron]
        unknown += [f"{name}: {key}" for key in leaves(data) for ref in references if not in_schema(key, ref)]
    assert not unknown, "keys missing from verl 0.9.1's schema:\n" + "\n".join(unknown)


@pytest.mark.parametrize("main_name", sorted(MAIN_CONFIGS))
def test_main_config_and_groups_set_disjoint_keys(main_name: str) -> None:
    files = our_yaml_files()
    main = set(leaves(files.pop(main_name)))
    defaults = yaml.safe_load((CONFIG_DIR / main_name).read_text())["defaults"]
    used = {f"{group}/{option}.yaml" for item in defaults if isinstance(item, dict) for group, option in item.items()}
    clashes = {f"{name}: {key}" for name in used for key in set(leaves(files[name])) & main}
    assert not clashes, f"set in a group and in {main_name} (the main config would win):\n" + "\n".join(clashes)


def test_group_options_do_not_shadow_verl_configs() -> None:
    for group_dir in (p for p in CONFIG_DIR.iterdir() if p.is_dir()):
        verl_group = VERL_CONFIG_DIR / group_dir.name
        if verl_group.is_dir():
            ours = {p.name for p in group_dir.glob("*.yaml")}
            assert not ours & {p.name for p in verl_group.glob("*.yaml")}, group_dir.name


def test_group_files_are_global_and_commented() -> None:
    for path in CONFIG_DIR.rglob("*.yaml"):
        lines = path.read_text().splitlines()
        if path.parent != CONFIG_DIR:
            assert lines[0] == "# @package _global_", path
        for i, line in enumerate(lines):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-")) or stripped.endswith(":"):
                continue
            above = lines[i - 1].strip()
            assert above.startswith("#"), f"{path.name}:{i + 1} needs a comment above {stripped!r}"


def test_cpu_groups_compose() -> None:
    cfg = recipes.compose_cell("sat_grpo", 1, overrides=["model=tiny_moe_cpu", "rollout=hf"])
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "sat"


# ---------------------------------------------------------------------------------------------
# command lines
# ---------------------------------------------------------------------------------------------
def test_dry_run_prints_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert recipes.main(["--print", "sat_gspo_r3", "8", "trainer.total_epochs=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor_rollout_ref"]["actor"]["policy_loss"]["loss_mode"] == "sat_gspo"
    assert printed["actor_rollout_ref"]["actor"]["megatron"]["router_replay"]["mode"] == "R3"
    assert printed["trainer"]["experiment_name"] == "sat_gspo_r3-lag8"
    assert printed["trainer"]["total_epochs"] == 3
    assert printed["trainer"]["v1"]["sampler"]["max_off_policy_strategy"] == "wait"
    assert "${" not in str(printed)


def test_list_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert recipes.main(["--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 27 and listed[0].split()[:2] == ["base", "1"]
    assert recipes.main(["--overrides", "base", "1", "--run-dir", "/x/base-lag1"]) == 0
    assert capsys.readouterr().out.split() == [
        "algorithm=grpo",
        "stabilizer=none",
        "lag=n1",
        "sat.method=base",
        "sat.run_dir=/x/base-lag1",
        "trainer.val_only=true",
    ]


def test_run_sh_dry_run(tmp_path: Path) -> None:
    # A stand-in interpreter answers run.sh's `-m verl_sat.paper.grid --overrides` call with the real
    # overrides (importing verl_sat in a subprocess costs ~10 s); DRY_RUN echoes the launch.
    run_dir = tmp_path / "gspo_tis_r3-lag8"
    lines = recipes.cell_overrides("gspo_tis_r3", 8, run_dir=str(run_dir))
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/usr/bin/env bash\nprintf '%s\\n' " + " ".join(f"'{line}'" for line in lines) + "\n")
    fake_python.chmod(0o755)
    env = dict(
        os.environ, DRY_RUN="1", PYTHON=str(fake_python), RUNS_ROOT=str(tmp_path), DATA_DIR="/d", MODEL_PATH="/m"
    )
    env["SAT_SKIP_PREFLIGHT"] = "1"  # the launch line only (tests/test_preflight_on_cpu.py covers the preflight's)
    out = subprocess.run(
        ["bash", str(REPO / "recipes/sat_paper/run.sh"), "gspo_tis_r3", "8", "trainer.logger=[console]"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[:5] == [str(fake_python), "-m", "verl_sat.main", "--config-path", str(REPO / "hydra_configs")]
    assert out[5:7] == ["--config-name", recipes.CONFIG_NAME]
    assert out[7 : 7 + len(lines)] == lines
    for arg in (
        "data.train_files=/d/train.parquet",
        "data.val_files=/d/aime24.parquet",
        "actor_rollout_ref.model.path=/m",
        f"hydra.run.dir={run_dir}/hydra",
    ):
        assert arg in out
    assert out[-1] == "trainer.logger=[console]"
    assert not run_dir.exists()


# ---------------------------------------------------------------------------------------------
# grid.sh: each launch without stdin, on past a failed cell, a status table at the end
# ---------------------------------------------------------------------------------------------
FAKE_PYTHON = """#!/usr/bin/env bash
# The grid's own python for verl_sat.paper.grid; a stand-in for the preflight and the launch that
# reads its stdin to the end (as a process that prompts would) and fails the cell named in FAIL_CELL.
set -u
# the grid's list is the real one; a cell's overrides only need its run directory here
if [[ "$2 $3" == "verl_sat.paper.grid --list" ]]; then exec {python} "$@"; fi
if [[ "$2 $3" == "verl_sat.paper.grid --overrides" ]]; then echo "sat.run_dir=$7"; exit 0; fi
if [[ "$2" == verl_sat.preflight ]]; then exit 0; fi
run_dir=$(printf '%s\\n' "$@" | sed -n 's/^sat.run_dir=//p')
stdin=$(cat)
printf '%s\\t%s\\n' "$(basename "$run_dir")" "${{#stdin}}" >> "$GRID_LOG"
[[ "$(basename "$run_dir")" != "$FAIL_CELL" ]] || exit 7
"""


def run_grid(tmp_path: Path, only: str, fail: str, stop: bool = False) -> subprocess.CompletedProcess[str]:
    import sys

    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(python),
        "RUNS_ROOT": str(tmp_path / "runs"),
        "GRID_LOG": str(tmp_path / "launches.tsv"),
        "FAIL_CELL": fail,
        "ONLY": only,
        "SAT_SKIP_PREFLIGHT": "1",
    }
    if stop:
        env["STOP_ON_FAILURE"] = "1"
    # the grid's own stdin holds lines a launch could swallow
    return subprocess.run(
        [str(REPO / "recipes/sat_paper/grid.sh"), "--launch", "trainer.total_training_steps=1"],
        input="y\n" * 1000,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_grid_runs_on_past_a_failed_cell_without_giving_its_stdin(tmp_path: Path) -> None:
    out = run_grid(tmp_path, only="grpo:1 gspo_r3:8 sat_gspo_r3:8", fail="gspo_r3-lag8")
    assert out.returncode == 1, out.stdout + out.stderr
    launches = [line.split("\t") for line in (tmp_path / "launches.tsv").read_text().splitlines()]
    # every cell launched, in the grid's order, and none read a byte of the grid's stdin
    assert [name for name, _ in launches] == ["grpo-lag1", "gspo_r3-lag8", "sat_gspo_r3-lag8"]
    assert [read for _, read in launches] == ["0", "0", "0"]
    assert "[grid] gspo_r3 lag 8: FAILED (exit 7)" in out.stderr
    table = (tmp_path / "runs" / "grid_status.tsv").read_text().splitlines()
    assert table[0].split("\t") == ["method", "lag", "status", "exit", "run_dir"]
    assert [row.split("\t")[:4] for row in table[1:]] == [
        ["grpo", "1", "done", "0"],
        ["gspo_r3", "8", "FAILED", "7"],
        ["sat_gspo_r3", "8", "done", "0"],
    ]
    assert "3 cells, 1 failed" in out.stdout


def test_grid_stops_at_the_first_failure_when_asked(tmp_path: Path) -> None:
    out = run_grid(tmp_path, only="grpo:1 gspo_r3:8 sat_gspo_r3:8", fail="grpo-lag1", stop=True)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (tmp_path / "launches.tsv").read_text().splitlines() == ["grpo-lag1\t0"]
    rows = [row.split("\t")[:4] for row in (tmp_path / "runs" / "grid_status.tsv").read_text().splitlines()[1:]]
    assert rows == [
        ["grpo", "1", "FAILED", "7"],
        ["gspo_r3", "8", "not run", "-"],
        ["sat_gspo_r3", "8", "not run", "-"],
    ]


def test_a_grid_that_succeeds_exits_0(tmp_path: Path) -> None:
    out = run_grid(tmp_path, only="base:1", fail="none")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 cells, 0 failed" in out.stdout


# ---------------------------------------------------------------------------------------------
# Adam's betas reach Megatron (verl's init_megatron_optim_config reads override_optimizer_config)
# ---------------------------------------------------------------------------------------------
def megatron_optimizer_config(cfg: Any) -> Any:
    """What verl's Megatron engine hands Megatron for ``cfg``'s actor: the optim node as verl's
    dataclass (``omega_conf_to_dataclass``), then verl's own ``init_megatron_optim_config``
    (``workers/engine/megatron/transformer_impl.py::_build_optimizer``; bf16 as the paper's model).
    TransformerEngine is not installed here; Megatron's ``OptimizerConfig`` asks its version for the
    precision-aware optimizer, so that one query answers as the GPU node's TE >= 2.1 would."""
    from unittest import mock

    from megatron.core.optimizer import optimizer_config
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.megatron.optimizer import init_megatron_optim_config

    optim = omega_conf_to_dataclass(OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref.actor.optim)))
    with mock.patch.object(optimizer_config, "is_te_min_version", lambda version, check_equality=True: True):
        return init_megatron_optim_config(optim, use_distributed_optimizer=True, bf16=True)


def launched(method: str, lag: int, *overrides: str) -> Any:
    """A cell as ``verl_sat.main`` hands it to verl (``preflight.cli.resolve``: composed, then ``recipe.resolve``)."""
    return resolve(method, lag, overrides)


@pytest.mark.gpu_branch
@pytest.mark.parametrize(("method", "lag"), ALL_CELLS)
def test_megatron_gets_the_papers_betas_in_every_cell(cells: dict, method: str, lag: int) -> None:
    """verl's own Megatron optimizer config carries Adam (0.9, 0.98) for every cell; without
    verl-sat's mapping it carries Megatron's defaults (0.9, 0.999): the bug it guards."""
    unmapped = megatron_optimizer_config(recipes.compose_cell(method, lag))
    assert (unmapped.adam_beta1, unmapped.adam_beta2) == (0.9, 0.999)  # verl drops optim.betas
    config = megatron_optimizer_config(OmegaConf.create(cells[(method, lag)]))
    assert (config.adam_beta1, config.adam_beta2) == (0.9, 0.98)
    # the rest of the override still arrives (the recipe's CPU-offloaded optimizer)
    assert config.optimizer_cpu_offload is True and config.optimizer_offload_fraction == 1.0


@pytest.mark.gpu_branch
@pytest.mark.parametrize(("method", "lag"), [("sat_gspo_r3", 8), ("gspo", 1)])
def test_the_printed_cell_gives_megatron_the_papers_betas(capsys: pytest.CaptureFixture[str], method, lag) -> None:
    """``grid --print`` prints the config the launch hands verl: through verl's own
    ``init_megatron_optim_config`` it gives Adam (0.9, 0.98), not Megatron's (0.9, 0.999)."""
    assert recipes.main(["--print", method, str(lag)]) == 0
    config = megatron_optimizer_config(OmegaConf.create(yaml.safe_load(capsys.readouterr().out)))
    assert (config.adam_beta1, config.adam_beta2) == (0.9, 0.98)


@pytest.mark.gpu_branch
def test_a_beta_passed_to_megatron_explicitly_wins() -> None:
    override = "actor_rollout_ref.actor.optim.override_optimizer_config.adam_beta2"
    with pytest.warns(UserWarning, match=r"override_optimizer_config.adam_beta2=0.95 differs from .*optim.betas"):
        config = megatron_optimizer_config(launched("sat_gspo_r3", 8, f"+{override}=0.95"))
    assert (config.adam_beta1, config.adam_beta2) == (0.9, 0.95)
    # betas given on the command line (optim.betas) flow through when no explicit override is set
    config = megatron_optimizer_config(launched("gspo", 1, "actor_rollout_ref.actor.optim.betas=[0.8,0.9]"))
    assert (config.adam_beta1, config.adam_beta2) == (0.8, 0.9)


@pytest.mark.gpu_branch
@pytest.mark.parametrize(("method", "lag"), METHOD_CELLS[:2])
def test_cells_build_a_megatron_reference_the_cpu_job_never_builds(cells: dict, method: str, lag: int) -> None:
    """The paper's low-variance KL makes verl build a reference policy (``need_reference_policy``),
    on verl's own bf16 Megatron engine config with the actor's TP 4 / EP 4; the CPU default job has
    no KL term, so no CPU test builds one (docs/gpu_path.md)."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import McoreEngineConfig

    cfg = OmegaConf.create(cells[(method, lag)])
    assert need_reference_policy(cfg) and cfg.actor_rollout_ref.ref.strategy == "megatron"
    ref = omega_conf_to_dataclass(cfg.actor_rollout_ref.ref.megatron)
    assert type(ref) is McoreEngineConfig and ref.dtype == "bfloat16"
    assert (ref.tensor_model_parallel_size, ref.expert_model_parallel_size) == (4, 4)
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        assert not need_reference_policy(compose("sat_gspo_cpu"))
