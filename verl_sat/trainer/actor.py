"""AsyncSATActor: SAT's wiring into verl's v1 trainer and engine workers (docs/sat.md#which-log-probs).

What verl gives and what it lacks:

- The ratio's denominator must be the rollout log-prob mu (docs/sat.md#which-log-probs). verl's
  ``algorithm.rollout_correction.bypass_mode=true`` writes ``old_log_probs := rollout_log_probs``
  on the driver, and the v1 trainer keeps ``policy_loss.loss_mode`` as configured. So the
  registered SAT losses see mu through ``old_log_prob``, and ``verl_sat.main`` turns bypass on.
- Per-sample staleness never reaches a loss. verl's ``ppo_loss`` selects only response_mask,
  old_log_probs and advantages. The generating weight version of a trajectory lives in
  TransferQueue *tags* (``min_global_steps`` / ``max_global_steps``), which the worker never
  receives.

So verl-sat adds three small pieces, all through public seams:

1. ``SATTrainerMixin`` (on the trainer): before each actor update it writes a per-sample field
   ``sat_staleness`` into TransferQueue. The field holds optimizer steps between the weights
   that generated the sample and the weights being trained (``staleness_in_steps``). It is
   registered as ``trainer.v1.trainer_mode=sat_<mode>`` (``sat_sync``, ``sat_colocate_async``,
   ``sat_separate_async``). Each one behaves exactly as verl's ``<mode>``. Each step's metrics
   also carry verl's replay-buffer eviction counters, 0 when nothing was evicted
   (``fill_eviction_counters``).
2. ``AsyncSATActor`` (on the actor worker, ``sat.actor_class``): before verl's ``init_model`` it
   selects the engine mixins the actor needs (``verl_sat.trainer.engines``: the step's q, routing
   replay); after it, replaces the installed loss function with ``sat_ppo_loss``.
3. ``sat_ppo_loss``: calls verl's own ``ppo_loss`` with the sample staleness published through
   ``current_staleness()``, then adds the SAT diagnostics broken down by staleness:
   ``actor/sat_by_staleness/<s>/{token_frac, gate_rate, mismatch_abs_mean}``, and
   ``actor/staleness_{mean,max}``. The loss emits token sums for a fixed set of staleness
   buckets (the same keys in every micro-batch, which verl's data-parallel metric gather
   requires); the trainer turns them into exact token-weighted rates for the whole step
   (``finish_staleness_breakdown``); plus ``actor/sat_old_vs_rollout_logprob_gap``, the largest
   |old_log_prob - rollout_log_prob| over active tokens (0: the ratio is against mu, docs/sat.md#which-log-probs).

The Megatron engine uses the same worker classes (``ActorRolloutRefWorker`` /
``DetachActorWorker``) and the same ``ppo_loss`` seam, so this code path is engine-agnostic; it
runs on verl's Megatron engine on CPU (``tests/test_megatron_e2e.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import torch

from verl_sat.trainer.accounting import SampleAccountingMixin
from verl_sat.trainer.auto_lag import BY_STALENESS, AutoLagTrainerMixin
from verl_sat.trainer.engines import check_engine, enable_step_q, engine_mixins, register_engine
from verl_sat.trainer.faults import FaultMixin, scale_lr
from verl_sat.trainer.heldout import HeldoutTrainerMixin, score_worker_model
from verl_sat.trainer.sentinel import SentinelTrainerMixin

STALENESS_FIELD = "sat_staleness"
STALENESS_BUCKETS = 33  # per-staleness metrics for s = 0..31; bucket 32 holds s >= 32
# per bucket, summed over micro-batches. No "sum", "total", "max", "min" or "mean" in the names:
# verl's v1 MetricsAggregator picks its reduction over a step's iterations by name (a "sum" key is
# summed, the others averaged), and the three must be reduced alike for their ratios to hold.
SUM_FIELDS = ("tokens", "gated", "abs_d")
MODE_PREFIX = "sat_"
BASE_MODES = ("sync", "colocate_async", "separate_async")
# verl's replay-buffer eviction counters of the training partition (trainer/ppo/v1/replay_buffer.py;
# they count prompt groups, despite the name). verl adds each to a step's metrics only when it is
# nonzero; SATTrainerMixin writes 0 otherwise, so metrics.jsonl shows that nothing was dropped.
EVICTION_COUNTERS = (
    "training/off_policy/evicted_samples",  # older than max_off_policy_threshold (strategy "drop")
    "training/rollout_failure/evicted_samples",  # a session of the group failed
    "training/filter_groups/evicted_samples",  # DAPO group filter (algorithm.filter_groups)
    "training/filter_groups/discarded_surplus_samples",  # DAPO filter, sync mode's surplus
)

_STALENESS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("sat_staleness", default=None)


def current_staleness() -> torch.Tensor | None:
    """Per-sample staleness (B,) of the micro-batch whose loss is being computed, if known."""
    return _STALENESS.get()


@contextlib.contextmanager
def staleness_context(staleness: torch.Tensor | None) -> Iterator[None]:
    token = _STALENESS.set(staleness)
    try:
        yield
    finally:
        _STALENESS.reset(token)


# ---------------------------------------------------------------------------------------------
# staleness: trainer version - generating version, in optimizer steps
# ---------------------------------------------------------------------------------------------
def staleness_in_steps(
    global_step: int, min_global_steps: np.ndarray, steps_per_sync: int, local_step: int
) -> np.ndarray:
    """Optimizer steps between the generating weights and the weights each sample is trained on.

    verl counts weight versions in global steps: the rollout's version v means the weights after
    v global steps, and the trainer at global step g (1-based) starts from version g - 1. One
    global step holds ``steps_per_sync`` optimizer steps (``parameter_sync_step``; 1 in sync and
    colocate modes), one per mini-batch; ``local_step`` is the mini-batch's index in that cycle
    (verl's ``local_trigger_step``). So a sample of this mini-batch is trained after
    (g - 1) * steps_per_sync + local_step optimizer steps, and it was generated by the weights
    after v * steps_per_sync:

        staleness = (g - 1 - v) * steps_per_sync + local_step

    The oldest version a partial rollout touched is used (``min_global_steps``): the worst case.
    """
    return (global_step - 1 - np.asarray(min_global_steps)) * steps_per_sync + local_step


# ---------------------------------------------------------------------------------------------
# the installed loss
# ---------------------------------------------------------------------------------------------
def staleness_breakdown(
    staleness: torch.Tensor,
    log_prob: torch.Tensor,
    mu_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any,
    gate: torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-staleness token sums of one micro-batch (docs/sat.md#diagnostics, ours), for every bucket s:

    tokens_s = #{active tokens whose sample has staleness s}
    gated_s  = #{those tokens with q > 0, |d| > q}           (q from the whole micro-batch)
    abs_d_s  = sum over those tokens of |log pi - log mu|

    plus ``actor/staleness_mean`` and ``actor/staleness_max``. ``gate`` is the SAT loss's own
    (``LossContext``); without it (SAT off, or another loss) the gate SAT would apply is
    computed here. ``finish_staleness_breakdown`` turns the step's sums into rates.
    """
    from verl_sat.sat.config import sat_settings
    from verl_sat.sat.rule import sat_factors, staleness_score

    mask = response_mask.bool()
    if int(mask.sum()) == 0:
        return {}
    d = (log_prob.detach() - mu_log_prob).clamp(-20, 20)
    if gate is None or gate.shape != d.shape:
        sat = sat_settings(config.policy_loss)
        level = "sequence" if config.policy_loss.get("loss_mode", "vanilla") in ("gspo", "sat_gspo") else "token"
        score = staleness_score(level, log_prob, mu_log_prob, response_mask)  # SAT's d (docs/sat.md#sequence-level)
        gate = sat_factors(score, mask, sat.sat_alpha, sat.sat_kernel, sat.sat_kernel_exponent).gate
    bucket = staleness.to(d.device).round().long().clamp(0, STALENESS_BUCKETS - 1).reshape(-1, 1).expand_as(d)
    b = bucket[mask]
    sums = {
        "tokens": torch.bincount(b, minlength=STALENESS_BUCKETS),
        "gated": torch.bincount(bucket[mask & gate.to(d.device)], minlength=STALENESS_BUCKETS),
        "abs_d": torch.bincount(b, weights=d.abs()[mask].double(), minlength=STALENESS_BUCKETS),
    }
    metrics = {
        "actor/staleness_mean": float(staleness.float().mean()),
        "actor/staleness_max": float(staleness.max()),
    }
    for field_name, counts in sums.items():
        for s, value in enumerate(counts.tolist()):
            metrics[f"{BY_STALENESS}/{s}/{field_name}"] = float(value)
    return metrics


def breakdown_aggregation(key: str) -> Any:
    """How verl aggregates a breakdown metric over micro-batches: sums, max, or mean."""
    from verl.utils.metric import AggregationType

    if key.startswith(BY_STALENESS) and key.rsplit("/", 1)[-1] in SUM_FIELDS:
        return AggregationType.SUM
    return AggregationType.MAX if key.endswith("_max") else AggregationType.MEAN


def finish_staleness_breakdown(metrics: dict[str, Any]) -> None:
    """Replace the step's per-bucket sums by rates, in place, for the buckets that hold tokens.

    token_frac_s        = tokens_s / sum_s' tokens_s'
    gate_rate_s         = gated_s / tokens_s
    mismatch_abs_mean_s = abs_d_s / tokens_s

    verl reduces these sums alike over data-parallel ranks (mean), micro-batches (sum) and a
    step's mini-batches or iterations (mean, or a sample-weighted mean), which scales every
    bucket by the same factor: the ratios are exact token-weighted rates over the whole step.
    """
    sums: dict[int, dict[str, float]] = {}
    for key in [k for k in metrics if k.startswith(BY_STALENESS + "/")]:
        _, s, field_name = key.rsplit("/", 2)
        if field_name in SUM_FIELDS and s.isdigit():
            sums.setdefault(int(s), {})[field_name] = float(metrics.pop(key))
    total = sum(v.get("tokens", 0.0) for v in sums.values())
    for s, v in sorted(sums.items()):
        tokens = v.get("tokens", 0.0)
        if tokens <= 0 or total <= 0:
            continue
        prefix = f"{BY_STALENESS}/{s}"
        metrics[f"{prefix}/token_frac"] = tokens / total
        metrics[f"{prefix}/gate_rate"] = v.get("gated", 0.0) / tokens
        metrics[f"{prefix}/mismatch_abs_mean"] = v.get("abs_d", 0.0) / tokens


def fill_eviction_counters(metrics: dict[str, Any]) -> None:
    """Write 0 for each of verl's eviction counters (``EVICTION_COUNTERS``) absent from a step's metrics."""
    for key in EVICTION_COUNTERS:
        metrics.setdefault(key, 0.0)


def sat_ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict]:
    """verl's ``ppo_loss``, with per-sample staleness in context and SAT diagnostics by staleness."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_sat.sat.losses import loss_context, mu_log_prob
    from verl_sat.sat.step_q import WHOLE_STEP_KEY, padded

    staleness = data[STALENESS_FIELD] if STALENESS_FIELD in data.keys() else None
    if staleness is not None:
        staleness = padded(data, STALENESS_FIELD).reshape(-1)
    rollout = padded(data, "rollout_log_probs") if "rollout_log_probs" in data.keys() else None
    old = padded(data, "old_log_probs")
    mask = padded(data, "response_mask").bool()
    step_q, scored, step_metrics = step_inputs(data, old)
    whole_step = bool(tu.get_non_tensor_data(data, key=WHOLE_STEP_KEY, default=False))
    with staleness_context(staleness), loss_context(rollout, step_q, scored, whole_step) as ctx:
        loss, metrics = ppo_loss(config, model_output, data, dp_group)
        mu = mu_log_prob(old)  # the losses' own rule for log mu (the rollout's, when it fits)
    extra: dict[str, float] = {}
    if rollout is not None:
        # 0 when the ratio's denominator is the rollout's mu (docs/sat.md#which-log-probs; bypass mode), > 0 when
        # it is a trainer-side recomputation (decoupled mode)
        gap = (old - rollout).abs().masked_fill(~mask, 0.0)
        extra["actor/sat_old_vs_rollout_logprob_gap"] = float(gap.max()) if gap.numel() else 0.0
    if staleness is not None:
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        breakdown = staleness_breakdown(staleness, log_prob, mu, mask, config, ctx.gate)
        metrics.update({k: Metric(breakdown_aggregation(k), v) for k, v in breakdown.items()})
    extra.update(step_metrics)
    metrics.update(Metric.from_dict(extra, aggregation=AggregationType.MEAN))
    if step_q is not None and ctx.gate is not None:
        metrics["actor/sat_gate_rate"] = step_gate_rate(data, ctx.gate)
    return loss, metrics


def step_gate_rate(data: Any, gate: torch.Tensor) -> Any:
    """The step's exact token-weighted gate rate, as this micro-batch's share (step scope).

    gated_mb * dp_size / N_step, summed by verl over micro-batches and averaged over the dp_size
    ranks: sum over the step's micro-batches and ranks of gated / N_step (docs/sat.md#diagnostics).
    """
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric

    from verl_sat.sat.step_q import STEP_TOKENS_KEY

    n_step = int(tu.get_non_tensor_data(data, key=STEP_TOKENS_KEY, default=0))
    dp_size = int(tu.get_non_tensor_data(data, key="dp_size", default=1) or 1)
    share = float(gate.sum()) * dp_size / n_step if n_step > 0 else 0.0
    return Metric(AggregationType.SUM, share)


def step_inputs(data: Any, old: torch.Tensor) -> tuple[float | None, torch.Tensor | None, dict[str, float]]:
    """The step's q and the score's log pi that ``verl_sat.sat.step_q`` put in the micro-batch.

    Returns (q, padded score log pi, metrics); (None, None, {}) when no scoring pass ran.
    """
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_sat.sat import step_q as sq

    step_q = tu.get_non_tensor_data(data, key=sq.STEP_Q_KEY, default=None)
    if step_q is None:
        return None, None, {}
    if tu.get_non_tensor_data(data, key=sq.SCORE_FROM_OLD_KEY, default=False):
        scored = old
    else:
        scored = no_padding_2_padding(data[sq.SCORE_FIELD], data)
    seconds = tu.get_non_tensor_data(data, key=sq.SCORE_PASS_S_KEY, default=0.0)
    return float(step_q), scored, {"actor/sat_score_pass_seconds": float(seconds)}


# ---------------------------------------------------------------------------------------------
# worker and trainer mixins
# ---------------------------------------------------------------------------------------------
def install_sat_loss(worker: Any) -> None:
    """Swap the worker's installed ``ppo_loss`` for ``sat_ppo_loss`` (same config, same signature)."""
    loss_fn = getattr(worker, "loss_fn", None)
    if isinstance(loss_fn, partial) and getattr(loss_fn.func, "__name__", "") == "ppo_loss":
        worker.loss_fn = partial(sat_ppo_loss, **loss_fn.keywords)
        worker.actor.set_loss_fn(worker.loss_fn)
        enable_step_q(worker.actor.engine, loss_fn.keywords["config"])


