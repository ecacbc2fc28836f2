"""The preflight's checks (docs/reproduce.md): pure functions ``(config, facts) -> findings``, and
``run_checks`` over all of them (``CHECKS``). Nothing here touches the node."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig

from verl_sat.preflight.cluster import Node, Unseen, layout_refusal
from verl_sat.preflight.estimates import (
    MEGATRON,
    OPTIM,
    ROLLOUT,
    adam_bytes_per_param,
    as_list,
    bridge_module,
    checkpoint_bytes,
    dtype_bytes,
    get,
    gib,
    host_memory_bytes,
    is_standalone_rollout,
    kept_checkpoints,
    megatron_layout,
    on_cpu,
    optimizer_offload_fraction,
    pool_bundles,
    ray_kill_bytes,
    rollout_pool_gpus,
    rollout_replica_gpus,
    snapshot_bytes,
    trainer_gpu_bytes,
    trainer_gpus,
    uses_r3,
    warmup_prompts,
)
from verl_sat.preflight.facts import (
    BRIDGES,
    MEGATRON_BRIDGE_PYTHON,
    MEGATRON_ENGINE,
    ROUTED_EXPERTS_ARG,
    SGLANG_ENGINE_FILE,
    STACK,
    Facts,
    Finding,
)
from verl_sat.preflight.stack import GPU_STACK, override_for


# ---------------------------------------------------------------------------------------------
# checks: pure functions (config, facts) -> findings
# ---------------------------------------------------------------------------------------------
def check_gpu_count(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """This node has the GPUs of the trainer pool plus the standalone rollout pool (none on a CPU run)."""
    if on_cpu(cfg):
        return []
    n_train = int(get(cfg, "trainer.n_gpus_per_node", 0))
    n_roll = int(get(cfg, f"{ROLLOUT}.n_gpus_per_node", 0)) if is_standalone_rollout(cfg) else 0
    single_node = int(get(cfg, "trainer.nnodes", 1)) == 1 and int(get(cfg, f"{ROLLOUT}.nnodes", 0)) <= 1
    need = n_train + n_roll if single_node else max(n_train, n_roll)
    have = len(facts.gpus)
    if have >= need:
        return []
    layout = f"trainer.n_gpus_per_node={n_train}" + (f" + {ROLLOUT}.n_gpus_per_node={n_roll}" if n_roll else "")
    return [
        Finding(
            "gpu_count",
            "trainer.n_gpus_per_node",
            f"{layout} needs {need} GPUs on this node, {have} visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}"
            f"{f'; {facts.gpu_error}' if facts.gpu_error else ''}); run on a node with {need} GPUs or lower "
            "trainer.n_gpus_per_node / actor_rollout_ref.rollout.n_gpus_per_node",
        )
    ]


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
    params = facts.model.params
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


def sglang_fix(facts: Facts) -> str:
    """How to install the sglang verl's ``sglang`` extra pins (its metadata names the version)."""
    pin = facts.pin("sglang", "sglang")
    return f"install sglang=={pin}" if pin else "install verl, then the sglang its sglang extra pins"


