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
from verl_sat.trainer.recipe import trainer_dp_size

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
            "sglang": {"sglang": "0.5.12"},
            "megatron": {"megatron-bridge": "0.5.2"},
        },
        import_errors={module: None for module in node_facts.PROBED_MODULES},
        sglang_routed_experts=True,
        checkpoint_engines=("naive", "nccl"),
        cupy_distributions=("cupy-cuda12x",),
        # lag 8 with R3 needs 1.92 TB (docs/reproduce.md): under Ray's 95% of 2.2 TB with 50 GB in use
        host_mem_total_bytes=2200 * 10**9,
        host_mem_available_bytes=2150 * 10**9,
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
    unmet = node_facts.Unmet("verl-sat", "0.1.0", "verl[verl-core]==0.9.1", "0.9.0")
    return cfg, replace(facts, versions={**facts.versions, "verl": "0.9.0"}, requirement_conflicts=(unmet,))


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


def seed_bridge_built_for_other_megatron_core(cfg, facts):
    unmet = node_facts.Unmet("megatron-bridge", "0.5.1", "megatron-core>=0.18", "0.17.0")
    return cfg, replace(facts, requirement_conflicts=(unmet,))


def seed_old_flashinfer(cfg, facts):
    # SGLang 0.5.12 asserts flashinfer_python >= 0.6.11.post1 itself; verl's replacement only >= 0.2.5
    versions = {**facts.versions, "flashinfer-python": "0.6.8.post1"}
    return cfg, replace(facts, versions=versions, sglang_flashinfer_min="0.6.11.post1")


def seed_megatron_engine_not_importing(cfg, facts):
    error = "ImportError: cannot import name 'get_forward_backward_func' (raised at transformer_impl.py:25)"
    return cfg, replace(facts, import_errors={**facts.import_errors, node_facts.MEGATRON_ENGINE: error})


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


def seed_host_without_room_for_the_rank_copies(cfg, facts):
    # 2 TB of RAM, idle, holds optimizer + buffer (1.47 TB) but not 4 ranks × 111 GB under Ray's 95%
    return cfg, replace(facts, host_mem_total_bytes=2 * 10**12, host_mem_available_bytes=2 * 10**12)


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
    (seed_wrong_verl, checks.check_requirements, "requires verl[verl-core]==0.9.1, installed 0.9.0"),
    (seed_wrong_sglang, checks.check_versions, "sglang==0.5.12"),
    (seed_sglang_without_routed_experts, checks.check_routing_replay, "rollout.enable_rollout_routing_replay"),
    (seed_no_nccl_engine, checks.check_checkpoint_engine, "checkpoint_engine.backend=nccl"),
    (seed_cupy_for_other_cuda, checks.check_checkpoint_engine, "cupy-cuda11x"),
    (seed_r3_padded, checks.check_routing_replay, "actor_rollout_ref.model.use_remove_padding"),
    (seed_no_megatron_bridge, checks.check_megatron, "megatron-bridge"),
    (seed_no_mbridge_when_vanilla, checks.check_megatron, "vanilla_mbridge=true"),
    (seed_python_311, checks.check_megatron, "Python 3.12"),
    (seed_bridge_built_for_other_megatron_core, checks.check_requirements, "megatron-core>=0.18, installed 0.17.0"),
    (seed_old_flashinfer, checks.check_requirements, "flashinfer-python 0.6.8.post1"),
    (seed_use_mbridge_off, checks.check_megatron, "megatron.use_mbridge"),
    (seed_megatron_engine_not_importing, checks.check_megatron, "cannot import name 'get_forward_backward_func'"),
    (seed_full_32k_response, checks.check_context_length, "data.max_response_length"),
    (seed_post_trained_max_model_len, checks.check_context_length, "rollout.max_model_len"),
    (seed_small_host, checks.check_host_memory, "optimizer_offload_fraction"),
    (seed_host_without_room_for_routes, checks.check_host_memory, "R3's routes"),
    (seed_host_without_room_for_the_rank_copies, checks.check_host_memory, "4 trainer ranks' copies"),
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


