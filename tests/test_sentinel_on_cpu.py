"""The collapse sentinel (verl_sat.trainer.sentinel) and its hook on the trainer (SATTrainerMixin)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import transfer_queue
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import OmegaConf
from sat_strategies import PROPERTY, assert_biting_share
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from verl_sat.config_node import config_from_node
from verl_sat.files import hydra_config_dir
from verl_sat.trainer.actor import SATTrainerMixin
from verl_sat.trainer.faults import EXIT_COLLAPSED, checkpoint_steps, collapse_exit, write_tracker
from verl_sat.trainer.recipe import SATRecipeConfig
from verl_sat.trainer.sentinel import (
    CollapseSentinel,
    SentinelConfig,
    robust_center_scale,
    select_rollback_step,
)

REAL_KV_LIST = transfer_queue.kv_list
REWARD, DBAR, Q = "critic/score/mean", "actor/mismatch_abs_mean", "actor/sat_q"
GRAD, ENTROPY = "actor/grad_norm", "actor/entropy"
ON = SentinelConfig(enabled=True)


# ---------------------------------------------------------------------------------------------
# synthetic metric streams
# ---------------------------------------------------------------------------------------------
def stream(
    seed: int,
    steps: int,
    reward_sigma: float = 0.05,
    onset: int | None = None,
    drop: float = 0.0,
    spike: float = 1.0,
    reward: np.ndarray | None = None,
) -> Iterator[tuple[int, dict[str, float]]]:
    """Reward 0.5 + N(0, sigma) (or ``reward``), dbar_pi ~ 0.01 and q ~ 0.02 with 10% noise.

    From ``onset`` on, the reward drops by ``drop`` and dbar_pi and q are multiplied by ``spike``.
    """
    rng = np.random.default_rng(seed)
    for t in range(1, steps + 1):
        base = 0.5 if reward is None else float(reward[t - 1])
        collapsed = onset is not None and t >= onset
        row = {
            REWARD: base + reward_sigma * rng.standard_normal() - (drop if collapsed else 0.0),
            DBAR: 0.01 * (1 + 0.1 * rng.standard_normal()) * (spike if collapsed else 1.0),
            Q: 0.02 * (1 + 0.1 * rng.standard_normal()) * (spike if collapsed else 1.0),
            GRAD: abs(1.0 + 0.2 * rng.standard_normal()),
            ENTROPY: 0.8 + 0.02 * rng.standard_normal(),
        }
        yield t, row


def first_alarm(config: SentinelConfig, rows: Iterator[tuple[int, dict[str, float]]]) -> int | None:
    return watch(config, rows)[0]


def watch(config: SentinelConfig, rows: Iterator[tuple[int, dict[str, float]]]) -> tuple[int | None, int]:
    """(the first alarm's step or None, the longest low-reward run seen before it)."""
    sentinel = CollapseSentinel(config)
    longest = 0
    for t, row in rows:
        event = sentinel.update(t, row)
        longest = max(longest, int(sentinel.last_metrics.get("sentinel/low_run", 0)))
        if event is not None:
            return t, longest
    return None, longest


# ---------------------------------------------------------------------------------------------
# the rule
# ---------------------------------------------------------------------------------------------
def test_robust_scale_is_sigma_for_gaussian_noise():
    values = np.random.default_rng(0).normal(3.0, 0.2, size=20000)
    med, sigma, scale = robust_center_scale(values, rel_floor=0.0)
    assert med == pytest.approx(3.0, abs=0.01) and sigma == pytest.approx(0.2, rel=0.03) and scale == sigma
    assert robust_center_scale([1.0] * 10, rel_floor=0.05)[2] == pytest.approx(0.05)  # MAD 0: the floor


def test_collapse_fires_right_after_patience_with_event_and_metrics():
    sentinel = CollapseSentinel(ON)
    rows = stream(1, 130, onset=100, drop=0.3, spike=3.0)
    events = [(t, sentinel.update(t, row), dict(sentinel.last_metrics), row) for t, row in rows]
    fired = [(t, e) for t, e, _, _ in events if e is not None]
    t, event = fired[0]
    _, _, metrics, row = events[t - 1]
    assert t == 100 + ON.patience - 1 and event.onset_step == 100 and event.action == "log"
    assert metrics["sentinel/mismatch_z"] >= ON.spike_z and row[REWARD] < metrics["sentinel/reward_band_low"]
    assert metrics["sentinel/alarm"] == 1.0 and metrics["sentinel/low_run"] == ON.patience
    for key in ("sentinel/reward_band_low", "sentinel/mismatch_z", "sentinel/grad_norm_z", "sentinel/entropy_z"):
        assert math.isfinite(metrics[key])
    # the cooldown spaces out repeated alarms while the reward stays down
    assert all(b - a > ON.cooldown for (a, _), (b, _) in zip(fired, fired[1:], strict=False))


def test_quiet_metrics_before_warmup_and_between_alarms():
    sentinel = CollapseSentinel(ON)
    rows = list(stream(2, 30))
    sentinel.update(*rows[0])
    assert sentinel.last_metrics == {"sentinel/alarm": 0.0, "sentinel/low_run": 0.0}  # nothing finite yet
    for t, row in rows[1:]:
        sentinel.update(t, row)
    assert sentinel.last_metrics["sentinel/alarm"] == 0.0 and "sentinel/reward_band_low" in sentinel.last_metrics


def test_reward_drop_without_mismatch_spike_needs_the_switch():
    rows = list(stream(3, 160, onset=100, drop=0.3, spike=1.0))
    assert first_alarm(ON, iter(rows)) is None  # the paper's signature needs the mismatch spike
    assert first_alarm(SentinelConfig(enabled=True, require_mismatch_spike=False), iter(rows)) == 102


def test_a_spike_shortly_before_the_drop_counts():
    rows = list(stream(4, 130, onset=100, drop=0.3, spike=1.0))
    for t, row in rows:
        if 94 <= t < 97:  # dbar_pi spikes 3-6 steps before the reward falls, then settles
            row[DBAR] *= 4
    assert first_alarm(ON, iter(rows)) == 102
    assert first_alarm(SentinelConfig(enabled=True, spike_lookback=2), iter(rows)) is None


def test_aux_anomaly_requirement():
    rows = list(stream(5, 130, onset=100, drop=0.3, spike=3.0))
    strict = SentinelConfig(enabled=True, require_aux_anomaly=True)
    assert first_alarm(strict, iter(rows)) is None  # grad norm and entropy stay ordinary
    for t, row in rows:
        if t >= 100:
            row[GRAD] *= 5
    assert first_alarm(strict, iter(rows)) == 102


def test_single_step_outlier_and_missing_values_stay_quiet():
    rows = list(stream(6, 300))
    rows[150][1][REWARD] = -5.0  # one catastrophic step
    rows[150][1][DBAR] = 1.0
    rows[200][1][REWARD] = float("nan")
    del rows[201][1][REWARD]
    rows[202][1][Q] = None  # type: ignore[assignment]
    assert first_alarm(ON, iter(rows)) is None


def test_slow_plateau_stays_quiet():
    t = np.arange(1, 501)
    reward = 0.1 + 0.6 * (1 - np.exp(-t / 80))  # a learning curve rising into a plateau
    assert first_alarm(ON, stream(7, 500, reward_sigma=0.03, reward=reward)) is None


def test_no_false_alarm_on_gaussian_noise():
    """300 steps of gaussian reward noise (and ordinary mismatch) never alarm. Bites where the noise
    itself dips below the band (a low run opens: half of the rule fires, the rest must hold)."""
    dipped = []

    @PROPERTY
    @given(seed=st.integers(0, 2**31 - 1), sigma=st.sampled_from([0.001, 0.01, 0.05, 0.1]))
    def check(seed: int, sigma: float) -> None:
        fired, longest = watch(ON, stream(seed, 300, reward_sigma=sigma))
        assert fired is None
        dipped.append(longest >= 1)

    check()
    assert_biting_share(dipped, "no false alarm on gaussian noise, a noise dip below the band", minimum=0.1)


def test_fires_within_bounded_steps_of_onset():
    """A drop above the band with a mismatch spike alarms between onset + patience - 1 and
    onset + patience + 4. Bites both ways the band is set: by the floor reward_min_drop (small
    sigma) and by k sigma; measured: the floor's share."""
    floor = []

    @PROPERTY
    @given(
        seed=st.integers(0, 2**31 - 1),
        sigma=st.sampled_from([0.001, 0.01, 0.03]),
        onset=st.integers(30, 150),
        drop_in_sigmas=st.floats(8.0, 30.0),
        spike=st.floats(2.0, 10.0),
    )
    def check(seed: int, sigma: float, onset: int, drop_in_sigmas: float, spike: float) -> None:
        # above the floor: the drop exceeds both k * sigma (with room for noise) and reward_min_drop
        drop = max(drop_in_sigmas * sigma, 2 * ON.reward_min_drop)
        fired = first_alarm(ON, stream(seed, onset + 40, reward_sigma=sigma, onset=onset, drop=drop, spike=spike))
        # one noisy step just before the onset may already count toward patience (hypothesis found
        # seed 97, sigma 0.03); false alarms on noise alone are test_no_false_alarm_*'s
        assert fired is not None and onset + ON.patience - 2 <= fired <= onset + ON.patience + 4
        floor.append(ON.reward_k * sigma < ON.reward_min_drop)

    check()
    assert_biting_share(floor, "fires within bounded steps, the band set by the floor", minimum=0.2, maximum=0.8)


def binomial_stream(
    seed: int,
    steps: int,
    p: float,
    samples: int = 64,
    onset: int | None = None,
    p_after: float = 0.0,
    spike: float = 3.0,
) -> Iterator[tuple[int, dict[str, float]]]:
    """Reward = mean of ``samples`` Bernoulli(p) scores (the CPU default's noise), log-normal dbar_pi.

    From ``onset`` on, p becomes ``p_after`` and dbar_pi is multiplied by ``spike``.
    """
    rng = np.random.default_rng(seed)
    for t in range(1, steps + 1):
        collapsed = onset is not None and t >= onset
        yield (
            t,
            {
                REWARD: rng.binomial(samples, p_after if collapsed else p) / samples,
                DBAR: 0.02 * math.exp(0.1 * rng.standard_normal()) * (spike if collapsed else 1.0),
                GRAD: abs(1.0 + 0.2 * rng.standard_normal()),
            },
        )


def test_low_reward_collapse_to_zero_needs_the_relative_cap():
    # 32 samples at p = 0.1 (the quick study's batch): sigma ~0.05, so k sigma > the median and the
    # uncapped band mostly sits below 0, where no reward can fall. A noise dip (P ~ 0.1) may open
    # the low run a step early; there is never an alarm before the onset.
    uncapped = SentinelConfig(enabled=True, reward_max_rel_drop=0.0)
    seeds = range(20)
    fired = [first_alarm(ON, binomial_stream(s, 80, p=0.1, samples=32, onset=50)) for s in seeds]
    missed = [first_alarm(uncapped, binomial_stream(s, 80, p=0.1, samples=32, onset=50)) for s in seeds]
    assert all(f is not None and 50 <= f <= 50 + ON.patience + 4 for f in fired), fired
    assert sum(m is not None for m in missed) <= 3, missed


def test_no_false_alarm_on_binomial_reward_noise():
    """300 steps of binomial reward noise (64 samples) at p 0.3 and 0.6 never alarm: low rewards dip
    below half the median often, and the alarm also needs a mismatch spike. Bites where a dip opens
    a low run."""
    dipped = []

    @PROPERTY
    @given(seed=st.integers(0, 2**31 - 1), p=st.sampled_from([0.3, 0.6]))
    def check(seed: int, p: float) -> None:
        fired, longest = watch(ON, binomial_stream(seed, 300, p=p))
        assert fired is None
        dipped.append(longest >= 1)

    check()
    assert_biting_share(dipped, "no false alarm on binomial noise, a noise dip below the band", minimum=0.2)


@pytest.mark.parametrize(("p", "most"), [(0.03, 0.08), (0.1, 0.02)])
def test_false_alarm_rate_near_zero_reward_is_bounded(p: float, most: float):
    """Near a zero reward the relative cap (a band at most half the median below it) makes a batch
    of all-zero scores "low": at p = 0.03, 0.97^64 = 14% of batches score 0, three in a row with a
    mismatch spike happen, and some 300-step streams alarm. docs/sentinel.md states the rate these
    seeds give; this bounds it (and shows that the alarms do occur, so the docs' caveat stays true)."""
    fired = [watch(ON, binomial_stream(seed, 300, p=p))[0] is not None for seed in range(300)]
    rate = sum(fired) / len(fired)
    assert 0 < rate <= most, rate


def test_band_is_capped_at_a_fraction_of_the_median():
    sentinel = CollapseSentinel(SentinelConfig(enabled=True, warmup=4, window=4))
    for t, r in enumerate([0.0, 0.2, 0.1, 0.1], start=1):  # med 0.1, sigma 0.074: 3 sigma = 0.22 > 0.5 * 0.1
        sentinel.update(t, {REWARD: r})
    assert sentinel.reward_band() == pytest.approx(0.05)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "node,message",
    [
        ({"action": "halt"}, r"sat.sentinel.action must be one of \['log', 'stop', 'rollback'\], got 'halt'"),
        ({"enabled": "yes"}, "sat.sentinel.enabled must be a bool, got 'yes'"),
        ({"window": 1}, "sat.sentinel.window must be an integer >= 2, got 1"),
        ({"window": 10, "warmup": 20}, r"sat.sentinel.warmup must be <= sat.sentinel.window \(10\), got 20"),
        ({"patience": 0}, "sat.sentinel.patience must be an integer >= 1, got 0"),
        ({"patience": 2.5}, "sat.sentinel.patience must be an integer >= 1, got 2.5"),
        ({"reward_k": 0}, "sat.sentinel.reward_k must be a finite number > 0, got 0"),
        ({"spike_z": float("nan")}, "sat.sentinel.spike_z must be a finite number > 0, got nan"),
        ({"reward_min_drop": -0.1}, "sat.sentinel.reward_min_drop must be a finite number >= 0, got -0.1"),
        ({"reward_max_rel_drop": -1}, "sat.sentinel.reward_max_rel_drop must be a finite number >= 0, got -1"),
        ({"mismatch_keys": [""]}, r"sat.sentinel.mismatch_keys must be a list of non-empty strings, got \(''"),
        ({"require_mismatch_spike": 1}, "sat.sentinel.require_mismatch_spike must be a bool, got 1"),
        ({"windw": 5}, "unknown key.*sat.sentinel.windw"),
    ],
)
def test_config_errors_name_key_and_value(node: dict, message: str):
    with pytest.raises(ValueError, match=message):
        SATRecipeConfig.from_node(OmegaConf.create({"sentinel": node}))


