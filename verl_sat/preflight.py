"""Preflight: check a cell of the paper's grid against the node it is about to run on (SPEC §7).

``python -m verl_sat.preflight <method> <lag> [--run-dir DIR] [--json] [hydra overrides...]``
resolves the cell exactly as ``recipes/sat_paper/run.sh`` launches it (``verl_sat.recipes``
composes it, then ``verl_sat.schedule`` maps ``sat.lag`` / ``sat.routing_replay`` onto verl's keys
as ``verl_sat.main`` does), gathers the node's facts once (``probe``) and runs pure checks
``(config, facts) -> findings`` over them. Every failure is one line naming the key or package
and the fix; the exit code is 1 when any check fails. ``run.sh`` runs it before the launch
(``SAT_SKIP_PREFLIGHT=1`` skips it).

What is checked, and the estimates used, is listed in docs/reproduce.md. Nothing heavy is
imported at module import: torch, sglang, megatron, cupy, pyarrow and verl's checkpoint engines
are imported inside ``probe`` only, so the checks run on any machine with faked ``Facts``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
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


# ---------------------------------------------------------------------------------------------
# checks: pure functions (config, facts) -> findings
# ---------------------------------------------------------------------------------------------
def check_gpu_count(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """This node has the GPUs of the trainer pool plus the standalone rollout pool."""
    n_train = int(get(cfg, "trainer.n_gpus_per_node", 0))
    n_roll = int(get(cfg, f"{ROLLOUT}.n_gpus_per_node", 0)) if is_standalone_rollout(cfg) else 0
    single_node = int(get(cfg, "trainer.nnodes", 1)) == 1 and int(get(cfg, f"{ROLLOUT}.nnodes", 0)) <= 1
    need = n_train + n_roll if single_node else max(n_train, n_roll)
    have = len(facts.gpus)
    out = []
    if have < need:
        layout = f"trainer.n_gpus_per_node={n_train}" + (f" + {ROLLOUT}.n_gpus_per_node={n_roll}" if n_roll else "")
        out.append(
            Finding(
                "gpu_count",
                "trainer.n_gpus_per_node",
                f"{layout} needs {need} GPUs on this node, {have} visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); run on a node with {need} GPUs or lower "
                "trainer.n_gpus_per_node / actor_rollout_ref.rollout.n_gpus_per_node",
            )
        )
    if not single_node:
        out.append(
            Finding(
                "gpu_count", "trainer.nnodes", "multi-node layout: only this node's GPUs were checked", level="warn"
            )
        )
    return out


def check_parallel_layout(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Megatron's TP×PP×CP and ETP×EP×PP divide the trainer GPUs; rollout replicas fill their pool."""
    out = []
    n_train = trainer_gpus(cfg)
    lay = megatron_layout(cfg)
    if str(get(cfg, "actor_rollout_ref.actor.strategy", "")) == "megatron":
        dense = lay["tp"] * lay["pp"] * lay["cp"]
        if n_train % dense:
            out.append(
                Finding(
                    "parallel_layout",
                    f"{MEGATRON}.tensor_model_parallel_size",
                    f"TP {lay['tp']} × PP {lay['pp']} × CP {lay['cp']} = {dense} does not divide the {n_train} "
                    f"trainer GPUs (trainer.nnodes × trainer.n_gpus_per_node); change {MEGATRON}."
                    "tensor/pipeline/context_parallel_size or trainer.n_gpus_per_node",
                )
            )
        expert = lay["etp"] * lay["ep"] * lay["pp"]
        if n_train % expert:
            out.append(
                Finding(
                    "parallel_layout",
                    f"{MEGATRON}.expert_model_parallel_size",
                    f"ETP {lay['etp']} × EP {lay['ep']} × PP {lay['pp']} = {expert} does not divide the {n_train} "
                    f"trainer GPUs; change {MEGATRON}.expert_model_parallel_size / expert_tensor_parallel_size "
                    "(null means ETP = TP)",
                )
            )
    replica = rollout_replica_gpus(cfg)
    pool = rollout_pool_gpus(cfg) if is_standalone_rollout(cfg) else n_train
    pool_key = f"{ROLLOUT}.n_gpus_per_node" if is_standalone_rollout(cfg) else "trainer.n_gpus_per_node"
    if is_standalone_rollout(cfg) and pool <= 0:
        out.append(
            Finding(
                "parallel_layout",
                f"{ROLLOUT}.nnodes",
                f"separate_async with hybrid_engine=false needs a rollout pool: set {ROLLOUT}.nnodes >= 1 and "
                f"{ROLLOUT}.n_gpus_per_node >= 1 (now {get(cfg, f'{ROLLOUT}.nnodes')} × "
                f"{get(cfg, f'{ROLLOUT}.n_gpus_per_node')})",
            )
        )
    elif pool % replica:
        out.append(
            Finding(
                "parallel_layout",
                f"{ROLLOUT}.tensor_model_parallel_size",
                f"a rollout replica takes TP × DP × PP = {replica} GPUs, which does not divide the {pool} rollout "
                f"GPUs ({pool_key}); change {ROLLOUT}.tensor_model_parallel_size or {pool_key}",
            )
        )
    return out