def node(need: int, total: int) -> dict[str, int]:
    """A node of ``total`` bytes of RAM whose budget under Ray's default 95% is exactly ``need``."""
    return {"host_mem_total_bytes": total, "host_mem_available_bytes": need + total - int(0.95 * total)}


def test_host_check_counts_optimizer_buffer_and_rank_copies(cfg: DictConfig) -> None:
    params = QWEN3_30B_PARAMS
    need = estimates.host_memory_bytes(cfg, params, BASE_CONFIG)
    buffer = estimates.rollout_buffer_bytes(cfg, BASE_CONFIG)
    copies = estimates.rank_copy_bytes(cfg, BASE_CONFIG)
    assert need["optimizer"] == estimates.host_optimizer_bytes(cfg, params)
    assert need["total"] == need["optimizer"] + buffer["total"] + copies["total"]
    # TP 4 × EP 4 on 4 GPUs: DP 1, so each of the 4 ranks fetches the whole 256 × 16 optimizer batch,
    # every field: the buffer's and the step's write-backs (old_log_probs, ref_log_prob, advantages, returns)
    writeback = 30720 * 4 * len(step_writeback_fields(cfg))
    assert copies == {
        "ranks": 4,
        "dp": 1,
        "samples_per_rank": 4096,
        "per_sample": buffer["per_sample"] + writeback,
        "per_rank": 4096 * (buffer["per_sample"] + writeback),
        "total": 4 * 4096 * (buffer["per_sample"] + writeback),
    }
    total = 2300 * 10**9
    assert failures(cfg, replace(good_facts(cfg), **node(need["total"], total)), checks.check_host_memory) == []
    (short,) = failures(cfg, replace(good_facts(cfg), **node(need["total"] - 1, total)), checks.check_host_memory)
    assert "rollout buffer 36864 samples" in short.message and short.key == "data.max_response_length"
    assert "data.train_batch_size + 256 warm-up prompts" in short.message
    assert "4 trainer ranks' copies of the optimizer batch (DP 1: each rank fetches 4096 samples" in short.message
    assert "RAY_memory_usage_threshold=0.95" in short.message
    # what the estimate held before the rank copies were counted no longer passes
    old = need["optimizer"] + buffer["total"]
    assert failures(cfg, replace(good_facts(cfg), **node(old, total)), checks.check_host_memory)


def test_the_verdict_is_rays_kill_threshold_not_all_of_ram(cfg: DictConfig) -> None:
    """Ray kills a worker once used (MemTotal − MemAvailable) passes the threshold × MemTotal: a node
    whose free RAM holds the estimate, but not under 95% of it, fails; with Ray's memory monitor
    off (threshold 1.0) or RAY_min_memory_free_bytes small, it passes."""
    need = estimates.host_memory_bytes(cfg, QWEN3_30B_PARAMS, BASE_CONFIG)["total"]
    idle = replace(good_facts(cfg), host_mem_total_bytes=need + 10**9, host_mem_available_bytes=need + 10**9)
    (short,) = failures(cfg, idle, checks.check_host_memory)
    kill = estimates.ray_kill_bytes(need + 10**9, 0.95)
    assert kill == int(0.95 * (need + 10**9)) and estimates.gib(kill) in short.message
    assert failures(cfg, replace(idle, ray_memory_threshold=1.0), checks.check_host_memory) == []
    # Ray's min_memory_free_bytes: the threshold is max(fraction × total, total − min_free)
    assert failures(cfg, replace(idle, ray_min_memory_free_bytes=10**9), checks.check_host_memory) == []
    assert failures(cfg, replace(idle, ray_min_memory_free_bytes=10**12), checks.check_host_memory)
    # memory already in use counts against the budget
    busy = replace(idle, host_mem_total_bytes=need + 10**12)
    assert failures(cfg, busy, checks.check_host_memory) != []
    assert failures(cfg, replace(busy, host_mem_available_bytes=need + 10**12), checks.check_host_memory) == []