def test_sentinel_needs_the_sat_trainer():
    with pytest.raises(ValueError, match="sat.sentinel.enabled=true needs sat.actor=true"):
        SATRecipeConfig.from_node(OmegaConf.create({"actor": False, "sentinel": {"enabled": True}}))
    assert not SATRecipeConfig.from_node(OmegaConf.create({"actor": False})).sentinel.enabled


def test_config_from_hydra_node_and_cpu_yaml_matches_defaults():
    node = OmegaConf.create({"enabled": True, "action": "stop", "mismatch_keys": ["actor/sat_q"], "reward_k": 2})
    config = config_from_node(SentinelConfig, node, "sat.sentinel")
    assert config.enabled and config.action == "stop" and config.mismatch_keys == ("actor/sat_q",)
    assert config_from_node(SentinelConfig, None, "sat.sentinel") == SentinelConfig()
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        cfg = compose(config_name="sat_gspo_cpu")  # sat.sentinel comes from SATRecipeConfig (sat_defaults)
    assert set(cfg.sat.sentinel) == {f.name for f in dataclasses.fields(SentinelConfig)}  # every key composed
    # the CPU default: on, in log mode, windows sized for its 40 steps; every other key at the class default
    cpu = SentinelConfig(enabled=True, action="log", window=20, warmup=6)
    assert SATRecipeConfig.from_node(cfg.sat).sentinel == cpu
    # the YAML itself sets only what differs from the class (stats.cpu_sentinel_config reads it raw)
    yaml = OmegaConf.load(Path(hydra_config_dir()) / "sat_gspo_cpu.yaml")
    assert set(yaml.sat.sentinel) == {"enabled", "window", "warmup"}
    assert config_from_node(SentinelConfig, yaml.sat.sentinel, "sat.sentinel") == cpu