class AsyncSATActor:
    """SAT's actor worker: verl's own actor worker class with SAT's loss, engine and supervision.

    ``sat.actor_class`` names it (the default) or a subclass of it; ``SATTrainerMixin`` mixes it
    over the worker class verl maps each actor role to (``ActorRolloutRefWorker``,
    ``DetachActorWorker``), so verl's dispatch, placement and engine code run unchanged. Override
    a method and call ``super()`` to extend it.
    """

    def init_model(self) -> None:
        """Select the actor's engine mixins, run verl's ``init_model``, then install ``sat_ppo_loss``."""
        from verl_sat import routing

        is_actor = "actor" in getattr(self, "role", "actor")
        if is_actor:
            routing.prepare_worker(self)
            register_engine(str(self.config.actor.strategy), engine_mixins(self.config.actor))  # type: ignore[attr-defined]
        super().init_model()  # type: ignore[misc]
        if is_actor:
            check_engine(self.actor.engine, self.config.actor)  # type: ignore[attr-defined]
        install_sat_loss(self)
        from verl_sat.processes import register

        register("trainer worker", f"rank{os.environ.get('RANK', 0)}")  # watched by the driver's supervisor

    def sat_scale_lr(self, factor: float) -> list[float]:
        """Multiply every optimizer group's lr by ``factor`` (the lr-spike fault, ``verl_sat.trainer.faults``)."""
        return scale_lr(self, factor)

    def sat_heldout_accuracy(self, spec: dict) -> dict[str, float]:
        """The study's held-out accuracy of this worker's model (``sat.heldout``, ``verl_sat.trainer.heldout``)."""
        return score_worker_model(self, spec)