def test_rays_threshold_is_read_from_the_environment_ray_reads() -> None:
    assert node_facts.ray_memory_threshold({}) == node_facts.RAY_MEMORY_USAGE_THRESHOLD == 0.95
    assert node_facts.ray_memory_threshold({"RAY_memory_usage_threshold": "0.8"}) == 0.8
    assert node_facts.ray_memory_threshold({"RAY_memory_monitor_refresh_ms": "0"}) == 1.0  # no killing
    assert node_facts.ray_min_memory_free({}) == -1
    assert node_facts.ray_min_memory_free({"RAY_min_memory_free_bytes": "1000"}) == 1000
    for bad in ("high", "1.5"):
        with pytest.raises(ValueError, match="RAY_memory_usage_threshold"):
            node_facts.ray_memory_threshold({"RAY_memory_usage_threshold": bad})


@pytest.mark.extended  # tests/README.md: starts a Ray head (about 10 s)
def test_rays_raylet_kills_at_the_preflights_threshold(tmp_path: Path) -> None:
    """Ray's raylet logs the threshold its memory monitor kills at; with nothing set it is the
    preflight's default, and RAY_memory_usage_threshold moves it as the preflight reads it."""
    import re

    code = (
        "import ray, glob, time\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "logs = ray._private.worker._global_node.get_logs_dir_path()\n"
        "for _ in range(100):\n"
        "    text = ''.join(open(f).read() for f in glob.glob(logs + '/raylet*.out'))\n"
        "    if 'MemoryMonitor initialized' in text: break\n"
        "    time.sleep(0.1)\n"
        "ray.shutdown()\n"
        "print(text)\n"
    )
    for env, expected in (({}, node_facts.RAY_MEMORY_USAGE_THRESHOLD), ({"RAY_memory_usage_threshold": "0.9"}, 0.9)):
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_memory")}
        full = {**base, "RAY_AUTH_MODE": "disabled", **env}
        out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
        # Ray 2.60: "... usage threshold at N bytes (95.000000% of system memory)"; later: "usage_threshold=0.950"
        found = re.search(r"\(([0-9.]+)% of system memory\)|usage_threshold=([0-9.]+)", out.stdout)
        assert found, out.stdout[-2000:] + out.stderr[-2000:]
        logged = float(found.group(1)) / 100 if found.group(1) else float(found.group(2))
        assert logged == pytest.approx(expected), found.group(0)
        assert node_facts.ray_memory_threshold(full) == expected


