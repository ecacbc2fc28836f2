"""The preflight's config helpers and estimates (docs/reproduce.md, "Host memory"): the keys the
checks read, and the sizes they compare with a node's facts (``host_memory_bytes``: the offloaded
optimizer, ``rollout_buffer_bytes`` and ``rank_copy_bytes``; ``warmup_prompts``, ``checkpoint_bytes``,
``snapshot_bytes``, ``trainer_gpu_bytes``). Where verl computes a number itself (the warm-up prompts, the fields a
step writes back), its own code is called."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

# What TransferQueue holds per sample of the rollout buffer (verl's agent_loop_tq puts
# AgentLoopOutput.as_dict() unpadded): int64 input_ids, prompts + responses and position_ids over
# the whole sequence; int64 response_mask and loss_mask, fp32 rollout_log_probs and rm_scores
# over the response. R3 adds routed_experts: int16 [sequence, layers, top-k].
BUFFER_BYTES_PER_TOKEN = 3 * 8
BUFFER_BYTES_PER_RESPONSE_TOKEN = 2 * 8 + 2 * 4
# What verl's step writes back onto the batch it trains, fp32 over the response, before the save
# (trainer_base.py's fit: step -> _save_checkpoint -> kv_clear of the step's batch).
WRITEBACK_BYTES_PER_RESPONSE_TOKEN = 4
ROUTE_ID_BYTES = 2
DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "fp8": 1}
GIB = 1024**3

ROLLOUT = "actor_rollout_ref.rollout"
MEGATRON = "actor_rollout_ref.actor.megatron"
OPTIM = "actor_rollout_ref.actor.optim"


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


def on_cpu(cfg: DictConfig) -> bool:
    """A CPU run (``trainer.device=cpu``, the embedded default): no GPU to check (its "GPUs" are Ray's CPU slots)."""
    return str(get(cfg, "trainer.device", "cuda")) == "cpu"


def is_standalone_rollout(cfg: DictConfig) -> bool:
    """separate_async with ``hybrid_engine=false``: rollout GPUs are a pool of their own."""
    return base_mode(cfg) == "separate_async" and not bool(get(cfg, "actor_rollout_ref.hybrid_engine", True))


def bridge_module(cfg: DictConfig) -> str:
    """The module verl's Megatron engine imports for the HF <-> Megatron bridge (``BRIDGES``):
    ``megatron.bridge`` unless ``actor.megatron.vanilla_mbridge`` is true (then ``mbridge``)."""
    return "mbridge" if bool(get(cfg, f"{MEGATRON}.vanilla_mbridge", False)) else "megatron.bridge"


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


def base_mode(cfg: DictConfig) -> str:
    """verl's trainer mode (``trainer.v1.trainer_mode`` without verl-sat's ``sat_`` prefix)."""
    return str(get(cfg, "trainer.v1.trainer_mode", "sync")).removeprefix("sat_")


def warmup_prompts(cfg: DictConfig) -> int:
    """Prompts verl issues ahead of the first global step, counted by verl's own code.

    The trainer class verl registers for the mode (``get_trainer_cls``; verl-sat's ``sat_`` classes
    leave ``on_train_begin`` to it) runs its ``on_train_begin`` on a stand-in: the config with
    ``data.gen_batch_size=1`` in the async modes, as verl's ``_init_dataloader`` forces it there
    ("exact refill counts require single-prompt dataloader fetches"; ``sync`` issues no warm-up,
    so its value does not matter), nothing restored from a checkpoint (a resume tops the
    restored groups up to the same number), and
    ``_add_prompts_to_generate`` counting prompts instead of fetching them. In the async modes
    that is ``_add_async_warmup_batches``: floor(num_warmup_batches × train_batch_size /
    gen_batch_size) × gen_batch_size with gen_batch_size = 1, i.e. 256 prompts at lag 1
    (1 × 256) and at lag 8 (0.125 × 2048); ``sync`` has none.
    """
    import copy
    import logging
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # verl's optional engines warn when they are absent
        from verl.trainer.ppo.v1 import trainer_base

    config = copy.deepcopy(cfg)
    if base_mode(cfg) != "sync":
        with open_dict(config):
            OmegaConf.update(config, "data.gen_batch_size", 1, force_add=True)
    trainer = object.__new__(trainer_base.get_trainer_cls(base_mode(cfg)))
    issued: list[int] = []
    trainer.config = config
    trainer._restored_tq_prompt_count = 0
    trainer._add_prompts_to_generate = lambda n: issued.append(int(n)) or int(n)
    log = logging.getLogger(trainer_base.__name__)
    level = log.level
    log.setLevel(logging.WARNING)  # its "Added N warmup prompts" line is the trainer's, not the preflight's
    try:
        trainer.on_train_begin()
    finally:
        log.setLevel(level)
    return sum(issued)


def buffered_prompts(cfg: DictConfig) -> int:
    """Prompt groups TransferQueue holds at once: the global step's ``data.train_batch_size`` plus
    the warm-up window verl keeps in flight ahead of it (``warmup_prompts``). A step's groups are
    cleared (``kv_clear``) after the step and its checkpoint, so a snapshot holds as many."""
    batch = int(get(cfg, "data.train_batch_size", 0))
    if batch <= 0:
        return 0
    return batch + warmup_prompts(cfg)


def route_bytes_per_token(cfg: DictConfig, config: dict[str, Any] | None) -> int | None:
    """R3's routed_experts per token: layers × top-k × int16 (0 when R3 is off; None: unknown)."""
    if not bool(get(cfg, f"{ROLLOUT}.enable_rollout_routing_replay", False)):
        return 0
    config = config or {}
    if "num_hidden_layers" not in config:
        config = config.get("text_config") or {}
    layers, top_k = config.get("num_hidden_layers"), config.get("num_experts_per_tok")
    if layers is None or top_k is None:
        return None
    return int(layers) * int(top_k) * ROUTE_ID_BYTES


def rollout_buffer_bytes(cfg: DictConfig, config: dict[str, Any] | None) -> dict[str, int] | None:
    """The rollout buffer in host memory at its largest (every response at max length).

    samples   = buffered_prompts × rollout.n
    sequence  = data.max_prompt_length + data.max_response_length
    per sample = sequence × (24 + route bytes per token) + max_response_length × 24
    with route bytes per token = num_hidden_layers × num_experts_per_tok × 2 under R3 (verl
    stores routed_experts as int16 over the whole sequence), 0 otherwise. None when R3 is on and
    config.json's layers / top-k are unknown. Returns samples, per_sample, routes (all samples'
    routes) and total bytes.
    """
    routes_per_token = route_bytes_per_token(cfg, config)
    if routes_per_token is None:
        return None
    prompt, response = int(get(cfg, "data.max_prompt_length", 0)), int(get(cfg, "data.max_response_length", 0))
    sequence = prompt + response
    samples = buffered_prompts(cfg) * int(get(cfg, f"{ROLLOUT}.n", 1))
    per_sample = sequence * (BUFFER_BYTES_PER_TOKEN + routes_per_token) + response * BUFFER_BYTES_PER_RESPONSE_TOKEN
    return {
        "samples": samples,
        "per_sample": per_sample,
        "routes": samples * sequence * routes_per_token,
        "total": samples * per_sample,
    }


def parameter_sync_step(cfg: DictConfig) -> int:
    """Optimizer steps per global step, as verl's ``PPOTrainer.__init__`` reads it
    (``trainer.v1.<mode>.parameter_sync_step``, 1 when unset)."""
    return int(get(cfg, f"trainer.v1.{base_mode(cfg)}.parameter_sync_step", 1))


def optimizer_batch_samples(cfg: DictConfig) -> int:
    """Samples of one optimizer step's batch: verl's ``step`` samples ``data.train_batch_size //
    parameter_sync_step`` prompts for each local update (``_step_once``), × ``rollout.n``."""
    return int(get(cfg, "data.train_batch_size", 0)) // parameter_sync_step(cfg) * int(get(cfg, f"{ROLLOUT}.n", 1))


def rank_copy_bytes(
    cfg: DictConfig, config: dict[str, Any] | None, buffer: dict[str, int] | None = None
) -> dict[str, int] | None:
    """The optimizer batch as the trainer ranks of one node hold it in host memory.

    verl's dispatch (``single_controller/base/decorator.py``) splits the batch handle into DP
    chunks and hands rank r the chunk of its DP rank; ``tqbridge`` (``utils/transferqueue_utils.py``)
    then fetches that chunk's samples, every field (``fields=None``: routes included), in the
    rank's own process. So each of the node's ``trainer.n_gpus_per_node`` ranks holds
    ceil(optimizer batch / DP) samples, at DP 1 the whole batch, one copy per rank:

    total = ranks × ceil(optimizer_batch_samples / DP) × (rollout-buffer sample + write-backs)

    with the write-backs the step put on the batch before ``update_actor`` fetches it
    (``step_writeback_fields``, 4 B a response token each). None when R3's routes are unknown;
    ``buffer``: ``rollout_buffer_bytes`` when already computed.
    """
    buffer = rollout_buffer_bytes(cfg, config) if buffer is None else buffer
    if buffer is None:
        return None
    response = int(get(cfg, "data.max_response_length", 0))
    per_sample = buffer["per_sample"] + response * WRITEBACK_BYTES_PER_RESPONSE_TOKEN * len(step_writeback_fields(cfg))
    from verl_sat.trainer.recipe import trainer_dp_size  # the size verl's dispatch splits a batch into

    ranks, dp = int(get(cfg, "trainer.n_gpus_per_node", 0)), trainer_dp_size(cfg)
    samples = -(-optimizer_batch_samples(cfg) // dp)
    return {
        "ranks": ranks,
        "dp": dp,
        "samples_per_rank": samples,
        "per_sample": per_sample,
        "per_rank": samples * per_sample,
        "total": ranks * samples * per_sample,
    }


def host_memory_bytes(cfg: DictConfig, params: int | None, config: dict[str, Any] | None) -> dict[str, Any] | None:
    """One node's host memory at the worst case (every response at its maximum):

    total = offloaded optimizer (``host_optimizer_bytes``; 0 without offload or unknown params)
          + the rollout buffer (``rollout_buffer_bytes``, R3's routes included)
          + the trainer ranks' copies of the optimizer batch (``rank_copy_bytes``).

    Returns those bytes (optimizer, buffer, routes, rank_copies, total) and the two estimates'
    own dicts (buffer_detail, copies_detail); None when R3's routes are unknown.
    """
    buffer = rollout_buffer_bytes(cfg, config)
    copies = rank_copy_bytes(cfg, config, buffer) if buffer is not None else None
    if buffer is None or copies is None:
        return None
    optimizer = host_optimizer_bytes(cfg, params) if params is not None else 0
    return {
        "optimizer": optimizer,
        "buffer": buffer["total"],
        "routes": buffer["routes"],
        "rank_copies": copies["total"],
        "total": optimizer + buffer["total"] + copies["total"],
        "buffer_detail": buffer,
        "copies_detail": copies,
    }


def ray_kill_bytes(total: int, threshold: float, min_free: int = -1) -> int:
    """The node's used memory above which Ray's memory monitor kills a worker (Ray's
    ``MemoryMonitorUtils::GetMemoryThreshold``): threshold × total, or with
    ``RAY_min_memory_free_bytes`` set (>= 0) max(threshold × total, total − min_free)."""
    fraction = int(total * threshold)
    return max(fraction, total - min_free) if min_free >= 0 else fraction


def step_writeback_fields(cfg: DictConfig) -> tuple[str, ...]:
    """The fields verl's step writes into TransferQueue for the batch it trains (fp32, over the
    response; ``verl/trainer/ppo/v1/trainer_base.py``): ``old_log_probs`` (bypass mode: a copy of
    ``rollout_log_probs``; else recomputed, with ``entropy``), ``ref_log_prob`` when verl's
    ``need_reference_policy``, ``values`` when ``need_critic``, then ``advantages`` and ``returns``,
    ``token_level_rewards`` with ``algorithm.use_kl_in_reward`` and ``rollout_is_weights`` with
    decoupled rollout correction (``rollout_is`` set, bypass off)."""
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy

    bypass = bool(get(cfg, "algorithm.rollout_correction.bypass_mode", False))
    fields = ["old_log_probs"] + ([] if bypass else ["entropy"])
    if need_reference_policy(cfg):
        fields.append("ref_log_prob")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # need_critic warns that GRPO needs none
        if need_critic(cfg):
            fields.append("values")
    fields += ["advantages", "returns"]
    if bool(get(cfg, "algorithm.use_kl_in_reward", False)):
        fields.append("token_level_rewards")
    if not bypass and get(cfg, "algorithm.rollout_correction.rollout_is") is not None:
        fields.append("rollout_is_weights")
    return tuple(fields)


def snapshot_bytes(cfg: DictConfig, config: dict[str, Any] | None) -> dict[str, int] | None:
    """One TransferQueue snapshot, ``global_step_k/transfer_queue``, at its largest.

    verl's ``_save_checkpoint`` pickles the whole queue (``tq.save_checkpoint``) in the async modes,
    after the step trained and before its batch is cleared, so the snapshot holds the rollout
    buffer at its largest (``rollout_buffer_bytes``: the step's batch plus the warm-up window,
    × rollout.n, R3's routes included) and, on the step's ``train_batch_size × rollout.n``
    samples, what the step wrote back (``step_writeback_fields``, 4 B a response token each).
    Zero in ``sync`` (verl saves no snapshot); None when R3's routes are unknown.
    """
    if base_mode(cfg) == "sync":
        return {"samples": 0, "buffer": 0, "writeback": 0, "total": 0}
    buffer = rollout_buffer_bytes(cfg, config)
    if buffer is None:
        return None
    trained = int(get(cfg, "data.train_batch_size", 0)) * int(get(cfg, f"{ROLLOUT}.n", 1))
    response = int(get(cfg, "data.max_response_length", 0))
    writeback = trained * response * WRITEBACK_BYTES_PER_RESPONSE_TOKEN * len(step_writeback_fields(cfg))
    return {
        "samples": buffer["samples"],
        "buffer": buffer["total"],
        "writeback": writeback,
        "total": buffer["total"] + writeback,
    }


def checkpoint_bytes(cfg: DictConfig, params: int) -> int:
    """One checkpoint: model (params × model dtype) + optimizer (params × Adam bytes, no grad) +
    hf_model (params × model dtype), for what ``actor.checkpoint.save_contents`` lists."""
    contents = set(as_list(get(cfg, "actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer"])))
    weight = dtype_bytes(get(cfg, f"{MEGATRON}.dtype", "bfloat16"))
    per_param = weight * (("model" in contents) + ("hf_model" in contents))
    per_param += adam_bytes_per_param(cfg, with_grad=False) if "optimizer" in contents else 0
    return params * per_param


def kept_checkpoints(cfg: DictConfig) -> int:
    """``trainer.max_actor_ckpt_to_keep``, or every save of the run when it is unset (null/<= 0).
    TransferQueue snapshots are kept as many (``verl_sat.trainer.faults.prune_snapshots``)."""
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


# verl's placement (verl/single_controller/ray/base.py): one placement group per node of a pool,
# n_gpus_per_node bundles of {"CPU": max_colocate_count, "GPU": 1}, all on one node. The trainer's
# pools use ResourcePoolManager's default max_colocate_count (3); a standalone rollout replica's
# pool (RolloutReplica.init_standalone) uses 2.
TRAINER_BUNDLE_CPUS = 3
ROLLOUT_BUNDLE_CPUS = 2


def pool_bundles(cfg: DictConfig) -> list[tuple[str, int, int]]:
    """verl's placement groups for ``cfg``: (pool, GPUs, CPUs), one per node of each pool.

    The trainer: ``trainer.nnodes`` groups of ``trainer.n_gpus_per_node``; a standalone rollout
    (separate_async, hybrid_engine=false): ``rollout.nnodes × rollout.n_gpus_per_node`` GPUs in
    replicas of TP × DP × PP, each replica ``ceil(size / n_gpus_per_node)`` groups of
    ``min(size, n_gpus_per_node)`` (``RolloutReplica.gpus_per_replica_node``)."""
    n_train = int(get(cfg, "trainer.n_gpus_per_node", 0))
    groups = [("trainer", n_train, n_train * TRAINER_BUNDLE_CPUS)] * int(get(cfg, "trainer.nnodes", 1))
    if is_standalone_rollout(cfg):
        per_node = int(get(cfg, f"{ROLLOUT}.n_gpus_per_node", 0))
        size = max(1, rollout_replica_gpus(cfg))
        on_node_gpus = min(size, per_node) if per_node else 0
        replicas = rollout_pool_gpus(cfg) // size
        nodes_per_replica = -(-size // per_node) if per_node else 0
        groups += [("rollout", on_node_gpus, on_node_gpus * ROLLOUT_BUNDLE_CPUS)] * (replicas * nodes_per_replica)
    return [g for g in groups if g[1] > 0]
