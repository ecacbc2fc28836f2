"""The preflight's facts and estimates (SPEC §7): what the probe gathers about the node
(``Facts``, ``GPU``, ``ModelFacts``), one result line (``Finding``), and the config helpers and
estimates the checks share (``param_count``, ``host_optimizer_bytes``, ``checkpoint_bytes``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

# verl-sat is built on exactly this verl (pyproject.toml pins it).
VERL_VERSION = "0.9.1"
# The sglang that verl 0.9.1's `sglang` extra pins (its METADATA); used when the installed verl's
# metadata does not say (tests check the two agree).
SGLANG_FOR_VERL = "0.5.12"
# The SGLang server argument R3 needs (verl's async_sglang_server sets it when
# rollout.enable_rollout_routing_replay is on).
ROUTED_EXPERTS_ARG = "enable_return_routed_experts"
# Modules imported by the probe; None in Facts.import_errors means the import worked.
PROBED_MODULES = ("megatron.core", "mbridge", "transformer_engine", "sglang.srt.server_args")
# Distributions whose versions the probe records.
PROBED_DISTRIBUTIONS = ("verl", "sglang", "megatron-core", "mbridge", "torch")
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "fp8": 1}
GIB = 1024**3

ROLLOUT = "actor_rollout_ref.rollout"
MEGATRON = "actor_rollout_ref.actor.megatron"
OPTIM = "actor_rollout_ref.actor.optim"


# ---------------------------------------------------------------------------------------------
# facts of the node
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """One visible accelerator: its index, name, total and currently free memory in bytes."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclass
class ModelFacts:
    """What the model path holds locally (nothing is downloaded).

    Args:
        source: the directory ``config.json`` was read from ('' when not found locally).
        config: the parsed ``config.json``, or None.
        weight_bytes: the checkpoint's size in bytes (``model.safetensors.index.json``'s
            ``metadata.total_size``, else the sum of ``*.safetensors``), or None.
    """

    source: str = ""
    config: dict[str, Any] | None = None
    weight_bytes: int | None = None


@dataclass
class Facts:
    """Everything the checks read about the node, gathered once by ``probe``.

    Args:
        gpus: visible GPUs (``CUDA_VISIBLE_DEVICES`` applies).
        cuda_runtime: torch's CUDA runtime version (``torch.version.cuda``), None without CUDA.
        versions: distribution name -> installed version (None: not installed).
        sglang_pin: the sglang version the installed verl's ``sglang`` extra pins.
        import_errors: module -> None when it imports, else the error's one-line text.
        sglang_server_args: the field names of SGLang's ``ServerArgs`` (None: not importable).
        checkpoint_engines: backends registered in verl's ``CheckpointEngineRegistry``.
        checkpoint_engine_errors: verl's recorded import errors of its engine modules.
        cupy_distributions: installed ``cupy*`` distributions (e.g. ``cupy-cuda12x``).
        host_mem_available_bytes: ``MemAvailable`` of /proc/meminfo.
        disk_free_bytes: free bytes on the file system of ``trainer.default_local_dir``.
        model: the model path's local files.
        data_schemas: data file -> {column: struct field names}, or a string saying why not.
        reward_fn_error: None when the reward function loads, else the error.
    """

    gpus: tuple[GPU, ...] = ()
    cuda_runtime: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    sglang_pin: str | None = None
    import_errors: dict[str, str | None] = field(default_factory=dict)
    sglang_server_args: frozenset[str] | None = None
    checkpoint_engines: frozenset[str] = frozenset()
    checkpoint_engine_errors: dict[str, str] = field(default_factory=dict)
    cupy_distributions: tuple[str, ...] = ()
    host_mem_available_bytes: int | None = None
    disk_free_bytes: int | None = None
    model: ModelFacts = field(default_factory=ModelFacts)
    data_schemas: dict[str, dict[str, tuple[str, ...]] | str] = field(default_factory=dict)
    reward_fn_error: str | None = None


