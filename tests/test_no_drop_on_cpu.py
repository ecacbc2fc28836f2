"""No sample is dropped for its age: the recipes' sampler strategy, run through verl's own replay buffer.

verl 0.9.1's ``ReplayBufferAsync`` (trainer/ppo/v1/replay_buffer.py) evicts, with
``max_off_policy_strategy=drop``, a group whose prompt is older than ``max_off_policy_threshold``
global steps once it has finished generating; ``wait`` holds sampling until such prompts finish.
Here the buffer runs against a stand-in for TransferQueue's tags (a rollout that keeps generating
while the trainer polls, as verl's standalone pool does) with the recipe cell's own schedule.

The same schedule then runs against the real TransferQueue (``transfer_queue``, started as verl's
``main_ppo`` starts it, on a private local Ray cluster). Real there: verl's ``ReplayBufferAsync``
and its sampling loop, and every TransferQueue call (the prompts' and trajectories' ``kv_batch_put``
/ ``kv_put`` with verl's tags and fields, the buffer's ``kv_list`` and ``kv_clear``, the trainer's
``kv_batch_get`` and ``kv_clear``). Simulated: the rollout's and the trainer's time, as ticks of a
clock (the buffer's sleep between two polls is one tick), and the tokens themselves.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
import torch
from omegaconf import DictConfig, open_dict
from tensordict import TensorDict

from verl_sat.paper import grid as recipes
from verl_sat.trainer.actor import EVICTION_COUNTERS, SATTrainerMixin
from verl_sat.trainer.recipe import apply_lag

STALE = "training/off_policy/evicted_samples"


# ---------------------------------------------------------------------------------------------
# the configs
# ---------------------------------------------------------------------------------------------
def test_cpu_default_waits_instead_of_dropping() -> None:
    from hydra import compose, initialize_config_dir

    from verl_sat.files import hydra_config_dir

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
class SimulatedRollout:
    """A rollout clock: each ``tick`` every generating prompt advances one tick; ``finish`` at zero."""

    max_ticks: int
    ticks: int
    remaining: dict[str, int]

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks > self.max_ticks:
            raise RuntimeError(f"no progress after {self.max_ticks} ticks: the sampler waits forever")
        for uid in list(self.remaining):
            self.remaining[uid] -= 1
            if self.remaining[uid] == 0:
                del self.remaining[uid]
                self.finish(uid)

    def finish(self, uid: str) -> None:
        raise NotImplementedError


class FakeTransferQueue(SimulatedRollout):
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

    def finish(self, uid: str) -> None:
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


def buffer_settings(cfg: DictConfig, refill_fn: Callable[[int], Any]) -> dict[str, Any]:
    """verl's ``ReplayBufferAsync`` arguments for the cell's separate_async sampler (no sleep between polls)."""
    v1 = cfg.trainer.v1
    return {
        "trainer_mode": "separate_async",
        "trainer_config": v1.separate_async,
        "max_off_policy_threshold": v1.sampler.max_off_policy_threshold,
        "max_off_policy_strategy": v1.sampler.max_off_policy_strategy,
        "sampler_kwargs": v1.sampler.sampler_kwargs,
        "poll_interval": 0.0,
        "refill_fn": refill_fn,
    }


def lag_cell(lag: int) -> DictConfig:
    """The SAT-GSPO + R3 cell at ``lag`` with the lag's v1 keys derived (``apply_lag``, their one source)."""
    cfg = recipes.compose_cell("sat_gspo_r3", lag)
    apply_lag(cfg, lag)
    return cfg


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
    buffer = replay_buffer.ReplayBufferAsync(**buffer_settings(cfg, lambda k: tq.submit(k, step["g"])))
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
    cfg = lag_cell(lag)
    result = run_schedule(cfg, monkeypatch)
    assert result["evicted"] == 0
    assert result["max_span"] <= cfg.trainer.v1.sampler.max_off_policy_threshold  # staleness still bounded
    # every prompt issued before the last step's was trained on
    assert result["trained"] == result["issued"] - round(cfg.trainer.v1.separate_async.num_warmup_batches * lag * 4)


