"""Work-arounds for verl 0.9.1 bugs that hit every platform, installed by the plugin everywhere.

``verl_sat.plugin`` (the ``verl.plugins`` entry point, loaded by every ``import verl``: driver and
Ray workers) calls :func:`install` on every platform; nothing in verl is edited. One function per
bug, named after the bug and the verl version it was read in. CPU-only fixes stay in
``verl_sat.cpu.platform`` (installed with ``VERL_PLATFORM=cpu``).

- :func:`separate_async_logger_flush_kwarg_0_9_1`: ``trainer/ppo/v1/trainer_separate_async.py``
  ``_setup`` calls ``logger.info(..., flush=True)`` when ``actor_rollout_ref.hybrid_engine=False``
  (every separate_async cell of the paper's recipe). ``Logger._log`` has no ``flush`` keyword, so
  at INFO level (that module's default, ``VERL_LOGGING_LEVEL``) ``trainer.init()`` raises
  ``TypeError`` after the models are built.
- :func:`sglang_launch_logger_flush_kwarg_0_9_1`: the same call in
  ``workers/rollout/sglang_rollout/http_server_engine.py`` ``launch_server_process`` for a
  non-leader node (multi-node SGLang); that module logs at WARN by default, so it raises only with
  ``VERL_LOGGING_LEVEL=INFO`` or lower.
- :func:`sglang_routed_experts_base64_0_9_1_sglang_0_5_12`: R3 on SGLang. SGLang 0.5.12 (the
  release verl 0.9.1's ``sglang`` extra pins) returns ``meta_info["routed_experts"]`` as a base64
  string of int32 bytes on both paths (``managers/tokenizer_manager.py`` encodes the tensor with
  ``pybase64.b64encode`` when ``skip_tokenizer_init`` is on, ``managers/detokenizer_manager.py``
  otherwise). verl's ``workers/rollout/sglang_rollout/async_sglang_server.py`` ``generate`` calls
  ``captured.numpy()`` on that string (``skip_tokenizer_init=true``, verl's default) or imports
  ``sglang.srt.layers.moe.routed_experts_capturer``, which SGLang 0.5.12 moved to
  ``sglang.srt.state_capturer.routed_experts`` (``false``). Either way every R3 request raises, the
  agent loop refills its group, and the job hangs. The fix decodes the string where verl receives
  it (the server's tokenizer manager) into the ``[tokens, layers, top_k]`` int32 tensor verl's
  ``.numpy()`` expects (``true``), or gives verl's import the module it looks for (``false``).
- :func:`megatron_core_adam_step_on_resume_0_16_to_0_19`: megatron-core's distributed optimizer,
  loaded the way verl's Megatron checkpoint manager loads it (``dp_reshardable``), resumes Adam at
  a stale step (docs/faults.md#kill-and-resume); :func:`keep_adam_step` restores it.
"""

from __future__ import annotations

import base64
import logging
import sys
from types import ModuleType
from typing import Any

import numpy as np

from verl_sat.hooks import when_imported, wrap_once

SEPARATE_ASYNC_LOGGER = "verl.trainer.ppo.v1.trainer_separate_async"
SGLANG_HTTP_ENGINE_LOGGER = "verl.workers.rollout.sglang_rollout.http_server_engine"
SGLANG_SERVER_MODULE = "verl.workers.rollout.sglang_rollout.async_sglang_server"
# Where SGLang < 0.5.12 kept the routes decoder, which verl 0.9.1 imports with skip_tokenizer_init=false.
SGLANG_OLD_CAPTURER_MODULE = "sglang.srt.layers.moe.routed_experts_capturer"
# Set on the functions decode_sglang_routes wraps, so that each is wrapped once.
ROUTES_MARKER = "__verl_sat_decodes_routes__"
DISTRIB_OPTIMIZER_MODULE = "megatron.core.optimizer.distrib_optimizer"
ADAM_STEP_MARKER = "__verl_sat_keeps_adam_step__"