@dataclass(frozen=True)
class Finding:
    """One result line. ``level`` is ``fail`` (the launch would break or be wrong) or ``warn``."""

    check: str
    key: str
    message: str
    level: str = "fail"

    def line(self) -> str:
        return f"[preflight] {self.level.upper()} {self.check}: {self.message}"


# ---------------------------------------------------------------------------------------------
# config helpers
# ---------------------------------------------------------------------------------------------
def get(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for a dotted key, ``default`` when absent or null."""
    value = OmegaConf.select(cfg, key, default=default)
    return default if value is None else value


def as_list(value: Any) -> list[str]:
    """A data-files value (one path or a list of them) as a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def is_standalone_rollout(cfg: DictConfig) -> bool:
    """separate_async with ``hybrid_engine=false``: rollout GPUs are a pool of their own."""
    mode = str(get(cfg, "trainer.v1.trainer_mode", "")).removeprefix("sat_")
    return mode == "separate_async" and not bool(get(cfg, "actor_rollout_ref.hybrid_engine", True))


def uses_r3(cfg: DictConfig) -> bool:
    return str(get(cfg, f"{MEGATRON}.router_replay.mode", "disabled")) == "R3" or bool(
        get(cfg, f"{ROLLOUT}.enable_rollout_routing_replay", False)
    )


def trainer_gpus(cfg: DictConfig) -> int:
    return int(get(cfg, "trainer.nnodes", 1)) * int(get(cfg, "trainer.n_gpus_per_node", 0))


def rollout_pool_gpus(cfg: DictConfig) -> int:
    return int(get(cfg, f"{ROLLOUT}.nnodes", 0)) * int(get(cfg, f"{ROLLOUT}.n_gpus_per_node", 0))


def megatron_layout(cfg: DictConfig) -> dict[str, int]:
    """TP, PP, CP, EP and ETP of the actor (ETP null means ETP = TP, as in Megatron)."""
    tp = int(get(cfg, f"{MEGATRON}.tensor_model_parallel_size", 1))
    return {
        "tp": tp,
        "pp": int(get(cfg, f"{MEGATRON}.pipeline_model_parallel_size", 1)),
        "cp": int(get(cfg, f"{MEGATRON}.context_parallel_size", 1)),
        "ep": int(get(cfg, f"{MEGATRON}.expert_model_parallel_size", 1)),
        "etp": int(get(cfg, f"{MEGATRON}.expert_tensor_parallel_size", tp)),
    }


def rollout_replica_gpus(cfg: DictConfig) -> int:
    """GPUs of one rollout replica: TP × DP × PP (verl's RolloutReplica.world_size)."""
    return (
        int(get(cfg, f"{ROLLOUT}.tensor_model_parallel_size", 1))
        * int(get(cfg, f"{ROLLOUT}.data_parallel_size", 1))
        * int(get(cfg, f"{ROLLOUT}.pipeline_model_parallel_size", 1))
    )


def dtype_bytes(name: Any, default: int = 2) -> int:
    return DTYPE_BYTES.get(str(name).removeprefix("torch."), default)


def param_count(facts: Facts) -> int | None:
    """Parameters of the model: checkpoint bytes / bytes of its ``torch_dtype`` (None: unknown)."""
    if facts.model.weight_bytes is None:
        return None
    config = facts.model.config or {}
    return facts.model.weight_bytes // dtype_bytes(config.get("torch_dtype") or config.get("dtype"))


def optimizer_offload_fraction(cfg: DictConfig) -> float:
    """Share of the Adam states kept in host memory: Megatron's hybrid-device optimizer
    (``optimizer_cpu_offload`` with ``optimizer_offload_fraction``, Megatron's default 0) or
    verl's ``megatron.optimizer_offload`` (all of it); 0 when neither is on."""
    override = f"{OPTIM}.override_optimizer_config"
    if bool(get(cfg, f"{override}.optimizer_cpu_offload", False)):
        return float(get(cfg, f"{override}.optimizer_offload_fraction", 0.0))
    return 1.0 if bool(get(cfg, f"{MEGATRON}.optimizer_offload", False)) else 0.0


def adam_bytes_per_param(cfg: DictConfig, with_grad: bool) -> int:
    """fp32 master weight + exp_avg + exp_avg_sq (their configured dtypes) [+ the main grad]."""
    total = 4 + dtype_bytes(get(cfg, f"{OPTIM}.exp_avg_dtype", "fp32"), 4)
    total += dtype_bytes(get(cfg, f"{OPTIM}.exp_avg_sq_dtype", "fp32"), 4)
    if with_grad:
        total += dtype_bytes(get(cfg, f"{OPTIM}.main_grads_dtype", "fp32"), 4)
    return total


def host_optimizer_bytes(cfg: DictConfig, params: int) -> int:
    """Host bytes of the offloaded optimizer = params × fraction × bytes per parameter.

    Megatron's hybrid-device optimizer keeps master weight, both moments and the main grad on the
    CPU (16 bytes at fp32); verl's ``optimizer_offload`` moves master weight and moments (12).
    With the distributed optimizer the states are sharded, not replicated, over data parallelism.
    """
    fraction = optimizer_offload_fraction(cfg)
    hybrid = bool(get(cfg, f"{OPTIM}.override_optimizer_config.optimizer_cpu_offload", False))
    return int(params * fraction * adam_bytes_per_param(cfg, with_grad=hybrid))


def checkpoint_bytes(cfg: DictConfig, params: int) -> int:
    """One checkpoint: model (params × model dtype) + optimizer (params × Adam bytes, no grad) +
    hf_model (params × model dtype), for what ``actor.checkpoint.save_contents`` lists."""
    contents = set(as_list(get(cfg, "actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer"])))
    weight = dtype_bytes(get(cfg, f"{MEGATRON}.dtype", "bfloat16"))
    per_param = weight * (("model" in contents) + ("hf_model" in contents))
    per_param += adam_bytes_per_param(cfg, with_grad=False) if "optimizer" in contents else 0
    return params * per_param