def check_versions(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """With SGLang rollout, the sglang verl's ``sglang`` extra pins (read from the installed metadata,
    ``PINNED_BY``); verl at the version verl-sat requires is ``check_requirements``'."""
    want, have = facts.pin("sglang", "sglang"), facts.versions.get("sglang")
    if str(get(cfg, f"{ROLLOUT}.name", "")) != "sglang" or not want or have == want:
        return []
    return [
        Finding(
            "versions",
            "sglang",
            f"sglang {have or 'not installed'}; {ROLLOUT}.name=sglang and verl {facts.versions.get('verl')}'s "
            f"sglang extra pins sglang=={want}: pip install 'sglang=={want}'",
        )
    ]


def check_requirements(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Every declared requirement of the stack's installed packages that the installed versions do
    not meet (``Facts.requirement_conflicts``, read as pip check reads them). A named override of the
    GPU install (``verl_sat.preflight.stack.OVERRIDES``), with the version the install puts there
    (``GPU_STACK``), warns with its reason; any other fails, naming the dependent, the requirement
    and what is installed (verl-sat's own pin on verl too). With SGLang's flashinfer attention,
    flashinfer at SGLang's own floor (``check_flashinfer_floor``)."""
    out = []
    for unmet in facts.requirement_conflicts:
        override = override_for(unmet.dependent, unmet.requirement)
        kept = GPU_STACK.get(unmet.target)
        if override is not None and unmet.installed is not None and unmet.installed == kept:
            message, level = f"{unmet.line()}: a named override of the GPU install ({override.reason})", "warn"
        elif override is not None:
            message, level = (
                f"{unmet.line()}: the GPU install overrides this pin only with {unmet.target} {kept} "
                f"({override.reason}); pip install '{unmet.target}=={kept}'",
                "fail",
            )
        else:
            message, level = (
                f"{unmet.line()}: install the version it declares, or a {unmet.dependent} built for what is "
                "installed (recipes/sat_paper/install_gpu.sh installs a set that meets it)",
                "fail",
            )
        out.append(Finding("requirements", unmet.dependent, message, level))
    return out + check_flashinfer_floor(cfg, facts)


# verl's SGLang server (async_sglang_server.py): engine_kwargs.sglang.attention_backend, else
# flashinfer for SGLang >= 0.5.12 on CUDA.
SGLANG_ATTENTION_KEY = f"{ROLLOUT}.engine_kwargs.sglang.attention_backend"
SGLANG_FLASHINFER_DEFAULT_FROM = "0.5.12"


def sglang_attention_backend(cfg: DictConfig, sglang_version: str | None) -> str | None:
    """The attention backend verl's SGLang server starts SGLang with (CUDA): the configured one, else
    flashinfer for SGLang >= 0.5.12 (verl forces it there), else fa3."""
    from packaging.version import Version

    configured = get(cfg, SGLANG_ATTENTION_KEY)
    if configured is not None:
        return str(configured)
    if sglang_version is None:
        return None
    return "flashinfer" if Version(sglang_version) >= Version(SGLANG_FLASHINFER_DEFAULT_FROM) else "fa3"


def check_flashinfer_floor(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """With SGLang rollout on flashinfer attention, flashinfer-python >= the floor the installed SGLang
    asserts in its own ``_set_envs_and_config``; verl replaces that function with one asserting only
    >= 0.2.5, so an older flashinfer would otherwise run unchecked."""
    from packaging.version import Version

    floor, sglang = facts.sglang_flashinfer_min, facts.versions.get("sglang")
    if str(get(cfg, f"{ROLLOUT}.name", "")) != "sglang" or floor is None:
        return []
    backend = sglang_attention_backend(cfg, sglang)
    have = facts.versions.get("flashinfer-python")
    if backend != "flashinfer" or (have is not None and Version(have) >= Version(floor)):
        return []
    why = f"{SGLANG_ATTENTION_KEY}={backend}" if get(cfg, SGLANG_ATTENTION_KEY) else "verl's default for it"
    return [
        Finding(
            "requirements",
            "flashinfer-python",
            f"flashinfer-python {have or 'not installed'}, but sglang {sglang} asserts flashinfer_python >= {floor} "
            f"for flashinfer attention ({why}; {SGLANG_ENGINE_FILE}, _set_envs_and_config), a check verl's "
            f"replacement of that function lowers to 0.2.5: pip install 'flashinfer-python=={floor}' "
            f"'flashinfer-cubin=={floor}'",
        )
    ]


# The keys whose false value makes verl's Megatron engine pad the batch (bshd), where R3 fails with
# "Router replay tensors are not aligned": verl's engine workers copy the model's key onto the
# engine config (engine_workers.py), the engine's own key is the same setting.
REMOVE_PADDING_KEYS = ("actor_rollout_ref.model.use_remove_padding", f"{MEGATRON}.use_remove_padding")


def check_r3_padding(cfg: DictConfig) -> list[Finding]:
    """R3 on Megatron runs only on packed sequences (remove-padding on)."""
    if not uses_r3(cfg) or str(get(cfg, "actor_rollout_ref.actor.strategy", "")) != "megatron":
        return []
    return [
        Finding(
            "routing_replay",
            key,
            f"{key}=false with R3: verl's Megatron engine then pads the batch and router replay fails "
            f'("Router replay tensors are not aligned"); set {key}=true (stabilizer=r3 / tis_r3 do)',
        )
        for key in REMOVE_PADDING_KEYS
        if not bool(get(cfg, key, True))
    ]


def check_routing_replay(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """R3 on: remove-padding on (Megatron) and SGLang's ServerArgs accepts ``enable_return_routed_experts``
    (that SGLang is verl's pin, whose routes format verl-sat decodes, is ``check_versions``')."""
    padding = check_r3_padding(cfg)
    if not uses_r3(cfg) or str(get(cfg, f"{ROLLOUT}.name", "")) != "sglang":
        return padding
    if facts.sglang_routed_experts is None:
        error = facts.import_errors.get("sglang.srt.server_args") or "not importable"
        return padding + [
            Finding(
                "routing_replay",
                f"{ROLLOUT}.enable_rollout_routing_replay",
                f"R3 needs SGLang's ServerArgs, but sglang.srt.server_args does not import ({error}); "
                f"{sglang_fix(facts)} or turn R3 off (stabilizer=none)",
            )
        ]
    if not facts.sglang_routed_experts:
        return padding + [
            Finding(
                "routing_replay",
                f"{ROLLOUT}.enable_rollout_routing_replay",
                f"R3 is on but this SGLang's ServerArgs has no '{ROUTED_EXPERTS_ARG}' (the server cannot return "
                f"routed experts); {sglang_fix(facts)} or turn R3 off",
            )
        ]
    return padding


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


MEGATRON_INSTALL = "docs/reproduce.md, 'Install on the GPU node'"


def bridge_findings(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """The bridge verl's Megatron engine imports under this cell's settings, its Python and pins."""
    module = bridge_module(cfg)
    package = BRIDGES[module]
    setting = f"{MEGATRON}.vanilla_mbridge={str(module == 'mbridge').lower()}"
    out = []
    if not bool(get(cfg, f"{MEGATRON}.use_mbridge", True)):
        out.append(
            Finding(
                "megatron",
                f"{MEGATRON}.use_mbridge",
                f"{MEGATRON}.use_mbridge=false: verl 0.9.1's Megatron engine asserts use_mbridge "
                "(it builds the model through a bridge); set it to true",
            )
        )
    if module == "megatron.bridge" and facts.python < MEGATRON_BRIDGE_PYTHON:
        have, need = ".".join(map(str, facts.python)), ".".join(map(str, MEGATRON_BRIDGE_PYTHON))
        out.append(
            Finding(
                "megatron",
                "python",
                f"Python {have}: with {setting} (verl's default) verl imports megatron.bridge, and "
                f"Megatron-Bridge needs Python {need} (Requires-Python >={need},<3.13); use a Python {need} "
                f"environment ({MEGATRON_INSTALL})",
            )
        )
    error = facts.import_errors.get(module, "not probed")
    if error is not None:
        out.append(
            Finding(
                "megatron",
                package,
                f"{module} does not import ({error}); with {setting} verl's Megatron engine imports it "
                f"(from {module} import AutoBridge): install {package} ({MEGATRON_INSTALL})",
            )
        )
    pin = facts.pin("megatron", package)
    have = facts.versions.get(package)
    if pin and have and have != pin:
        out.append(
            Finding(
                "megatron",
                package,
                f"{package} {have}; verl {facts.versions.get('verl')}'s megatron extra pins {package}=={pin}",
                level="warn",
            )
        )
    return out  # its declared requirements: check_requirements


def check_megatron(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """megatron-core imports; the bridge verl imports (``bridge_module``) imports, on its Python,
    against the versions it declares; TransformerEngine for the precision-aware Adam."""
    if str(get(cfg, "actor_rollout_ref.actor.strategy", "")) != "megatron":
        return []
    needs = {"megatron.core": ("megatron-core", "actor_rollout_ref.actor.strategy=megatron")}
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
                    f"{module} does not import ({error}); {why} needs it: install {package} ({MEGATRON_INSTALL})",
                )
            )
    return out + bridge_findings(cfg, facts) + engine_findings(facts)


def engine_findings(facts: Facts) -> list[Finding]:
    """verl's Megatron engine imports: verl's ``workers/engine/__init__.py`` turns its ImportError
    into a warning, and the launch then stops with only "Unknown backend: megatron"."""
    error = facts.import_errors.get(MEGATRON_ENGINE)
    if error is None:
        return []
    return [
        Finding(
            "megatron",
            "actor_rollout_ref.actor.strategy",
            f"{MEGATRON_ENGINE} does not import: {error}. verl's workers/engine/__init__.py turns this into a "
            'warning and the launch then fails with only "Unknown backend: megatron"; fix the import above '
            f"({MEGATRON_INSTALL})",
        )
    ]


def max_position_embeddings(cfg: DictConfig, config: dict[str, Any]) -> int | None:
    """The model's context as verl's HFModelConfig sees it (``override_config`` applied)."""
    override = dict(get(cfg, "actor_rollout_ref.model.override_config", {}) or {})
    override = dict(override.get("model_config", override))
    value = override.get("max_position_embeddings", config.get("max_position_embeddings"))
    if value is None:
        value = (config.get("text_config") or {}).get("max_position_embeddings")
    return None if value is None else int(value)


DOWNLOAD_FIX = (
    "download it first (huggingface-cli download {path} --local-dir DIR) and point the launch at it "
    "(run.sh: MODEL_PATH=DIR, i.e. actor_rollout_ref.model.path=DIR)"
)


def check_context_length(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """prompt + response + 1 <= SGLang's max_model_len (null: the model's max_position_embeddings).

    verl's SGLang server clamps a request's max_new_tokens to max_model_len - len(prompt) - 1
    (async_sglang_server.py), so a longer budget silently cuts the longest responses. A model
    that is not on this node fails: its context cannot be checked, and the launch would download
    a model whose config nobody read.
    """
    path = get(cfg, "actor_rollout_ref.model.path", "")
    if facts.model.config is None:
        return [
            Finding(
                "context_length",
                "actor_rollout_ref.model.path",
                f"no local config.json for {path} (local directory or Hugging Face cache), so its context "
                f"cannot be checked against the responses; {DOWNLOAD_FIX.format(path=path)}",
            )
        ]
    limit = max_position_embeddings(cfg, facts.model.config)
    if limit is None:
        return [
            Finding(
                "context_length",
                "actor_rollout_ref.model.path",
                f"{facts.model.source}/config.json has no max_position_embeddings; verl's SGLang server "
                "needs it (get_max_position_embeddings)",
            )
        ]
    max_model_len = get(cfg, f"{ROLLOUT}.max_model_len")
    out = []
    if max_model_len is not None and int(max_model_len) > limit:
        out.append(
            Finding(
                "context_length",
                f"{ROLLOUT}.max_model_len",
                f"{ROLLOUT}.max_model_len={max_model_len} > "
                f"max_position_embeddings {limit} (verl's SGLang server refuses it); set it <= {limit} or null",
            )
        )
    cap = limit if max_model_len is None else min(int(max_model_len), limit)
    prompt, response = int(get(cfg, "data.max_prompt_length", 0)), int(get(cfg, "data.max_response_length", 0))
    if prompt + response + 1 > cap:
        out.append(
            Finding(
                "context_length",
                "data.max_response_length",
                f"data.max_prompt_length + data.max_response_length + 1 = {prompt} + {response} + 1 > {cap} "
                f"(SGLang's max_model_len: max_position_embeddings of {facts.model.source}/config.json"
                + ("" if max_model_len is None else f", {ROLLOUT}.max_model_len")
                + f"): verl caps a response at max_model_len - len(prompt) - 1 and silently cuts the longest; "
                f"lower data.max_response_length to {cap - prompt - 1} or extend the context for both engines "
                "(actor_rollout_ref.model.override_config: rope_scaling + max_position_embeddings; docs/reproduce.md)",
            )
        )
    return out


def check_end_of_turn(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """The chat template's end-of-turn token is an id generation stops at (warn otherwise).

    verl sends no stop ids with a request (agent_loop_tq.py), and SGLang with
    ``skip_tokenizer_init`` stops only at the ``eos_token_id`` of config.json and
    generation_config.json. A Base model's is ``<|endoftext|>`` while its chat template ends a turn
    with ``<|im_end|>``: each response then runs past the answer's turn until ``<|endoftext|>`` or
    the response budget, and the verifier reads whatever followed. Not refused: the paper's setting
    is not stated (docs/gpu_path.md).
    """
    model = facts.model
    if model.end_of_turn is None or not model.stop_ids:
        return []
    token, token_id = model.end_of_turn
    if token_id in model.stop_ids:
        return []
    ids = sorted({*model.stop_ids, token_id})
    return [
        Finding(
            "end_of_turn",
            "actor_rollout_ref.model.path",
            f"the chat template ends a turn with {token} (id {token_id}), but generation stops only at "
            f"eos_token_id {list(model.stop_ids)} ({model.source}/config.json and generation_config.json; "
            "verl sends no stop ids, SGLang skips the tokenizer): responses run on past the answer's turn "
            f"until that token or data.max_response_length; to end them at the turn, set "
            f'"eos_token_id": {ids} in {model.source}/generation_config.json',
            level="warn",
        )
    ]


def unknown_size(check: str) -> Finding:
    return Finding(
        check,
        "actor_rollout_ref.model.path",
        "not estimated: the model's parameters are unknown (transformers cannot build it from the local config.json)",
        level="warn",
    )


def check_host_memory(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """The node's host memory at the worst case (``host_memory_bytes``: the offloaded optimizer,
    TransferQueue's rollout buffer with R3's routes, and each trainer rank's copy of the optimizer
    batch) fits under Ray's memory-kill threshold (``ray_kill_bytes``, less what is in use), not merely in RAM."""
    if facts.host_mem_available_bytes is None:
        return []
    params = facts.model.params
    fraction = optimizer_offload_fraction(cfg)
    need = host_memory_bytes(cfg, params, facts.model.config)
    out = []
    if fraction > 0 and params is None:
        out.append(unknown_size("host_memory"))
    if need is None:
        return out + [
            Finding(
                "host_memory",
                "actor_rollout_ref.model.path",
                "R3's routes not estimated: config.json has no num_hidden_layers / num_experts_per_tok",
                level="warn",
            )
        ]
    total = facts.host_mem_total_bytes or facts.host_mem_available_bytes
    kill = ray_kill_bytes(total, facts.ray_memory_threshold, facts.ray_min_memory_free_bytes)
    in_use = total - facts.host_mem_available_bytes  # Ray's used memory (GetLinuxMemoryBytes): MemTotal − MemAvailable
    budget = kill - in_use
    if need["total"] <= budget:
        return out
    buffer, copies = need["buffer_detail"], need["copies_detail"]
    parts = []
    if need["optimizer"]:
        per = adam_bytes_per_param(cfg, bool(get(cfg, f"{OPTIM}.override_optimizer_config.optimizer_cpu_offload")))
        parts.append(
            f"offloaded optimizer {params / 1e9:.1f}e9 params × {fraction} × {per} B = {gib(need['optimizer'])}"
        )
    parts.append(
        f"rollout buffer {buffer['samples']} samples (data.train_batch_size + {warmup_prompts(cfg)} warm-up "
        f"prompts, × rollout.n) × {buffer['per_sample'] / 2**20:.1f} MiB at full length = {gib(need['buffer'])}, of "
        f"which R3's routes {gib(need['routes'])}"
    )
    parts.append(
        f"{copies['ranks']} trainer ranks' copies of the optimizer batch (DP {copies['dp']}: each rank fetches "
        f"{copies['samples_per_rank']} samples × {copies['per_sample'] / 2**20:.1f} MiB through TransferQueue) = "
        f"{gib(need['rank_copies'])}"
    )
    fraction_key = f"{OPTIM}.override_optimizer_config.optimizer_offload_fraction"
    key = fraction_key if need["optimizer"] > need["buffer"] + need["rank_copies"] else "data.max_response_length"
    return out + [
        Finding(
            "host_memory",
            key,
            f"{' + '.join(parts)} = {gib(need['total'])} of host memory, but Ray kills a worker once the node "
            f"uses {gib(kill)} (RAY_memory_usage_threshold={facts.ray_memory_threshold} of {gib(total)}) and "
            f"{gib(in_use)} is in use now, leaving {gib(max(budget, 0))}; use a node with more memory, or lower "
            f"{OPTIM}.override_optimizer_config.optimizer_offload_fraction / data.max_response_length / the lag",
        )
    ]


def check_disk(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Free disk at ``trainer.default_local_dir`` >= kept checkpoints × (``checkpoint_bytes`` + the
    TransferQueue snapshot verl saves with each in the async modes, ``snapshot_bytes``); verl-sat
    prunes a snapshot with its actor checkpoint, so as many are kept (``trainer.faults.prune_snapshots``)."""
    params = facts.model.params
    kept = kept_checkpoints(cfg)
    if facts.disk_free_bytes is None or kept == 0:
        return []
    if params is None:
        return [unknown_size("disk")]
    size = checkpoint_bytes(cfg, params)
    snapshot = snapshot_bytes(cfg, facts.model.config)
    out = []
    if snapshot is None:
        out.append(
            Finding(
                "disk",
                "actor_rollout_ref.model.path",
                "TransferQueue snapshots not estimated: config.json has no num_hidden_layers / num_experts_per_tok",
                level="warn",
            )
        )
    snap = snapshot["total"] if snapshot else 0
    if facts.disk_free_bytes >= kept * (size + snap):
        return out
    what = f"{gib(size)} actor (params × (model dtype + Adam bytes))"
    if snap:
        routes = ", R3's routes included" if uses_r3(cfg) else ""
        what = (
            f"({what} + {gib(snap)} TransferQueue snapshot: {snapshot['samples']} samples at full length"  # type: ignore[index]
            f"{routes}, with the trained batch's write-backs)"
        )
    return out + [
        Finding(
            "disk",
            "trainer.max_actor_ckpt_to_keep",
            f"{kept} kept checkpoints × {what} = {gib(kept * (size + snap))}, "
            f"but {gib(facts.disk_free_bytes)} free at trainer.default_local_dir="
            f"{get(cfg, 'trainer.default_local_dir')}; free disk, point sat.run_dir elsewhere or lower "
            "trainer.max_actor_ckpt_to_keep",
        )
    ]


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
                        f"{key}: {path}: {schema}; write it with python "
                        "recipes/sat_paper/prepare_math.py --out DIR (run.sh: DATA_DIR=DIR)",
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
                        "reward_model.ground_truth: rewrite it with python recipes/sat_paper/prepare_math.py",
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
    check_requirements,
    check_routing_replay,
    check_checkpoint_engine,
    check_megatron,
    check_context_length,
    check_end_of_turn,
    check_host_memory,
    check_disk,
    check_data,
    check_reward_function,
)


def run_checks(cfg: DictConfig, facts: Facts) -> list[Finding]:
    """Every check of ``CHECKS`` on one resolved config and one node's facts."""
    return [finding for check in CHECKS for finding in check(cfg, facts)]


# ---------------------------------------------------------------------------------------------
# on a cluster (docs/cluster.md): each node's own resources, and what the nodes must share
# ---------------------------------------------------------------------------------------------
# The checks that read only one node's resources; on a cluster they run on each node's facts.
NODE_CHECKS = (check_gpu_memory, check_host_memory, check_disk, check_requirements)


def check_each_node(cfg: DictConfig, facts: dict[Node, Facts]) -> list[Finding]:
    """``NODE_CHECKS`` on each node's facts (GPU memory on GPU runs only), the line naming the node."""
    checks = NODE_CHECKS[1:] if on_cpu(cfg) else NODE_CHECKS
    return [
        Finding(f.check, f.key, f"node {node.name}: {f.message}", f.level)
        for node, node_facts in facts.items()
        for check in checks
        for f in check(cfg, node_facts)
    ]


def check_same_versions(facts: dict[Node, Facts]) -> list[Finding]:
    """Every distribution of the stack at the first node's version on every other node."""
    nodes = list(facts)
    out = []
    for name in STACK:
        want = facts[nodes[0]].versions.get(name) if nodes else None
        for node in nodes[1:]:
            have = facts[node].versions.get(name)
            if have != want:
                out.append(
                    Finding(
                        "cluster_versions",
                        name,
                        f"{name} {have or 'not installed'} on node {node.name}, but {want or 'not installed'} "
                        f"on node {nodes[0].name}: install the same {name} on every node",
                    )
                )
    return out


def check_gpu_slots(cfg: DictConfig, facts: dict[Node, Facts]) -> list[Finding]:
    """On a GPU run, each raylet's ``GPU`` slots are the GPUs NVML reports there (verl places a
    worker per slot; a raylet started with another --num-gpus misplaces or starves them)."""
    if on_cpu(cfg):
        return []
    return [
        Finding(
            "cluster_gpus",
            "trainer.n_gpus_per_node",
            f"node {node.name}: its raylet declares {node.gpus} GPU slots but NVML reports {len(found.gpus)} "
            f"GPUs{f' ({found.gpu_error})' if found.gpu_error else ''} (CUDA_VISIBLE_DEVICES at `ray start`; "
            "start it with --num-gpus)",
        )
        for node, found in facts.items()
        if node.gpus != len(found.gpus)
    ]


def check_layout(cfg: DictConfig, nodes: Sequence[Node]) -> list[Finding]:
    """The trainer and rollout pools fit the nodes' GPU (and CPU) slots as verl places them
    (``verl_sat.preflight.cluster.layout_refusal``, the job's own refusal)."""
    refusal = layout_refusal(cfg, nodes)
    if refusal is None:
        return []
    key = "trainer.nnodes" if len(pool_bundles(cfg)) > len(nodes) else "trainer.n_gpus_per_node"
    return [Finding("cluster_layout", key, refusal)]


def run_cluster_checks(cfg: DictConfig, facts: dict[Node, Facts], unseen: Sequence[Unseen] = ()) -> list[Finding]:
    """Every cluster check on the nodes' facts, and each path a node does not see
    (``verl_sat.preflight.cluster.paths_on_nodes``)."""
    nodes = list(facts)
    return (
        check_each_node(cfg, facts)
        + check_same_versions(facts)
        + check_gpu_slots(cfg, facts)
        + check_layout(cfg, nodes)
        + [Finding("cluster_shared_dir", u.key, u.line()) for u in unseen]
    )