# ---------------------------------------------------------------------------------------------
# rollback target
# ---------------------------------------------------------------------------------------------
def test_rollback_target_is_the_newest_checkpoint_before_the_onset(tmp_path: Path):
    for k in (5, 10, 15, 20):
        (tmp_path / f"global_step_{k}" / "actor").mkdir(parents=True)
    (tmp_path / "global_step_25").mkdir()  # no actor/: incomplete
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    assert checkpoint_steps(tmp_path, with_actor=True) == [5, 10, 15, 20]
    assert checkpoint_steps(tmp_path) == [5, 10, 15, 20, 25]
    assert checkpoint_steps(tmp_path / "missing", with_actor=True) == []
    assert select_rollback_step([5, 10, 15, 20], onset_step=17, margin=2) == 15
    assert select_rollback_step([5, 10, 15, 20], onset_step=16, margin=2) == 10
    assert select_rollback_step([5, 10, 15, 20], onset_step=30, margin=2, poisoned=[(15, 20)]) == 15
    assert select_rollback_step([5, 10], onset_step=6, margin=2) is None


# ---------------------------------------------------------------------------------------------
# the hook on verl's real v1 fit loop (no Ray): verl's PPOTrainer.fit and _save_checkpoint run
# unchanged; only the work of a step (rollout, training, reward) and TransferQueue are stubbed
# ---------------------------------------------------------------------------------------------
class StubWorkerGroup:
    """The actor worker group: checkpoints hold the model's state, here whether it is poisoned."""

    def __init__(self, trainer: StubTrainer) -> None:
        self.trainer = trainer
        self.loaded: list[str] = []

    def save_checkpoint(self, local_path: str, hdfs_path: Any = None, global_step: int = 0, max_ckpt_to_keep=None):
        Path(local_path).mkdir(parents=True, exist_ok=True)
        (Path(local_path) / "model.json").write_text(json.dumps({"poisoned": self.trainer.poisoned}))

    def load_checkpoint(self, local_path: str, hdfs_path: Any = None, del_local_after_load: bool = False):
        assert not del_local_after_load
        self.loaded.append(local_path)
        self.trainer.poisoned = json.loads((Path(local_path) / "model.json").read_text())["poisoned"]


