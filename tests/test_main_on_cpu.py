"""verl_sat.main's config processing, without the trainer: the embedded default fills only what the
user left unset, missing paths fail before Ray starts, and run.json names the method that ran."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from verl_sat import main
from verl_sat.default import assets as default_assets
from verl_sat.default import reward
from verl_sat.files import hydra_config_dir
from verl_sat.paper.report import load_run
from verl_sat.paper.table import normalize_method
from verl_sat.trainer import launch
from verl_sat.trainer.recipe import derive_method, label_method

MODEL, TRAIN, VAL, REWARD = (
    default_assets.MODEL_PATH_KEY,
    default_assets.TRAIN_FILES_KEY,
    default_assets.VAL_FILES_KEY,
    default_assets.REWARD_PATH_KEY,
)
CORRECTION = "algorithm.rollout_correction"
ROLLOUT_MICRO = f"{launch.ROLLOUT_KEY}.log_prob_micro_batch_size_per_gpu"


@pytest.fixture(autouse=True)
def restore_environ():
    """prepare() sets VERL_PLATFORM, VERL_FILE_LOGGER_PATH, ... for the Ray workers it would start."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def assets(tmp_path: Path) -> Path:
    """A stand-in for the built assets (prepare only checks that the files exist)."""
    out = tmp_path / "assets"
    for name in ("model/config.json", "data/train.parquet", "data/val.parquet"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("x")
    return out


@pytest.fixture
def no_build(monkeypatch):
    """Fail the test if prepare() would build the assets (~1 min)."""

    def refuse(path):
        raise AssertionError(f"the assets were built in {path}")

    monkeypatch.setattr(default_assets, "build_assets_once", refuse)


def compose_cfg(*overrides: str, config_name: str = "sat_gspo_cpu") -> DictConfig:
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def cpu_cfg(assets: Path, tmp_path: Path, *overrides: str) -> DictConfig:
    return compose_cfg(f"sat.assets_dir={assets}", f"sat.run_dir={tmp_path / 'run'}", *overrides)


def run_record(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "run.json").read_text())


def user_file(tmp_path: Path, name: str) -> str:
    path = tmp_path / "user" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if "." not in name else path.write_text("x")
    return str(path)


# ---------------------------------------------------------------------------------------------
# the embedded default fills what is unset, and only that
# ---------------------------------------------------------------------------------------------
def test_default_fills_every_unset_key_and_records_it(assets, tmp_path, no_build):
    cfg = cpu_cfg(assets, tmp_path)
    main.prepare(cfg)
    expected = {
        MODEL: str(assets / "model"),
        TRAIN: str(assets / "data/train.parquet"),
        VAL: str(assets / "data/val.parquet"),
        REWARD: reward.__file__,
        **dict.fromkeys(launch.MICRO_BATCH_KEYS, 32),  # one node: a whole mini-batch (8 prompts x 4) a rank
    }
    assert {k: OmegaConf.select(cfg, k) for k in expected} == expected
    assert cfg.reward.custom_reward_function.name == "compute_score"  # the yaml's (and verl's) own
    assert run_record(tmp_path)["filled_by_default"] == expected


def test_cfg_job_prints_what_the_launch_hands_verl_and_builds_nothing(tmp_path, no_build, monkeypatch, capsys):
    """``verl-sat --cfg job``: the composed config changed as ``prepare`` changes it (the lag's keys,
    the embedded default's paths and micro-batches, a passed value kept), with no assets built."""
    assets = tmp_path / "assets"
    argv = ["verl-sat", f"sat.assets_dir={assets}", "sat.lag=4", f"{ROLLOUT_MICRO}=3", "--cfg", "job", "--resolve"]
    monkeypatch.setattr("sys.argv", argv)
    main.main()
    printed = OmegaConf.create(capsys.readouterr().out)
    assert not assets.exists()
    assert OmegaConf.select(printed, MODEL) == str(assets / "model")
    assert OmegaConf.select(printed, TRAIN) == str(assets / "data/train.parquet")
    assert OmegaConf.select(printed, f"{launch.ACTOR_KEY}.ppo_micro_batch_size_per_gpu") == 32
    assert OmegaConf.select(printed, ROLLOUT_MICRO) == 3
    assert printed.trainer.v1.separate_async.parameter_sync_step == 4
    monkeypatch.setattr("sys.argv", [*argv, "--package", "trainer.v1.separate_async"])
    main.main()
    out = capsys.readouterr().out
    assert out.startswith("# @package trainer.v1.separate_async\n")  # as Hydra's own --cfg prints a package
    assert OmegaConf.create(out).parameter_sync_step == 4
    monkeypatch.setattr("sys.argv", [*argv, "--package", "trainer.logger"])  # a list: YAML, as Hydra prints it
    main.main()
    out = capsys.readouterr().out
    assert out.startswith("# @package trainer.logger\n") and list(OmegaConf.create(out)) == list(printed.trainer.logger)


def test_an_unset_reward_name_is_filled_with_the_path(assets, tmp_path, no_build):
    cfg = cpu_cfg(assets, tmp_path, "reward.custom_reward_function.name=null")
    main.prepare(cfg)
    assert run_record(tmp_path)["filled_by_default"][default_assets.REWARD_NAME_KEY] == "compute_score"
    assert cfg.reward.custom_reward_function.name == "compute_score"


