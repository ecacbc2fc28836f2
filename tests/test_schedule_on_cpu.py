"""sat.lag onto verl's v1 keys, the sat: node, per-sample staleness, and the main job's plumbing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import actor_config, random_batch
from omegaconf import OmegaConf

from verl_sat.files import read_metrics
from verl_sat.trainer.actor import finish_staleness_breakdown, staleness_breakdown, staleness_in_steps
from verl_sat.trainer.launch import make_run_dir
from verl_sat.trainer.progress import progress_line, summary
from verl_sat.trainer.recipe import SATRecipeConfig, apply_actor, apply_lag


def v1_config(mode: str = "separate_async", mini: int = 8) -> OmegaConf:
    return OmegaConf.create(
        {
            "data": {"train_batch_size": 999},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": mini}, "rollout": {"calculate_log_probs": False}},
            "trainer": {
                "experiment_name": "x",
                "logger": ["console"],
                "default_local_dir": "checkpoints/p/x",
                "v1": {
                    "trainer_mode": mode,
                    "separate_async": {"parameter_sync_step": 4, "num_warmup_batches": 1},
                    "sampler": {"max_off_policy_threshold": 8},
                },
            },
            "sat": {"run_dir": None},
        }
    )


@pytest.mark.parametrize("lag", [1, 2, 8])
def test_lag_maps_onto_separate_async(lag):
    cfg = v1_config()
    apply_lag(cfg, lag)
    assert cfg.trainer.v1.separate_async.parameter_sync_step == lag
    assert cfg.data.train_batch_size == lag * 8
    assert cfg.trainer.v1.separate_async.num_warmup_batches == pytest.approx(1 / lag)
    assert cfg.trainer.v1.sampler.max_off_policy_threshold == 2


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "sat_sync"])
def test_lag_above_one_needs_separate_async(mode):
    cfg = v1_config(mode)
    cfg.actor_rollout_ref.rollout.checkpoint_engine = {"backend": "ray_object_store"}
    apply_lag(cfg, 1)  # fine: these modes broadcast every step
    # the rollout is colocated: no standalone nodes, weights move in process
    assert cfg.actor_rollout_ref.hybrid_engine is True and cfg.actor_rollout_ref.rollout.nnodes == 0
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"
    with pytest.raises(ValueError, match=rf"sat.lag=8 needs trainer.v1.trainer_mode=separate_async.*{mode}"):
        apply_lag(cfg, 8)


def test_actor_selects_sat_trainer_mode_and_rollout_log_probs():
    cfg = v1_config()
    apply_actor(cfg, True)
    assert cfg.trainer.v1.trainer_mode == "sat_separate_async"
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    apply_actor(cfg, True)  # idempotent
    assert cfg.trainer.v1.trainer_mode == "sat_separate_async"


@pytest.mark.parametrize(
    "node,message",
    [
        ({"lag": 0}, "sat.lag must be an integer >= 1 or .auto., got 0"),
        ({"lag": "2"}, "sat.lag must be an integer >= 1 or .auto., got .2."),
        ({"lag": True}, "sat.lag must be an integer >= 1 or .auto., got True"),
        ({"routing_replay": "R4"}, "sat.routing_replay must be one of .* got 'R4'"),
        ({"lagg": 2}, "unknown key.*sat.lagg"),
    ],
)
def test_sat_node_validation_names_key_and_value(node, message):
    with pytest.raises(ValueError, match=message):
        SATRecipeConfig.from_node(OmegaConf.create(node))


def test_staleness_in_steps():
    # lag 4, trainer at global step 3 (starts from version 2), third mini-batch of the cycle
    versions = np.array([2, 2, 1, 1])
    s = staleness_in_steps(global_step=3, min_global_steps=versions, steps_per_sync=4, local_step=2)
    # trained after (3-1)*4 + 2 = 10 steps; generated after v*4 steps
    assert s.tolist() == [2, 2, 6, 6]
    # sync mode: one mini-batch a step, fresh weights -> staleness 0
    assert staleness_in_steps(5, np.array([4, 4, 4]), 1, 0).tolist() == [0, 0, 0]


def test_staleness_breakdown_partitions_the_tokens():
    b = random_batch(0, 6, 10, scale=0.3)
    b["response_mask"][:, 0] = 1  # every sample has an active token
    staleness = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0])
    for mode in ("sat", "sat_gspo"):
        cfg = actor_config(mode)
        m = staleness_breakdown(staleness, b["log_prob"], b["old_log_prob"], b["response_mask"], cfg)
        assert m["actor/staleness_max"] == 2.0 and m["actor/staleness_mean"] == pytest.approx(1.0)
        finish_staleness_breakdown(m)
        fracs = [m[f"actor/sat_by_staleness/{s}/token_frac"] for s in (0, 1, 2)]
        assert sum(fracs) == pytest.approx(1.0)
        assert not any(k.endswith(("/tokens", "/gated", "/abs_d")) for k in m)  # sums replaced by rates
        # the per-staleness gate rates average back to the micro-batch's gate rate (<= 1 - alpha)
        overall = sum(f * m[f"actor/sat_by_staleness/{s}/gate_rate"] for s, f in zip((0, 1, 2), fracs, strict=True))
        assert overall <= 0.1 + 1e-6


def test_staleness_breakdown_is_exact_over_micro_batches_of_different_staleness():
    """Micro-batches with different staleness sets: same keys (verl's DP gather), exact step rates."""
    cfg = actor_config("sat")
    parts = [(random_batch(1, 4, 8, scale=0.3), torch.tensor([0.0, 0.0, 0.0, 1.0])),
             (random_batch(2, 4, 8, scale=0.3), torch.tensor([3.0, 3.0, 1.0, 40.0]))]  # fmt: skip
    outs = []
    for b, staleness in parts:
        b["response_mask"][:, 0] = 1
        outs.append(staleness_breakdown(staleness, b["log_prob"], b["old_log_prob"], b["response_mask"], cfg))
    assert outs[0].keys() == outs[1].keys()  # fixed buckets: every rank and micro-batch reports every key
    # verl: SUM metrics add up over micro-batches; then mean over 2 DP ranks (here: both ranks alike)
    step = {k: (outs[0][k] + outs[1][k]) / 2 for k in outs[0] if k.startswith("actor/sat_by_staleness/")}
    finish_staleness_breakdown(step)
    assert sum(v for k, v in step.items() if k.endswith("/token_frac")) == pytest.approx(1.0)
    assert {k.split("/")[2] for k in step} == {"0", "1", "3", "32"}  # 40 lands in the last bucket (>= 32)
    # exact token-weighted mismatch at staleness 1: one sample from each micro-batch
    d1 = [
        (b["log_prob"] - b["old_log_prob"]).abs()[i][b["response_mask"][i].bool()]
        for (b, _), i in zip(parts, (3, 2), strict=True)
    ]
    expected = torch.cat(d1).mean().item()
    assert step["actor/sat_by_staleness/1/mismatch_abs_mean"] == pytest.approx(expected, rel=1e-6)


def test_run_dir_refuses_to_overwrite_a_run(tmp_path):
    cfg = v1_config()
    sat = SATRecipeConfig(run_dir=str(tmp_path / "run"))
    run_dir = make_run_dir(cfg, sat)
    assert cfg.trainer.logger == ["console", "file"]
    assert cfg.trainer.default_local_dir == str(run_dir / "checkpoints")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n')
    with pytest.raises(FileExistsError, match="already holds a run"):
        make_run_dir(v1_config(), sat)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1, "data": {}}\n'  # nothing lost
    # a step directory without verl's tracker is not a checkpoint verl resumes from: still refused
    step_dir = run_dir / "checkpoints" / "global_step_1"
    (step_dir / "actor").mkdir(parents=True)
    (step_dir / "actor" / "model.pt").write_bytes(b"weights")
    (step_dir / "data.pt").write_bytes(b"dataloader")
    cfg = v1_config()
    cfg.trainer.resume_mode = "auto"
    with pytest.raises(FileExistsError, match="no checkpoint to resume from"):
        make_run_dir(cfg, sat)
    # with a complete, tracked checkpoint, the earlier lines stay (verl's logger, which opens the file
    # with "wb", writes them back: accounting.keep_metrics_on_resume)
    (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("1")
    (step_dir / "transfer_queue").mkdir()
    cfg = v1_config()
    cfg.trainer.resume_mode = "auto"
    make_run_dir(cfg, sat)
    assert [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "data": {}}
    ]


