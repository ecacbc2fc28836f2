"""verl_sat.preflight on CPU: each check catches a seeded misconfiguration naming the key.

The cell is resolved once as run.sh launches it; the node's facts are faked (an 8-GPU H200 node
that is set up right), then one fact or one key is broken per test.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import DictConfig, OmegaConf

from verl_sat.preflight import checks, cli, estimates
from verl_sat.preflight import facts as node_facts
from verl_sat.preflight.estimates import snapshot_bytes, step_writeback_fields, warmup_prompts
from verl_sat.preflight.facts import GPU, Facts, Finding, ModelFacts

REPO = Path(__file__).resolve().parents[1]
H200 = 141 * 10**9
QWEN3_30B_PARAMS = 30_500_000_000  # Qwen3-30B-A3B: 30.5e9 parameters
# Qwen3-30B-A3B-Base's config.json (max_position_embeddings 32768; tests/fixtures/.../README.md)
BASE_MODEL_DIR = REPO / "tests/fixtures/qwen3_30b_a3b_base"
BASE_CONFIG = json.loads((BASE_MODEL_DIR / "config.json").read_text())
GOOD_SCHEMA = {"data_source": (), "prompt": (), "ability": (), "reward_model": ("ground_truth", "style")}


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> DictConfig:
    """sat_gspo_r3 at lag 8 (R3, separate_async, NCCL), resolved as run.sh launches it."""
    run_dir = tmp_path_factory.mktemp("runs") / "sat_gspo_r3-lag8"
    return cli.resolve(
        "sat_gspo_r3", 8, ["data.train_files=/d/train.parquet", "data.val_files=/d/aime24.parquet"], str(run_dir)
    )


@pytest.fixture
def cfg(cell: DictConfig) -> DictConfig:
    return copy.deepcopy(cell)


def good_facts(cfg: DictConfig) -> Facts:
    """A node on which the paper's cell launches: 8 idle H200s, the pinned packages, enough RAM/disk."""
    files = estimates.as_list(cfg.data.train_files) + estimates.as_list(cfg.data.val_files)
    return Facts(
        gpus=tuple(GPU(i, "NVIDIA H200", H200, H200 - 10**9) for i in range(8)),
        cuda_runtime="12.8",
        python=(3, 12),
        versions={
            "verl": "0.9.1",
            "sglang": "0.5.12",
            "megatron-core": "0.17.0",
            "megatron-bridge": "0.5.2",
            "transformer-engine": "2.12",
            "transformers": "5.9.0",
            "torch": "2.11.0",
        },
        extra_pins={
            "verl-sat": {"verl": "0.9.1"},
            "sglang": {"sglang": "0.5.12"},
            "megatron": {"megatron-bridge": "0.5.2"},
        },
        import_errors={module: None for module in node_facts.PROBED_MODULES},
        sglang_routed_experts=True,
        checkpoint_engines=("naive", "nccl"),
        cupy_distributions=("cupy-cuda12x",),
        host_mem_available_bytes=1500 * 10**9,
        disk_free_bytes=10 * 10**12,
        model=ModelFacts(str(BASE_MODEL_DIR), dict(BASE_CONFIG), QWEN3_30B_PARAMS),
        data_schemas={path: dict(GOOD_SCHEMA) for path in files},
        reward_fn_error=None,
    )


def failures(cfg: DictConfig, facts: Facts, check) -> list[Finding]:
    return [f for f in check(cfg, facts) if f.level == "fail"]


def set_key(cfg: DictConfig, key: str, value) -> DictConfig:
    OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


# ---------------------------------------------------------------------------------------------
# the correct node passes
# ---------------------------------------------------------------------------------------------
def test_the_resolved_cell_is_what_run_sh_launches(cell: DictConfig) -> None:
    # schedule's mapping applied (as verl_sat.main does) and interpolations resolved
    assert cell.trainer.v1.trainer_mode == "sat_separate_async"
    assert cell.data.train_batch_size == 8 * 256
    assert cell.trainer.default_local_dir.endswith("sat_gspo_r3-lag8/checkpoints")
    assert cell.actor_rollout_ref.rollout.enable_rollout_routing_replay is True


def test_a_correct_node_passes_every_check(cfg: DictConfig) -> None:
    findings = checks.run_checks(cfg, good_facts(cfg))
    assert findings == [], [f.line() for f in findings]


# ---------------------------------------------------------------------------------------------
# one seeded misconfiguration per check; the message names the key or package
# ---------------------------------------------------------------------------------------------
def seed_too_few_gpus(cfg, facts):
    return cfg, replace(facts, gpus=facts.gpus[:4])


def seed_bad_expert_parallel(cfg, facts):
    return set_key(cfg, "actor_rollout_ref.actor.megatron.expert_model_parallel_size", 3), facts