def check_gpu_memory(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Free memory covers ``gpu_memory_utilization``; weights fit the trainer and rollout shards."""
    out = []
    util = float(get(cfg, f"{ROLLOUT}.gpu_memory_utilization", 0.5))
    if not 0.0 < util <= 1.0:
        return [
            Finding("gpu_memory", f"{ROLLOUT}.gpu_memory_utilization", f"must be in (0, 1], got {util}; set e.g. 0.85")
        ]
    if not facts.gpus:
        return out
    short = [g for g in facts.gpus if g.free_bytes < util * g.total_bytes]
    if short:
        worst = min(short, key=lambda g: g.free_bytes)
        out.append(
            Finding(
                "gpu_memory",
                f"{ROLLOUT}.gpu_memory_utilization",
                f"GPU(s) {[g.index for g in short]} have less free memory than gpu_memory_utilization={util} of "
                f"their total (GPU {worst.index}: {gib(worst.free_bytes)} free of {gib(worst.total_bytes)}); "
                f"stop the processes holding them or lower {ROLLOUT}.gpu_memory_utilization",
            )
        )
    params = param_count(facts)
    if params is None:
        return out
    smallest = min(g.total_bytes for g in facts.gpus)
    rollout_shards = int(get(cfg, f"{ROLLOUT}.tensor_model_parallel_size", 1)) * int(
        get(cfg, f"{ROLLOUT}.pipeline_model_parallel_size", 1)
    )
    rollout_weights = params * dtype_bytes(get(cfg, f"{ROLLOUT}.dtype", "bfloat16")) / rollout_shards
    if rollout_weights >= util * smallest:
        out.append(
            Finding(
                "gpu_memory",
                f"{ROLLOUT}.tensor_model_parallel_size",
                f"the rollout's weight shard (params × dtype / (TP × PP) = {gib(rollout_weights)}) leaves no KV "
                f"cache in gpu_memory_utilization {util} × {gib(smallest)}; raise {ROLLOUT}.tensor_model_parallel_size "
                "or gpu_memory_utilization",
            )
        )
    if str(get(cfg, "actor_rollout_ref.actor.strategy", "")) == "megatron":
        train = trainer_gpu_bytes(cfg, params)
        if train >= smallest:
            out.append(
                Finding(
                    "gpu_memory",
                    f"{OPTIM}.override_optimizer_config.optimizer_cpu_offload",
                    f"a trainer GPU needs at least {gib(train)} (weights + main grads + on-GPU Adam + reference "
                    f"weights, per shard) but has {gib(smallest)}; offload the optimizer "
                    f"({OPTIM}.override_optimizer_config.optimizer_cpu_offload=true, optimizer_offload_fraction=1.0) "
                    f"or raise {MEGATRON}.tensor/expert_model_parallel_size",
                )
            )
    return out


def check_versions(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """verl == 0.9.1; with SGLang rollout, the sglang that verl's ``sglang`` extra pins."""
    out = []
    verl = facts.versions.get("verl")
    if verl != VERL_VERSION:
        out.append(
            Finding(
                "versions",
                "verl",
                f"verl {verl or 'not installed'}; verl-sat needs verl=={VERL_VERSION}: "
                f"pip install 'verl[sglang,megatron]=={VERL_VERSION}'",
            )
        )
    if str(get(cfg, f"{ROLLOUT}.name", "")) == "sglang":
        want = facts.sglang_pin or SGLANG_FOR_VERL
        have = facts.versions.get("sglang")
        if have != want:
            out.append(
                Finding(
                    "versions",
                    "sglang",
                    f"sglang {have or 'not installed'}; {ROLLOUT}.name=sglang and verl {VERL_VERSION}'s sglang extra "
                    f"pins sglang=={want}: pip install 'sglang=={want}'",
                )
            )
    return out


def check_routing_replay(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """R3 on: SGLang's ServerArgs accepts ``enable_return_routed_experts``."""
    if not uses_r3(cfg) or str(get(cfg, f"{ROLLOUT}.name", "")) != "sglang":
        return []
    if facts.sglang_server_args is None:
        error = facts.import_errors.get("sglang.srt.server_args") or "not importable"
        return [
            Finding(
                "routing_replay",
                f"{ROLLOUT}.enable_rollout_routing_replay",
                f"R3 needs SGLang's ServerArgs, but sglang.srt.server_args does not import ({error}); install "
                f"sglang=={facts.sglang_pin or SGLANG_FOR_VERL} or turn R3 off (stabilizer=none)",
            )
        ]
    if ROUTED_EXPERTS_ARG not in facts.sglang_server_args:
        return [
            Finding(
                "routing_replay",
                f"{ROLLOUT}.enable_rollout_routing_replay",
                f"R3 is on but this SGLang's ServerArgs has no '{ROUTED_EXPERTS_ARG}' (the server cannot return "
                f"routed experts); install sglang=={facts.sglang_pin or SGLANG_FOR_VERL} or turn R3 off",
            )
        ]
    return []


def cupy_cuda_major(distribution: str) -> str | None:
    """``cupy-cuda12x`` -> ``12``; None for a source build (``cupy``)."""
    tail = distribution.removeprefix("cupy-cuda")
    return tail[:-1] if tail != distribution and tail.endswith("x") else None


def check_checkpoint_engine(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """The weight-sync backend is registered in verl; for nccl, one cupy matching CUDA."""
    backend = str(get(cfg, f"{ROLLOUT}.checkpoint_engine.backend", "naive"))
    key = f"{ROLLOUT}.checkpoint_engine.backend"
    out = []
    cuda_major = (facts.cuda_runtime or "").split(".")[0] or None
    fix_cupy = (
        f"pip install cupy-cuda{cuda_major or '<CUDA major>'}x (verl's megatron extra pins cupy-cuda13x for CUDA 13)"
    )
    if backend not in facts.checkpoint_engines:
        reason = facts.checkpoint_engine_errors.get(f"{backend}_checkpoint_engine", "")
        out.append(
            Finding(
                "checkpoint_engine",
                key,
                f"{key}={backend} is not registered in verl's CheckpointEngineRegistry"
                + (f" (its module failed: {reason})" if reason else "")
                + (f"; {fix_cupy}" if backend == "nccl" else ""),
            )
        )
    if backend == "nccl":
        if len(facts.cupy_distributions) > 1:
            out.append(
                Finding(
                    "checkpoint_engine",
                    "cupy",
                    f"several cupy builds installed {list(facts.cupy_distributions)}; "
                    f"keep one: pip uninstall them, then {fix_cupy}",
                )
            )
        for dist in facts.cupy_distributions:
            major = cupy_cuda_major(dist)
            if major and cuda_major and major != cuda_major:
                out.append(
                    Finding(
                        "checkpoint_engine",
                        "cupy",
                        f"{dist} is built for CUDA {major}, torch runs CUDA "
                        f"{facts.cuda_runtime}; pip uninstall {dist} && {fix_cupy}",
                    )
                )
    return out


def check_megatron(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """megatron-core imports; mbridge when ``use_mbridge``; TransformerEngine for the precision-aware Adam."""
    if str(get(cfg, "actor_rollout_ref.actor.strategy", "")) != "megatron":
        return []
    needs = {"megatron.core": ("megatron-core", "actor_rollout_ref.actor.strategy=megatron")}
    if bool(get(cfg, f"{MEGATRON}.use_mbridge", False)):
        needs["mbridge"] = ("mbridge", f"{MEGATRON}.use_mbridge=true")
    if bool(get(cfg, f"{OPTIM}.use_precision_aware_optimizer", False)):
        needs["transformer_engine"] = ("transformer-engine", f"{OPTIM}.use_precision_aware_optimizer=true")
    out = []
    for module, (package, why) in needs.items():
        error = facts.import_errors.get(module, "not probed")
        if error is not None:
            out.append(
                Finding(
                    "megatron",
                    package,
                    f"{module} does not import ({error}); {why} needs it: "
                    f"pip install 'verl[megatron]=={VERL_VERSION}' (it pulls {package})",
                )
            )
    return out


def max_position_embeddings(cfg: DictConfig, config: dict[str, Any]) -> int | None:
    """The model's context as verl's HFModelConfig sees it (``override_config`` applied)."""
    override = dict(get(cfg, "actor_rollout_ref.model.override_config", {}) or {})
    override = dict(override.get("model_config", override))
    value = override.get("max_position_embeddings", config.get("max_position_embeddings"))
    if value is None:
        value = (config.get("text_config") or {}).get("max_position_embeddings")
    return None if value is None else int(value)


def check_context_length(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """prompt + response <= the model's max_position_embeddings (SGLang's max_model_len cap)."""
    path = get(cfg, "actor_rollout_ref.model.path", "")
    if facts.model.config is None:
        return [
            Finding(
                "context_length",
                "actor_rollout_ref.model.path",
                f"no local config.json for {path} (local "
                "directory or Hugging Face cache); download the model first to check max_position_embeddings",
                level="warn",
            )
        ]
    limit = max_position_embeddings(cfg, facts.model.config)
    prompt, response = int(get(cfg, "data.max_prompt_length", 0)), int(get(cfg, "data.max_response_length", 0))
    out = []
    if limit is None:
        return [
            Finding(
                "context_length",
                "actor_rollout_ref.model.path",
                f"{facts.model.source}/config.json has no max_position_embeddings",
                level="warn",
            )
        ]
    if prompt + response > limit:
        out.append(
            Finding(
                "context_length",
                "data.max_response_length",
                f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = {prompt + response} > "
                f"max_position_embeddings {limit} of {facts.model.source}/config.json: SGLang caps max_model_len "
                f"there and silently cuts responses; lower data.max_response_length to {limit - prompt} or extend "
                "the context (actor_rollout_ref.model.override_config: rope_scaling + max_position_embeddings)",
            )
        )
    max_model_len = get(cfg, f"{ROLLOUT}.max_model_len")
    if max_model_len is not None and int(max_model_len) > limit:
        out.append(
            Finding(
                "context_length",
                f"{ROLLOUT}.max_model_len",
                f"{ROLLOUT}.max_model_len={max_model_len} > "
                f"max_position_embeddings {limit} (verl's SGLang server refuses it); set it <= {limit} or null",
            )
        )
    return out


def unknown_size(check: str) -> Finding:
    return Finding(
        check,
        "actor_rollout_ref.model.path",
        "not estimated: the model's weights are not on this node (no model.safetensors.index.json or *.safetensors)",
        level="warn",
    )


def check_host_memory(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Available host memory >= the offloaded optimizer's estimate (``host_optimizer_bytes``)."""
    params = param_count(facts)
    fraction = optimizer_offload_fraction(cfg)
    if fraction <= 0 or facts.host_mem_available_bytes is None:
        return []
    if params is None:
        return [unknown_size("host_memory")]
    need = host_optimizer_bytes(cfg, params)
    if facts.host_mem_available_bytes < need:
        per = adam_bytes_per_param(cfg, bool(get(cfg, f"{OPTIM}.override_optimizer_config.optimizer_cpu_offload")))
        return [
            Finding(
                "host_memory",
                f"{OPTIM}.override_optimizer_config.optimizer_offload_fraction",
                f"the offloaded optimizer needs params × fraction × bytes = {params / 1e9:.1f}e9 × {fraction} × {per} "
                f"= {gib(need)} of host memory, {gib(facts.host_mem_available_bytes)} available; use a node with "
                f"more memory or lower {OPTIM}.override_optimizer_config.optimizer_offload_fraction",
            )
        ]
    return []


def check_disk(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Free disk at ``trainer.default_local_dir`` >= kept checkpoints × ``checkpoint_bytes``."""
    params = param_count(facts)
    kept = kept_checkpoints(cfg)
    if facts.disk_free_bytes is None or kept == 0:
        return []
    if params is None:
        return [unknown_size("disk")]
    size = checkpoint_bytes(cfg, params)
    if facts.disk_free_bytes < kept * size:
        return [
            Finding(
                "disk",
                "trainer.max_actor_ckpt_to_keep",
                f"{kept} kept checkpoints × {gib(size)} (params × (model dtype + Adam bytes)) = {gib(kept * size)}, "
                f"but {gib(facts.disk_free_bytes)} free at trainer.default_local_dir="
                f"{get(cfg, 'trainer.default_local_dir')}; free disk, point sat.run_dir elsewhere or lower "
                "trainer.max_actor_ckpt_to_keep",
            )
        ]
    return []


def check_data(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Train/val files exist with the prompt, ``reward_model.ground_truth`` and data-source columns."""
    prompt_key = str(get(cfg, "data.prompt_key", "prompt"))
    source_key = str(get(cfg, "data.reward_fn_key", "data_source"))
    out = []
    for key in ("data.train_files", "data.val_files"):
        for path in as_list(get(cfg, key)):
            schema = facts.data_schemas.get(path, "not probed")
            if isinstance(schema, str):
                out.append(
                    Finding(
                        "data",
                        key,
                        f"{key}: {path}: {schema}; write it with python -m "
                        "verl_sat.data.prepare_math --out DIR (run.sh: DATA_DIR=DIR)",
                    )
                )
                continue
            missing = [c for c in (prompt_key, source_key) if c not in schema]
            if "ground_truth" not in schema.get("reward_model", ()):
                missing.append("reward_model.ground_truth")
            if missing:
                out.append(
                    Finding(
                        "data",
                        key,
                        f"{key}: {path} lacks column(s) {missing} (has {sorted(schema)}); the "
                        f"recipe reads data.prompt_key={prompt_key}, data.reward_fn_key={source_key} and "
                        "reward_model.ground_truth: rewrite it with python -m verl_sat.data.prepare_math",
                    )
                )
    return out


def check_reward_function(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """The reward function loads: ``reward.custom_reward_function.path/name``, else verl's default."""
    if facts.reward_fn_error is None:
        return []
    path = get(cfg, "reward.custom_reward_function.path")
    key = "reward.custom_reward_function.path" if path else "reward.custom_reward_function"
    what = f"{path}:{get(cfg, 'reward.custom_reward_function.name')}" if path else "verl's default_compute_score"
    return [
        Finding(
            "reward",
            key,
            f"the reward function {what} does not load ({facts.reward_fn_error}); fix "
            "reward.custom_reward_function.path/name",
        )
    ]


CHECKS: tuple[Callable[[DictConfig, Facts], list[Finding]], ...] = (
    check_gpu_count,
    check_parallel_layout,
    check_gpu_memory,
    check_versions,
    check_routing_replay,
    check_checkpoint_engine,
    check_megatron,
    check_context_length,
    check_host_memory,
    check_disk,
    check_data,
    check_reward_function,
)


def run_checks(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Every check of ``CHECKS`` on one resolved config and one node's facts."""
    return [finding for check in CHECKS for finding in check(cfg, facts)]


# ---------------------------------------------------------------------------------------------
# the config, as run.sh launches it
# ---------------------------------------------------------------------------------------------
def resolve_cell(method: str, lag: int, overrides: Sequence[str] = (), run_dir: str | None = None) -> DictConfig:
    """The cell's config as ``verl_sat.main`` hands it to verl: composed by ``verl_sat.recipes``,
    ``sat.*`` mapped by ``verl_sat.schedule`` (lag, actor, routing replay), then resolved."""
    from verl_sat.recipes import compose_cell
    from verl_sat.schedule import SATRecipeConfig, apply_actor, apply_lag, apply_routing_replay

    extra = ([f"sat.run_dir={run_dir}"] if run_dir else []) + list(overrides)
    cfg = compose_cell(method, lag, overrides=extra)
    sat = SATRecipeConfig.from_node(cfg.get("sat"))
    apply_lag(cfg, sat.lag)
    apply_actor(cfg, sat.actor)
    apply_routing_replay(cfg, sat.routing_replay)
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


# ---------------------------------------------------------------------------------------------
# probe: the only place that touches the node (heavy imports inside)
# ---------------------------------------------------------------------------------------------
def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def probe_gpus() -> tuple[tuple[GPU, ...], str | None]:
    try:
        import torch
    except ImportError:
        return (), None
    if not torch.cuda.is_available():
        return (), torch.version.cuda
    gpus = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GPU(i, torch.cuda.get_device_name(i), int(total), int(free)))
    return tuple(gpus), torch.version.cuda


def probe_versions() -> tuple[dict[str, str | None], str | None, tuple[str, ...]]:
    """Installed versions, verl's sglang pin (its METADATA) and the cupy distributions."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in PROBED_DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    pin = None
    try:
        for req in metadata.requires("verl") or []:
            spec, _, marker = req.partition(";")
            if spec.replace(" ", "").startswith("sglang==") and "sglang" in marker:
                pin = spec.split("==", 1)[1].strip()
    except metadata.PackageNotFoundError:
        pass
    cupy = sorted(
        {
            d.metadata["Name"].lower()
            for d in metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith("cupy")
        }
    )
    return versions, pin, tuple(cupy)


def probe_imports() -> tuple[dict[str, str | None], frozenset[str] | None]:
    import dataclasses
    import importlib

    errors: dict[str, str | None] = {}
    server_args = None
    for module in PROBED_MODULES:
        try:
            mod = importlib.import_module(module)
            errors[module] = None
            if module == "sglang.srt.server_args":
                server_args = frozenset(f.name for f in dataclasses.fields(mod.ServerArgs))
        except Exception as err:  # noqa: BLE001 (any import failure is a fact to report)
            errors[module] = one_line(err)
    return errors, server_args


def probe_checkpoint_engines() -> tuple[frozenset[str], dict[str, str]]:
    try:
        from verl.checkpoint_engine import CheckpointEngineRegistry
    except Exception as err:  # noqa: BLE001
        return frozenset(), {"verl.checkpoint_engine": one_line(err)}
    errors = {module: one_line(err) for module, err in CheckpointEngineRegistry._import_errors.items()}
    return frozenset(CheckpointEngineRegistry._registry), errors


def probe_host_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def probe_disk(path: str) -> int | None:
    """Free bytes on the file system that will hold ``path`` (its nearest existing parent)."""
    target = Path(path).expanduser().absolute()
    while not target.exists() and target != target.parent:
        target = target.parent
    try:
        return shutil.disk_usage(target).free
    except OSError:
        return None


def local_model_dir(path: str) -> Path | None:
    """A local directory, or the Hugging Face cache's snapshot of a hub id (never downloads)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id=path, filename="config.json")
    except Exception:  # noqa: BLE001 (not a valid repo id: not cached)
        return None
    return Path(found).parent if isinstance(found, str) else None


def probe_model(path: str) -> ModelFacts:
    directory = local_model_dir(path)
    if directory is None or not (directory / "config.json").is_file():
        return ModelFacts()
    config = json.loads((directory / "config.json").read_text())
    index = directory / "model.safetensors.index.json"
    weight_bytes = None
    if index.is_file():
        weight_bytes = json.loads(index.read_text()).get("metadata", {}).get("total_size")
    if weight_bytes is None:
        shards = list(directory.glob("*.safetensors"))
        weight_bytes = sum(s.stat().st_size for s in shards) if shards else None
    return ModelFacts(str(directory), config, None if weight_bytes is None else int(weight_bytes))


def probe_data(paths: Sequence[str]) -> dict[str, dict[str, tuple[str, ...]] | str]:
    """Each data file's columns (and struct fields), from the parquet schema alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out: dict[str, dict[str, tuple[str, ...]] | str] = {}
    for path in paths:
        local = Path(path).expanduser()
        if not local.is_file():
            out[path] = "file not found"
            continue
        try:
            schema = pq.read_schema(local)
        except Exception as err:  # noqa: BLE001
            out[path] = f"not a readable parquet file ({one_line(err)})"
            continue
        out[path] = {
            f.name: tuple(f.type.field(i).name for i in range(f.type.num_fields)) if pa.types.is_struct(f.type) else ()
            for f in schema
        }
    return out


def probe_reward(cfg: DictConfig) -> str | None:
    """None when verl can load the reward function (``load_extern_object``, as verl does)."""
    path, name = get(cfg, "reward.custom_reward_function.path"), get(cfg, "reward.custom_reward_function.name")
    try:
        if path:
            from verl.utils.import_utils import load_extern_object

            fn = load_extern_object(module_path=path, object_name=name)
        else:
            from verl.utils.reward_score import default_compute_score as fn
        return None if callable(fn) else f"{name} is not callable"
    except Exception as err:  # noqa: BLE001
        return one_line(err)


def probe(cfg: DictConfig) -> Facts:
    """Gather the node's facts for one resolved config (GPUs, packages, memory, disk, files)."""
    gpus, cuda = probe_gpus()
    versions, pin, cupy = probe_versions()
    imports, server_args = probe_imports()
    engines, engine_errors = probe_checkpoint_engines()
    data_files = as_list(get(cfg, "data.train_files")) + as_list(get(cfg, "data.val_files"))
    return Facts(
        gpus=gpus,
        cuda_runtime=cuda,
        versions=versions,
        sglang_pin=pin,
        import_errors=imports,
        sglang_server_args=server_args,
        checkpoint_engines=engines,
        checkpoint_engine_errors=engine_errors,
        cupy_distributions=cupy,
        host_mem_available_bytes=probe_host_memory(),
        disk_free_bytes=probe_disk(str(get(cfg, "trainer.default_local_dir", "."))),
        model=probe_model(str(get(cfg, "actor_rollout_ref.model.path", ""))),
        data_schemas=probe_data(data_files),
        reward_fn_error=probe_reward(cfg),
    )


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def summary(findings: Sequence[Finding]) -> str:
    fails = sum(f.level == "fail" for f in findings)
    warns = len(findings) - fails
    verdict = "FAILED" if fails else "passed"
    return f"[preflight] {verdict}: {fails} failure(s), {warns} warning(s) over {len(CHECKS)} checks"


def report_json(findings: Sequence[Finding], facts: Facts) -> str:
    facts_dict = asdict(facts)
    for key in ("sglang_server_args", "checkpoint_engines"):
        value = facts_dict[key]
        facts_dict[key] = None if value is None else sorted(value)
    if facts_dict["sglang_server_args"] is not None:
        facts_dict["sglang_server_args"] = ROUTED_EXPERTS_ARG in facts_dict["sglang_server_args"]
    return json.dumps(
        {
            "ok": not any(f.level == "fail" for f in findings),
            "findings": [asdict(f) for f in findings],
            "facts": facts_dict,
        },
        indent=1,
        default=str,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_sat.preflight",
        description="Check a cell of the paper's grid against this node before launching it (docs/reproduce.md).",
    )
    parser.add_argument("method", help="a Table-1 method (python -m verl_sat.recipes --list)")
    parser.add_argument("lag", type=int, help="the lag (1 or 8)")
    parser.add_argument("hydra_overrides", nargs="*", help="the Hydra overrides run.sh passes")
    parser.add_argument("--run-dir", default=None, help="the run directory (sat.run_dir), as run.sh sets it")
    parser.add_argument("--json", action="store_true", help="print findings and facts as JSON")
    return parser


def main(argv: Sequence[str] | None = None, probe_fn: Callable[[DictConfig], Facts] = probe) -> int:
    """Resolve the cell, probe the node, run the checks; 0 when nothing fails, 1 otherwise."""
    args = _parser().parse_intermixed_args(argv)
    cfg = resolve_cell(args.method, args.lag, args.hydra_overrides, run_dir=args.run_dir)
    facts = probe_fn(cfg)
    findings = run_checks(cfg, facts)
    if args.json:
        print(report_json(findings, facts))
    else:
        for finding in findings:
            print(finding.line())
        print(summary(findings))
    return 1 if any(f.level == "fail" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
