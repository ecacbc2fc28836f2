"""No sample is dropped for its age: the recipes' sampler strategy, run through verl's own replay buffer.

verl 0.9.1's ``ReplayBufferAsync`` (trainer/ppo/v1/replay_buffer.py) evicts, with
``max_off_policy_strategy=drop``, a group whose prompt is older than ``max_off_policy_threshold``
global steps once it has finished generating; ``wait`` holds sampling until such prompts finish.
Here the buffer runs against a stand-in for TransferQueue's tags (a rollout that keeps generating
while the trainer polls, as verl's standalone pool does) with the recipe cell's own schedule.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from omegaconf import DictConfig, open_dict

from verl_sat import recipes
from verl_sat.actor import EVICTION_COUNTERS, SATTrainerMixin
from verl_sat.schedule import apply_lag

STALE = "training/off_policy/evicted_samples"


# ---------------------------------------------------------------------------------------------
# the configs
# ---------------------------------------------------------------------------------------------
def test_cpu_default_waits_instead_of_dropping() -> None:
    from hydra import compose, initialize_config_dir

    from verl_sat.paths import hydra_config_dir

    with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
        cfg = compose(config_name="sat_gspo_cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "wait": apply_lag has nothing to warn about
        apply_lag(cfg, int(cfg.sat.lag))
    assert cfg.trainer.v1.sampler.max_off_policy_strategy == "wait"
    assert cfg.trainer.v1.sampler.max_off_policy_threshold == 2


def test_explicit_drop_is_kept_and_warned_about() -> None:
    cfg = recipes.compose_cell("sat_gspo_r3", 8, ["trainer.v1.sampler.max_off_policy_strategy=drop"])
    with pytest.warns(UserWarning, match=r"trainer\.v1\.sampler\.max_off_policy_strategy=drop"):
        apply_lag(cfg, 8)
    assert cfg.trainer.v1.sampler.max_off_policy_strategy == "drop"


# ---------------------------------------------------------------------------------------------
# verl's replay buffer under the cell's schedule
# ---------------------------------------------------------------------------------------------
class FakeTransferQueue:
    """TransferQueue's tags as verl's rollout leaves them; every ``kv_list`` (one poll) is a tick.

    A prompt generates for 1 tick, every ``long_every``-th one for ``long_ticks`` (the long
    responses); then it is "finished" and its ``n`` trajectories are listed.
    """

    def __init__(self, n: int, long_every: int, long_ticks: int, max_ticks: int = 20_000) -> None:
        self.n, self.long_every, self.long_ticks, self.max_ticks = n, long_every, long_ticks, max_ticks
        self.tags: dict[str, dict[str, Any]] = {}
        self.remaining: dict[str, int] = {}
        self.issued: dict[str, int] = {}
        self.ticks = 0

    def submit(self, num: int, global_steps: int) -> None:
        for _ in range(num):
            uid = f"p{len(self.issued)}"
            long = len(self.issued) % self.long_every == 0
            self.issued[uid] = global_steps
            self.remaining[uid] = self.long_ticks if long else 1
            self.tags[uid] = {"is_prompt": True, "status": "running", "global_steps": global_steps}

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks > self.max_ticks:
            raise RuntimeError(f"no progress after {self.max_ticks} ticks: the sampler waits forever")
        for uid in list(self.remaining):
            self.remaining[uid] -= 1
            if self.remaining[uid] == 0:
                del self.remaining[uid]
                self.tags[uid]["status"] = "finished"
                for session in range(self.n):
                    self.tags[f"{uid}_{session}_0"] = {"min_global_steps": self.issued[uid] - 1}

    def kv_list(self) -> dict[str, dict[str, dict[str, Any]]]:
        self.tick()
        return {"train": {key: dict(tag) for key, tag in self.tags.items()}}

    def kv_clear(self, partition_id: str, keys: list[str]) -> None:
        uids = {key.split("_")[0] for key in keys}
        for key in [k for k in self.tags if k.split("_")[0] in uids]:
            del self.tags[key]
        for uid in uids:
            self.remaining.pop(uid, None)


def run_schedule(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch, steps: int = 8, mini: int = 4) -> dict[str, Any]:
    """verl's separate_async sampling loop (trainer_base.step / _step_once) over ``steps`` global steps.

    The cell's lag, warm-up and sampler settings, with ``mini`` prompts per optimizer step instead
    of 256. Training one mini-batch takes 2 ticks; one prompt in 20 generates for as long as 6 global
    steps of training take.
    """
    from verl.trainer.ppo.v1 import replay_buffer

    v1 = cfg.trainer.v1
    lag = int(v1.separate_async.parameter_sync_step)
    tq = FakeTransferQueue(n=int(cfg.actor_rollout_ref.rollout.n), long_every=20, long_ticks=6 * lag * 2)
    monkeypatch.setattr(replay_buffer.tq, "kv_list", tq.kv_list)
    monkeypatch.setattr(replay_buffer.tq, "kv_clear", tq.kv_clear)
    step = {"g": 1}
    buffer = replay_buffer.ReplayBufferAsync(
        trainer_mode="separate_async",
        trainer_config=v1.separate_async,
        max_off_policy_threshold=v1.sampler.max_off_policy_threshold,
        max_off_policy_strategy=v1.sampler.max_off_policy_strategy,
        sampler_kwargs=v1.sampler.sampler_kwargs,
        poll_interval=0.0,
        refill_fn=lambda k: tq.submit(k, step["g"]),
    )
    tq.submit(round(float(v1.separate_async.num_warmup_batches) * lag * mini), 1)  # on_train_begin
    evicted, spans, trained = 0.0, [], 0
    for g in range(1, steps + 1):
        step["g"] = g
        tq.submit(lag * mini, g)  # prepare_step: one global step's prompts
        for _ in range(lag):  # one mini-batch per optimizer step
            batch, metrics = buffer.sample(global_steps=g, partition_id="train", batch_size=mini)
            evicted += sum(metrics.get(key, 0) for key in EVICTION_COUNTERS)
            uids = {key.split("_")[0] for key in batch.keys}
            spans += [g - tq.issued[uid] + 1 for uid in uids]
            trained += len(uids)
            tq.kv_clear("train", list(uids))  # the trainer clears what it trained on
            tq.tick()
            tq.tick()
    return {"evicted": evicted, "max_span": max(spans), "trained": trained, "issued": len(tq.issued)}


@pytest.mark.parametrize("lag", recipes.LAGS)
def test_recipe_cell_drops_nothing_in_verls_replay_buffer(lag: int, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = recipes.compose_cell("sat_gspo_r3", lag)
    result = run_schedule(cfg, monkeypatch)
    assert result["evicted"] == 0
    assert result["max_span"] <= cfg.trainer.v1.sampler.max_off_policy_threshold  # staleness still bounded
    # every prompt issued before the last step's was trained on
    assert result["trained"] == result["issued"] - round(cfg.trainer.v1.separate_async.num_warmup_batches * lag * 4)


@pytest.mark.parametrize("lag", recipes.LAGS)
def test_drop_strategy_evicts_the_long_groups(lag: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same run with verl's default: the simulation does see drops when there are some
    cfg = recipes.compose_cell("sat_gspo_r3", lag)
    with open_dict(cfg):
        cfg.trainer.v1.sampler.max_off_policy_strategy = "drop"
    assert run_schedule(cfg, monkeypatch)["evicted"] > 0


# ---------------------------------------------------------------------------------------------
# the counters in every step's metrics
# ---------------------------------------------------------------------------------------------
class FakeVerlTrainer:
    def __init__(self, step_metrics: dict[str, float]) -> None:
        self.config = DictConfig({"sat": {"sentinel": {"enabled": False}}})
        self.step_metrics = step_metrics

    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        metrics.update(self.step_metrics)


class FakeSATTrainer(SATTrainerMixin, FakeVerlTrainer):
    pass


def test_eviction_counters_are_in_every_step() -> None:
    metrics: dict[str, float] = {}
    FakeSATTrainer({"critic/score/mean": 0.5})._compute_metrics(None, metrics, {}, global_steps=1, epoch=0)
    assert {key: metrics[key] for key in EVICTION_COUNTERS} == dict.fromkeys(EVICTION_COUNTERS, 0.0)
    assert STALE in EVICTION_COUNTERS and metrics["critic/score/mean"] == 0.5
    metrics = {}
    FakeSATTrainer({STALE: 3.0})._compute_metrics(None, metrics, {}, global_steps=1, epoch=0)
    assert metrics[STALE] == 3.0  # verl's count is kept


def test_eviction_counters_are_the_ones_verl_sums() -> None:
    # verl's step aggregator sums exactly these keys over a step's mini-batches (v1/utils.py)
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    summed = MetricsAggregator().aggregation_rules["sum"]
    assert set(EVICTION_COUNTERS) == {key for key in summed if key.startswith("training/")}
