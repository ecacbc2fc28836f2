"""verl's Megatron engine on CPU: run-time patches for what megatron-core and mbridge hard-wire to CUDA.

Installed by :func:`verl_sat.cpu.register` only when the CPU platform is selected
(``VERL_PLATFORM=cpu``), in every process that imports verl (Ray workers included), as
post-import hooks on the modules they patch: nothing in site-packages is edited and nothing is
imported early. Written for exactly the versions in :data:`SUPPORTED` (the ``megatron-cpu``
extra); any other version stops the import of ``megatron.core`` / ``mbridge`` with an error naming
both versions, because each patch reaches into one version's internals.

Scope: a patch never replaces ``torch`` itself. Where megatron looks a CUDA call up through its
own module global ``torch`` (``torch.cuda.get_rng_state()``, ``torch.zeros(..., device="cuda")``),
that one module's global is pointed at :data:`CPU_TORCH`, a stand-in that forwards everything to
torch except ``torch.cuda`` and the device argument of the tensor factories. (A global
``torch.tensor`` wrapper once made HF's Qwen3-MoE forward non-deterministic.) Each entry of
:data:`TORCH_SCOPED` and each ``patch_*`` function carries its reason in one line; docs/cpu.md
lists them. Settings that need no patch (local layers, no fusions, CPU initialisation) are
config: :data:`TRANSFORMER_OVERRIDES`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

from verl_sat.cpu.patching import ScopedTorch, checked, scope
from verl_sat.cpu.platform import CPUDeviceModule
from verl_sat.hooks import when_imported, wrap_once

SUPPORTED = {"megatron-core": "0.16.1", "mbridge": "0.15.1"}
MARKER = "_verl_sat_cpu"  # set on each function a patch wraps, so that it is wrapped once

# verl's ``actor.megatron.override_transformer_config`` for CPU: what megatron would otherwise take
# from TransformerEngine / apex / CUDA kernels. Local (non-TE) layers are chosen by
# ``patch_mbridge_local_spec``; these keys make the local layers run in plain torch.
TRANSFORMER_OVERRIDES: dict[str, Any] = {
    "use_cpu_initialization": True,  # build weights on the host (no torch.cuda.current_device())
    "attention_backend": "local",  # megatron's DotProductAttention instead of TE / flash
    "moe_grouped_gemm": False,  # SequentialMLP experts (grouped GEMM needs TE or nv-grouped-gemm)
    "gradient_accumulation_fusion": False,  # a CUDA kernel (fused_weight_gradient_mlp_cuda)
    "bias_activation_fusion": False,  # torch.jit-fused CUDA kernels
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,  # apex's scaled_masked_softmax_cuda
    "persist_layer_norm": False,  # apex's persistent LayerNorm
    "apply_rope_fusion": False,  # TE's fused RoPE
    "moe_permute_fusion": False,  # TE's fused permute
    "moe_router_fusion": False,  # TE's fused top-k
    "moe_token_dispatcher_type": "alltoall",  # the one dispatcher that takes variable sequence lengths
}


# ---------------------------------------------------------------------------------------------
# the module-scoped torch stand-in
# ---------------------------------------------------------------------------------------------
def to_cpu_device(device: Any) -> Any:
    """``"cuda"``, ``"cuda:0"``, ``0`` or ``torch.device("cuda")`` -> ``"cpu"``; anything else unchanged."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


class _NoEvent:
    """``torch.cuda.Event`` on a host: already complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _NoStream:
    """``torch.cuda.Stream`` / ``current_stream()`` on a host: work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _NoEvent:
        return event if event is not None else _NoEvent()

    def synchronize(self) -> None:
        return None


class _CPUCuda(CPUDeviceModule):
    """``torch.cuda`` as the patched megatron modules see it: the CPU platform's device module (the
    host's RNG, no memory to manage), no streams, and ``torch.cuda`` for anything else."""

    Stream = _NoStream
    Event = _NoEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def current_stream(device: Any = None) -> _NoStream:
        return _NoStream()

    @staticmethod
    def stream(stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def nvtx_range_push(msg: str) -> None:
        return None

    @staticmethod
    def nvtx_range_pop() -> None:
        return None


# Tensor factories whose ``device=`` megatron sets to "cuda" / torch.cuda.current_device().
_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
)