def test_the_trainer_ranks_fetch_the_batch_as_verl_dispatches_it(cfg: DictConfig, monkeypatch) -> None:
    """Megatron's own ``initialize_model_parallel`` gives each trainer rank its DP rank (torch.distributed
    answering for one rank of the layout at a time); verl's own ``dispatch_lazy_compute_data_proto``
    chunks the optimizer batch's handle (a TransferQueue ``KVBatchMeta``) by them; each rank's
    ``tqbridge`` fetches its chunk. The samples fetched on the node are what ``rank_copy_bytes`` counts."""
    from unittest import mock

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from transfer_queue import KVBatchMeta
    from verl.single_controller.base import decorator
    from verl.single_controller.base.worker_group import WorkerGroup
    from verl.utils import ray_utils, transferqueue_utils

    class Group:
        """A process group as Megatron asks it: this rank's index in ``ranks`` and their count."""

        def __init__(self, ranks, rank: int) -> None:
            self.ranks, self.me = list(ranks), rank

        def rank(self) -> int:
            return self.ranks.index(self.me) if self.me in self.ranks else -1

        def size(self) -> int:
            return len(self.ranks)

    def dp_ranks(world: int, lay: dict[str, int]) -> list[int]:
        out = []
        for rank in range(world):
            with (
                mock.patch.object(dist, "is_initialized", lambda: True),
                mock.patch.object(dist, "get_world_size", lambda group=None: world),
                mock.patch.object(dist, "get_rank", lambda group=None, r=rank: r),
                mock.patch.object(dist, "new_group", lambda ranks=None, r=rank, **kw: Group(ranks or range(world), r)),
            ):
                mpu.destroy_model_parallel()
                mpu.initialize_model_parallel(
                    tensor_model_parallel_size=lay["tp"],
                    pipeline_model_parallel_size=lay["pp"],
                    context_parallel_size=lay["cp"],
                    expert_model_parallel_size=lay["ep"],
                    expert_tensor_parallel_size=lay["etp"],
                )
                out.append(mpu.get_data_parallel_rank())
                mpu.destroy_model_parallel()
        return out

    monkeypatch.setattr(ray_utils, "parallel_put", lambda chunks, max_workers=None: list(chunks))
    monkeypatch.setattr(transferqueue_utils, "kv_batch_meta2batch_meta", lambda meta: meta)
    meg = "actor_rollout_ref.actor.megatron"
    for gpus, tp, pp, ep in ((4, 4, 1, 4), (8, 2, 1, 4), (8, 2, 2, 2), (8, 1, 1, 8)):
        for key, value in (("tensor", tp), ("pipeline", pp), ("expert", ep)):
            set_key(cfg, f"{meg}.{key}_model_parallel_size", value)
        set_key(cfg, "trainer.n_gpus_per_node", gpus)
        mapping = dp_ranks(gpus, estimates.megatron_layout(cfg))
        group = object.__new__(WorkerGroup)
        group._workers, group._dispatch_info = [None] * gpus, {"train": mapping}
        samples = estimates.optimizer_batch_samples(cfg)
        batch = KVBatchMeta(partition_id="train", keys=[f"k{i}" for i in range(samples)], tags=[{}] * samples)
        (per_rank,), _ = decorator.dispatch_lazy_compute_data_proto("train", group, batch)
        copies = estimates.rank_copy_bytes(cfg, BASE_CONFIG)
        assert max(mapping) + 1 == trainer_dp_size(cfg) == copies["dp"], (gpus, tp, pp, ep)
        assert [len(chunk.keys) for chunk in per_rank] == [copies["samples_per_rank"]] * gpus
        assert sum(len(chunk.keys) for chunk in per_rank) * copies["per_sample"] == copies["total"]