def test_progress_and_summary_read_verls_file_logger(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": s, "data": {"critic/score/mean": 0.1 * s, "actor/sat_gate_rate": 0.05, "timing_s/step": 2.0}}
        for s in range(1, 5)
    ]
    rows[-1]["data"]["training/sat/staleness_steps/max"] = 2
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    flat = read_metrics(path)
    assert flat[0] == {"step": 1, **rows[0]["data"]}
    line = progress_line(flat[-1])
    assert "step    4" in line and "reward 0.400" in line and "gate 0.050" in line and "staleness<= 2" in line
    text = summary(flat, 10.0)
    assert "4 steps" in text and "0.100 -> last-quarter 0.400" in text and "max staleness 2" in text


def test_concurrent_jobs_build_the_default_assets_once(tmp_path, monkeypatch):
    """Two jobs starting on an empty cache (the study's --jobs 2): one builds, the other waits."""
    import threading
    import time

    from verl_sat.default import assets as default_assets
    from verl_sat.default import warmup

    calls = []

    def fake_build(out):  # writes the files a real build writes, slowly
        calls.append(Path(out))
        time.sleep(0.3)
        for name in ("model/config.json", "data/train.parquet", "data/val.parquet"):
            (Path(out) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(out) / name).write_text("x")
        return {"sampled_accuracy": 0.0}

    monkeypatch.setattr(warmup, "build", fake_build)
    assets = tmp_path / "cache" / "tiny_moe_v5"
    threads = [threading.Thread(target=default_assets.build_assets_once, args=(assets,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and calls[0] != assets  # built once, in a temporary directory
    assert default_assets.assets_complete(assets) and not list(assets.parent.glob(".tiny_moe_v5.building-*"))
    # an incomplete directory the user pointed at is completed in place, not replaced
    partial = tmp_path / "mine"
    (partial / "model").mkdir(parents=True)
    (partial / "notes.txt").write_text("keep me")
    default_assets.build_assets_once(partial)
    assert calls[-1] == partial and (partial / "notes.txt").read_text() == "keep me"


def test_breakdown_sums_are_reduced_alike_by_verls_step_aggregator():
    """verl's v1 MetricsAggregator picks a reduction by metric name ("sum" keys are summed over a
    step's iterations, others averaged): the three sums must get the same one, or their ratios
    break (an "abs_d_sum" name once made mismatch_abs_mean 8x too large at lag 8)."""
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    aggregator = MetricsAggregator()
    b = random_batch(3, 4, 8, scale=0.3)
    b["response_mask"][:, 0] = 1
    keys = staleness_breakdown(
        torch.zeros(4), b["log_prob"], b["old_log_prob"], b["response_mask"], actor_config("sat")
    )
    kinds = {aggregator._get_aggregation_type(k) for k in keys if k.startswith("actor/sat_by_staleness/")}
    assert len(kinds) == 1, kinds
    # end to end through the aggregator: 8 iterations, one staleness each, as at lag 8
    for s in range(8):
        staleness = torch.full((4,), float(s))
        m = staleness_breakdown(staleness, b["log_prob"], b["old_log_prob"], b["response_mask"], actor_config("sat"))
        aggregator.add_step_metrics(m, sample_count=4)
    step = aggregator.get_aggregated_metrics()
    finish_staleness_breakdown(step)
    expected = (b["log_prob"] - b["old_log_prob"]).abs()[b["response_mask"].bool()].mean().item()
    for s in range(8):
        assert step[f"actor/sat_by_staleness/{s}/mismatch_abs_mean"] == pytest.approx(expected, rel=1e-6)
        assert step[f"actor/sat_by_staleness/{s}/token_frac"] == pytest.approx(1 / 8)


def _scope_cfg(scope: str, loss_mode: str = "sat_gspo", **actor: object):
    from omegaconf import OmegaConf

    node = {"loss_mode": loss_mode, "sat_quantile_scope": scope, "sat_alpha": 0.9}
    base = {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 2, "ppo_max_token_len_per_gpu": 35000}
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"actor": {**base, **actor, "policy_loss": node}},
            "data": {"max_prompt_length": 2048, "max_response_length": 32768},
        }
    )