@pytest.mark.parametrize("lag", recipes.LAGS)
def test_drop_strategy_evicts_the_long_groups(lag: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the same run with verl's default: the simulation does see drops when there are some
    cfg = lag_cell(lag)
    with open_dict(cfg):
        cfg.trainer.v1.sampler.max_off_policy_strategy = "drop"
    assert run_schedule(cfg, monkeypatch)["evicted"] > 0


# ---------------------------------------------------------------------------------------------
# the same schedule against the real TransferQueue
# ---------------------------------------------------------------------------------------------
PARTITION = "train"
REAL_STEPS, REAL_MINI, REAL_LONG_EVERY = 5, 2, 20
REAL_N = 4  # sessions per prompt: the buffer works on groups, the cell's rollout.n=16 only multiplies the puts
PROMPT_LEN = 4


@pytest.fixture(scope="module")
def real_tq() -> Iterator[ModuleType]:
    """TransferQueue as verl's ``main_ppo`` starts it (``tq.init(config.transfer_queue)``), on a private Ray.

    ``address="local"`` never joins another Ray on the machine (whose TransferQueueController this
    would otherwise attach to). The controller and each SimpleStorage unit reserve one logical CPU
    (``@ray.remote(num_cpus=1)``), hence ``num_cpus=2`` and one storage unit instead of the cell's 8.
    """
    import ray
    import transfer_queue as tq

    assert not ray.is_initialized(), "an earlier test left Ray initialised in this process"
    # TQ's client asks for 8 torch threads on every put and warns each time that this machine has fewer
    logging.getLogger("transfer_queue.utils.common").setLevel(logging.ERROR)
    conf = recipes.compose_cell("sat_gspo_r3", recipes.LAGS[0]).transfer_queue
    with open_dict(conf):
        conf.backend.SimpleStorage.num_data_storage_units = 1
    temp_dir = tempfile.mkdtemp(prefix="ray_tq_")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 1024**2,
        log_to_driver=False,
        _temp_dir=temp_dir,
    )
    try:
        tq.init(conf)
        yield tq
    finally:
        tq.close()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def listed(tq: ModuleType) -> dict[str, dict[str, Any]]:
    """The real ``kv_list`` of the train partition: key -> tags."""
    return (tq.kv_list(PARTITION) or {}).get(PARTITION, {})


def prompt_uids(tags: dict[str, dict[str, Any]]) -> set[str]:
    return {key for key, tag in tags.items() if tag.get("is_prompt", False)}