def seed_rollout_replica_not_dividing(cfg, facts):
    return set_key(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size", 3), facts


def seed_busy_gpu(cfg, facts):
    busy = replace(facts.gpus[5], free_bytes=H200 // 2)
    return cfg, replace(facts, gpus=facts.gpus[:5] + (busy,) + facts.gpus[6:])


def seed_optimizer_on_gpu(cfg, facts):
    # 30.5e9 × (2 + 4 + 12 + 2 reference) / 4 shards = 152 GB > 141 GB
    return set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload", False), facts


def seed_wrong_verl(cfg, facts):
    return cfg, replace(facts, versions={**facts.versions, "verl": "0.9.0"})


def seed_wrong_sglang(cfg, facts):
    return cfg, replace(facts, versions={**facts.versions, "sglang": "0.5.10"})


def seed_sglang_without_routed_experts(cfg, facts):
    return cfg, replace(facts, sglang_routed_experts=False)


def seed_no_nccl_engine(cfg, facts):
    return cfg, replace(
        facts,
        checkpoint_engines=("naive",),
        checkpoint_engine_errors={"nccl_checkpoint_engine": "ModuleNotFoundError: No module named 'cupy'"},
    )


def seed_cupy_for_other_cuda(cfg, facts):
    return cfg, replace(facts, cupy_distributions=("cupy-cuda11x",))


def seed_no_megatron_bridge(cfg, facts):
    # vanilla_mbridge=false (verl's default): verl imports megatron.bridge, not mbridge
    error = "ModuleNotFoundError: No module named 'megatron.bridge'"
    return cfg, replace(facts, import_errors={**facts.import_errors, "megatron.bridge": error})


def seed_no_mbridge_when_vanilla(cfg, facts):
    set_key(cfg, "actor_rollout_ref.actor.megatron.vanilla_mbridge", True)
    return cfg, replace(facts, import_errors={**facts.import_errors, "mbridge": "ModuleNotFoundError: mbridge"})


def seed_python_311(cfg, facts):
    return cfg, replace(facts, python=(3, 11))


def seed_bridge_built_for_other_transformers(cfg, facts):
    unmet = ("transformers<5.9.0,>=5.8.1 (5.9.0 installed)",)
    return cfg, replace(facts, requirement_conflicts={"megatron-bridge": unmet})


def seed_use_mbridge_off(cfg, facts):
    return set_key(cfg, "actor_rollout_ref.actor.megatron.use_mbridge", False), facts


def seed_full_32k_response(cfg, facts):
    # the old recipe: 2047 + 32768 > 32768, the Base model's context
    return set_key(cfg, "data.max_response_length", 32768), facts


def seed_post_trained_max_model_len(cfg, facts):
    # a max_model_len copied from the post-trained Qwen3-30B-A3B (40960)
    return set_key(cfg, "actor_rollout_ref.rollout.max_model_len", 40960), facts


def seed_r3_padded(cfg, facts):
    return set_key(cfg, "actor_rollout_ref.model.use_remove_padding", False), facts


def seed_small_host(cfg, facts):
    # 30.5e9 × 1.0 × 16 bytes = 488 GB of Adam states on the host
    return cfg, replace(facts, host_mem_available_bytes=256 * 10**9)


def seed_host_without_room_for_routes(cfg, facts):
    # holds the 488 GB optimizer, not the lag-8 buffer of 36864 samples × 25 MiB of routes
    return cfg, replace(facts, host_mem_available_bytes=1000 * 10**9)


def seed_small_disk(cfg, facts):
    # 2 kept × (30.5e9 × (2 + 12) bytes = 427 GB of actor + 1.0 TB of TransferQueue snapshot) = 2.9 TB
    return cfg, replace(facts, disk_free_bytes=500 * 10**9)


def seed_data_without_ground_truth(cfg, facts):
    path = cfg.data.train_files
    return cfg, replace(facts, data_schemas={**facts.data_schemas, path: {"prompt": (), "data_source": ()}})


def seed_missing_val_file(cfg, facts):
    return cfg, replace(facts, data_schemas={**facts.data_schemas, cfg.data.val_files: "file not found"})


def seed_broken_reward(cfg, facts):
    set_key(cfg, "reward.custom_reward_function.path", "/x/reward.py")
    return cfg, replace(facts, reward_fn_error="FileNotFoundError: /x/reward.py")


SEEDED = [
    (seed_too_few_gpus, checks.check_gpu_count, "trainer.n_gpus_per_node"),
    (seed_bad_expert_parallel, checks.check_parallel_layout, "megatron.expert_model_parallel_size"),
    (seed_rollout_replica_not_dividing, checks.check_parallel_layout, "rollout.tensor_model_parallel_size"),
    (seed_busy_gpu, checks.check_gpu_memory, "rollout.gpu_memory_utilization"),
    (seed_optimizer_on_gpu, checks.check_gpu_memory, "override_optimizer_config.optimizer_cpu_offload"),
    (seed_wrong_verl, checks.check_versions, "verl==0.9.1"),
    (seed_wrong_sglang, checks.check_versions, "sglang==0.5.12"),
    (seed_sglang_without_routed_experts, checks.check_routing_replay, "rollout.enable_rollout_routing_replay"),
    (seed_no_nccl_engine, checks.check_checkpoint_engine, "checkpoint_engine.backend=nccl"),
    (seed_cupy_for_other_cuda, checks.check_checkpoint_engine, "cupy-cuda11x"),
    (seed_r3_padded, checks.check_routing_replay, "actor_rollout_ref.model.use_remove_padding"),
    (seed_no_megatron_bridge, checks.check_megatron, "megatron-bridge"),
    (seed_no_mbridge_when_vanilla, checks.check_megatron, "vanilla_mbridge=true"),
    (seed_python_311, checks.check_megatron, "Python 3.12"),
    (seed_bridge_built_for_other_transformers, checks.check_megatron, "transformers<5.9.0"),
    (seed_use_mbridge_off, checks.check_megatron, "megatron.use_mbridge"),
    (seed_full_32k_response, checks.check_context_length, "data.max_response_length"),
    (seed_post_trained_max_model_len, checks.check_context_length, "rollout.max_model_len"),
    (seed_small_host, checks.check_host_memory, "optimizer_offload_fraction"),
    (seed_host_without_room_for_routes, checks.check_host_memory, "R3's routes"),
    (seed_small_disk, checks.check_disk, "trainer.max_actor_ckpt_to_keep"),
    (seed_data_without_ground_truth, checks.check_data, "reward_model.ground_truth"),
    (seed_missing_val_file, checks.check_data, "data.val_files"),
    (seed_broken_reward, checks.check_reward_function, "reward.custom_reward_function.path"),
]


@pytest.mark.parametrize(("seed", "check", "named"), SEEDED, ids=[s[0].__name__ for s in SEEDED])
def test_each_check_catches_its_seeded_misconfiguration(cfg: DictConfig, seed, check, named: str) -> None:
    assert failures(cfg, good_facts(cfg), check) == []  # the check passes before the seed
    cfg, facts = seed(cfg, good_facts(cfg))
    found = failures(cfg, facts, check)
    assert len(found) == 1, [f.line() for f in found]
    assert named in found[0].message or named in found[0].key
    assert "\n" not in found[0].line()
    # and the whole preflight reports it
    assert found[0] in checks.run_checks(cfg, facts)


WARN_ONLY = {checks.check_end_of_turn}  # never fails; its warning has a test of its own below


def test_every_check_has_a_seeded_misconfiguration() -> None:
    assert {check for _, check, _ in SEEDED} | WARN_ONLY == set(checks.CHECKS)


# ---------------------------------------------------------------------------------------------
# details of the checks
# ---------------------------------------------------------------------------------------------
def test_r3_off_needs_no_routed_experts(tmp_path: Path) -> None:
    cfg = cli.resolve("sat_gspo", 1, run_dir=str(tmp_path))
    facts = replace(good_facts(cfg), sglang_routed_experts=False)
    assert checks.check_routing_replay(cfg, facts) == []
    assert checks.run_checks(cfg, facts) == []


def test_a_longer_context_by_override_config_passes(cfg: DictConfig) -> None:
    cfg, facts = seed_full_32k_response(cfg, good_facts(cfg))
    set_key(cfg, "actor_rollout_ref.model.override_config", {"max_position_embeddings": 65536})
    assert checks.check_context_length(cfg, facts) == []


def test_the_short_context_fix_names_the_largest_response(cfg: DictConfig) -> None:
    cfg, facts = seed_full_32k_response(cfg, good_facts(cfg))
    (finding,) = checks.check_context_length(cfg, facts)
    # verl's SGLang server: max_new_tokens <= max_model_len - len(prompt) - 1 = 32768 - 2047 - 1
    assert "lower data.max_response_length to 30720" in finding.message


def test_the_cell_fills_the_base_models_context_exactly(cfg: DictConfig) -> None:
    assert BASE_CONFIG["max_position_embeddings"] == 32768 and BASE_CONFIG["rope_scaling"] is None
    assert cfg.data.max_prompt_length + cfg.data.max_response_length + 1 == 32768
    set_key(cfg, "data.max_response_length", cfg.data.max_response_length + 1)  # one token more fails
    assert failures(cfg, good_facts(cfg), checks.check_context_length)


def test_a_model_not_on_this_node_fails_naming_the_download(cfg: DictConfig) -> None:
    facts = replace(good_facts(cfg), model=ModelFacts())
    findings = checks.run_checks(cfg, facts)
    (context,) = [f for f in findings if f.level == "fail"]
    assert context.check == "context_length" and context.key == "actor_rollout_ref.model.path"
    assert "download it first" in context.message and "MODEL_PATH=DIR" in context.message
    # the size-based estimates say they could not be made (the buffer's routes need config.json)
    assert {(f.check, f.level) for f in findings if f is not context} == {
        ("host_memory", "warn"),
        ("disk", "warn"),
    }


def test_r3_cells_run_packed_and_r3_off_may_pad(cfg: DictConfig, tmp_path: Path) -> None:
    # every R3 cell: tests/test_recipes.py; here the preflight's view of one, and of a cell without R3
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    assert cfg.actor_rollout_ref.actor.megatron.use_remove_padding is True
    assert checks.check_r3_padding(cfg) == []
    set_key(cfg, "actor_rollout_ref.actor.megatron.use_remove_padding", False)
    assert [f.key for f in checks.check_r3_padding(cfg)] == ["actor_rollout_ref.actor.megatron.use_remove_padding"]
    plain = cli.resolve("sat_gspo", 1, run_dir=str(tmp_path))
    set_key(plain, "actor_rollout_ref.model.use_remove_padding", False)
    assert checks.check_r3_padding(plain) == []


@pytest.mark.gpu_branch
def test_the_bridge_is_the_one_verl_imports(cfg: DictConfig) -> None:
    # verl 0.9.1's defaults: use_mbridge=true, vanilla_mbridge=false -> megatron.bridge
    assert cfg.actor_rollout_ref.actor.megatron.use_mbridge is True
    assert cfg.actor_rollout_ref.actor.megatron.vanilla_mbridge is False
    assert estimates.bridge_module(cfg) == "megatron.bridge"
    # with megatron.bridge importable, a missing mbridge is no failure (verl does not import it)
    facts = replace(good_facts(cfg), import_errors={**good_facts(cfg).import_errors, "mbridge": "missing"})
    assert failures(cfg, facts, checks.check_megatron) == []
    assert estimates.bridge_module(set_key(cfg, "actor_rollout_ref.actor.megatron.vanilla_mbridge", True)) == "mbridge"


def test_a_bridge_other_than_verls_pin_is_named(cfg: DictConfig) -> None:
    facts = replace(good_facts(cfg), versions={**good_facts(cfg).versions, "megatron-bridge": "0.6.0"})
    (finding,) = checks.check_megatron(cfg, facts)
    assert finding.level == "warn" and "megatron-bridge 0.6.0" in finding.message
    assert "megatron-bridge==0.5.2" in finding.message


def test_host_estimate_includes_rollout_buffer_and_routes(cfg: DictConfig) -> None:
    # lag 8: 2048 prompts a global step + the warm-up verl issues ahead of it, 0.125 × 2048 = 256
    # (verl fetches them one prompt at a time in the async modes: gen_batch_size 1)
    assert estimates.buffered_prompts(cfg) == 2048 + 256
    samples = (2048 + 256) * 16
    prompt, response = 2047, 30720
    layers, top_k = BASE_CONFIG["num_hidden_layers"], BASE_CONFIG["num_experts_per_tok"]
    routes_per_sample = (prompt + response) * layers * top_k * 2  # int16 ids
    # int64 input_ids, prompts + responses, position_ids; int64 response_mask, loss_mask and fp32
    # rollout_log_probs, rm_scores over the response
    per_sample = (prompt + response) * 3 * 8 + response * (2 * 8 + 2 * 4) + routes_per_sample
    buffer = estimates.rollout_buffer_bytes(cfg, BASE_CONFIG)
    assert buffer == {
        "samples": samples,
        "per_sample": per_sample,
        "routes": samples * routes_per_sample,
        "total": samples * per_sample,
    }
    assert round(buffer["routes"] / 2**30) == 864  # 36864 samples × 24 MiB of routes (32k tokens × 768 B)
    # R3 off: no routes
    plain = copy.deepcopy(cfg)
    set_key(plain, "actor_rollout_ref.rollout.enable_rollout_routing_replay", False)
    assert estimates.rollout_buffer_bytes(plain, BASE_CONFIG)["routes"] == 0
    # a gen_batch_size set by hand changes nothing: verl's _init_dataloader overrides it to 1
    set_key(plain, "data.gen_batch_size", 2048)
    assert estimates.buffered_prompts(plain) == 2048 + 256


def test_host_check_counts_optimizer_plus_buffer(cfg: DictConfig) -> None:
    params = QWEN3_30B_PARAMS
    need = estimates.host_optimizer_bytes(cfg, params) + estimates.rollout_buffer_bytes(cfg, BASE_CONFIG)["total"]
    assert failures(cfg, replace(good_facts(cfg), host_mem_available_bytes=need), checks.check_host_memory) == []
    (short,) = failures(cfg, replace(good_facts(cfg), host_mem_available_bytes=need - 1), checks.check_host_memory)
    assert "rollout buffer 36864 samples" in short.message and short.key == "data.max_response_length"
    assert "data.train_batch_size + 256 warm-up prompts" in short.message


def test_host_estimate_follows_the_formula(cfg: DictConfig) -> None:
    params = 30 * 10**9
    assert estimates.host_optimizer_bytes(cfg, params) == params * 16  # fp32 master, m, v, grad
    set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction", 0.5)
    set_key(cfg, "actor_rollout_ref.actor.optim.exp_avg_sq_dtype", "bf16")
    assert estimates.host_optimizer_bytes(cfg, params) == params * 0.5 * 14


def test_no_offload_counts_only_the_rollout_buffer(cfg: DictConfig) -> None:
    set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload", False)
    buffer = estimates.rollout_buffer_bytes(cfg, BASE_CONFIG)["total"]
    assert checks.check_host_memory(cfg, replace(good_facts(cfg), host_mem_available_bytes=buffer)) == []
    (short,) = checks.check_host_memory(cfg, replace(good_facts(cfg), host_mem_available_bytes=buffer - 1))
    assert "offloaded optimizer" not in short.message and "rollout buffer" in short.message


def test_disk_estimate_counts_the_kept_snapshots(cfg: DictConfig) -> None:
    params = QWEN3_30B_PARAMS
    actor = estimates.checkpoint_bytes(cfg, params)
    snapshot = snapshot_bytes(cfg, BASE_CONFIG)
    # what TransferQueue holds at the save: the step's batch (cleared after the save) + the warm-up
    # window, at full length with R3's routes, and what the step wrote back onto its batch
    assert snapshot["samples"] == (2048 + 256) * 16
    assert snapshot["buffer"] == estimates.rollout_buffer_bytes(cfg, BASE_CONFIG)["total"]
    fields = step_writeback_fields(cfg)  # bypass on (no entropy, no IS weights), KL loss on
    assert fields == ("old_log_probs", "ref_log_prob", "advantages", "returns")
    assert snapshot["writeback"] == 2048 * 16 * 30720 * 4 * len(fields)
    assert snapshot["total"] == snapshot["buffer"] + snapshot["writeback"]
    assert round(snapshot["total"] / 10**12, 2) == 1.00  # about 1 TB a save at lag 8 with R3
    kept = estimates.kept_checkpoints(cfg)
    assert kept == 2
    # the actor checkpoints alone (the estimate before snapshots were counted) no longer pass
    (short,) = failures(cfg, replace(good_facts(cfg), disk_free_bytes=kept * actor), checks.check_disk)
    assert "TransferQueue snapshot: 36864 samples" in short.message and short.key == "trainer.max_actor_ckpt_to_keep"
    need = kept * (actor + snapshot["total"])
    assert failures(cfg, replace(good_facts(cfg), disk_free_bytes=need), checks.check_disk) == []
    assert failures(cfg, replace(good_facts(cfg), disk_free_bytes=need - 1), checks.check_disk)
    # sync saves no snapshot: the actor checkpoints are all
    set_key(cfg, "trainer.v1.trainer_mode", "sat_sync")
    assert snapshot_bytes(cfg, BASE_CONFIG)["total"] == 0
    assert failures(cfg, replace(good_facts(cfg), disk_free_bytes=kept * actor), checks.check_disk) == []


def test_disk_warns_when_the_snapshots_routes_are_unknown(cfg: DictConfig) -> None:
    config = {k: v for k, v in BASE_CONFIG.items() if k != "num_experts_per_tok"}
    facts = replace(good_facts(cfg), model=replace(good_facts(cfg).model, config=config))
    (warning,) = checks.check_disk(cfg, facts)
    assert warning.level == "warn" and "TransferQueue snapshots not estimated" in warning.message


def verl_dataloader_stand_in(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch) -> object:
    """verl's own ``PPOTrainer._init_dataloader`` run on the cell, its datasets stubbed: the
    trainer's ``data.gen_batch_size`` as verl rewrites it."""
    from verl.trainer.ppo.v1 import trainer_base

    monkeypatch.setattr(trainer_base, "create_rl_dataset", lambda *args, **kwargs: list(range(4096)))
    monkeypatch.setattr(trainer_base, "create_rl_sampler", lambda *args, **kwargs: None)
    mode = estimates.base_mode(cfg)
    trainer = object.__new__(trainer_base.get_trainer_cls(mode))
    trainer.config = copy.deepcopy(cfg)
    trainer.trainer_mode, trainer.tokenizer, trainer.processor = mode, None, None
    trainer.parameter_sync_step = int(cfg.trainer.v1.get(mode, {}).get("parameter_sync_step", 1))
    trainer._init_dataloader()
    return trainer


@pytest.mark.parametrize(("lag", "mode"), [(1, None), (8, None), (1, "sat_sync")], ids=["lag1", "lag8", "sync"])
def test_the_warm_up_is_verls_own_count(lag: int, mode: str | None, tmp_path: Path, monkeypatch) -> None:
    cfg = cli.resolve("sat_gspo_r3", lag, run_dir=str(tmp_path))
    if mode is not None:
        set_key(cfg, "trainer.v1.trainer_mode", mode)
    trainer = verl_dataloader_stand_in(cfg, monkeypatch)
    # verl's dataloader fetches one prompt at a time in the async modes (the estimate's stand-in
    # sets that), and on_train_begin on verl's own trainer issues what the estimate counts
    assert trainer.train_dataloader.batch_size == (1 if mode is None else 256)
    issued: list[int] = []
    trainer._restored_tq_prompt_count = 0
    trainer._add_prompts_to_generate = issued.append
    trainer.on_train_begin()
    assert sum(issued) == warmup_prompts(cfg)
    # the paper's intent: one 256-prompt optimizer batch in flight ahead of the trainer, at both lags
    assert warmup_prompts(cfg) == (0 if mode == "sat_sync" else 256)
    assert estimates.buffered_prompts(cfg) == 256 * lag + warmup_prompts(cfg)


def test_sat_trainers_leave_the_warm_up_to_verl() -> None:
    from verl_sat.trainer.actor import SATTrainerMixin

    # warmup_prompts runs verl's base class's on_train_begin: no verl-sat mixin may override it
    assert not [c for c in SATTrainerMixin.__mro__ if "on_train_begin" in vars(c)]


def test_routing_replay_names_the_sglang_whose_routes_format_it_knows(cfg: DictConfig) -> None:
    from verl_sat.verl_fixes import SGLANG_ROUTES_FORMAT_VERSIONS

    assert SGLANG_ROUTES_FORMAT_VERSIONS == ("0.5.12",)  # the release verl 0.9.1 pins, read in its source
    assert checks.check_routing_replay(cfg, good_facts(cfg)) == []
    facts = good_facts(cfg)
    facts = replace(facts, versions={**facts.versions, "sglang": "0.5.13"})
    (warn,) = checks.check_routing_replay(cfg, facts)
    assert warn.level == "warn" and warn.key == "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    assert "format of sglang 0.5.12" in warn.message and "sglang 0.5.13 is installed" in warn.message
    # another engine: SGLang's routes are never decoded, nothing to say
    set_key(cfg, "actor_rollout_ref.rollout.name", "vllm")
    assert checks.check_routing_replay(cfg, facts) == []


def test_unset_keep_counts_every_checkpoint(cfg: DictConfig) -> None:
    assert estimates.kept_checkpoints(cfg) == 2
    set_key(cfg, "trainer.max_actor_ckpt_to_keep", None)
    assert estimates.kept_checkpoints(cfg) == 14  # 68 global steps, a save every 5


def test_unknown_weights_warn_instead_of_passing_silently(cfg: DictConfig) -> None:
    # config.json present, but an architecture transformers cannot build: context checked, sizes not
    facts = replace(good_facts(cfg), model=replace(good_facts(cfg).model, params=None))
    findings = checks.run_checks(cfg, facts)
    assert {f.check for f in findings} == {"host_memory", "disk"}
    assert all(f.level == "warn" for f in findings)


# ---------------------------------------------------------------------------------------------
# the probe's pieces that need no GPU
# ---------------------------------------------------------------------------------------------
def install_metadata(site: Path, name: str, version: str, requires: list[str]) -> None:
    """A distribution's metadata only (a dist-info directory), as pip leaves it."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join(lines + [f"Requires-Dist: {r}" for r in requires]) + "\n")


def test_unmet_requirements_are_read_as_pip_check_reads_them(cfg: DictConfig, tmp_path: Path, monkeypatch) -> None:
    """megatron-bridge 0.5.1's and SGLang 0.5.12's declared requirements (from their wheels'
    METADATA) next to this environment's real transformers and torch: importlib.metadata reads
    them, markers are evaluated (an extra's requirement is not the base install's), and each pin the
    installed version misses is recorded, naming both versions; the bridge's fails the check."""
    from importlib import metadata

    transformers = metadata.version("transformers")
    install_metadata(
        tmp_path,
        "megatron-bridge",
        "0.5.1",
        [
            f"transformers<{transformers},>=5.8.1",
            "megatron-core[dev,mlm]",
            "torch>=2.6.0",
            'transformer-engine[core_cu13,pytorch]; extra == "te"',
            "einops",
            'torch<1; python_version < "3.0"',
        ],
    )
    install_metadata(tmp_path, "sglang", "0.5.12", ["transformers==5.6.0", "flashinfer_python==0.6.11.post1"])
    monkeypatch.syspath_prepend(str(tmp_path))
    versions, _, conflicts = node_facts.probe_packages()
    assert versions["megatron-bridge"] == "0.5.1" and versions["sglang"] == "0.5.12"
    assert conflicts["megatron-bridge"] == (f"transformers<{transformers},>=5.8.1 ({transformers} installed)",)
    assert conflicts["sglang"] == (f"transformers==5.6.0 ({transformers} installed)",)  # flashinfer: not installed
    facts = replace(good_facts(cfg), versions={**good_facts(cfg).versions, **versions}, requirement_conflicts=conflicts)
    found = failures(cfg, facts, checks.check_megatron)
    assert [f.key for f in found] == ["megatron-bridge"] and f"({transformers} installed)" in found[0].message


def test_pins_are_read_from_the_installed_metadata(cfg: DictConfig, tmp_path: Path, monkeypatch) -> None:
    """The verl verl-sat requires and the sglang verl's sglang extra pins come from the installed
    METADATA: another verl's metadata first on the path moves the pin the check names."""
    from importlib import metadata

    _, pins, _ = node_facts.probe_packages()
    assert pins["verl-sat"]["verl"] == metadata.version("verl")  # this environment installs what verl-sat requires
    install_metadata(
        tmp_path, "verl", "0.9.2", ['sglang==0.6.1; extra == "sglang"', 'megatron-bridge==0.6.0; extra == "megatron"']
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    versions, pins, _ = node_facts.probe_packages()
    assert (pins["sglang"]["sglang"], pins["megatron"]["megatron-bridge"]) == ("0.6.1", "0.6.0")
    facts = replace(good_facts(cfg), versions={**good_facts(cfg).versions, "verl": versions["verl"]}, extra_pins=pins)
    found = {f.key: f.message for f in failures(cfg, facts, checks.check_versions)}
    assert set(found) == {"verl", "sglang"}
    assert f"verl=={pins['verl-sat']['verl']}" in found["verl"] and "sglang==0.6.1" in found["sglang"]


def test_probe_data_reads_columns_from_the_schema(tmp_path: Path) -> None:
    good, bad, absent = tmp_path / "good.parquet", tmp_path / "bad.parquet", tmp_path / "absent.parquet"
    pq.write_table(
        pa.table(
            {"prompt": ["q"], "data_source": ["math_dapo"], "reward_model": [{"ground_truth": "1", "style": "r"}]}
        ),
        good,
    )
    pq.write_table(pa.table({"question": ["q"]}), bad)
    schemas = node_facts.probe_data([str(good), str(bad), str(absent)])
    assert schemas[str(good)]["reward_model"] == ("ground_truth", "style")
    assert schemas[str(absent)] == "file not found"
    cfg = OmegaConf.create({"data": {"train_files": [str(good), str(bad)], "val_files": str(absent)}})
    found = checks.check_data(cfg, Facts(data_schemas=schemas))
    assert [f.key for f in found] == ["data.train_files", "data.val_files"]
    assert str(bad) in found[0].message and "prompt" in found[0].message


def test_probe_reward_loads_as_verl_does(tmp_path: Path) -> None:
    module = tmp_path / "reward.py"
    module.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    ok = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(module), "name": "compute_score"}}})
    assert node_facts.probe_reward(ok) is None
    wrong = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(module), "name": "score"}}})
    assert "score" in node_facts.probe_reward(wrong)
    default = OmegaConf.create({"reward": {"custom_reward_function": {"path": None, "name": "compute_score"}}})
    assert node_facts.probe_reward(default) is None


