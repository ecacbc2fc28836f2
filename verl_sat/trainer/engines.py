"""How verl-sat extends verl's training engines: mixins composed over the engine verl would build.

One mechanism for every extension: :func:`register_engine` composes the mixins the actor needs
over the class verl's ``EngineRegistry`` would pick for its backend, registers the result in that
registry under a vendor key of its own, and points ``VERL_ENGINE_VENDOR`` at it in this worker
process, so verl's ``init_model`` builds the composed engine itself. The mixins:

- :class:`StepQuantileEngine`: q over the optimizer step (``verl_sat.sat.step_q``), any backend;
- ``verl_sat.routing.fsdp.RoutingReplayFSDP``: R2/R3 on the FSDP engine;
- ``verl_sat.routing.megatron.MegatronRouteMetrics``: routing metrics on verl's Megatron replay.

The order is fixed (step-q outermost), so the step's scoring pass runs through routing replay
like the training pass it precedes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from verl_sat.sat.config import sat_settings
from verl_sat.sat.step_q import (
    SCORE_FIELD,
    SCORE_FROM_OLD_KEY,
    SCORE_PASS_S_KEY,
    STEP_Q_KEY,
    STEP_TOKENS_KEY,
    WHOLE_STEP_KEY,
    compute_step_q,
    needs_step_q,
    padded,
)

VENDOR = "verl_sat"
MODEL_TYPE = "language_model"
DEVICES = ("cuda", "npu")  # verl's engines register under these (CPU runs use VERL_ENGINE_DEVICE=cuda)
_COMPOSED: dict[tuple[str, tuple[type, ...]], str] = {}


class StepQuantileEngine:
    """Mixed over the actor's engine: the scoring pass and the step's q before every training
    ``forward_backward_batch`` (``verl_sat.sat.step_q``); everything else is verl's. Inert until
    ``_sat_actor_config`` is set (``AsyncSATActor`` sets it on the actor's engine), so a reference
    engine built in the same process passes straight through."""

    _sat_actor_config: Any = None

    def forward_backward_batch(self, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        config = self._sat_actor_config
        if forward_only or config is None or not needs_step_q(config):
            return super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
        from verl.utils import tensordict_utils as tu

        if self._sat_one_micro_batch(data, tu):  # the micro-batch is the step: its own q is the step's
            tu.assign_non_tensor(data, **{WHOLE_STEP_KEY: True})
        else:
            self._sat_prepare_step(data, config, tu)
        try:
            return super().forward_backward_batch(data, loss_function, forward_only)  # type: ignore[misc]
        finally:
            for key in (STEP_Q_KEY, SCORE_FROM_OLD_KEY, SCORE_PASS_S_KEY, STEP_TOKENS_KEY, WHOLE_STEP_KEY):
                tu.pop(data, key=key, default=None)
            if SCORE_FIELD in data.keys():
                del data[SCORE_FIELD]

    def _sat_prepare_step(self, data: Any, config: Any, tu: Any) -> None:
        """Score the step at its weights, then hand q (and the scores) to every micro-batch."""
        from verl.utils.device import get_device_name
        from verl.workers.utils.padding import no_padding_2_padding

        start = time.perf_counter()
        if sat_settings(config.policy_loss).sat_step_score == "old_log_prob":
            score_log_prob = padded(data, "old_log_probs").to(get_device_name())  # all-reduce on the device
            tu.assign_non_tensor(data, **{SCORE_FROM_OLD_KEY: True})
        else:
            self._sat_check_forward_scoring()
            with torch.no_grad(), scoring_flags(data, tu):
                out = super().forward_backward_batch(data, None, forward_only=True)  # type: ignore[misc]
            model_output = (out or {}).get("model_output") or {}
            if "log_probs" not in model_output:
                if not is_pipeline_last_stage():
                    return  # an earlier pipeline stage computes no loss, so needs no q
                raise RuntimeError("sat_quantile_scope=step: the scoring pass returned no log_probs")
            data[SCORE_FIELD] = model_output["log_probs"]
            score_log_prob = no_padding_2_padding(model_output["log_probs"], data)
        group = self.get_data_parallel_group()  # type: ignore[attr-defined]
        q, n_step = compute_step_q(config, data, score_log_prob, group)
        seconds = time.perf_counter() - start
        tu.assign_non_tensor(data, **{STEP_Q_KEY: float(q), STEP_TOKENS_KEY: n_step, SCORE_PASS_S_KEY: seconds})

    def _sat_one_micro_batch(self, data: Any, tu: Any) -> bool:
        """One rank and one micro-batch holding the whole step (fixed micro-batch size >= the
        mini-batch): the loss's own q over that micro-batch is the step's, at the step's weights,
        so the scoring pass is skipped (it cost ~0.2 s per optimizer step on the CPU default)."""
        if self.get_data_parallel_size() != 1 or tu.get_non_tensor_data(data, key="use_dynamic_bsz", default=True):  # type: ignore[attr-defined]
            return False
        micro = tu.get_non_tensor_data(data, key="micro_batch_size_per_gpu", default=None)
        return micro is not None and int(micro) >= len(data)

    def _sat_check_forward_scoring(self) -> None:
        """Refuse what the forward scoring pass does not handle (instead of a silent micro-batch q)."""
        engine_config = getattr(self, "engine_config", None)
        if engine_config is not None and getattr(engine_config, "dynamic_context_parallel", False):
            raise NotImplementedError(
                "actor_rollout_ref.actor.policy_loss.sat_quantile_scope=step with sat_step_score=forward does not "
                "support Megatron's dynamic_context_parallel (its forward-only output reaches one rank only); "
                "use sat_step_score=old_log_prob (decoupled mode) or sat_quantile_scope=micro_batch"
            )


# The scoring pass needs log pi only: verl's per-batch switches that would make it compute more
# (entropy, sum pi^2) or call a loss (distillation) are off for its duration, then restored.
SCORING_OFF = ("calculate_entropy", "calculate_sum_pi_squared", "distillation_use_topk", "distillation_only")
_UNSET = object()


@contextlib.contextmanager
def scoring_flags(data: Any, tu: Any) -> Iterator[None]:
    saved = {key: tu.get_non_tensor_data(data, key=key, default=_UNSET) for key in SCORING_OFF}
    tu.assign_non_tensor(data, **dict.fromkeys(SCORING_OFF, False))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is _UNSET:
                tu.pop(data, key=key, default=None)
            else:
                tu.assign_non_tensor(data, **{key: value})


def is_pipeline_last_stage() -> bool:
    """True unless Megatron's pipeline parallelism is initialised and this is not its last stage."""
    try:
        from megatron.core import parallel_state as mpu
    except ImportError:
        return True
    if not mpu.model_parallel_is_initialized():
        return True
    return mpu.is_pipeline_last_stage(ignore_virtual=True)


def engine_mixins(actor_config: Any) -> tuple[type, ...]:
    """Every mixin the actor's engine needs, outermost first."""
    from verl_sat import routing

    return ((StepQuantileEngine,) if needs_step_q(actor_config) else ()) + routing.engine_mixins(actor_config)


def compose(base: type, mixins: tuple[type, ...]) -> type:
    """``SAT<Engine>(*mixins, <Engine>)``: verl's engine with the mixins' methods in front."""
    return type(f"SAT{base.__name__}", (*mixins, base), {"__module__": __name__})


def register_engine(backend: str, mixins: tuple[type, ...]) -> str | None:
    """Register ``compose(<verl's engine for backend>, mixins)`` and select it in this process.

    The base is what verl's registry returns for ``backend`` here (device and vendor as verl
    detects them), looked up with ``VERL_ENGINE_VENDOR`` unset, so it is never a composed class. Returns the vendor key,
    None when there is nothing to mix in. Idempotent per (backend, mixins).
    """
    if not mixins:
        return None
    from verl.utils.py_functional import temp_env_var
    from verl.workers.engine.base import EngineRegistry

    key = (backend, mixins)
    if key not in _COMPOSED:
        vendor = f"{VENDOR}:" + "+".join(m.__name__ for m in mixins)
        with temp_env_var("VERL_ENGINE_VENDOR", ""):  # verl reads "" as unset: the engine it would build
            base = EngineRegistry.get_engine_cls(MODEL_TYPE, backend)
        EngineRegistry.register(model_type=MODEL_TYPE, backend=backend, device=list(DEVICES), vendor=vendor)(
            compose(base, mixins)
        )
        _COMPOSED[key] = vendor
    os.environ["VERL_ENGINE_VENDOR"] = _COMPOSED[key]
    return _COMPOSED[key]


def check_engine(engine: Any, actor_config: Any) -> None:
    """After verl's ``init_model``: the actor's engine carries every mixin :func:`engine_mixins`
    names. Without one, the step's q, R2/R3 replay or the routing metrics would be skipped silently
    (a training pass routing on its own gives a dbar_pi no error explains). ``RuntimeError``
    naming the engine and what it lacks."""
    missing = [m.__name__ for m in engine_mixins(actor_config) if not isinstance(engine, m)]
    if missing:
        raise RuntimeError(
            f"the actor's engine {type(engine).__name__} lacks {', '.join(missing)} "
            "(verl_sat.trainer.engines.register_engine did not run before verl's init_model)"
        )


def enable_step_q(engine: Any, actor_config: Any) -> None:
    """Hand the actor's config to its (composed) engine: the step's q is taken from now on
    (:func:`check_engine` has refused an engine without the scoring pass the config needs)."""
    if isinstance(engine, StepQuantileEngine):
        engine._sat_actor_config = actor_config
