"""``sat.strategy=megatron``: the default job's actor moves to verl's Megatron engine config (no run)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from verl_sat.files import hydra_config_dir
from verl_sat.trainer.recipe import SATRecipeConfig, apply_lag, apply_routing_replay, apply_strategy


def composed(*overrides: str):
    """The default job's config as verl receives it: composed, then the micro-batches the launch fills
    (``sat_gspo_cpu.yaml`` leaves them null; verl's actor config refuses null)."""
    from verl_sat.trainer.launch import fill_micro_batches

    with initialize_config_dir(str(hydra_config_dir()), version_base=None):
        cfg = compose("sat_gspo_cpu", overrides=list(overrides))
    fill_micro_batches(cfg)
    return cfg


def test_megatron_strategy_keeps_the_run_and_swaps_the_engine():
    cfg = composed("sat.strategy=megatron", "actor_rollout_ref.actor.optim.lr=1e-3")
    before = cfg.actor_rollout_ref.actor.copy()
    dropped = apply_strategy(cfg, "megatron")
    apply_lag(cfg, 2)
    apply_routing_replay(cfg, "R3")
    actor = cfg.actor_rollout_ref.actor
    assert actor.strategy == "megatron" and cfg.model_engine == "megatron"
    assert "fsdp_config" not in actor and any(k.startswith("actor_rollout_ref.actor.fsdp_config.") for k in dropped)
    # the run's own settings are carried over verl's Megatron default
    assert actor.policy_loss == before.policy_loss and actor.policy_loss.loss_mode == "sat_gspo"
    assert actor.optim.lr == 1e-3 and actor.ppo_mini_batch_size == before.ppo_mini_batch_size
    assert actor.ppo_micro_batch_size_per_gpu == before.ppo_micro_batch_size_per_gpu
    # the CPU node: fp32 through verl-sat's engine config, mbridge, local layers, packed sequences
    assert actor.megatron._target_ == "verl_sat.cpu.megatron_config.CPUMcoreEngineConfig"
    assert actor.megatron.dtype == "float32" and actor.megatron.vanilla_mbridge is True
    assert actor.megatron.override_transformer_config.attention_backend == "local"
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    # R3 through verl's own Megatron router replay, not the project's FSDP replay engine
    assert actor.megatron.router_replay.mode == "R3" and cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay
    from verl.utils.config import omega_conf_to_dataclass

    config = omega_conf_to_dataclass(actor)
    assert type(config).__name__ == "McoreActorConfig" and config.megatron.dtype == "float32"
    assert type(config.policy_loss).__name__ == "SATPolicyLossConfig"


def test_fsdp_strategy_leaves_the_config_as_composed():
    cfg = composed()
    before = cfg.copy()
    assert apply_strategy(cfg, "fsdp") == [] and cfg == before


def test_an_unknown_strategy_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"sat.strategy must be one of \['fsdp', 'megatron'\], got 'deepspeed'"):
        SATRecipeConfig(strategy="deepspeed")


def test_a_users_megatron_keys_are_kept_over_the_cpu_node():
    # the composed config is FSDP's until sat.strategy switches it, hence the `+`
    cfg = composed(
        "sat.strategy=megatron",
        "+actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=allgather",
    )
    apply_strategy(cfg, "megatron")
    megatron = cfg.actor_rollout_ref.actor.megatron
    assert megatron.expert_model_parallel_size == 2
    assert megatron.override_transformer_config.moe_token_dispatcher_type == "allgather"  # not the CPU node's
    assert megatron.override_transformer_config.attention_backend == "local"  # the rest of the CPU node stays
    assert megatron.dtype == "float32"


@pytest.mark.gpu_branch
def test_off_cpu_the_megatron_strategy_is_verls_own_engine_config():
    """``trainer.device=cuda``: nothing of megatron_cpu.yaml is merged; the actor and reference are
    verl's own Megatron defaults (bf16 McoreEngineConfig, Megatron-Bridge, flash attention), and
    verl's dataclass accepts them."""
    cfg = composed("sat.strategy=megatron", "trainer.device=cuda")
    apply_strategy(cfg, "megatron")
    for role in ("actor", "ref"):
        megatron = cfg.actor_rollout_ref[role].megatron
        assert megatron._target_ == "verl.workers.config.McoreEngineConfig" and megatron.dtype == "bfloat16"
        assert megatron.vanilla_mbridge is False
    overrides = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert overrides.attention_backend == "flash" and "use_cpu_initialization" not in overrides
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import McoreEngineConfig

    assert type(omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).megatron) is McoreEngineConfig