def test_gate_starvation_warning_names_the_keys_only_where_the_gate_can_starve():
    from verl_sat.trainer.recipe import gate_starvation_warning

    warning = gate_starvation_warning(_scope_cfg("micro_batch"))
    assert "ppo_micro_batch_size_per_gpu=2" in warning and "sat_quantile_scope=step" in warning
    dynamic = gate_starvation_warning(_scope_cfg("micro_batch", use_dynamic_bsz=True))
    assert "ppo_max_token_len_per_gpu=35000 holds ~1 longest responses" in dynamic  # the paper's packing
    assert gate_starvation_warning(_scope_cfg("step")) is None
    assert gate_starvation_warning(_scope_cfg("micro_batch", ppo_micro_batch_size_per_gpu=32)) is None
    assert gate_starvation_warning(_scope_cfg("micro_batch", loss_mode="sat")) is None


def test_gate_starvation_warning_reads_a_null_micro_batch_as_the_one_the_launch_fills():
    # the CPU default leaves ppo_micro_batch_size_per_gpu null; the launch fills a rank's share of a mini-batch
    from omegaconf import OmegaConf

    from verl_sat.trainer.recipe import gate_starvation_warning

    def cfg(nnodes: int):
        node = _scope_cfg("micro_batch", ppo_micro_batch_size_per_gpu=None, ppo_mini_batch_size=8)
        return OmegaConf.merge(
            node, {"actor_rollout_ref": {"rollout": {"n": 4}}, "trainer": {"nnodes": nnodes, "n_gpus_per_node": 1}}
        )

    assert gate_starvation_warning(cfg(1)) is None  # 32 responses a micro-batch: 32 x 0.1 >= 1
    warning = gate_starvation_warning(cfg(16))  # 2 responses a rank
    assert warning is not None and "ppo_micro_batch_size_per_gpu=2" in warning