class StubTQ:
    """TransferQueue as verl's trainer calls it in these tests."""

    def kv_clear(self, keys, partition_id):
        return None

    def kv_list(self, partition_id):
        return {partition_id: {}}

    def save_checkpoint(self, path, metadata=None):
        Path(path).mkdir(parents=True, exist_ok=True)


class StubTrainer(PPOTrainer):
    """verl's ``PPOTrainer`` whose step is a metrics row: reward 0.5 + noise, minus 0.3 and with
    dbar_pi x3 while the model is poisoned. ``transient``: the model is poisoned from step
    ``fault`` on, until a checkpoint saved before it is reloaded; persistent: from ``fault`` on,
    whatever the weights (a rollout-side fault)."""

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        if self.global_steps == self.fault:
            self.poisoned = True
        self.lags.append(int(self.parameter_sync_step))
        return KVBatchMeta(partition_id="train", keys=[], tags=[])

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        collapsed = self.poisoned or (not self.transient and global_steps >= self.fault)
        _, row = next(stream(global_steps, 1, onset=1 if collapsed else None, drop=0.3, spike=3.0))
        metrics.update(row)

    def on_step_end(self):
        self.synced.append(self.global_steps)

    def on_sample_end(self):
        return None


class StubSATTrainer(SATTrainerMixin, StubTrainer):
    pass