@pytest.mark.parametrize(
    "key,name", [(MODEL, "my_model"), (TRAIN, "mine.parquet"), (VAL, "mine_val.parquet"), (REWARD, "my_reward.py")]
)
def test_a_value_the_user_passed_wins(assets, tmp_path, no_build, key, name):
    mine = user_file(tmp_path, name)
    cfg = cpu_cfg(assets, tmp_path, f"{key}={mine}")
    main.prepare(cfg)
    assert OmegaConf.select(cfg, key) == mine
    filled = run_record(tmp_path)["filled_by_default"]
    assert key not in filled and len(set(filled) & {MODEL, TRAIN, VAL, REWARD}) == 3  # the other three still are
    if key == REWARD:
        assert (
            cfg.reward.custom_reward_function.name == "compute_score" and default_assets.REWARD_NAME_KEY not in filled
        )


def test_the_legacy_reward_key_counts_as_set(assets, tmp_path, no_build):
    mine = user_file(tmp_path, "legacy_reward.py")
    cfg = cpu_cfg(assets, tmp_path, f"custom_reward_function.path={mine}", "custom_reward_function.name=score")
    main.prepare(cfg)
    assert cfg.reward.custom_reward_function.path is None  # verl moves the legacy node here itself
    assert REWARD not in run_record(tmp_path)["filled_by_default"]


def test_a_separate_tokenizer_path_is_kept_and_checked(assets, tmp_path, no_build):
    tokenizer = user_file(tmp_path, "tokenizer")
    cfg = cpu_cfg(assets, tmp_path, f"{launch.TOKENIZER_PATH_KEY}={tokenizer}")
    main.prepare(cfg)
    assert cfg.actor_rollout_ref.model.tokenizer_path == tokenizer
    assert launch.TOKENIZER_PATH_KEY not in run_record(tmp_path)["filled_by_default"]
    with pytest.raises(FileNotFoundError, match=rf"{launch.TOKENIZER_PATH_KEY}: /nowhere/tok does not exist"):
        main.prepare(cpu_cfg(assets, tmp_path / "b", f"{launch.TOKENIZER_PATH_KEY}=/nowhere/tok"))


def test_nothing_is_built_when_the_user_set_model_and_data(tmp_path, no_build):
    given = {MODEL: "m", TRAIN: "t.parquet", VAL: "v.parquet"}
    given = {key: user_file(tmp_path, name) for key, name in given.items()}
    cfg = cpu_cfg(tmp_path / "empty_cache", tmp_path, *(f"{k}={v}" for k, v in given.items()))
    main.prepare(cfg)  # no_build: the assets dir is empty, and must stay so
    assert set(run_record(tmp_path)["filled_by_default"]) - set(launch.MICRO_BATCH_KEYS) == {REWARD}


@pytest.mark.parametrize("key", [MODEL, TRAIN, VAL, REWARD])
def test_a_missing_user_path_fails_before_anything_starts(assets, tmp_path, no_build, key):
    missing = f"/nonexistent/{key.replace('.', '_')}.parquet"
    with pytest.raises(FileNotFoundError) as err:
        main.prepare(cpu_cfg(assets, tmp_path, f"{key}={missing}"))
    assert f"{key}: {missing} does not exist" in str(err.value)
    assert not (tmp_path / "run").exists()  # before the run directory, verl and Ray


def test_a_list_of_data_files_is_checked_item_by_item(assets, tmp_path, no_build):
    mine = user_file(tmp_path, "a.parquet")
    cfg = cpu_cfg(assets, tmp_path, f"{TRAIN}=[{mine},/nonexistent/b.parquet]")
    with pytest.raises(FileNotFoundError, match=rf"{TRAIN}: /nonexistent/b.parquet does not exist"):
        main.prepare(cfg)


def test_hub_ids_and_urls_are_not_checked_locally(assets, tmp_path, no_build):
    cfg = cpu_cfg(assets, tmp_path, f"{MODEL}=Qwen/Qwen3-0.6B", f"{VAL}=hdfs://cluster/val.parquet")
    main.prepare(cfg)
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-0.6B" and cfg.data.val_files == "hdfs://cluster/val.parquet"
    with pytest.raises(FileNotFoundError, match=rf"{TRAIN}: Qwen/data does not exist"):  # not for data
        main.prepare(cpu_cfg(assets, tmp_path / "b", f"{TRAIN}=Qwen/data"))


def test_without_the_default_an_unset_key_is_an_error(assets, tmp_path):
    cfg = cpu_cfg(assets, tmp_path, "sat.default_assets=false")
    with pytest.raises(ValueError, match=rf"{MODEL} is not set"):
        main.prepare(cfg)


def test_a_reward_name_the_embedded_reward_lacks_is_an_error(assets, tmp_path, no_build):
    with pytest.raises(ValueError, match=r"reward.custom_reward_function.name='my_score' is not a function"):
        main.prepare(cpu_cfg(assets, tmp_path, "reward.custom_reward_function.name=my_score"))