def _on_cpu(kwargs: dict[str, Any]) -> None:
    if "device" in kwargs:
        kwargs["device"] = to_cpu_device(kwargs["device"])


def _cpu_device(*args: Any, **kwargs: Any) -> torch.device:
    if args and isinstance(args[0], str) and args[0].startswith("cuda"):
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


# ``torch`` for one megatron module: everything forwarded, except ``cuda`` and factory devices.
CPU_TORCH = ScopedTorch(_FACTORIES, _on_cpu)
CPU_TORCH.cuda = _CPUCuda()
CPU_TORCH.device = _cpu_device

# Modules whose global ``torch`` becomes CPU_TORCH, each with the CUDA call that needs it.
TORCH_SCOPED: dict[str, str] = {
    "megatron.core.tensor_parallel.random": "the RNG state tracker calls torch.cuda.get_rng_state / manual_seed",
    "megatron.core.utils": "GlobalMemoryBuffer allocates on torch.cuda.current_device()",
    "megatron.core.optimizer.clip_grads": "grad-norm and zero-count buffers are made with device='cuda'",
    "megatron.core.optimizer.optimizer": "found-inf / grad-norm tensors are made with device='cuda'",
    "megatron.core.optimizer.distrib_optimizer": "buffers made on torch.cuda.current_device()",
    "megatron.core.pipeline_parallel.schedules": "total_num_tokens is made with device='cuda'",
    "megatron.core.transformer.moe.moe_utils": "router metrics are made with device='cuda'",
    "megatron.core.transformer.moe.token_dispatcher": "the all-to-all dispatcher creates a torch.cuda.Stream",
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers are made on torch.cuda.current_device()",
    "megatron.core.distributed.distributed_data_parallel": "buffers made on torch.cuda.current_device()",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "RoPE moves inv_freq to torch.cuda.current_device()",
    "megatron.core.transformer.moe.router": "the router moves its weight to torch.cuda.current_device() every call",
    "megatron.core.transformer.moe.experts": "SequentialMLP makes empty-expert outputs on torch.cuda.current_device()",
    "megatron.core.tensor_parallel.mappings": "gather / all-to-all outputs are made on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async": "preload_tensors calls torch.cuda.synchronize",
    "megatron.core.dist_checkpointing.strategies.fully_parallel": "the save/load exchange calls torch.cuda.synchronize",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": "its failure flag is made on a CUDA device",
    "megatron.core.dist_checkpointing.strategies.async_utils": "liveness flags on a CUDA device; synchronize",
    "mbridge.core.util": "get_model calls model.cuda(torch.cuda.current_device())",
    "mbridge.core.bridge": "export_weights moves expert_bias to torch.cuda.current_device()",
}


# Point a module's global ``torch`` at CPU_TORCH (that module only).
scope_torch = functools.partial(scope, stand_in=CPU_TORCH)


# ---------------------------------------------------------------------------------------------
# the patches that are not a torch stand-in
# ---------------------------------------------------------------------------------------------
def patch_random(module: ModuleType) -> None:
    """megatron.core.tensor_parallel.random: its CUDA RNG helpers read and set the host generator."""
    scope_torch(module)
    module._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    module._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


def patch_moe_utils(module: ModuleType) -> None:
    """megatron.core.transformer.moe.moe_utils: ``te_general_gemm`` is referenced without TE (NameError)."""
    scope_torch(module)
    if not hasattr(module, "te_general_gemm"):
        module.te_general_gemm = None


def patch_token_dispatcher(module: ModuleType) -> None:
    """The all-to-all dispatcher: no CUDA stream; split sizes as lists (gloo's all_to_all_single)."""
    scope_torch(module)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def token_dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
            for name in ("input_splits", "output_splits"):
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.tolist())
            return original(self, *args, **kwargs)

        return token_dispatch

    wrap_once(module.MoEAlltoAllTokenDispatcher, "token_dispatch", MARKER, make)