def run_fit(
    tmp_path: Path, monkeypatch, sentinel: dict, steps: int, fault: int, transient: bool, save_freq: int = 5
) -> StubSATTrainer:
    """verl's fit over ``steps`` global steps of StubSATTrainer (lag 2, separate_async)."""
    from verl.trainer.ppo.v1 import trainer_base

    monkeypatch.setattr(trainer_base, "tq", StubTQ())
    # verl-sat's sample accounting lists what is in flight through the module itself: without this
    # stub, TransferQueue's client would start a whole Ray cluster in this process (and leave it up)
    if transfer_queue.kv_list is REAL_KV_LIST:  # a test may have put its own in place
        monkeypatch.setattr(transfer_queue, "kv_list", StubTQ().kv_list)
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    config = OmegaConf.create(
        {
            "sat": {"sentinel": {"enabled": True, **sentinel}, "run_dir": str(tmp_path)},
            "trainer": {
                "project_name": "p",
                "experiment_name": "e",
                "logger": ["file"],
                "val_before_train": False,
                "total_epochs": 1,
                "save_freq": save_freq,
                "test_freq": -1,
                "default_local_dir": str(tmp_path / "checkpoints"),
                "default_hdfs_dir": None,
                "v1": {"trainer_mode": "sat_separate_async", "separate_async": {"parameter_sync_step": 2}},
            },
            "data": {"train_batch_size": 8},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "checkpoint": {}}},
            "global_profiler": {"steps": None, "profile_continuous_steps": False},
            "skip": {},
        }
    )
    trainer = object.__new__(StubSATTrainer)
    trainer.config, trainer.trainer_mode, trainer.parameter_sync_step = config, "sat_separate_async", 2
    trainer.global_steps, trainer.total_training_steps, trainer.steps_per_epoch = 0, steps, steps
    trainer.use_critic, trainer.poisoned, trainer.transient, trainer.fault = False, False, transient, fault
    trainer.synced, trainer.lags = [], []
    trainer.actor_rollout_wg = StubWorkerGroup(trainer)
    trainer.train_dataloader = mock.Mock(state_dict=lambda: {})
    trainer.checkpoint_callback = mock.Mock()
    trainer._init_dump_executor()
    trainer.fit(agent_loop_manager=None)
    return trainer


