"""recipes/sat_paper/smoke_1gpu.sh on CPU: its stages, their overrides, the stage runner, the probe.

The smoke itself needs a GPU with verl's megatron and sglang extras; here the script runs with
DRY_RUN=1 (it prints its stages' commands), and each printed ``verl_sat.main`` command is composed
on verl 0.9.1's packaged configs, mapped by ``verl_sat.main.prepare`` and checked against what
verl's separate_async trainer and dataclasses require. The stage logic (PASS/FAIL, JSON summary,
stop at the first failure with its last lines) runs for real with stand-in commands, and the
environment probe's mode choice and its fallback are driven with faked probe results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes/sat_paper"))  # the smoke's scripts, run by path
import gpu_env  # noqa: E402
import smoke  # noqa: E402
import stages  # noqa: E402

SCRIPT = REPO / "recipes/sat_paper/smoke_1gpu.sh"
STAGES = ["env", "no_offload", "offload", "resume", "check"]
OFFLOAD_OFF = "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=false"


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

    from verl_sat.files import hydra_config_dir

    task = [o for o in overrides if not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        return hydra_compose(config_name="sat_paper", overrides=task)


@pytest.fixture(scope="module")
def commands(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    tmp = tmp_path_factory.mktemp("smoke")
    return tmp, dry_run(tmp, "trainer.logger=[console,file]")


def test_stages_in_order(commands: tuple[Path, list[list[str]]]) -> None:
    tmp, lines = commands
    assert len(lines) == len(STAGES)
    env, no_offload, offload, resume, check = lines
    # env: the probe, for the bridge verl imports (vanilla_mbridge=false: Megatron-Bridge)
    assert env[1].endswith("recipes/sat_paper/gpu_env.py")
    assert env[env.index("--gpu") + 1] == "0" and env[env.index("--bridge") + 1] == "megatron.bridge"
    assert env[env.index("--slots-file") + 1] == str(tmp / "run" / "gpu_slots.sh")
    # no_offload: its own run directory, one global step, optimizer on the GPU, no checkpoint
    a, b, c = main_overrides(no_offload), main_overrides(offload), main_overrides(resume)
    assert OFFLOAD_OFF in a and OFFLOAD_OFF not in b + c
    assert f"sat.run_dir={tmp / 'run' / 'no_offload'}" in a and "trainer.total_training_steps=1" in a
    assert "trainer.save_freq=-1" in a
    # offload, then resume: the same run directory, steps 2 then 3
    assert "trainer.total_training_steps=2" in b and "trainer.total_training_steps=3" in c
    assert [o for o in b if "total_training_steps" not in o] == [o for o in c if "total_training_steps" not in o]
    assert f"sat.run_dir={tmp / 'run'}" in b
    assert a[-1] == b[-1] == c[-1] == "trainer.logger=[console,file]"  # the user's overrides reach all
    assert check[1:3] == [str(REPO / "recipes/sat_paper/smoke.py"), "check"]
    assert check[check.index("--run-dir") + 1] == str(tmp / "run")


@pytest.mark.parametrize("invocation", [1, 2, 3])
def test_overrides_compose_and_validate(
    commands: tuple[Path, list[list[str]]], invocation: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.workers.config import McoreActorConfig, RolloutConfig

    from verl_sat import SATPolicyLossConfig
    from verl_sat.main import prepare
    from verl_sat.trainer import launch

    monkeypatch.setattr(launch, "check_paths", lambda cfg: None)  # the dry run does not build the assets
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "restored after the test")  # prepare sets it
    tmp, lines = commands
    cfg = compose(main_overrides(lines[invocation]))
    prepare(cfg)
    arr, v1 = cfg.actor_rollout_ref, cfg.trainer.v1
    run = tmp / "run" / "no_offload" if invocation == 1 else tmp / "run"
    # SGLang + Megatron, SAT-GSPO + R3 (packed sequences), separate_async at lag 2
    assert arr.rollout.name == "sglang" and arr.actor.strategy == "megatron"
    assert arr.actor.policy_loss.loss_mode == "sat_gspo" and v1.trainer_mode == "sat_separate_async"
    assert arr.actor.megatron.router_replay.mode == "R3" and arr.rollout.enable_rollout_routing_replay
    assert arr.model.use_remove_padding and arr.actor.megatron.use_remove_padding
    assert cfg.algorithm.rollout_correction.bypass_mode and arr.rollout.calculate_log_probs
    assert cfg.sat.lag == 2 and v1.separate_async.parameter_sync_step == 2
    assert v1.sampler.max_off_policy_strategy == "wait"
    # the first launch keeps the optimizer on the GPU, the others offload it as the recipe does
    assert arr.actor.optim.override_optimizer_config.optimizer_cpu_offload is (invocation != 1)
    # PPOTrainerSeparateAsync.__init__'s assertions
    assert cfg.data.train_batch_size == 2 * arr.actor.ppo_mini_batch_size
    assert arr.rollout.nnodes > 0 and arr.rollout.n_gpus_per_node > 0
    assert arr.rollout.checkpoint_engine.backend == "ray_object_store" and not arr.hybrid_engine
    # one GPU, two Ray slots: trainer + standalone rollout
    slots = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes + arr.rollout.n_gpus_per_node * arr.rollout.nnodes
    assert cfg.ray_kwargs.ray_init.num_gpus == slots == 2
    # a checkpoint every step in the offload run, resumed by the second invocation
    assert cfg.trainer.resume_mode == "auto"
    assert cfg.trainer.total_training_steps == [1, 2, 3][invocation - 1]
    assert cfg.trainer.save_freq == (-1 if invocation == 1 else 1)
    assert cfg.trainer.default_local_dir == str(run / "checkpoints")
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH == str(run / "metrics.jsonl")
    # one whole sequence fits a micro-batch; the model's context holds it (SGLang caps max_model_len there)
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert arr.actor.ppo_max_token_len_per_gpu >= sequence
    assert smoke.SMOKE_MODEL_KWARGS["max_position_embeddings"] >= sequence + 1
    assert arr.model.path == str(tmp / "assets" / "model")
    assert cfg.reward.custom_reward_function.path == str(REPO / "verl_sat/default/reward.py")
    # verl's dataclasses and validation accept it
    actor = omega_conf_to_dataclass(OmegaConf.create(OmegaConf.to_container(arr.actor, resolve=True)))
    assert isinstance(actor, McoreActorConfig) and isinstance(actor.policy_loss, SATPolicyLossConfig)
    assert isinstance(omega_conf_to_dataclass(arr.rollout), RolloutConfig)
    validate_config(cfg, use_reference_policy=True, use_critic=False)


@pytest.mark.gpu_branch
def test_the_slots_compose_into_the_runtime_env(
    commands: tuple[Path, list[list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launches carry the slot mode's overrides, and verl-sat's prepare keeps them beside its
    own runtime-env entry: what ray.init receives in the smoke."""
    from verl_sat.main import prepare
    from verl_sat.trainer import launch

    monkeypatch.setattr(launch, "check_paths", lambda cfg: None)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "restored after the test")
    _, lines = commands
    overrides = main_overrides(lines[2])
    assert [o for o in overrides if o.startswith("+ray_kwargs")] == gpu_env.slot_overrides("runtime_env", "0")
    cfg = compose(overrides)
    prepare(cfg)
    env_vars = cfg.ray_kwargs.ray_init.runtime_env.env_vars
    # a string, as Ray's runtime env needs it; verl-sat's own entry is merged in beside it
    assert env_vars.CUDA_VISIBLE_DEVICES == "0" and "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES" not in env_vars
    assert env_vars.VERL_FILE_LOGGER_PATH.endswith("metrics.jsonl") and cfg.ray_kwargs.ray_init.num_gpus == 2