def test_the_optimizer_batch_is_the_one_verls_step_samples(tmp_path: Path) -> None:
    """verl's own ``PPOTrainer.step`` asks ``_step_once`` for ``train_batch_size // parameter_sync_step``
    prompts per optimizer step: 256 at both lags (× rollout.n samples)."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base

    for lag in (1, 8):
        cfg = cli.resolve("sat_gspo_r3", lag, run_dir=str(tmp_path))
        # the class the launch runs (verl-sat's, registered as sat_separate_async), its mode and
        # parameter_sync_step set as verl's PPOTrainer.__init__ sets them
        trainer = object.__new__(trainer_base.get_trainer_cls(cfg.trainer.v1.trainer_mode))
        trainer.config = cfg
        trainer.trainer_mode = cfg.trainer.v1.trainer_mode
        trainer.parameter_sync_step = cfg.trainer.v1.get(trainer.trainer_mode, {}).get("parameter_sync_step", 1)
        asked: list[int] = []
        trainer.prepare_step = dict
        trainer._step_once = lambda metrics, timing, size, asked=asked: asked.append(size) or KVBatchMeta()
        trainer.step({}, {})
        assert asked == [256] * lag
        assert estimates.optimizer_batch_samples(cfg) == 256 * cfg.actor_rollout_ref.rollout.n


def test_the_docs_host_memory_figures_are_the_preflights() -> None:
    """docs/reproduce.md's host-memory table and the figures its "Host memory" section quotes,
    recomputed by the preflight's own code on the Base model's config.json (the printer
    ``python -m verl_sat.preflight --memory-table``), so the docs cannot drift from the check."""
    docs = (REPO / "docs/reproduce.md").read_text()
    rows = cli.memory_rows([f"actor_rollout_ref.model.path={BASE_MODEL_DIR}"])
    table = cli.memory_table(rows)
    assert [line for line in docs.splitlines() if line.startswith("| lag ")] == table[2:]
    assert "\n".join(table) in docs
    section = docs[docs.index("### Host memory") : docs.index("To see the fully resolved config")]
    by_row = {r["row"]: r for r in rows}
    lag1, lag8, plain = by_row["lag 1, R3"], by_row["lag 8, R3"], by_row["lag 1, no R3"]
    copies = lag8["copies"]
    quoted = [
        f"= {lag1['buffer']['samples']} samples",
        f"= {lag8['buffer']['samples']} samples",
        f"a sample is {lag8['buffer']['per_sample'] / 1e6:.1f} MB with R3",
        f"({plain['buffer']['per_sample'] / 1e6:.1f} MB\nwithout)",
        f"256 prompts × 16 = {copies['samples_per_rank']} samples",
        f"DP = {copies['dp']} and each of the {copies['ranks']} ranks",
        f"{copies['samples_per_rank']} samples × {copies['per_sample'] / 1e6:.1f} MB = "
        f"{cli.decimal_size(copies['per_rank'])} a rank",
        f"{cli.decimal_size(copies['total'])} for the node",
    ]
    assert [q for q in quoted if q not in section] == []
    assert lag8["copies"] == lag1["copies"]  # the same optimizer batch at both lags
    # the verdict the docs draw: lag 8 with R3 does not fit under Ray's 95% of a 2 TB node
    assert lag8["need"]["total"] > 0.95 * 2 * 10**12 > lag1["need"]["total"]


def test_host_estimate_follows_the_formula(cfg: DictConfig) -> None:
    params = 30 * 10**9
    assert estimates.host_optimizer_bytes(cfg, params) == params * 16  # fp32 master, m, v, grad
    set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction", 0.5)
    set_key(cfg, "actor_rollout_ref.actor.optim.exp_avg_sq_dtype", "bf16")
    assert estimates.host_optimizer_bytes(cfg, params) == params * 0.5 * 14


def test_no_offload_counts_only_the_rollout_buffer_and_rank_copies(cfg: DictConfig) -> None:
    set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload", False)
    need = estimates.host_memory_bytes(cfg, QWEN3_30B_PARAMS, BASE_CONFIG)
    assert need["optimizer"] == 0 and need["total"] == need["buffer"] + need["rank_copies"]
    total = 2 * 10**12
    assert checks.check_host_memory(cfg, replace(good_facts(cfg), **node(need["total"], total))) == []
    (short,) = checks.check_host_memory(cfg, replace(good_facts(cfg), **node(need["total"] - 1, total)))
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


def test_unmet_requirements_are_read_as_pip_check_reads_them(cfg: DictConfig, tmp_path: Path) -> None:
    """megatron-bridge 0.5.1's declared requirements (from its wheel's METADATA) on a search path
    ahead of this environment's real transformers and torch: importlib.metadata reads them, markers are
    evaluated (an extra's requirement is not the base install's), and each one the installed versions
    miss is recorded, naming the dependent, the requirement and what is installed; a missing package
    of the stack is one too, a missing package outside it is left to the imports."""
    from importlib import metadata

    transformers = metadata.version("transformers")
    install_metadata(
        tmp_path,
        "megatron-bridge",
        "0.5.1",
        [
            f"transformers<{transformers},>=5.8.1",
            "megatron-core[dev,mlm]>=0.99",
            "torch>=2.6.0",
            'transformer-engine[core_cu13,pytorch]; extra == "te"',
            "einops",
            'torch<1; python_version < "3.0"',
            "flashinfer-python==0.6.8.post1",
            "no-such-package-xyz",
        ],
    )
    versions, _, conflicts = node_facts.probe_packages([str(tmp_path), *sys.path])
    assert versions["megatron-bridge"] == "0.5.1"
    core = metadata.version("megatron-core")
    assert conflicts == (
        node_facts.Unmet("megatron-bridge", "0.5.1", f"transformers<{transformers},>=5.8.1", transformers),
        node_facts.Unmet("megatron-bridge", "0.5.1", "megatron-core[dev,mlm]>=0.99", core),
        node_facts.Unmet("megatron-bridge", "0.5.1", "flashinfer-python==0.6.8.post1", None),
    )
    assert (
        conflicts[0].line()
        == f"megatron-bridge 0.5.1 requires transformers<{transformers},>=5.8.1, installed {transformers}"
    )
    assert conflicts[2].line().endswith("flashinfer-python==0.6.8.post1, not installed")
    # without the search path: this environment, whose own requirements are met (pip check is clean)
    assert node_facts.probe_packages()[2] == ()
    facts = replace(good_facts(cfg), versions={**good_facts(cfg).versions, **versions}, requirement_conflicts=conflicts)
    found = {f.message.split(":")[0]: f.level for f in checks.check_requirements(cfg, facts)}
    assert found == {
        f"megatron-bridge 0.5.1 requires transformers<{transformers},>=5.8.1, installed {transformers}": "fail",
        f"megatron-bridge 0.5.1 requires megatron-core[dev,mlm]>=0.99, installed {core}": "fail",
        # the install's named override (verl_sat.preflight.stack.OVERRIDES), but without the
        # flashinfer the install puts there (SGLang's): a failure naming it
        "megatron-bridge 0.5.1 requires flashinfer-python==0.6.8.post1, not installed": "fail",
    }
    install_metadata(tmp_path, "flashinfer-python", "0.6.11.post1", [])
    _, _, conflicts = node_facts.probe_packages([str(tmp_path), *sys.path])
    facts = replace(facts, requirement_conflicts=conflicts)
    (override,) = [f for f in checks.check_requirements(cfg, facts) if f.level == "warn"]
    assert override.message.startswith(
        "megatron-bridge 0.5.1 requires flashinfer-python==0.6.8.post1, installed 0.6.11.post1: a named override"
    )


SGLANG_WHEEL = "sglang-0.5.12-cp312-cp312-manylinux_2_34_x86_64.whl"


def sglang_wheel() -> Path:
    """SGLang 0.5.12's wheel as PyPI serves it (downloaded once, no dependencies, not installed)."""
    cache = Path.home() / ".cache/verl-sat/wheels"
    wheel = cache / SGLANG_WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "sglang==0.5.12", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "--platform", "manylinux_2_34_x86_64", "-d", str(cache)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return wheel