def patch_module_cuda(module: ModuleType) -> None:
    """mbridge.core.util.get_model: ``model.cuda(...)`` is a no-op while it runs (weights stay on the host)."""
    scope_torch(module)
    wrap_once(module, "get_model", MARKER, lambda original: _module_cuda_is_identity()(original))


@contextlib.contextmanager
def _module_cuda_is_identity() -> Iterator[None]:
    original = torch.nn.Module.cuda
    torch.nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.cuda = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """``tensor.type()`` answers ``torch.cuda.<X>Tensor`` for host tensors while megatron checks it."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = original  # type: ignore[method-assign]


def _with_cuda_type_names(owner: Any, name: str) -> None:
    """Run ``owner.<name>`` inside :func:`_cuda_type_names` (once)."""
    wrap_once(owner, name, MARKER, lambda original: _cuda_type_names()(original))


def patch_optimizer(module: ModuleType) -> None:
    """megatron.core.optimizer.optimizer: it sorts parameters by ``param.type() == 'torch.cuda.<X>Tensor'``."""
    scope_torch(module)
    _with_cuda_type_names(module.Float16OptimizerWithFloat16Params, "__init__")
    _with_cuda_type_names(module, "clip_grad_by_total_norm_fp32")  # asserts grads are torch.cuda.FloatTensor


def patch_distrib_optimizer(module: ModuleType) -> None:
    """megatron.core.optimizer.distrib_optimizer: the same ``param.type()`` checks, in its constructor;
    ``state_dict`` of a fresh optimizer, which a checkpoint load builds as its template; and the
    in-place load of fp32 main params."""
    scope_torch(module)
    _with_cuda_type_names(module.DistributedOptimizer, "__init__")
    original = module.DistributedOptimizer.state_dict

    @functools.wraps(original)
    def state_dict(self: Any) -> dict:
        # Without TE/apex, state_dict reads the step from torch's Adam state and asserts there is
        # exactly one, but a fresh optimizer (resume) has no state yet: it has taken step 0 (the
        # loaded checkpoint then brings its own).
        if module.HAVE_APEX_OR_TE or self.optimizer.state:
            return original(self)
        module.HAVE_APEX_OR_TE = True  # the branch that reads no step
        try:
            out = original(self)
        finally:
            module.HAVE_APEX_OR_TE = False
        for group in out["optimizer"]["param_groups"]:
            group.setdefault("step", 0)
        return out

    module.DistributedOptimizer.state_dict = state_dict
    # fp32 parameters (the CPU config): a main param is a view of its model param, a leaf that
    # requires grad, and resume copies the checkpoint into it in place outside no_grad
    setter = module.DistributedOptimizer._set_main_param_and_optimizer_states
    module.DistributedOptimizer._set_main_param_and_optimizer_states = torch.no_grad()(setter)


def local_attention_mask(query: torch.Tensor, attention_mask: Any, packed_seq_params: Any) -> torch.Tensor:
    """megatron's mask (True = masked) for its local DotProductAttention: causal within each sequence.

    Packed (thd) input, one row ``[t, ...]`` of sequences delimited by ``cu_seqlens``: ``[1, 1, t, t]``,
    a token sees the earlier tokens of its own sequence (tokens past the last boundary only themselves).
    Padded (bshd) input with verl's ``[B, S]`` validity mask: ``[B, 1, S, S]``, causal and no padded keys.
    """
    length = query.shape[0]
    positions = torch.arange(length, device=query.device)
    causal = positions[None, :] <= positions[:, None]  # [q, k]: key k at or before query q
    if packed_seq_params is not None:
        bounds = packed_seq_params.cu_seqlens_q_padded
        if bounds is None:
            bounds = packed_seq_params.cu_seqlens_q
        segment = torch.bucketize(positions, bounds.to(query.device).long(), right=True)
        segment = torch.where(positions >= bounds[-1].to(query.device), length + positions, segment)
        visible = causal & (segment[:, None] == segment[None, :])
        return ~visible[None, None]
    valid = attention_mask.bool().to(query.device)  # [B, S], True at real tokens
    return ~(causal[None, None] & valid[:, None, None, :])


def patch_dot_product_attention(module: ModuleType) -> None:
    """megatron's local attention: packed sequences (refused: 'use TEDotProductAttention') and verl's
    [B, S] padding mask (it needs [B, 1, S, S]) become one explicit mask."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(
            self: Any,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            packed = packed_seq_params is not None
            if packed:  # [t, np, hn] -> [t, b=1, np, hn]
                query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if packed or (attention_mask is not None and attention_mask.dim() == 2):
                attention_mask = local_attention_mask(query, attention_mask, packed_seq_params)
            return original(self, query, key, value, attention_mask, attn_mask_type, attention_bias, None)

        return forward

    wrap_once(module.DotProductAttention, "forward", MARKER, make)