# ---------------------------------------------------------------------------------------------
# the stage runner and the environment probe
# ---------------------------------------------------------------------------------------------
def run_stage_cli(summary: Path, name: str, *command: str, timeout: float = 0) -> subprocess.CompletedProcess:
    runner = REPO / "recipes/sat_paper/stages.py"  # by path, as the script runs it
    cli = [sys.executable, str(runner), "--summary", str(summary), "--name", name, "--tail", "3"]
    cli += ["--timeout", str(timeout), "--", *command]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120)


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan this container's init has not reaped yet)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def test_a_stage_past_its_timeout_fails_and_ends_its_process_group(tmp_path: Path) -> None:
    """A hung stage (here a child that sleeps) is ended after --timeout with the whole group, says
    so on its FAIL line, exits 124 and is recorded with its timeout."""
    summary, pid_file = tmp_path / "smoke_summary.json", tmp_path / "sleeper.pid"
    hung = f"echo started; sleep 60 & echo $! > {pid_file}; wait"
    out = run_stage_cli(summary, "offload", "bash", "-c", hung, timeout=2)
    assert out.returncode == stages.TIMED_OUT == 124, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    (fail,) = [line for line in lines if line.startswith("[smoke] FAIL offload")]
    assert fail.startswith("[smoke] FAIL offload (timeout after 2 s)")
    assert "[smoke]   | started" in lines
    report = json.loads(summary.read_text())
    assert (report["ok"], report["failed"]) == (False, "offload")
    (stage,) = report["stages"]
    assert (stage["status"], stage["returncode"], stage["timeout"]) == ("FAIL", 124, 2.0)
    assert not running(int(pid_file.read_text()))  # the grandchild went with its group
    # a stage within its limit passes and records no timeout
    ok = run_stage_cli(summary, "check", "bash", "-c", "echo fine", timeout=30)
    assert ok.returncode == 0 and json.loads(summary.read_text())["stages"][1]["timeout"] is None


