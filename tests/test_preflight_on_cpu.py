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
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import DictConfig, OmegaConf

from verl_sat import preflight
from verl_sat.preflight import GPU, Facts, Finding, ModelFacts

REPO = Path(__file__).resolve().parents[1]
H200 = 141 * 10**9
QWEN3_30B_BYTES = 61 * 10**9  # 30.5e9 parameters in bfloat16
GOOD_SCHEMA = {"data_source": (), "prompt": (), "ability": (), "reward_model": ("ground_truth", "style")}


@pytest.fixture(scope="module")
def cell(tmp_path_factory: pytest.TempPathFactory) -> DictConfig:
    """sat_gspo_r3 at lag 8 (R3, separate_async, NCCL), resolved as run.sh launches it."""
    run_dir = tmp_path_factory.mktemp("runs") / "sat_gspo_r3-lag8"
    return preflight.resolve_cell(
        "sat_gspo_r3", 8, ["data.train_files=/d/train.parquet", "data.val_files=/d/aime24.parquet"], str(run_dir)
    )


@pytest.fixture
def cfg(cell: DictConfig) -> DictConfig:
    return copy.deepcopy(cell)


def good_facts(cfg: DictConfig) -> Facts:
    """A node on which the paper's cell launches: 8 idle H200s, the pinned packages, enough RAM/disk."""
    files = preflight.as_list(cfg.data.train_files) + preflight.as_list(cfg.data.val_files)
    return Facts(
        gpus=tuple(GPU(i, "NVIDIA H200", H200, H200 - 10**9) for i in range(8)),
        cuda_runtime="12.8",
        versions={"verl": "0.9.1", "sglang": "0.5.12", "megatron-core": "0.16.0", "mbridge": "0.15", "torch": "2.11"},
        sglang_pin="0.5.12",
        import_errors={module: None for module in preflight.PROBED_MODULES},
        sglang_server_args=frozenset({"model_path", "mem_fraction_static", preflight.ROUTED_EXPERTS_ARG}),
        checkpoint_engines=frozenset({"naive", "nccl"}),
        cupy_distributions=("cupy-cuda12x",),
        host_mem_available_bytes=1500 * 10**9,
        disk_free_bytes=10 * 10**12,
        model=ModelFacts("/m", {"max_position_embeddings": 40960, "torch_dtype": "bfloat16"}, QWEN3_30B_BYTES),
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
    findings = preflight.run_checks(cfg, good_facts(cfg))
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
    return cfg, replace(facts, sglang_server_args=frozenset({"model_path"}))


def seed_no_nccl_engine(cfg, facts):
    return cfg, replace(
        facts,
        checkpoint_engines=frozenset({"naive"}),
        checkpoint_engine_errors={"nccl_checkpoint_engine": "ModuleNotFoundError: No module named 'cupy'"},
    )


def seed_cupy_for_other_cuda(cfg, facts):
    return cfg, replace(facts, cupy_distributions=("cupy-cuda11x",))


def seed_no_mbridge(cfg, facts):
    return cfg, replace(facts, import_errors={**facts.import_errors, "mbridge": "ModuleNotFoundError: mbridge"})


def seed_short_context(cfg, facts):
    return cfg, replace(facts, model=replace(facts.model, config={"max_position_embeddings": 32768}))


def seed_small_host(cfg, facts):
    # 30.5e9 × 1.0 × 16 bytes = 488 GB of Adam states on the host
    return cfg, replace(facts, host_mem_available_bytes=256 * 10**9)


def seed_small_disk(cfg, facts):
    # 2 kept × 30.5e9 × (2 + 12) bytes = 854 GB
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
    (seed_too_few_gpus, preflight.check_gpu_count, "trainer.n_gpus_per_node"),
    (seed_bad_expert_parallel, preflight.check_parallel_layout, "megatron.expert_model_parallel_size"),
    (seed_rollout_replica_not_dividing, preflight.check_parallel_layout, "rollout.tensor_model_parallel_size"),
    (seed_busy_gpu, preflight.check_gpu_memory, "rollout.gpu_memory_utilization"),
    (seed_optimizer_on_gpu, preflight.check_gpu_memory, "override_optimizer_config.optimizer_cpu_offload"),
    (seed_wrong_verl, preflight.check_versions, "verl==0.9.1"),
    (seed_wrong_sglang, preflight.check_versions, "sglang==0.5.12"),
    (seed_sglang_without_routed_experts, preflight.check_routing_replay, "rollout.enable_rollout_routing_replay"),
    (seed_no_nccl_engine, preflight.check_checkpoint_engine, "checkpoint_engine.backend=nccl"),
    (seed_cupy_for_other_cuda, preflight.check_checkpoint_engine, "cupy-cuda11x"),
    (seed_no_mbridge, preflight.check_megatron, "mbridge"),
    (seed_short_context, preflight.check_context_length, "data.max_response_length"),
    (seed_small_host, preflight.check_host_memory, "optimizer_offload_fraction"),
    (seed_small_disk, preflight.check_disk, "trainer.max_actor_ckpt_to_keep"),
    (seed_data_without_ground_truth, preflight.check_data, "reward_model.ground_truth"),
    (seed_missing_val_file, preflight.check_data, "data.val_files"),
    (seed_broken_reward, preflight.check_reward_function, "reward.custom_reward_function.path"),
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
    assert found[0] in preflight.run_checks(cfg, facts)


def test_every_check_has_a_seeded_misconfiguration() -> None:
    assert {check for _, check, _ in SEEDED} == set(preflight.CHECKS)


# ---------------------------------------------------------------------------------------------
# details of the checks
# ---------------------------------------------------------------------------------------------
def test_r3_off_needs_no_routed_experts(tmp_path: Path) -> None:
    cfg = preflight.resolve_cell("sat_gspo", 1, run_dir=str(tmp_path))
    facts = replace(good_facts(cfg), sglang_server_args=frozenset({"model_path"}))
    assert preflight.check_routing_replay(cfg, facts) == []
    assert preflight.run_checks(cfg, facts) == []


def test_a_longer_context_by_override_config_passes(cfg: DictConfig) -> None:
    cfg, facts = seed_short_context(cfg, good_facts(cfg))
    set_key(cfg, "actor_rollout_ref.model.override_config", {"max_position_embeddings": 65536})
    assert preflight.check_context_length(cfg, facts) == []


def test_the_short_context_fix_names_the_largest_response(cfg: DictConfig) -> None:
    cfg, facts = seed_short_context(cfg, good_facts(cfg))
    (finding,) = preflight.check_context_length(cfg, facts)
    assert "lower data.max_response_length to 30720" in finding.message  # 32768 - 2048


def test_host_estimate_follows_the_formula(cfg: DictConfig) -> None:
    params = 30 * 10**9
    assert preflight.host_optimizer_bytes(cfg, params) == params * 16  # fp32 master, m, v, grad
    set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction", 0.5)
    set_key(cfg, "actor_rollout_ref.actor.optim.exp_avg_sq_dtype", "bf16")
    assert preflight.host_optimizer_bytes(cfg, params) == params * 0.5 * 14


def test_no_offload_no_host_check(cfg: DictConfig) -> None:
    set_key(cfg, "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload", False)
    facts = replace(good_facts(cfg), host_mem_available_bytes=1)
    assert preflight.check_host_memory(cfg, facts) == []


def test_unset_keep_counts_every_checkpoint(cfg: DictConfig) -> None:
    assert preflight.kept_checkpoints(cfg) == 2
    set_key(cfg, "trainer.max_actor_ckpt_to_keep", None)
    assert preflight.kept_checkpoints(cfg) == 14  # 68 global steps, a save every 5


def test_an_unknown_model_size_warns_instead_of_passing_silently(cfg: DictConfig) -> None:
    facts = replace(good_facts(cfg), model=ModelFacts())
    findings = preflight.run_checks(cfg, facts)
    assert {f.check for f in findings} == {"context_length", "host_memory", "disk"}
    assert all(f.level == "warn" for f in findings)


# ---------------------------------------------------------------------------------------------
# the probe's pieces that need no GPU
# ---------------------------------------------------------------------------------------------
def test_sglang_pin_is_the_one_installed_verl_declares() -> None:
    _, pin, _ = preflight.probe_versions()
    assert pin == preflight.SGLANG_FOR_VERL


def test_probe_data_reads_columns_from_the_schema(tmp_path: Path) -> None:
    good, bad, absent = tmp_path / "good.parquet", tmp_path / "bad.parquet", tmp_path / "absent.parquet"
    pq.write_table(
        pa.table(
            {"prompt": ["q"], "data_source": ["math_dapo"], "reward_model": [{"ground_truth": "1", "style": "r"}]}
        ),
        good,
    )
    pq.write_table(pa.table({"question": ["q"]}), bad)
    schemas = preflight.probe_data([str(good), str(bad), str(absent)])
    assert schemas[str(good)]["reward_model"] == ("ground_truth", "style")
    assert schemas[str(absent)] == "file not found"
    cfg = OmegaConf.create({"data": {"train_files": [str(good), str(bad)], "val_files": str(absent)}})
    found = preflight.check_data(cfg, Facts(data_schemas=schemas))
    assert [f.key for f in found] == ["data.train_files", "data.val_files"]
    assert str(bad) in found[0].message and "prompt" in found[0].message


def test_probe_reward_loads_as_verl_does(tmp_path: Path) -> None:
    module = tmp_path / "reward.py"
    module.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    ok = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(module), "name": "compute_score"}}})
    assert preflight.probe_reward(ok) is None
    wrong = OmegaConf.create({"reward": {"custom_reward_function": {"path": str(module), "name": "score"}}})
    assert "score" in preflight.probe_reward(wrong)
    default = OmegaConf.create({"reward": {"custom_reward_function": {"path": None, "name": "compute_score"}}})
    assert preflight.probe_reward(default) is None