def patch_mbridge_local_spec(module: ModuleType) -> None:
    """mbridge.core.llm_bridge: it hard-codes ``use_transformer_engine=True``; build the local layer spec."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_gpt_decoder_block_spec(config: Any, use_transformer_engine: bool = True, **kwargs: Any) -> Any:
            return original(config, use_transformer_engine=False, **kwargs)

        return get_gpt_decoder_block_spec

    wrap_once(module, "get_gpt_decoder_block_spec", MARKER, make)


_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def te_style_name(name: str, expert_offset: int = 0) -> str:
    """A local-spec parameter name as mbridge's (TE-spec) tables spell it.

    ``...input_layernorm.weight`` -> ``...self_attention.linear_qkv.layer_norm_weight`` (TE fuses the
    norm into the QKV projection); ``...mlp.experts.local_experts.<e>.linear_fc1.weight`` ->
    ``...mlp.experts.linear_fc1.weight<e + expert_offset>`` (TE's grouped experts).
    """
    if name.endswith(".input_layernorm.weight"):
        return name[: -len("input_layernorm.weight")] + "self_attention.linear_qkv.layer_norm_weight"
    match = _LOCAL_EXPERT.search(name)
    if match:
        return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{int(match.group(1)) + expert_offset}"
    return name


def patch_mbridge_names(module: ModuleType) -> None:
    """mbridge.core.bridge: its weight tables name TE-spec parameters; map the local spec's onto them.

    With EP the local expert index becomes the global one when loading (``consider_ep``), and
    stays local when exporting, where mbridge all-gathers each expert over the EP group; with
    local names it did not recognise experts and each EP rank exported only its own.
    """
    scope_torch(module)

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def mapping(self: Any, model: Any, consider_ep: bool = True) -> dict[str, str]:
            names = original(self, model, consider_ep=consider_ep)
            offset = 0
            if consider_ep and self.mpu.ep_size > 1:
                offset = (self.config.num_moe_experts // self.mpu.ep_size) * self.mpu.ep_rank
            return {local: te_style_name(name, offset) for local, name in names.items()}

        return mapping

    wrap_once(module.Bridge, "_weight_name_mapping_mcore_local_to_global", MARKER, make)


# ---------------------------------------------------------------------------------------------
# installation
# ---------------------------------------------------------------------------------------------
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "megatron.core.tensor_parallel.random": patch_random,
    "megatron.core.transformer.moe.moe_utils": patch_moe_utils,
    "megatron.core.transformer.moe.token_dispatcher": patch_token_dispatcher,
    "megatron.core.optimizer.optimizer": patch_optimizer,
    "megatron.core.transformer.dot_product_attention": patch_dot_product_attention,
    "megatron.core.optimizer.distrib_optimizer": patch_distrib_optimizer,
    "mbridge.core.util": patch_module_cuda,
    "mbridge.core.llm_bridge": patch_mbridge_local_spec,
    "mbridge.core.bridge": patch_mbridge_names,
}


INSTALL = 'pip install -e ".[megatron-cpu]"'  # the tested set of :data:`SUPPORTED`


def install() -> None:
    """Register every patch as a post-import hook (CPU platform only; see the module doc), each after
    the version check of the distribution its module belongs to."""
    hooks = {"megatron.core": lambda module: None, "mbridge": lambda module: None}
    hooks |= {name: scope_torch for name in TORCH_SCOPED} | PATCHES
    for name, patch in hooks.items():
        distribution = "mbridge" if name.startswith("mbridge") else "megatron-core"
        when_imported(name, checked(patch, distribution, SUPPORTED[distribution], __name__, INSTALL))
