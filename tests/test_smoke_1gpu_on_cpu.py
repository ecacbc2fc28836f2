"""recipes/sat_paper/smoke_1gpu.sh on CPU: its exact overrides compose and validate, its assets build.

The smoke itself needs a GPU with verl's megatron and sglang extras; here the script runs with
DRY_RUN=1 (it prints its commands), and each printed ``verl_sat.main`` command is composed on
verl 0.9.1's packaged configs, mapped by ``verl_sat.main.prepare`` and checked against what
verl's separate_async trainer and dataclasses require.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import DictConfig, OmegaConf

from verl_sat.default import smoke

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes/sat_paper/smoke_1gpu.sh"


def dry_run(tmp_path: Path, *extra: str) -> list[list[str]]:
    env = dict(os.environ, DRY_RUN="1", RUN_DIR=str(tmp_path / "run"), ASSETS_DIR=str(tmp_path / "assets"))
    out = subprocess.run(["bash", str(SCRIPT), *extra], env=env, capture_output=True, text=True, check=True)
    return [line.split() for line in out.stdout.splitlines()]


def main_overrides(command: list[str]) -> list[str]:
    assert command[1:3] == ["-m", "verl_sat.main"]
    assert command[3:7] == ["--config-path", str(REPO / "hydra_configs"), "--config-name", "sat_paper"]
    return command[7:]


def compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from verl_sat.paths import hydra_config_dir

    task = [o for o in overrides if not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        return hydra_compose(config_name="sat_paper", overrides=task)


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    tmp = tmp_path_factory.mktemp("smoke")
    return tmp, dry_run(tmp, "trainer.logger=[console,file]")


def test_two_invocations_then_the_check(commands: tuple[Path, list[list[str]]]) -> None:
    tmp, lines = commands
    first, second, check = lines[0], lines[1], lines[2]
    a, b = main_overrides(first), main_overrides(second)
    assert "trainer.total_training_steps=2" in a and "trainer.total_training_steps=3" in b
    assert [o for o in a if "total_training_steps" not in o] == [o for o in b if "total_training_steps" not in o]
    assert a[-1] == b[-1] == "trainer.logger=[console,file]"  # the user's overrides reach both
    assert check[1:4] == ["-m", "verl_sat.default.smoke", "check"]
    assert check[check.index("--run-dir") + 1] == str(tmp / "run")


@pytest.mark.parametrize("invocation", [0, 1])
def test_overrides_compose_and_validate(
    commands: tuple[Path, list[list[str]]], invocation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import McoreActorConfig, RolloutConfig

    from verl_sat import SATPolicyLossConfig, main
    from verl_sat.main import prepare

    monkeypatch.setattr(main, "check_paths", lambda cfg: None)  # the dry run does not build the assets
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "restored after the test")  # prepare sets it
    tmp, lines = commands
    cfg = compose(main_overrides(lines[invocation]))
    prepare(cfg)
    arr, v1 = cfg.actor_rollout_ref, cfg.trainer.v1
    # SGLang + Megatron, SAT-GSPO + R3, separate_async at lag 2
    assert arr.rollout.name == "sglang" and arr.actor.strategy == "megatron"
    assert arr.actor.policy_loss.loss_mode == "sat_gspo" and v1.trainer_mode == "sat_separate_async"
    assert arr.actor.megatron.router_replay.mode == "R3" and arr.rollout.enable_rollout_routing_replay
    assert cfg.algorithm.rollout_correction.bypass_mode and arr.rollout.calculate_log_probs
    assert cfg.sat.lag == 2 and v1.separate_async.parameter_sync_step == 2
    assert v1.sampler.max_off_policy_strategy == "wait"
    # PPOTrainerSeparateAsync.__init__'s assertions
    assert cfg.data.train_batch_size == 2 * arr.actor.ppo_mini_batch_size
    assert arr.rollout.nnodes > 0 and arr.rollout.n_gpus_per_node > 0
    assert arr.rollout.checkpoint_engine.backend == "ray_object_store" and not arr.hybrid_engine
    # one GPU, two Ray slots: trainer + standalone rollout
    slots = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes + arr.rollout.n_gpus_per_node * arr.rollout.nnodes
    assert cfg.ray_kwargs.ray_init.num_gpus == slots == 2
    # a checkpoint every step, resumed by the second invocation
    assert cfg.trainer.save_freq == 1 and cfg.trainer.resume_mode == "auto"
    assert cfg.trainer.total_training_steps == 2 + invocation
    assert cfg.trainer.default_local_dir == str(tmp / "run" / "checkpoints")
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH == str(tmp / "run" / "metrics.jsonl")
    # one whole sequence fits a micro-batch; the model's context holds it (SGLang caps max_model_len there)
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert arr.actor.ppo_max_token_len_per_gpu >= sequence
    assert smoke.SMOKE_MODEL_KWARGS["max_position_embeddings"] >= sequence
    assert arr.model.path == str(tmp / "assets" / "model")
    assert cfg.reward.custom_reward_function.path == str(REPO / "verl_sat/default/reward.py")
    # verl's dataclasses and validation accept it
    actor = omega_conf_to_dataclass(OmegaConf.create(OmegaConf.to_container(arr.actor, resolve=True)))
    assert isinstance(actor, McoreActorConfig) and isinstance(actor.policy_loss, SATPolicyLossConfig)
    assert isinstance(omega_conf_to_dataclass(arr.rollout), RolloutConfig)
    validate_config(cfg, use_reference_policy=True, use_critic=False)


def test_assets_build_for_sglang_and_megatron(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    paths = smoke.build(tmp_path)
    config = AutoConfig.from_pretrained(paths["model"])
    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    assert config.model_type == "qwen3_moe" and config.head_dim in (64, 128, 256)
    assert config.vocab_size % smoke.VOCAB_MULTIPLE == 0 and config.vocab_size >= len(tokenizer)
    assert str(config.dtype).endswith("bfloat16")
    assert config.num_experts == 8 and config.num_experts_per_tok == 2  # transformers 5 saves num_local_experts
    train = pd.read_parquet(paths["train"])
    assert len(train) >= 8 * 3 and {"prompt", "data_source", "reward_model"} <= set(train.columns)
    # the longest chat prompt fits data.max_prompt_length=128 (longer ones would be filtered out)
    longest = max(
        len(tokenizer.apply_chat_template(list(p), tokenize=True, add_generation_prompt=True)["input_ids"])
        for p in train["prompt"]
    )
    assert longest <= 128


def write_run(run: Path, first: list[dict], second: list[dict], latest: int) -> None:
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text(str(latest))
    for name, rows in (("metrics.part1.jsonl", first), ("metrics.jsonl", second)):
        (run / name).write_text("".join(json.dumps({"step": r.pop("step"), "data": r}) + "\n" for r in rows))


def good_row(step: int) -> dict:
    return {
        "step": step,
        "critic/score/mean": 0.0,
        "actor/sat_gate_rate": 0.1,
        "training/sat/staleness_steps/max": 2.0,
        "actor/sat_old_vs_rollout_logprob_gap": 0.0,
        "training/off_policy/evicted_samples": 0.0,
    }


def test_check_passes_a_resumed_run_and_names_each_failure(tmp_path: Path) -> None:
    write_run(tmp_path / "ok", [good_row(1), good_row(2)], [good_row(3)], latest=3)
    assert smoke.check(tmp_path / "ok", lag=2, steps=2, resumed_steps=1) == []
    evicting = good_row(3) | {"training/off_policy/evicted_samples": 1.0}
    write_run(tmp_path / "bad", [good_row(1), good_row(2)], [good_row(1), evicting], latest=2)
    failures = smoke.check(tmp_path / "bad", lag=2, steps=2, resumed_steps=1)
    assert any("expected [3] (a resume)" in f for f in failures)
    assert any("latest_checkpointed_iteration.txt" in f for f in failures)
    assert any("groups evicted" in f and "off_policy" in f for f in failures)