def test_every_stage_of_the_script_has_a_timeout() -> None:
    text = SCRIPT.read_text()
    for name in [*STAGES, "assets"]:
        assert f"TIMEOUT_{name.upper()}=${{TIMEOUT_{name.upper()}:-" in text, name
    assert '--timeout "${!limit_var}"' in text


def test_stage_runner_passes_fails_and_keeps_a_summary(tmp_path: Path) -> None:
    summary = tmp_path / "smoke_summary.json"
    ok = run_stage_cli(summary, "first", "bash", "-c", "echo hello")
    assert ok.returncode == 0 and "hello" in ok.stdout
    assert [line for line in ok.stdout.splitlines() if line.startswith("[smoke] PASS")] != []
    failing = "for i in 1 2 3 4 5; do echo line $i; done; exit 3"
    bad = run_stage_cli(summary, "second", "bash", "-c", failing)
    assert bad.returncode == 3
    out = bad.stdout.splitlines()
    (fail,) = [line for line in out if line.startswith("[smoke] FAIL second")]
    assert "exit 3" in fail and "the last 3 lines" in fail
    assert out[out.index(fail) + 1 :][:3] == ["[smoke]   | line 3", "[smoke]   | line 4", "[smoke]   | line 5"]
    report = json.loads(summary.read_text())
    assert (report["ok"], report["failed"]) == (False, "second")
    assert [(s["name"], s["status"], s["returncode"]) for s in report["stages"]] == [
        ("first", "PASS", 0),
        ("second", "FAIL", 3),
    ]
    assert report["stages"][1]["tail"] == ["line 3", "line 4", "line 5"]
    assert (tmp_path / "stages" / "second.log").read_text().count("line") == 5
    missing = run_stage_cli(summary, "third", str(tmp_path / "no-such-command"))
    assert missing.returncode == 127 and json.loads(summary.read_text())["failed"] == "second"


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python: the stage runner runs for real, the probe picks the fallback mode, the
# first verl_sat.main launch passes and the offload launch fails.
case "$1" in
    *stages.py) exec "{python}" "$@" ;;
    *gpu_env.py)
        while [[ $# -gt 0 ]]; do [[ $1 == --slots-file ]] && slots=$2; shift; done
        "{python}" -c "import sys; sys.path.insert(0, '{repo}/recipes/sat_paper'); import gpu_env; \
open('$slots', 'w').write(gpu_env.slots_file('runtime_env', '0'))"
        echo "probe ok" ;;
    -m)
        echo "CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES:-}} $*" >> "{calls}"
        if [[ " $* " != *optimizer_cpu_offload=false* ]]; then
            for i in $(seq 1 50); do echo "training line $i"; done
            echo "RuntimeError: offload broke"; exit 3
        fi
        echo "one step done" ;;
esac
"""


def test_the_script_stops_at_the_first_failing_stage(tmp_path: Path) -> None:
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable, repo=REPO, calls=calls))
    fake.chmod(0o755)
    (tmp_path / "assets" / "model").mkdir(parents=True)
    (tmp_path / "assets" / "model" / "config.json").write_text("{}")  # built: no assets stage
    run = tmp_path / "run"
    env = dict(os.environ, PYTHON=str(fake), RUN_DIR=str(run), ASSETS_DIR=str(tmp_path / "assets"))
    env["CUDA_VISIBLE_DEVICES"] = "5"  # the user's: the smoke's driver must not pass it on
    env.pop("DRY_RUN", None)
    out = subprocess.run(["bash", str(SCRIPT), "trainer.logger=[console]"], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    verdicts = [line.split()[1:3] for line in out.stdout.splitlines() if line.split()[1:2] in (["PASS"], ["FAIL"])]
    assert verdicts == [["PASS", "env"], ["PASS", "no_offload"], ["FAIL", "offload"]]
    assert "[smoke]   | RuntimeError: offload broke" in out.stdout
    report = json.loads((run / "smoke_summary.json").read_text())
    assert report["failed"] == "offload" and [s["name"] for s in report["stages"]] == STAGES[:3]
    assert report["stages"][2]["tail"][-1] == "RuntimeError: offload broke"
    # the launches used the mode the probe chose: the driver without CUDA_VISIBLE_DEVICES, the
    # workers given GPU 0 by the runtime env
    launches = calls.read_text().splitlines()
    assert len(launches) == 2 and all(line.startswith("CUDA_VISIBLE_DEVICES= ") for line in launches)
    assert all("+ray_kwargs.ray_init.runtime_env.env_vars.CUDA_VISIBLE_DEVICES='0'" in line for line in launches)


def test_probe_reports_the_mode_and_each_import() -> None:
    imports_ok = lambda module: {"ok": True, "version": "1"}  # noqa: E731
    passing = lambda mode, gpu: {"ok": True}  # noqa: E731
    failing = lambda mode, gpu: {"ok": False, "error": "no"}  # noqa: E731
    assert gpu_env.SLOT_MODES == ("runtime_env",)
    report = gpu_env.run_probe("0", "megatron.bridge", imports_ok, passing)
    assert (report["ok"], report["mode"]) == (True, "runtime_env")
    report = gpu_env.run_probe("0", "megatron.bridge", imports_ok, failing)
    assert (report["ok"], report["mode"]) == (False, None)
    no_bridge = lambda module: {"ok": module != "megatron.bridge", "error": "ModuleNotFoundError"}  # noqa: E731
    report = gpu_env.run_probe("0", "megatron.bridge", no_bridge, passing)
    assert report["ok"] is False and report["imports"]["megatron.bridge"]["ok"] is False
    assert set(report["imports"]) == {"sglang", "megatron-core", "TransformerEngine", "megatron.bridge"}
    with pytest.raises(ValueError, match="slot mode must be one of \\['runtime_env'\\], got 'repeat'"):
        gpu_env.slot_overrides("repeat", "0")


def test_slots_file_is_bash_the_script_can_source(tmp_path: Path) -> None:
    path = tmp_path / "gpu_slots.sh"
    path.write_text(gpu_env.slots_file("runtime_env", "1"))
    script = f'source {path}; echo "$SLOT_MODE"; printf "%s\\n" "${{SLOT_OVERRIDES[@]}}"'
    lines = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[0] == "runtime_env" and lines[1:] == gpu_env.slot_overrides("runtime_env", "1")
    assert lines[1:] == [
        "+ray_kwargs.ray_init.num_gpus=2",
        "+ray_kwargs.ray_init.runtime_env.env_vars.CUDA_VISIBLE_DEVICES='1'",
    ]


@pytest.mark.gpu_branch
@pytest.mark.parametrize("gpu", ["0", "3"])
def test_the_slot_mode_passes_torchs_parser_in_every_ray_worker(gpu: str) -> None:
    """The probe as the env stage runs it (a child process, the driver's CUDA_VISIBLE_DEVICES
    removed), with a real ``ray.init(num_gpus=2, runtime_env=...)``: both GPU-slot actors and the
    actor without a GPU see ``CUDA_VISIBLE_DEVICES=<gpu>`` and torch's parser makes ``[<gpu>]`` of
    it; Ray reports the slot's GPU id as that GPU. Only the allocation on cuda:0 is left to a GPU
    node (here torch finds no device, so the report as a whole fails)."""
    report = gpu_env.probe_mode("runtime_env", gpu)
    assert report["ray"]["ok"] is True, gpu_env.describe(report)
    slots = report["ray"]["slots"]
    assert [s["role"] for s in slots] == ["gpu slot", "gpu slot", "no-gpu actor"]
    assert all(s["cuda_visible_devices"] == gpu and s["torch_parse"] == [int(gpu)] for s in slots)
    assert [s["ray_gpu_ids"] for s in slots] == [[gpu], [gpu], []]
    assert report["torch"]["cuda_visible_devices"] is None  # the driver's environment: unset
    assert report["torch"]["device_count"] == 0 and report["ok"] is False  # no CUDA on this node


RAY_INIT_WITH_VISIBLE = """
import os, ray
os.environ["CUDA_VISIBLE_DEVICES"] = "0"
try:
    ray.init(num_gpus=2, num_cpus=1, include_dashboard=False)
except ValueError as err:
    print("ValueError:", err)
else:
    print("started")
    ray.shutdown()
"""


@pytest.mark.gpu_branch
def test_the_dropped_slot_modes_fail_in_torch_and_ray() -> None:
    """Why ``repeat`` and the driver-side ``CUDA_VISIBLE_DEVICES=G`` were dropped, with the real
    libraries: torch parses ``0,0`` as no device, and ``ray.init(num_gpus=2)`` refuses to start
    beside ``CUDA_VISIBLE_DEVICES=0``."""
    parse = "import torch; print(torch.cuda._parse_visible_devices())"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,0")
    repeated = subprocess.run([sys.executable, "-c", parse], env=env, capture_output=True, text=True, check=True)
    assert repeated.stdout.strip() == "[]"
    env["CUDA_VISIBLE_DEVICES"] = "0"
    single = subprocess.run([sys.executable, "-c", parse], env=env, capture_output=True, text=True, check=True)
    assert single.stdout.strip() == "[0]"
    out = subprocess.run([sys.executable, "-c", RAY_INIT_WITH_VISIBLE], capture_output=True, text=True, timeout=180)
    assert "Attempting to start raylet with 2 GPU, but CUDA_VISIBLE_DEVICES contains ['0']" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


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


def test_check_passes_a_resumed_run_and_names_each_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    adam = {"global_step_2": 4, "global_step_3": 6}  # two optimizer steps per global step, kept across the resume
    monkeypatch.setattr(smoke, "adam_step", lambda actor_dir: adam[Path(actor_dir).parent.name])
    write_run(tmp_path / "ok", [good_row(1), good_row(2)], [good_row(3)], latest=3)
    assert smoke.check(tmp_path / "ok", lag=2, steps=2, resumed_steps=1) == []
    evicting = good_row(3) | {"training/off_policy/evicted_samples": 1.0}
    write_run(tmp_path / "bad", [good_row(1), good_row(2)], [good_row(1), evicting], latest=2)
    failures = smoke.check(tmp_path / "bad", lag=2, steps=2, resumed_steps=1)
    assert any("expected [3] (a resume)" in f for f in failures)
    assert any("latest_checkpointed_iteration.txt" in f for f in failures)
    assert any("groups evicted" in f and "off_policy" in f for f in failures)


def test_check_names_a_resume_that_restarted_adam(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's own load of the offloaded optimizer resumes Adam at step 1 (docs/faults.md):
    step 3's checkpoint then holds 1 + 2, not 4 + 2."""
    write_run(tmp_path, [good_row(1), good_row(2)], [good_row(3)], latest=3)
    adam = {"global_step_2": 4, "global_step_3": 3}
    monkeypatch.setattr(smoke, "adam_step", lambda actor_dir: adam[Path(actor_dir).parent.name])
    assert smoke.check(tmp_path, lag=2, steps=2, resumed_steps=1) == [
        "resume: Adam step 3 after resume (global_step_3), expected 6: saved 4 at global_step_2, 2 per global step"
    ]
    monkeypatch.undo()  # the real reader: no optimizer files in this run directory
    (failure,) = smoke.check(tmp_path, lag=2, steps=2, resumed_steps=1)
    assert failure.startswith("resume: cannot read Adam's step:") and "global_step_2" in failure


def test_check_prints_the_named_line_and_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``smoke.py check``'s command line, as the script's check stage runs it (in this process)."""
    write_run(tmp_path, [good_row(1), good_row(2)], [good_row(3)], latest=3)
    adam = {"global_step_2": 4, "global_step_3": 1}
    monkeypatch.setattr(smoke, "adam_step", lambda actor_dir: adam[Path(actor_dir).parent.name])
    argv = ["smoke.py", "check", "--run-dir", str(tmp_path), "--lag", "2", "--steps", "2", "--resumed-steps", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit, match="1"):
        smoke.main()
    assert capsys.readouterr().out.splitlines() == [
        "[verl-sat] smoke: FAIL resume: Adam step 1 after resume (global_step_3), expected 6: "
        "saved 4 at global_step_2, 2 per global step"
    ]