def test_a_recipes_own_values_are_kept(tmp_path, no_build):
    """--config-name sat_paper with the default switched on: the recipe's model (a Hub id) and the
    data it is given are not replaced by the tiny default's."""
    train, val = user_file(tmp_path, "train.parquet"), user_file(tmp_path, "aime24.parquet")
    cfg = compose_cfg(
        "sat.default_assets=true",
        f"sat.assets_dir={tmp_path / 'empty_cache'}",
        f"sat.run_dir={tmp_path / 'run'}",
        f"{TRAIN}={train}",
        f"{VAL}={val}",
        config_name="sat_paper",
    )
    main.prepare(cfg)
    assert (cfg.actor_rollout_ref.model.path, cfg.data.train_files, cfg.data.val_files) == (
        "Qwen/Qwen3-30B-A3B-Base",
        train,
        val,
    )
    assert not {MODEL, TRAIN, VAL} & set(run_record(tmp_path)["filled_by_default"])


# ---------------------------------------------------------------------------------------------
# the method label
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides,method",
    [
        ((), "sat_gspo"),
        (("sat.routing_replay=R3",), "sat_gspo_r3"),
        (("actor_rollout_ref.actor.policy_loss.loss_mode=gspo",), "gspo"),
        (("actor_rollout_ref.actor.policy_loss.sat_enabled=false",), "gspo"),
        (("algorithm=sat_grpo", "sat.routing_replay=R3"), "sat_grpo_r3"),
        (("algorithm=grpo", f"{CORRECTION}.bypass_mode=false", f"{CORRECTION}.rollout_is=token"), "grpo_tis"),
        (("algorithm=dppo",), "dppo"),
    ],
)  # fmt: skip
def test_run_json_names_the_method_that_ran(assets, tmp_path, no_build, overrides, method):
    cfg = cpu_cfg(assets, tmp_path, *overrides)
    sat, run_dir = main.prepare(cfg)
    record = run_record(tmp_path)
    assert sat.method == record["method"] == record["method_derived"] == cfg.sat.method == method
    assert normalize_method(method) == method  # the report reads it unchanged
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "data": {"critic/score/mean": 0.5}}\n')
    assert load_run(run_dir).method == method


def test_an_explicit_method_wins_and_the_derived_one_is_kept(assets, tmp_path, no_build):
    main.prepare(cpu_cfg(assets, tmp_path, "sat.method=my_ablation", "sat.routing_replay=R3"))
    record = run_record(tmp_path)
    assert (record["method"], record["method_derived"]) == ("my_ablation", "sat_gspo_r3")


def test_sat_paper_names_its_experiment_after_the_derived_method(tmp_path):
    cfg = compose_cfg("algorithm=gspo", "stabilizer=tis_r3", "lag=n8", config_name="sat_paper")
    assert cfg.sat.method is None
    label_method(cfg)
    assert cfg.trainer.experiment_name == "gspo_tis_r3-lag8" and cfg.sat.run_dir == "runs/gspo_tis_r3-lag8"


def loss(mode: str) -> dict:
    return {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": mode}}}}


def correction(**keys) -> dict:
    return {"algorithm": {"rollout_correction": keys}}


MEGATRON_R2 = {"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": {"router_replay": {"mode": "R2"}}}}}


@pytest.mark.parametrize(
    "node,method",
    [
        (loss("vanilla"), "grpo"),
        (loss("sat"), "sat_grpo"),
        (loss("cispo"), "cispo"),
        (correction(bypass_mode=True, rollout_is="token"), "grpo"),  # bypass: verl applies no IS weights
        (correction(rollout_is="sequence"), "grpo_seq_tis"),
        (correction(rollout_is="token", rollout_is_threshold="0.5_5.0"), "grpo_icepop"),
        (correction(rollout_rs="token_k1"), "grpo_rs"),
        (MEGATRON_R2, "grpo_r2"),
        ({**loss("dppo_tv"), "sat": {"routing_replay": "R3"}}, "dppo_r3"),
    ],
)
def test_derive_method_from_verl_keys(node, method):
    assert derive_method(OmegaConf.create(node)) == method
    assert normalize_method(method) == method


PLATFORM_ENV = ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "RAY_DEDUP_LOGS")


@pytest.mark.gpu_branch
def test_a_gpu_cell_sets_none_of_the_cpu_platform_variables(monkeypatch):
    """``launch.set_platform_env`` on a paper cell (``trainer.device`` is verl's ``cuda``): no
    ``VERL_PLATFORM``, so verl's own platform detection runs in the driver and every worker."""
    for name in PLATFORM_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = compose_cfg("algorithm=sat_gspo", "stabilizer=r3", "lag=n8", config_name="sat_paper")
    assert cfg.trainer.device == "cuda"
    launch.set_platform_env(cfg)
    assert [name for name in PLATFORM_ENV if name in os.environ] == []
    launch.set_platform_env(compose_cfg())  # the CPU job, for contrast
    assert os.environ["VERL_PLATFORM"] == "cpu" and os.environ["VERL_ENGINE_DEVICE"] == "cuda"