def kept_checkpoints(cfg: DictConfig) -> int:
    """``trainer.max_actor_ckpt_to_keep``, or every save of the run when it is unset (null/<= 0)."""
    save_freq = int(get(cfg, "trainer.save_freq", -1))
    if save_freq <= 0:
        return 0
    keep = int(get(cfg, "trainer.max_actor_ckpt_to_keep", 0) or 0)
    total = int(get(cfg, "trainer.total_training_steps", 0) or 0)
    every = math.ceil(total / save_freq) if total > 0 else 1
    return min(keep, every) if keep > 0 else every


def trainer_gpu_bytes(cfg: DictConfig, params: int) -> int:
    """A lower bound of one trainer GPU's memory (activations and buffers not counted).

    Per GPU = params / shards × (weight dtype + main grad) + Adam states kept on the GPU
    / (shards × DP) + the reference model's weights (when a KL term needs it and it is not
    offloaded), with shards = PP × max(TP, EP × ETP) and DP = trainer GPUs / (TP × PP × CP).
    """
    lay = megatron_layout(cfg)
    shards = lay["pp"] * max(lay["tp"], lay["ep"] * lay["etp"])
    dp = max(1, trainer_gpus(cfg) // (lay["tp"] * lay["pp"] * lay["cp"]))
    weight = dtype_bytes(get(cfg, f"{MEGATRON}.dtype", "bfloat16"))
    grad = dtype_bytes(get(cfg, f"{OPTIM}.main_grads_dtype", "fp32"), 4)
    total = params * (weight + grad) / shards
    on_gpu = 1.0 - optimizer_offload_fraction(cfg)
    total += params * on_gpu * adam_bytes_per_param(cfg, with_grad=False) / (shards * dp)
    needs_ref = bool(get(cfg, "actor_rollout_ref.actor.use_kl_loss", False)) or bool(
        get(cfg, "algorithm.use_kl_in_reward", False)
    )
    if needs_ref and not bool(get(cfg, "actor_rollout_ref.ref.megatron.param_offload", False)):
        total += params * weight / shards
    return int(total)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"