def sat_worker_class(remote_cls: Any, actor_class: type[AsyncSATActor] = AsyncSATActor) -> Any:
    """``ray.remote(SAT<Worker>(actor_class, <Worker>))`` for verl's ``ray.remote(<Worker>)``.

    ``init_model`` is registered with the same dispatch attributes as verl's
    (``verl.single_controller.base.decorator.register``), so the worker group exposes it.
    """
    import ray
    from verl.single_controller.base.decorator import MAGIC_ATTR, Dispatch, register

    base = remote_cls.__ray_actor_class__
    cls = type(
        f"SAT{base.__name__}",
        (actor_class, base),
        {
            "__module__": actor_class.__module__,
            "init_model": register(**getattr(base.init_model, MAGIC_ATTR))(actor_class.init_model),
            "sat_scale_lr": register(dispatch_mode=Dispatch.ONE_TO_ALL)(actor_class.sat_scale_lr),
            "sat_heldout_accuracy": register(dispatch_mode=Dispatch.ONE_TO_ALL)(actor_class.sat_heldout_accuracy),
        },
    )
    return ray.remote(cls)


def actor_class_of(path: str | None) -> type[AsyncSATActor]:
    """The class ``sat.actor_class`` names (a dotted path): AsyncSATActor or a subclass of it."""
    from verl.utils.import_utils import load_class_from_fqn

    if not path:
        return AsyncSATActor
    try:
        cls = load_class_from_fqn(path, "sat.actor_class")
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"sat.actor_class={path!r} cannot be imported: {error}") from error
    if not (isinstance(cls, type) and issubclass(cls, AsyncSATActor)):
        raise ValueError(f"sat.actor_class={path!r} is not a subclass of verl_sat.trainer.actor.AsyncSATActor")
    return cls