def test_probe_model_reads_a_local_dir_without_downloading(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "torch_dtype": "bfloat16"}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2000}}))
    model = preflight.probe_model(str(tmp_path))
    assert (model.config["max_position_embeddings"], model.weight_bytes) == (4096, 2000)
    assert preflight.param_count(Facts(model=model)) == 1000
    assert preflight.probe_model("no-such-org/no-such-model-xyz") == ModelFacts()


def test_probe_on_this_cpu_node(cfg: DictConfig) -> None:
    facts = preflight.probe(cfg)
    assert facts.versions["verl"] == "0.9.1"
    assert "naive" in facts.checkpoint_engines
    assert facts.host_mem_available_bytes and facts.disk_free_bytes
    if not facts.gpus:  # a CPU node cannot host the paper's layout, and the preflight says so
        assert failures(cfg, facts, preflight.check_gpu_count)


# ---------------------------------------------------------------------------------------------
# command line, run.sh, import weight
# ---------------------------------------------------------------------------------------------
def test_main_exit_code_summary_and_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = ["sat_gspo_r3", "8", "--run-dir", str(tmp_path), "data.train_files=/d/t.parquet"]
    assert preflight.main(args, probe_fn=good_facts) == 0
    assert "passed: 0 failure(s)" in capsys.readouterr().out
    # a misconfiguration passed as a Hydra override, as run.sh forwards "$@"
    bad = args + ["actor_rollout_ref.rollout.tensor_model_parallel_size=3"]
    assert preflight.main(bad, probe_fn=good_facts) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("[preflight] FAILED: 1 failure(s)")
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size" in out[0]
    assert preflight.main([*bad, "--json"], probe_fn=good_facts) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["findings"][0]["check"] == "parallel_layout"
    assert report["facts"]["sglang_server_args"] is True