def logged(tmp_path: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["data"] for r in rows}


def test_hook_off_by_default_adds_nothing(tmp_path: Path, monkeypatch):
    trainer = run_fit(tmp_path, monkeypatch, {"enabled": False}, steps=80, fault=60, transient=True)
    rows = logged(tmp_path)
    assert sorted(rows) == list(range(1, 81)) and trainer.global_steps == 81
    assert not any(k.startswith("sentinel/") for m in rows.values() for k in m)


def test_hook_log_adds_metrics_every_step_and_keeps_training(tmp_path: Path, monkeypatch):
    run_fit(tmp_path, monkeypatch, {}, steps=80, fault=60, transient=False)
    rows = logged(tmp_path)
    assert sorted(rows) == list(range(1, 81)) and all("sentinel/alarm" in m for m in rows.values())
    alarms = [s for s, m in rows.items() if m["sentinel/alarm"] == 1.0]
    assert alarms[0] == 62 and "sentinel/mismatch_z" in rows[62]
    record = json.loads((tmp_path / "sentinel.json").read_text())
    # log mode, reward still down at the last step: the alarm stands, the run is a collapse
    assert record["verdict"]["collapsed"] and "still stands at the last step 80" in record["verdict"]["why"]
    assert collapse_exit(record)[0] == EXIT_COLLAPSED


def test_hook_stop_ends_verls_loop_after_the_alarm_step_as_a_collapse(tmp_path: Path, monkeypatch, capsys):
    trainer = run_fit(tmp_path, monkeypatch, {"action": "stop"}, steps=120, fault=60, transient=False)
    rows = logged(tmp_path)
    assert max(rows) == 62 and trainer.total_training_steps == 62
    assert rows[62]["sentinel/alarm"] == 1.0 and rows[62]["sentinel/stop"] == 1.0
    assert "stopping after step 62" in capsys.readouterr().out
    status, line = collapse_exit(json.loads((tmp_path / "sentinel.json").read_text()))
    assert status == EXIT_COLLAPSED and "stopped training after step 62" in line


def test_a_stop_records_what_is_still_in_flight(tmp_path: Path, monkeypatch):
    """The sentinel's stop makes its step the last: the sample accounting then records what is
    still in TransferQueue (``in_flight_at_end``), as on a run's planned last step, so run.json
    says how many prompts the stopped run left untrained instead of "unknown"."""
    import transfer_queue

    monkeypatch.setattr(transfer_queue, "kv_list", lambda partition_id: {"train": {"u7_0": {}, "u8_3": {}}})
    run_fit(tmp_path, monkeypatch, {"action": "stop"}, steps=120, fault=60, transient=False)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    (end,) = [r for r in rows if r.get("event") == "in_flight_at_end"]
    assert end["step"] == 62 and end["uids"] == ["u7", "u8"]