class SATTrainerMixin(
    SentinelTrainerMixin, AutoLagTrainerMixin, SampleAccountingMixin, FaultMixin, HeldoutTrainerMixin
):
    """A v1 trainer that writes per-sample staleness for the loss and uses SAT workers.

    Registered as ``sat_<mode>``; ``trainer_mode`` reads back as ``<mode>`` so that verl's own
    code (which keys settings and behaviour on the mode's name) is unchanged.
    """

    @property
    def trainer_mode(self) -> str:
        return self._sat_base_mode

    @trainer_mode.setter
    def trainer_mode(self, value: str) -> None:
        self._sat_base_mode = value.removeprefix(MODE_PREFIX)

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()  # type: ignore[misc]
        from verl.trainer.ppo.utils import Role

        actor_class = actor_class_of((self.config.get("sat") or {}).get("actor_class"))  # type: ignore[attr-defined]
        for role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = sat_worker_class(self.role_worker_mapping[role], actor_class)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        staled = self._put_staleness(batch, metrics)
        # sat.heldout: the trainer's policy scored at the named optimizer steps (verl_sat.trainer.heldout)
        batch = self._heldout_around_update(lambda: super(SATTrainerMixin, self)._update_actor(staled, metrics))  # type: ignore[misc]
        self._auto_lag_observe(metrics, batch.tags)  # sat.lag=auto: this step's signal (verl_sat.trainer.auto_lag)
        return batch

    def _put_staleness(self, batch: Any, metrics: dict) -> Any:
        """Write ``sat_staleness`` for this mini-batch into TransferQueue; the batch now lists it."""
        import transfer_queue as tq
        from tensordict import TensorDict

        versions = np.array([tag.get("min_global_steps", self.global_steps - 1) for tag in batch.tags], dtype=int)
        staleness = staleness_in_steps(
            self.global_steps, versions, int(self.parameter_sync_step), int(getattr(self, "local_trigger_step", 0))
        )
        real = np.array([not tag.get("is_padding", False) for tag in batch.tags], dtype=bool)
        if real.any():
            metrics["training/sat/staleness_steps/mean"] = float(staleness[real].mean())
            metrics["training/sat/staleness_steps/max"] = float(staleness[real].max())
        field = TensorDict({STALENESS_FIELD: torch.as_tensor(staleness, dtype=torch.float32)}, batch_size=len(batch))
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=field)
        self._account_mini_batch(batch, staleness.tolist())
        self._fault_before_update()
        if batch.fields is not None and STALENESS_FIELD not in batch.fields:
            batch = dataclasses.replace(batch, fields=[*batch.fields, STALENESS_FIELD])
        return batch

    # -- the sentinel, sample accounting and faults (verl_sat.trainer.sentinel, .accounting, .faults) -----
    # verl's fit loop, per global step t: step() -> save checkpoint -> on_step_end (weight sync)
    # -> _compute_metrics (the reward appears here) -> logger.log -> global_steps += 1.
    def _compute_metrics(self, batch: Any, metrics: dict, timing_raw: dict, global_steps: int, epoch: int) -> None:
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)  # type: ignore[misc]
        finish_staleness_breakdown(metrics)
        fill_eviction_counters(metrics)
        self._heldout_metrics(metrics)
        # the sentinel first: a stop makes this step the last, and the accounting then records what
        # is still in flight, as on the planned last step
        self._sentinel_observe(int(global_steps), metrics)
        self._account_step(int(global_steps))

    def on_step_end(self) -> None:
        self._sentinel_rollback_if_pending()
        self._auto_lag_wrap_sync()
        super().on_step_end()  # type: ignore[misc]

    def _sentinel_safer_setting(self) -> dict[str, tuple[int, int]]:
        """sat.lag=auto: halve ``sat.auto_lag.max`` and broadcast now; a fixed lag: halve it."""
        if self._auto_lag() is not None:
            return self._auto_lag_after_rollback()
        return super()._sentinel_safer_setting()

    def _submit_batch_to_rollout(self, batch: Any) -> int:
        self._account_submitted(batch)
        return super()._submit_batch_to_rollout(batch)  # type: ignore[misc]

    def _reissue_inflight_prompts(self, partition_id: str = "train") -> int:
        count = super()._reissue_inflight_prompts(partition_id)  # type: ignore[misc]
        self._account_reissued(count)
        return count

    def _load_checkpoint(self) -> None:
        super()._load_checkpoint()  # type: ignore[misc]
        self._account_epoch_order()


def register_sat_trainers() -> None:
    """Register ``sat_sync``, ``sat_colocate_async``, ``sat_separate_async`` with verl's v1 registry."""
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, get_trainer_cls, register_trainer

    for mode in BASE_MODES:
        name = MODE_PREFIX + mode
        if name in TRAINER_REGISTRY:
            continue
        base = get_trainer_cls(mode)
        cls = type(f"SAT{base.__name__}", (SATTrainerMixin, base), {"__module__": __name__})
        register_trainer(name)(cls)