def test_sglang_0512s_own_metadata_next_to_a_transformers_it_does_not_accept(
    cfg: DictConfig, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang 0.5.12's real METADATA and engine.py (from its wheel, on a search path ahead of this
    environment) next to this environment's transformers, which SGLang's pin does not accept: the
    preflight names sglang, transformers and both versions and fails. With the transformers the GPU
    install keeps (5.9.0) it warns with the override's reason instead; flashinfer is held to the floor
    SGLang's own _set_envs_and_config asserts."""
    import zipfile
    from importlib import metadata

    from verl_sat.preflight import stack

    with zipfile.ZipFile(sglang_wheel()) as wheel:
        for name in wheel.namelist():
            if name.startswith("sglang-0.5.12.dist-info/") or name == node_facts.SGLANG_ENGINE_FILE:
                wheel.extract(name, tmp_path)
    paths = [str(tmp_path), *sys.path]
    assert node_facts.sglang_flashinfer_min(paths) == stack.SGLANG_FLASHINFER_MIN == "0.6.11.post1"
    assert node_facts.sglang_flashinfer_min() is None  # no SGLang in this environment
    versions, _, conflicts = node_facts.probe_packages(paths)
    transformers = metadata.version("transformers")
    assert transformers != "5.6.0" and versions["sglang"] == "0.5.12"
    expected = f"sglang 0.5.12 requires transformers==5.6.0, installed {transformers}"
    assert expected in [u.line() for u in conflicts]

    def probed(cfg: DictConfig) -> Facts:
        facts = good_facts(cfg)
        versions_here = {**facts.versions, **{k: v for k, v in versions.items() if k in ("sglang", "transformers")}}
        sglang_only = tuple(u for u in conflicts if u.dependent == "sglang")
        return replace(
            facts, versions=versions_here, requirement_conflicts=sglang_only, sglang_flashinfer_min="0.6.11.post1"
        )

    args = ["sat_gspo_r3", "8", "--run-dir", str(tmp_path / "run"), "data.train_files=/d/train.parquet"]
    assert cli.main([*args, "data.val_files=/d/aime24.parquet"], gather_fn=probed) == 1
    out = capsys.readouterr().out
    assert f"[preflight] FAIL requirements: {expected}:" in out
    assert "flashinfer-python not installed, but sglang 0.5.12 asserts flashinfer_python >= 0.6.11.post1" in out
    # the GPU install's transformers (verl's sglang extra pin) and SGLang's flashinfer: the override warns
    install_metadata(tmp_path, "transformers", "5.9.0", [])
    install_metadata(tmp_path, "flashinfer-python", "0.6.11.post1", [])
    versions, _, conflicts = node_facts.probe_packages(paths)
    facts = replace(
        good_facts(cfg),
        versions={**good_facts(cfg).versions, **versions},
        requirement_conflicts=tuple(u for u in conflicts if u.dependent == "sglang"),
        sglang_flashinfer_min=node_facts.sglang_flashinfer_min(paths),
    )
    findings = checks.check_requirements(cfg, facts)
    assert not [f for f in findings if f.key == "flashinfer-python"]  # SGLang's floor is met
    (override,) = [f for f in findings if "transformers" in f.message]
    assert override.level == "warn" and override.key == "sglang"
    assert override.message.startswith("sglang 0.5.12 requires transformers==5.6.0, installed 5.9.0: a named override")
    assert stack.override_for("sglang", "transformers==5.6.0").reason in override.message
    # an older flashinfer under flashinfer attention (verl's default for SGLang >= 0.5.12) fails
    old = replace(facts, versions={**facts.versions, "flashinfer-python": "0.6.8.post1"})
    (floor,) = failures(cfg, old, checks.check_flashinfer_floor)
    assert "flashinfer-python 0.6.8.post1" in floor.message and ">= 0.6.11.post1" in floor.message
    set_key(cfg, checks.SGLANG_ATTENTION_KEY, "fa3")  # another backend: SGLang does not assert it
    assert checks.check_flashinfer_floor(cfg, old) == []