def test_rollback_undoes_a_transient_training_fault_and_halves_the_lag(tmp_path: Path, monkeypatch, capsys):
    """A fault in the weights (transient=True) from step 60: the alarm at 62 reloads step 55's
    checkpoint, saved by verl's own _save_checkpoint, in step 63's on_step_end, before the
    weight sync; the lag halves from step 64 on; the reward recovers and the run ends healthy."""
    config = {"action": "rollback"}
    trainer = run_fit(tmp_path, monkeypatch, config, steps=90, fault=60, transient=True)
    rows = logged(tmp_path)
    assert sorted(rows) == list(range(1, 91))  # ran to the end
    assert rows[62]["sentinel/rollback_target"] == 55.0
    assert trainer.actor_rollout_wg.loaded == [str(tmp_path / "checkpoints" / "global_step_55" / "actor")]
    assert rows[63]["sentinel/rollbacks"] == 1.0 and rows[63]["sentinel/rolled_back_to"] == 55.0
    assert trainer.lags[:63] == [2] * 63 and set(trainer.lags[63:]) == {1}  # halved after the rollback
    assert trainer.config.data.train_batch_size == 4 and trainer.parameter_sync_step == 1
    assert sum(m["sentinel/alarm"] for m in rows.values()) == 1.0
    pre = np.mean([rows[s]["critic/score/mean"] for s in range(40, 60)])
    post = np.mean([rows[s]["critic/score/mean"] for s in range(70, 91)])
    assert post > pre - 0.05  # back to the pre-fault level
    record = json.loads((tmp_path / "sentinel.json").read_text())
    (rollback,) = record["rollbacks"]
    assert rollback["step"] == 63 and rollback["target"] == 55 and rollback["alarm_step"] == 62
    assert rollback["setting_changed"] == {"sat.lag": [2, 1], "data.train_batch_size": [8, 4]}
    assert "collapse signature at step 62" in rollback["reason"]
    assert record["verdict"] == {"collapsed": False, "final_step": 90} and collapse_exit(record) == (0, None)
    assert "changed: sat.lag 2 -> 1" in capsys.readouterr().out


def test_rollback_cannot_undo_a_persistent_fault_and_ends_as_a_collapse(tmp_path: Path, monkeypatch):
    """The rollout-side fault persists: two rollbacks, then the next alarm stops the run."""
    trainer = run_fit(tmp_path, monkeypatch, {"action": "rollback"}, steps=120, fault=60, transient=False)
    rows = logged(tmp_path)
    assert len(trainer.actor_rollout_wg.loaded) == 2  # max_rollbacks
    last = max(rows)
    assert rows[last]["sentinel/stop"] == 1.0 and last < 120
    record = json.loads((tmp_path / "sentinel.json").read_text())
    assert [r["target"] for r in record["rollbacks"]] == [55, 55]  # the checkpoint before the onset
    status, line = collapse_exit(record)
    assert status == EXIT_COLLAPSED and "2 rollback(s) already done" in line


def test_rollback_ignores_checkpoints_newer_than_verls_tracker(tmp_path: Path, monkeypatch):
    """A half-written checkpoint (its directory exists, the tracker verl writes last does not
    name it) is never a rollback target."""
    trainer = run_fit(tmp_path, monkeypatch, {"action": "rollback"}, steps=90, fault=60, transient=True, save_freq=0)
    assert trainer.actor_rollout_wg.loaded == []  # no checkpoint at all: stop
    ckpt = tmp_path / "x" / "checkpoints"
    (ckpt / "global_step_58" / "actor").mkdir(parents=True)
    (ckpt / "global_step_50" / "actor").mkdir(parents=True)
    write_tracker(ckpt, 50)
    trainer.config.trainer.default_local_dir = str(ckpt)
    event = trainer._sat_sentinel.events[0]
    assert trainer._sentinel_schedule_rollback(dataclasses.replace(event, onset_step=61), {}) == "rollback"
    assert trainer._sat_rollback_pending["target"] == 50


def test_hook_rollback_without_checkpoint_stops(tmp_path: Path, monkeypatch, capsys):
    run_fit(tmp_path, monkeypatch, {"action": "rollback"}, steps=120, fault=60, transient=False, save_freq=0)
    assert max(logged(tmp_path)) == 62
    assert "no checkpoint" in capsys.readouterr().out