class TQRollout(SimulatedRollout):
    """verl's rollout writing into the real TransferQueue, on a simulated clock (one ``tick`` at a time).

    ``submit`` is ``trainer_base._submit_batch_to_rollout`` (prompt tags ``pending`` and the prompt's
    tensors) followed by ``AgentLoopWorkerTQ._run_prompt`` setting ``running``. A prompt generates for
    1 tick, every ``long_every``-th one for ``long_ticks``; then each of its ``n`` sessions is put as
    ``_agent_loop_postprocess`` puts it (fields and tags), and only then the prompt becomes ``finished``.
    """

    def __init__(self, tq: ModuleType, n: int, long_every: int, long_ticks: int, max_ticks: int = 5_000) -> None:
        self.tq, self.n, self.long_every, self.long_ticks, self.max_ticks = tq, n, long_every, long_ticks, max_ticks
        self.issued: dict[str, int] = {}  # uid -> global_steps it was fetched at
        self.long: set[str] = set()
        self.remaining: dict[str, int] = {}
        self.started: dict[str, int] = {}  # uid -> weights version its generation started with
        self.version = 0  # the weights the rollout holds
        self.ticks = 0

    def submit(self, num: int, global_steps: int) -> None:
        uids = [str(uuid.uuid4()) for _ in range(num)]
        prompts = TensorDict(
            {
                "input_ids": torch.randint(0, 100, (num, PROMPT_LEN)),
                "attention_mask": torch.ones(num, PROMPT_LEN, dtype=torch.int64),
            },
            batch_size=[num],
        )
        tags = [{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids]
        self.tq.kv_batch_put(keys=uids, partition_id=PARTITION, tags=tags, fields=prompts)
        for uid in uids:
            if len(self.issued) % self.long_every == 0:
                self.long.add(uid)
            self.issued[uid], self.started[uid] = global_steps, self.version
            self.remaining[uid] = self.long_ticks if uid in self.long else 1
            self.tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "running"})

    def finish(self, uid: str) -> None:
        from verl.utils.tensordict_utils import list_of_dict_to_tensordict

        for session in range(self.n):
            response_len = 2 + session % 3
            prompt_ids, response_ids = torch.randint(0, 100, (PROMPT_LEN,)), torch.randint(0, 100, (response_len,))
            rm_scores = torch.zeros(response_len)
            rm_scores[-1] = float(session % 2)
            field = {
                "prompts": prompt_ids,
                "responses": response_ids,
                "response_mask": torch.ones(response_len, dtype=torch.int64),
                "input_ids": torch.cat([prompt_ids, response_ids]),
                "rm_scores": rm_scores,
                "uid": uid,
                "session_id": session,
            }
            tag = {
                "status": "success",
                "prompt_len": PROMPT_LEN,
                "response_len": response_len,
                "seq_len": PROMPT_LEN + response_len,
                "global_steps": self.issued[uid],
                "min_global_steps": self.started[uid],
                "max_global_steps": self.version,
            }
            self.tq.kv_batch_put(
                keys=[f"{uid}_{session}_0"],
                fields=list_of_dict_to_tensordict([field]),
                tags=[tag],
                partition_id=PARTITION,
            )
        self.tq.kv_put(key=uid, partition_id=PARTITION, tag={"status": "finished"})