def test_the_megatron_engines_real_import_error_is_shown(cfg: DictConfig, monkeypatch) -> None:
    """verl's workers/engine/__init__.py swallows an ImportError of its Megatron engine; the probe
    imports ``verl.workers.engine.megatron`` again and reports the real error and where it was
    raised (here one import of verl's engine module blocked by a None entry in sys.modules)."""
    errors, _ = node_facts.probe_imports()
    assert errors[node_facts.MEGATRON_ENGINE] is None  # megatron-core 0.16.1 (CPU) imports here
    blocked = "verl.utils.megatron.router_replay_patch"
    for name in [m for m in sys.modules if m.startswith(node_facts.MEGATRON_ENGINE)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, blocked, None)
    errors, _ = node_facts.probe_imports()
    error = errors[node_facts.MEGATRON_ENGINE]
    assert error.startswith(f"ModuleNotFoundError: import of {blocked} halted; None in sys.modules"), error
    assert "verl/workers/engine/megatron/transformer_impl.py:" in error
    assert errors["megatron.core"] is None
    facts = replace(good_facts(cfg), import_errors={**good_facts(cfg).import_errors, node_facts.MEGATRON_ENGINE: error})
    (found,) = failures(cfg, facts, checks.check_megatron)
    assert error in found.message and "Unknown backend: megatron" in found.message