def test_file_logger_path_reaches_ray_through_runtime_env(tmp_path, monkeypatch):
    # on a pre-started Ray cluster, workers do not inherit the driver's environment
    from verl_sat.main import prepare
    from verl_sat.paper import grid as recipes
    from verl_sat.trainer import launch

    monkeypatch.setattr(launch, "check_paths", lambda cfg: None)  # the paper's data is not on this machine
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "unset after the test")  # prepare sets it
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    cfg = recipes.compose_cell(
        "sat_gspo_r3",
        8,
        [
            f"sat.run_dir={tmp_path / 'run'}",
            "+ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG=INFO",
            "ray_kwargs.ray_init.runtime_env.py_executable=/opt/py",
        ],
    )
    prepare(cfg)
    runtime_env = cfg.ray_kwargs.ray_init.runtime_env
    assert runtime_env.env_vars.VERL_FILE_LOGGER_PATH == str(tmp_path / "run" / "metrics.jsonl")
    assert runtime_env.env_vars.NCCL_DEBUG == "INFO" and runtime_env.py_executable == "/opt/py"  # kept


def test_runtime_env_keeps_a_users_file_logger_path(monkeypatch):
    from verl_sat.trainer.launch import pass_env_to_ray

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", "/run/metrics.jsonl")
    monkeypatch.delenv("VERL_SAT_RUN_DIR", raising=False)  # set by any make_run_dir earlier in the process
    for name in ("VERL_PLATFORM", "VERL_ENGINE_DEVICE", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "RAY_DEDUP_LOGS"):
        monkeypatch.delenv(name, raising=False)  # set_platform_env (any prepare earlier in the process)
    cfg = OmegaConf.create({"ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {"VERL_FILE_LOGGER_PATH": "/u"}}}}})
    pass_env_to_ray(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars == {"VERL_FILE_LOGGER_PATH": "/u"}
    cfg = OmegaConf.create({})
    pass_env_to_ray(cfg)
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars == {"VERL_FILE_LOGGER_PATH": "/run/metrics.jsonl"}


@pytest.mark.parametrize(
    "node,message",
    [
        ({"verbose": "yes"}, "sat.verbose must be true or false, got 'yes'"),
        ({"default_assets": 1}, "sat.default_assets must be true or false, got 1"),
        ({"method": ""}, "sat.method must be a non-empty name or null"),
    ],
)
def test_recipe_flags_are_validated(node, message):
    with pytest.raises(ValueError, match=message):
        SATRecipeConfig.from_node(OmegaConf.create(node))
    assert SATRecipeConfig.from_node(OmegaConf.create({"verbose": True})).verbose is True


@pytest.mark.parametrize("config_name", ["sat_gspo_cpu", "sat_paper"])
def test_every_sat_key_overrides_without_a_plus(config_name):
    """The sat: node is composed from SATRecipeConfig's defaults (ConfigStore ``sat_defaults``), so a
    key the YAML leaves out is overridden without ``+``; the YAML's own values stay as they were."""
    from hydra import compose, initialize_config_dir

    from verl_sat.files import hydra_config_dir
    from verl_sat.sat.config import SAT_FIELDS

    overrides = [
        "sat.sentinel.window=30",
        "sat.faults.lr_spike_factor=5",
        "sat.faults.lr_spike_steps=[3]",
        "sat.auto_lag.target=0.01",
        "actor_rollout_ref.actor.policy_loss.sat_alpha=0.8",
    ]
    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)
        plain = compose(config_name=config_name)
    assert cfg.sat.sentinel.window == 30 and cfg.sat.faults.lr_spike_factor == 5
    sat = SATRecipeConfig.from_node(OmegaConf.to_container(cfg.sat, resolve=False))
    assert (sat.sentinel.window, sat.faults.lr_spike_factor, sat.faults.lr_spike_steps) == (30, 5.0, (3,))
    assert sat.auto_lag.target == 0.01 and cfg.actor_rollout_ref.actor.policy_loss.sat_alpha == 0.8
    # every dataclass key is there, at the class default unless the YAML sets it
    assert set(plain.sat) == set(SATRecipeConfig.__dataclass_fields__)
    assert set(SAT_FIELDS) <= set(plain.actor_rollout_ref.actor.policy_loss)
    default = SATRecipeConfig.from_node(OmegaConf.to_container(plain.sat, resolve=False))
    if config_name == "sat_gspo_cpu":
        assert (default.lag, default.default_assets, default.auto_lag.target) == (2, True, 0.05)
        assert (default.sentinel.enabled, default.sentinel.window, default.sentinel.warmup) == (True, 20, 6)
    else:
        assert (default.lag, default.routing_replay, default.sentinel.enabled) == (1, "R3", False)
        assert default.auto_lag == SATRecipeConfig().auto_lag and default.faults == SATRecipeConfig().faults