def stepped_replay_buffer(cfg: DictConfig, clock: Callable[[], None], refill_fn: Callable[[int], None]) -> Any:
    """verl's ``ReplayBufferAsync`` with the cell's sampler; the pause between two polls is one ``clock()``."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    class SteppedReplayBufferAsync(ReplayBufferAsync):
        def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
            clock()  # instead of time.sleep(poll_interval) while the rollout generates
            return last_debug_time

    return SteppedReplayBufferAsync(**buffer_settings(cfg, refill_fn))


@dataclass
class TQRun:
    evicted: float
    max_span: int
    trained: Counter[str]  # prompt uid -> times trained
    issued: dict[str, int]  # prompt uid -> global_steps
    long: set[str]
    left: dict[str, dict[str, Any]]  # the real kv_list after the last step (then the partition is emptied)
    scheduled: int  # prompts the schedule itself submits (warm-up and one batch per step), without refills


def check_batch(tq: ModuleType, batch: Any, rollout: TQRollout) -> set[str]:
    """Read the batch back as the trainer does (real ``kv_batch_get``); return its prompt uids."""
    uids = {key.split("_")[0] for key in batch.keys}
    assert len(batch.keys) == len(uids) * rollout.n  # every session of every selected group
    for key, tag in zip(batch.keys, batch.tags, strict=True):  # the tags the rollout wrote, via the real kv_list
        assert tag["global_steps"] == rollout.issued[key.split("_")[0]] and tag["status"] == "success"
    data = tq.kv_batch_get(keys=batch.keys, partition_id=PARTITION, select_fields=["uid", "responses", "rm_scores"])
    assert list(data["uid"]) == [key.split("_")[0] for key in batch.keys]
    assert data["rm_scores"].offsets().diff().tolist() == [tag["response_len"] for tag in batch.tags]
    return uids


def run_schedule_on_tq(cfg: DictConfig, tq: ModuleType, steps: int = REAL_STEPS, mini: int = REAL_MINI) -> TQRun:
    """``run_schedule`` over the real TransferQueue: verl's rollout writes, verl's buffer samples, the trainer clears.

    Simulated: generation time (ticks) and training (2 ticks per mini-batch). Real: every put, list,
    get and clear, and verl's sampling loop. A long prompt generates for 3 global steps of training.
    """
    assert not listed(tq), "the train partition is not empty"
    try:
        return _run_schedule_on_tq(cfg, tq, steps, mini)
    finally:
        left = list(listed(tq))
        if left:
            tq.kv_clear(keys=left, partition_id=PARTITION)
        assert not listed(tq)


def _run_schedule_on_tq(cfg: DictConfig, tq: ModuleType, steps: int, mini: int) -> TQRun:
    v1 = cfg.trainer.v1
    lag = int(v1.separate_async.parameter_sync_step)
    rollout = TQRollout(tq, REAL_N, REAL_LONG_EVERY, long_ticks=3 * lag * 2)
    step = {"g": 1}
    buffer = stepped_replay_buffer(cfg, rollout.tick, lambda k: rollout.submit(k, step["g"]))
    warmup = round(float(v1.separate_async.num_warmup_batches) * lag * mini)
    rollout.submit(warmup, 1)  # on_train_begin
    evicted, spans, trained = 0.0, [], Counter[str]()
    for g in range(1, steps + 1):
        step["g"], rollout.version = g, g - 1  # the rollout holds the weights trained up to step g - 1
        rollout.submit(lag * mini, g)  # prepare_step
        for _ in range(lag):
            batch, metrics = buffer.sample(global_steps=g, partition_id=PARTITION, batch_size=mini)
            evicted += sum(metrics.get(key, 0) for key in EVICTION_COUNTERS)
            uids = check_batch(tq, batch, rollout)
            trained.update(uids)
            spans += [g - rollout.issued[uid] + 1 for uid in uids]
            tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)  # trainer_base: "cleanup transfer queue"
            rollout.tick()
            rollout.tick()
    return TQRun(evicted, max(spans), trained, rollout.issued, rollout.long, listed(tq), warmup + steps * lag * mini)


def dropped_prompts(run: TQRun) -> set[str]:
    """Check no prompt was trained twice and what the real TransferQueue still holds; return the dropped ones."""
    left = prompt_uids(run.left)
    assert max(run.trained.values()) == 1
    assert not left & set(run.trained)  # the buffer cleared the prompts it sampled ...
    assert {key.split("_")[0] for key in run.left} <= left  # ... and the trainer their trajectories
    return set(run.issued) - set(run.trained) - left  # neither trained nor in TransferQueue any more


def issued_before_last_step(run: TQRun, steps: int = REAL_STEPS) -> set[str]:
    return {uid for uid, global_steps in run.issued.items() if global_steps < steps}


@pytest.mark.parametrize("lag", recipes.LAGS)
def test_real_transfer_queue_waits_where_drop_evicts(lag: int, real_tq: ModuleType) -> None:
    cfg = lag_cell(lag)
    threshold = cfg.trainer.v1.sampler.max_off_policy_threshold

    run = run_schedule_on_tq(cfg, real_tq)  # the cell's "wait"
    assert run.evicted == 0
    assert run.max_span <= threshold
    assert not dropped_prompts(run)
    assert len(run.issued) == run.scheduled  # no refill
    assert issued_before_last_step(run) <= set(run.trained)  # each exactly once (dropped_prompts)
    assert run.long & set(run.trained)  # the long groups were waited for and trained

    with open_dict(cfg):
        cfg.trainer.v1.sampler.max_off_policy_strategy = "drop"
    run = run_schedule_on_tq(cfg, real_tq)  # verl's default, same schedule
    dropped = dropped_prompts(run)
    assert run.evicted > 0
    assert len(dropped) == run.evicted  # verl's count is what vanished from the real TransferQueue
    assert dropped <= run.long
    assert len(run.issued) == run.scheduled + run.evicted  # verl refilled each dropped group
    assert run.max_span <= threshold


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