@pytest.mark.extended  # tests/README.md: a fresh interpreter importing verl's Megatron engine (about 15 s)
def test_the_driver_sees_only_unknown_backend_where_the_preflight_shows_the_import(tmp_path: Path) -> None:
    """A fresh process with one import of verl's Megatron engine blocked (sitecustomize): verl's own
    EngineRegistry answers only "Unknown backend: megatron", the preflight's probe the ImportError."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["megatron.core.models.gpt.gpt_model"] = None\n')
    code = (
        "import json\n"
        "from verl_sat.preflight.facts import MEGATRON_ENGINE, probe_imports\n"
        "errors, _ = probe_imports()\n"
        "from verl.workers.engine import EngineRegistry\n"
        "try:\n"
        "    EngineRegistry.get_engine_cls('language_model', 'megatron')\n"
        "    symptom = None\n"
        "except AssertionError as err:\n"
        "    symptom = str(err)\n"
        "print(json.dumps({'engine': errors[MEGATRON_ENGINE], 'core': errors['megatron.core'], 'symptom': symptom}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["symptom"] == "Unknown backend: megatron" and report["core"] is None
    assert report["engine"].startswith("ModuleNotFoundError: import of megatron.core.models.gpt.gpt_model halted")


def test_pins_are_read_from_the_installed_metadata(cfg: DictConfig, tmp_path: Path, monkeypatch) -> None:
    """The verl verl-sat requires and the sglang verl's sglang extra pins come from the installed
    METADATA: another verl's metadata first on the path moves the pin the check names, and fails
    verl-sat's own requirement on verl."""
    from importlib import metadata

    want = metadata.version("verl")  # this environment installs what verl-sat requires
    install_metadata(
        tmp_path, "verl", "0.9.2", ['sglang==0.6.1; extra == "sglang"', 'megatron-bridge==0.6.0; extra == "megatron"']
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    versions, pins, conflicts = node_facts.probe_packages()
    assert (pins["sglang"]["sglang"], pins["megatron"]["megatron-bridge"]) == ("0.6.1", "0.6.0")
    facts = replace(
        good_facts(cfg),
        versions={**good_facts(cfg).versions, "verl": versions["verl"]},
        extra_pins=pins,
        requirement_conflicts=conflicts,
    )
    found = {f.key: f.message for f in failures(cfg, facts, checks.check_versions)}
    assert set(found) == {"sglang"} and "sglang==0.6.1" in found["sglang"]
    (verl,) = failures(cfg, facts, checks.check_requirements)
    assert verl.key == "verl-sat" and f"requires verl[verl-core]=={want}, installed 0.9.2" in verl.message


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
    # what verl receives, not only Hydra's composition: sat.lag's derived keys and the Megatron betas
    assert printed.trainer.v1.separate_async.parameter_sync_step == 8
    assert printed.data.train_batch_size == 8 * printed.actor_rollout_ref.actor.ppo_mini_batch_size
    betas = printed.actor_rollout_ref.actor.optim.override_optimizer_config
    assert (betas.adam_beta1, betas.adam_beta2) == (0.9, 0.98)


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
        "_thread",
        "argparse",
        "functools",
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
        "re",
        "typing",
        "omegaconf",
        "verl_sat.default.assets",
        "verl_sat.processes",  # standard library only: the watch thread the supervisor shares
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


def test_the_cpu_default_passes_on_this_node_as_the_launch_fills_it(cached_default_assets, capsys) -> None:
    """``python -m verl_sat.preflight`` on the CPU default, for real on this GPU-less node: no GPU is
    asked of a CPU run, and the model and data checked are the ones the launch fills in (the
    embedded default's, ``launch.config_verl_receives``), not an empty model path."""
    assert cli.main([f"sat.assets_dir={cached_default_assets}"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "[preflight] passed: 0 failure(s)" in out and "gpu_count" not in out
    cfg = cli.resolve(overrides=[f"sat.assets_dir={cached_default_assets}"])
    assert cfg.actor_rollout_ref.model.path == str(cached_default_assets / "model")
    assert checks.check_gpu_count(cfg, replace(good_facts(cfg), gpus=())) == []


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