class FlushTolerantLogger(logging.Logger):
    """A ``Logger`` that ignores a stray ``flush=`` keyword (a ``print`` habit) instead of raising."""

    def _log(self, level: int, msg: object, args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        kwargs.pop("flush", None)
        super()._log(level, msg, args, **kwargs)


def make_flush_tolerant(name: str) -> logging.Logger:
    """Make logger ``name`` a :class:`FlushTolerantLogger`, whether or not verl has created it yet.

    verl's modules take their logger with ``logging.getLogger(__name__)``, which returns this same
    object, before or after their import; only the class changes (no state is added), so handlers,
    level and propagation are kept.
    """
    logger = logging.getLogger(name)
    if not isinstance(logger, FlushTolerantLogger):
        logger.__class__ = FlushTolerantLogger
    return logger


def separate_async_logger_flush_kwarg_0_9_1() -> None:
    """``trainer_separate_async._setup``: ``logger.info(..., flush=True)`` with hybrid_engine=False."""
    make_flush_tolerant(SEPARATE_ASYNC_LOGGER)


def sglang_launch_logger_flush_kwarg_0_9_1() -> None:
    """``http_server_engine.launch_server_process``: ``logger.info(..., flush=True)`` off the leader node."""
    make_flush_tolerant(SGLANG_HTTP_ENGINE_LOGGER)


def decode_routed_experts(value: Any, num_layers: int, top_k: int) -> Any:
    """SGLang's ``meta_info["routed_experts"]`` -> int32 tensor ``[tokens, layers, top_k]``.

    routes = frombuffer(b64decode(value), int32).reshape(-1, num_layers, top_k)   (SGLang 0.5.12)

    A tensor or array (an SGLang that sends them unencoded) is only reshaped; ``None`` stays None.
    A byte count that is not a whole number of ``layers x top_k`` int32 rows raises ``ValueError``
    naming both, since it means the server's model is not the one verl configured.
    """
    import torch

    if value is None:
        return None
    if isinstance(value, str):
        flat = np.frombuffer(base64.b64decode(value, validate=True), dtype=np.int32)
    else:
        flat = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value).astype(np.int32, copy=False)
        flat = flat.reshape(-1)
    row = num_layers * top_k
    if row <= 0 or flat.size % row:
        raise ValueError(
            f"SGLang returned {flat.size} routed-expert ids, not a whole number of tokens x (num_hidden_layers "
            f"{num_layers} x num_experts_per_tok {top_k}); is the server's model the one verl configured?"
        )
    return torch.from_numpy(flat.copy()).reshape(-1, num_layers, top_k)


def route_shape(model_config: Any) -> tuple[int, int]:
    """(num_hidden_layers, num_experts_per_tok) of verl's ``HFModelConfig`` (its text config)."""
    hf_config = model_config.hf_config
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return int(text.num_hidden_layers), int(text.num_experts_per_tok)


def decoding_generate_request(tokenizer_manager: Any, num_layers: int, top_k: int) -> None:
    """Make ``tokenizer_manager.generate_request`` yield outputs whose routes are decoded (once)."""

    def make(original: Any) -> Any:
        async def generate_request(*args: Any, **kwargs: Any) -> Any:
            async for output in original(*args, **kwargs):
                meta_info = output.get("meta_info") if isinstance(output, dict) else None
                if meta_info and meta_info.get("routed_experts") is not None:
                    meta_info["routed_experts"] = decode_routed_experts(meta_info["routed_experts"], num_layers, top_k)
                yield output

        return generate_request

    wrap_once(tokenizer_manager, "generate_request", ROUTES_MARKER, make)


def old_capturer_module() -> ModuleType:
    """``sglang.srt.layers.moe.routed_experts_capturer`` for verl's ``skip_tokenizer_init=false`` path
    where SGLang no longer has it: ``extract_routed_experts_from_meta_info`` returns the flat int32
    routes (verl reshapes them to ``[tokens, layers, top_k]``)."""
    module = ModuleType(SGLANG_OLD_CAPTURER_MODULE)
    module.__doc__ = "verl-sat: the routes decoder verl 0.9.1 imports from SGLang's pre-0.5.12 path."

    def extract_routed_experts_from_meta_info(data: dict) -> np.ndarray:
        value = data["meta_info"]["routed_experts"]
        return np.frombuffer(base64.b64decode(value, validate=True), dtype=np.int32)

    module.extract_routed_experts_from_meta_info = extract_routed_experts_from_meta_info  # type: ignore[attr-defined]
    return module