def run_sh(tmp_path: Path, **env: str) -> list[str]:
    """run.sh's DRY_RUN lines, with a stand-in interpreter answering its `--overrides` call."""
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/usr/bin/env bash\nprintf '%s\\n' algorithm=grpo\n")
    fake_python.chmod(0o755)
    env = dict(os.environ, DRY_RUN="1", PYTHON=str(fake_python), RUNS_ROOT=str(tmp_path), DATA_DIR="/d", **env)
    cmd = ["bash", str(REPO / "recipes/sat_paper/run.sh"), "grpo", "1", "trainer.logger=[console]"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()


def test_run_sh_runs_the_preflight_before_the_launch(tmp_path: Path) -> None:
    preflight_line, launch = run_sh(tmp_path)
    words = preflight_line.split()
    assert words[1:5] == ["-m", "verl_sat.preflight", "grpo", "1"]
    assert f"--run-dir {tmp_path}/grpo-lag1" in preflight_line
    assert "data.train_files=/d/train.parquet" in words and words[-1] == "trainer.logger=[console]"
    assert "-m verl_sat.main" in launch
    assert run_sh(tmp_path, SAT_SKIP_PREFLIGHT="1") == [launch]


def test_module_imports_nothing_heavy() -> None:
    modules = sorted(Path(preflight.__file__).parent.glob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "__main__.py", "facts.py", "checks.py", "probe.py", "cli.py"}
    top: set[str] = set()
    for module in modules:
        tree = ast.parse(module.read_text())
        top |= {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
        top |= {
            node.module.split(".")[0]
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("verl_sat.preflight.")
        }
    assert top <= {
        "__future__",
        "argparse",
        "json",
        "math",
        "os",
        "shutil",
        "sys",
        "collections",
        "dataclasses",
        "pathlib",
        "typing",
        "omegaconf",
    }, top