def test_probe_model_counts_the_base_models_parameters_from_its_config() -> None:
    # transformers builds Qwen3-30B-A3B-Base from config.json alone on the meta device: the model
    # card's 30.5e9 parameters, though no weight file is in the directory
    model = node_facts.probe_model(str(BASE_MODEL_DIR))
    assert model.config["max_position_embeddings"] == 32768
    assert not list(BASE_MODEL_DIR.glob("*.safetensors")) and abs(model.params - QWEN3_30B_PARAMS) < 0.1e9


def test_the_meta_count_is_the_built_models_count(tmp_path: Path) -> None:
    # a small model of the Base model's architecture: the count on the meta device is the one the
    # model built in memory has, and it grows with the layers
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    small = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    counts = []
    for layers in (2, 4):
        config = Qwen3MoeConfig(**small, num_hidden_layers=layers, num_experts_per_tok=2)
        config.save_pretrained(tmp_path / str(layers))
        built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        counts.append(node_facts.count_params(tmp_path / str(layers)))
        assert counts[-1] == sum(p.numel() for p in built.parameters())
    assert counts[1] > counts[0]


def test_probe_model_reads_a_local_dir_without_downloading(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    model = node_facts.probe_model(str(tmp_path))
    assert model.config["max_position_embeddings"] == 4096
    assert model.params is None  # no model_type: transformers cannot build it, the sizes warn
    assert node_facts.probe_model("no-such-org/no-such-model-xyz") == ModelFacts()


def test_probe_on_this_cpu_node(cfg: DictConfig) -> None:
    facts = node_facts.gather(cfg)
    assert facts.versions["verl"] == "0.9.1"
    assert "naive" in facts.checkpoint_engines
    assert facts.host_mem_available_bytes and facts.disk_free_bytes
    if not facts.gpus:  # a CPU node cannot host the paper's layout, and the preflight says so
        assert failures(cfg, facts, checks.check_gpu_count)


# ---------------------------------------------------------------------------------------------
# command line, run.sh, import weight
# ---------------------------------------------------------------------------------------------
def test_main_exit_code_summary_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["sat_gspo_r3", "8", "--run-dir", str(tmp_path), "data.train_files=/d/t.parquet"]
    assert cli.main(args, gather_fn=good_facts) == 0
    assert "passed: 0 failure(s)" in capsys.readouterr().out
    # a misconfiguration passed as a Hydra override, as run.sh forwards "$@"
    bad = args + ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"]
    assert cli.main(bad, gather_fn=good_facts) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("[preflight] FAILED: 1 failure(s)")
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size" in out[0]
    assert cli.main([*bad, "--json"], gather_fn=good_facts) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["findings"][0]["check"] == "parallel_layout"
    assert report["facts"]["sglang_routed_experts"] is True


def test_main_leaves_hydras_flags_to_hydra(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["sat_gspo_r3", "8", "--cfg", "job", "--run-dir", str(tmp_path), "data.train_files=/d/t.parquet"]
    assert cli.main([*args, "--resolve", "--info", "defaults"], gather_fn=good_facts) == 0
    captured = capsys.readouterr()
    assert "passed: 0 failure(s)" in captured.out
    assert "left to Hydra: --cfg job --resolve --info defaults" in captured.err
    # Hydra's own parser splits them: its flags anywhere among the overrides, in its short forms too
    parser = cli._parser()
    args = parser.parse_intermixed_args(["m", "1", "-c", "hydra", "a=b", "-m", "-cn", "x", "--json"])
    assert args.overrides == ["m", "1", "a=b"] and (args.config_name, args.json) == ("x", True)
    assert cli.hydra_flags(parser, args) == ["--cfg", "hydra", "--multirun"]


def test_main_help_is_the_preflights(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "python -m verl_sat.preflight" in out and "--run-dir" in out and "--address" in out


def test_done_when_the_preflight_on_the_base_models_config_dir(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The command, model path = a directory holding the Base model's config.json: the
    # model is probed for real (probe_model), the node's other facts are the good node's.
    def probe_fn(cfg: DictConfig) -> Facts:
        return replace(good_facts(cfg), model=node_facts.probe_model(cfg.actor_rollout_ref.model.path))

    args = ["sat_gspo_r3", "8", f"actor_rollout_ref.model.path={BASE_MODEL_DIR}", "--json", "--cfg", "job"]
    assert cli.main([*args, "--run-dir", str(tmp_path)], gather_fn=probe_fn) == 0
    report = json.loads(capsys.readouterr().out)
    assert not [f for f in report["findings"] if f["check"] == "context_length"], report["findings"]
    assert report["facts"]["model"]["config"]["max_position_embeddings"] == 32768
    # no weights in the directory: the parameters are counted from config.json, nothing is left unestimated
    assert report["findings"] == [] and abs(report["facts"]["model"]["params"] - QWEN3_30B_PARAMS) < 0.1e9


def test_main_checks_the_cluster_the_launch_joins(tmp_path: Path, monkeypatch) -> None:
    """The launch's own address (the key, else RAY_ADDRESS) sends the same command to every node;
    without one it checks this node (run.sh runs one command either way)."""
    joined: list[str] = []
    monkeypatch.setattr(cli, "on_the_cluster", lambda cfg, address, as_json: joined.append(address) or True)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ["sat_gspo_r3", "8", "--run-dir", str(tmp_path)]
    assert cli.main([*args, "ray_kwargs.ray_init.address=10.0.0.1:6379"], gather_fn=good_facts) == 0
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert cli.main(args, gather_fn=good_facts) == 0
    assert cli.main([*args, "--address", "auto"], gather_fn=good_facts) == 0
    assert joined == ["10.0.0.1:6379", "10.0.0.2:6379", "auto"]
    monkeypatch.delenv("RAY_ADDRESS")
    assert cli.main(args, gather_fn=good_facts) == 0 and len(joined) == 3  # this node only


def run_sh(tmp_path: Path, *extra: str, **env: str) -> list[str]:
    """run.sh's DRY_RUN lines, with a stand-in interpreter answering its `--overrides` call."""
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/usr/bin/env bash\nprintf '%s\\n' algorithm=grpo\n")
    fake_python.chmod(0o755)
    env = dict(os.environ, DRY_RUN="1", PYTHON=str(fake_python), RUNS_ROOT=str(tmp_path), DATA_DIR="/d", **env)
    cmd = ["bash", str(REPO / "recipes/sat_paper/run.sh"), "grpo", "1", "trainer.logger=[console]", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()


def test_run_sh_runs_the_preflight_before_the_launch(tmp_path: Path) -> None:
    preflight_line, launch = run_sh(tmp_path)
    words = preflight_line.split()
    assert words[1:5] == ["-m", "verl_sat.preflight", "grpo", "1"]
    assert f"--run-dir {tmp_path}/grpo-lag1" in preflight_line
    assert "data.train_files=/d/train.parquet" in words and words[-1] == "trainer.logger=[console]"
    assert "-m verl_sat.main" in launch
    assert run_sh(tmp_path, SAT_SKIP_PREFLIGHT="1") == [launch]


def test_run_sh_prints_the_config_without_gpus(tmp_path: Path) -> None:
    # The command for real on this CPU node: Hydra prints the composed cell, no preflight
    # runs (it would fail here: no GPUs) and no run directory is created.
    env = dict(os.environ, PYTHON=sys.executable, RUNS_ROOT=str(tmp_path / "runs"))
    env.pop("DRY_RUN", None)
    cmd = ["bash", str(REPO / "recipes/sat_paper/run.sh"), "sat_gspo_r3", "8", "--cfg", "job"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = OmegaConf.create(out.stdout)
    assert printed.actor_rollout_ref.actor.policy_loss.loss_mode == "sat_gspo"
    assert printed.actor_rollout_ref.actor.megatron.router_replay.mode == "R3"
    assert printed.data.max_response_length == 30720 and printed.sat.method == "sat_gspo_r3"
    assert "[preflight]" not in out.stdout + out.stderr and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", [["--cfg", "job"], ["-c", "all"], ["--info"], ["--hydra-help"], ["--help"]])
def test_run_sh_skips_the_preflight_when_hydra_only_prints(tmp_path: Path, flag: list[str]) -> None:
    (launch,) = run_sh(tmp_path, *flag)
    assert "-m verl_sat.main" in launch and launch.endswith(" ".join(flag))


def test_module_imports_nothing_heavy() -> None:
    modules = sorted(Path(checks.__file__).parent.glob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "__main__.py", "facts.py", "estimates.py", "checks.py"}
    top: set[str] = set()
    for module in modules:
        tree = ast.parse(module.read_text())
        top |= {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {
            node.module.split(".")[0] if not node.module.startswith("verl_sat.") else node.module
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("verl_sat.preflight.")
        }
    assert top <= {
        "__future__",
        "argparse",
        "json",
        "math",
        "os",
        "shlex",
        "shutil",
        "signal",
        "subprocess",
        "sys",
        "threading",
        "time",
        "uuid",
        "collections",
        "dataclasses",
        "pathlib",
        "typing",
        "omegaconf",
        "verl_sat.default.assets",
    }, top


# ---------------------------------------------------------------------------------------------
# the probes' GPU branches (docs/gpu_path.md)
# ---------------------------------------------------------------------------------------------
class FakeNVML:
    """libnvidia-ml.so's C calls as an 8 × H200 node answers them, under pynvml's own Python
    bindings (pynvml builds the real ctypes structures and decodes the strings)."""

    def __init__(self) -> None:
        self.handles: dict[int, int] = {}

    def __getattr__(self, name: str):
        def call(*args):
            getattr(self, "_" + name.removesuffix("_v2"))(*args)
            return 0  # NVML_SUCCESS

        return call

    def _nvmlInitWithFlags(self, flags) -> None: ...

    def _nvmlShutdown(self) -> None: ...

    def _nvmlSystemGetCudaDriverVersion(self, ref) -> None:
        ref._obj.value = 12080

    def _nvmlDeviceGetCount(self, ref) -> None:
        ref._obj.value = 8

    def _nvmlDeviceGetHandleByIndex(self, index, ref) -> None:
        self.handles[id(ref._obj)] = index.value

    def _nvmlDeviceGetUUID(self, handle, buffer, size) -> None:
        buffer.value = f"GPU-{self.handles[id(handle)]:04d}-aaaa".encode()

    def _nvmlDeviceGetName(self, handle, buffer, size) -> None:
        buffer.value = b"NVIDIA H200"

    def _nvmlDeviceGetMemoryInfo(self, handle, ref) -> None:
        ref._obj.total, ref._obj.free = H200, H200 - 10**9 - self.handles[id(handle)]


@pytest.mark.gpu_branch
def test_probe_gpus_reads_each_device_as_nvml_reports_it(cfg: DictConfig, monkeypatch) -> None:
    """The GPU branch of ``probe_gpus`` through pynvml's real bindings over a stand-in of NVML's
    C library; ``CUDA_VISIBLE_DEVICES`` (ordinals or UUID prefixes) is parsed by torch's own code.
    The checks then pass on what it read."""
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlLib", FakeNVML())
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus, cuda, error = node_facts.probe_gpus()
    assert (cuda, error) == ("12.8", None) and [g.index for g in gpus] == list(range(8))
    assert gpus[3] == GPU(3, "NVIDIA H200", H200, H200 - 10**9 - 3)
    facts = replace(good_facts(cfg), gpus=gpus)
    assert failures(cfg, facts, checks.check_gpu_count) == []
    assert failures(cfg, facts, checks.check_gpu_memory) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2,9,1")  # the first invalid ordinal ends the list
    gpus, _, _ = node_facts.probe_gpus()
    assert [(g.index, g.free_bytes) for g in gpus] == [(0, H200 - 10**9 - 5), (1, H200 - 10**9 - 2)]
    assert failures(cfg, replace(facts, gpus=gpus), checks.check_gpu_count)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0006")
    assert [g.free_bytes for g in node_facts.probe_gpus()[0]] == [H200 - 10**9 - 6]


def test_a_node_without_an_nvidia_driver_has_no_gpu_and_says_why(cfg: DictConfig) -> None:
    """This CPU machine, for real: pynvml's nvmlInit finds no driver (NVMLError), so no GPU, and
    the GPU-count failure names the reason."""
    gpus, cuda, error = node_facts.probe_gpus()
    assert (gpus, cuda) == ((), None) and error.startswith("no NVIDIA driver (NVML: ")
    (short,) = failures(cfg, replace(good_facts(cfg), gpus=gpus, gpu_error=error), checks.check_gpu_count)
    assert "0 visible" in short.message and "no NVIDIA driver" in short.message


NCCL_ENGINE = """
import json, sys, types
cupy = types.ModuleType("cupy")
cupy.ndarray = type("ndarray", (), {})  # the one cupy name nccl_checkpoint_engine reads at import
sys.modules["cupy"] = cupy
from verl_sat.preflight.facts import probe_checkpoint_engines
from verl.checkpoint_engine import CheckpointEngineRegistry
engines, errors = probe_checkpoint_engines()
print(json.dumps([sorted(engines), errors, CheckpointEngineRegistry.get("nccl").__name__]))
"""


@pytest.mark.gpu_branch
def test_sglang_yamls_weight_sync_backend_is_the_name_verls_nccl_engine_registers(cfg: DictConfig) -> None:
    """With cupy importable (a stand-in: the GPU node's cupy-cuda12x), verl's own
    ``nccl_checkpoint_engine`` registers ``"nccl"``, the backend rollout/sglang.yaml names; the
    probe reads it and the checkpoint-engine check passes on the paper's cell."""
    out = subprocess.run([sys.executable, "-c", NCCL_ENGINE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    engines, errors, cls = json.loads(out.stdout.strip().splitlines()[-1])
    assert cls == "NCCLCheckpointEngine" and "nccl_checkpoint_engine" not in errors
    sglang = OmegaConf.load(REPO / "hydra_configs/rollout/sglang.yaml")
    assert sglang.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl" and "nccl" in engines
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "nccl"
    facts = replace(good_facts(cfg), checkpoint_engines=engines, checkpoint_engine_errors=errors)
    assert checks.check_checkpoint_engine(cfg, facts) == []


def test_a_chat_template_ending_turns_on_a_token_generation_does_not_stop_at_is_warned(tmp_path: Path) -> None:
    """A Base model's case: eos_token_id is <|endoftext|> while the chat template closes a turn with
    <|im_end|>. The probe renders the template with transformers (the CPU default's Qwen-style
    tokenizer, saved locally), the check warns with the file to change; with the id added to
    generation_config.json, as the warning says, nothing is found."""
    from verl_sat.default import model as tiny

    tokenizer = tiny.build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    text_end, turn_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    (tmp_path / "config.json").write_text(json.dumps({**BASE_CONFIG, "eos_token_id": text_end}))
    model = node_facts.probe_model(str(tmp_path))
    assert model.end_of_turn == ("<|im_end|>", turn_end) and model.stop_ids == (text_end,)
    (finding,) = checks.check_end_of_turn(OmegaConf.create({}), Facts(model=model))
    assert finding.level == "warn" and finding.key == "actor_rollout_ref.model.path"
    assert f"<|im_end|> (id {turn_end})" in finding.message
    assert f'"eos_token_id": {sorted([text_end, turn_end])} in {tmp_path}/generation_config.json' in finding.message
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted([text_end, turn_end])}))
    fixed = node_facts.probe_model(str(tmp_path))
    assert fixed.stop_ids == tuple(sorted([text_end, turn_end]))
    assert checks.check_end_of_turn(OmegaConf.create({}), Facts(model=fixed)) == []
    # no tokenizer beside the config (the fixture's Base config alone): nothing to check, no finding
    assert node_facts.probe_model(str(BASE_MODEL_DIR)).end_of_turn is None