def has_old_capturer() -> bool:
    """Whether this SGLang still has the pre-0.5.12 routes module."""
    import importlib.util

    try:
        return importlib.util.find_spec(SGLANG_OLD_CAPTURER_MODULE) is not None
    except ImportError:
        return False


def decode_sglang_routes(server_module: ModuleType) -> None:
    """Wrap ``SGLangHttpServer.generate`` (verl's SGLang server actor) so that R3 requests decode."""

    def make(original: Any) -> Any:
        async def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.config.enable_rollout_routing_replay:
                if self.config.skip_tokenizer_init:
                    decoding_generate_request(self.tokenizer_manager, *route_shape(self.model_config))
                elif SGLANG_OLD_CAPTURER_MODULE not in sys.modules and not has_old_capturer():
                    sys.modules[SGLANG_OLD_CAPTURER_MODULE] = old_capturer_module()
            return await original(self, *args, **kwargs)

        return generate

    wrap_once(server_module.SGLangHttpServer, "generate", ROUTES_MARKER, make)


def sglang_routed_experts_base64_0_9_1_sglang_0_5_12() -> None:
    """``async_sglang_server.generate``: SGLang 0.5.12's base64 routes (module docstring)."""
    when_imported(SGLANG_SERVER_MODULE, decode_sglang_routes)


def keep_adam_step(optimizer: Any) -> int:
    """Give every Adam state's ``step`` its param group's ``step`` (the one the checkpoint restored),
    one tensor per parameter. Returns how many states it set.

    megatron-core's ``DistributedOptimizer.load_state_dict`` (0.16.1 to 0.19, and its main branch)
    restores the step into the param groups, then loads the ``dp_reshardable`` parameter state
    (verl's default), whose ``step`` is the template's own value (``LocalNonpersistentObject``):
    that stale step overwrites the restored one. torch's AdamW on CPU then resumes at step 0, and
    all parameters share one step tensor, advanced once per parameter per optimizer step; the
    offloaded ``HybridDeviceOptimizer`` (the paper cell's) resumes at 1 (SkyRL PR #1403). A state
    without ``step`` (TransformerEngine's FusedAdam keeps it in the param group) is left as it is.
    """
    import torch

    inner = optimizer.optimizer
    count = 0
    for group in inner.param_groups:
        if "step" not in group or group["step"] is None:
            continue
        for param in group["params"]:
            state = inner.state.get(param)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.full_like(state["step"], float(group["step"]))
                count += 1
    return count


def keeping_adam_step(module: Any) -> None:
    """Wrap ``module.DistributedOptimizer.load_state_dict`` so that :func:`keep_adam_step` follows it."""

    def make(original: Any) -> Any:
        def load_state_dict(self: Any, state_dict: Any) -> Any:
            out = original(self, state_dict)
            keep_adam_step(self)
            return out

        return load_state_dict

    wrap_once(module.DistributedOptimizer, "load_state_dict", ADAM_STEP_MARKER, make)


def megatron_core_adam_step_on_resume_0_16_to_0_19() -> None:
    """``DistributedOptimizer.load_state_dict``: Adam's step kept across a resume (module docstring)."""
    when_imported(DISTRIB_OPTIMIZER_MODULE, keeping_adam_step)


FIXES = (
    separate_async_logger_flush_kwarg_0_9_1,
    sglang_launch_logger_flush_kwarg_0_9_1,
    sglang_routed_experts_base64_0_9_1_sglang_0_5_12,
    megatron_core_adam_step_on_resume_0_16_to_0_19,
)


def install() -> None:
    """Install every work-around in :data:`FIXES` (idempotent, cheap: no verl module is imported;
    the SGLang fix waits, as a post-import hook, for verl's SGLang server module)."""
    for fix in FIXES:
        fix()
