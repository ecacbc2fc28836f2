"""A node's facts for the preflight (docs/reproduce.md): ``gather`` is the only code that inspects a
node, here or in a Ray task pinned to each node of a cluster (``verl_sat.preflight.cluster``).

Each fact comes from the library that owns it: GPUs from NVML (``pynvml``: no CUDA context is
opened), installed versions and their declared requirements from ``importlib.metadata`` read with
``packaging`` as ``pip check`` reads them, SGLang's own flashinfer floor from its source, host
memory from ``psutil``, Ray's memory-kill threshold from the environment Ray reads it from, the
weight-sync backends from verl's ``CheckpointEngineRegistry``, the reward function loaded as verl
loads it. torch, sglang, megatron, pyarrow and transformers are imported inside the functions only.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from verl_sat.preflight.estimates import as_list, get
from verl_sat.preflight.stack import GPU_STACK

# The pins are read from the installed metadata, never retyped: the sglang and Megatron-Bridge
# verl's `sglang` / `megatron` extras pin (the verl verl-sat requires is one of its requirements).
PINNED_BY = {"sglang": ("verl", "sglang"), "megatron": ("verl", "megatron")}
# Megatron-Bridge's Requires-Python (0.4 and later, 0.5.1 and 0.6.0 read from their wheels).
MEGATRON_BRIDGE_PYTHON = (3, 12)
# The SGLang server argument R3 needs (verl's async_sglang_server sets it when
# rollout.enable_rollout_routing_replay is on).
ROUTED_EXPERTS_ARG = "enable_return_routed_experts"
# What verl's Megatron engine imports to build the model from the HF checkpoint
# (workers/engine/megatron/transformer_impl.py): vanilla_mbridge=false (verl's default) ->
# verl.models.mcore.bridge -> `from megatron.bridge import AutoBridge`; true ->
# verl.models.mcore.mbridge -> `from mbridge import AutoBridge`. module -> distribution.
BRIDGES = {"megatron.bridge": "megatron-bridge", "mbridge": "mbridge"}
# verl's Megatron engine: verl's workers/engine/__init__.py turns its ImportError into a warning,
# and the launch then fails with only "Unknown backend: megatron"; the probe imports it itself.
MEGATRON_ENGINE = "verl.workers.engine.megatron"
# Modules imported by the probe; None in Facts.import_errors means the import worked.
PROBED_MODULES = (
    "megatron.core",
    "megatron.bridge",
    "mbridge",
    "transformer_engine",
    "sglang.srt.server_args",
    MEGATRON_ENGINE,
)
# The stack: distributions whose versions are recorded (and compared across a cluster's nodes), and
# whose declared requirements are checked against what is installed: verl-sat's own, then every
# package of the GPU install (``verl_sat.preflight.stack.GPU_STACK``).
STACK = tuple(
    dict.fromkeys(
        (
            "torch",
            "verl",
            "verl-sat",
            "ray",
            "transformers",
            "vllm",
            "sglang",
            "flashinfer-python",
            "megatron-core",
            "megatron-bridge",
            "mbridge",
            "transformer-engine",
            *GPU_STACK,
        )
    )
)
# SGLang's own check of flashinfer: ``assert_pkg_version("flashinfer_python", <floor>, ...)`` in
# ``_set_envs_and_config`` of this file (verl replaces that function with one asserting >= 0.2.5).
SGLANG_ENGINE_FILE = "sglang/srt/entrypoints/engine.py"
# Ray's memory monitor kills a worker when the node's used memory passes this fraction of its RAM
# (Ray's C++ config ``memory_usage_threshold``, src/ray/common/ray_config_def.h; the raylet logs it
# as "ThresholdMemoryMonitor initialized with usage threshold at N bytes (95.000000% of system
# memory)"), overridden by RAY_memory_usage_threshold; RAY_memory_monitor_refresh_ms=0 turns the
# killing off.
RAY_MEMORY_USAGE_THRESHOLD = 0.95


@dataclass(frozen=True)
class Unmet:
    """One declared requirement of an installed distribution that the installed packages do not meet
    (pip check's "has requirement X, but you have X v" / "requires X, which is not installed").

    Args:
        dependent: the distribution declaring it (canonical name), at ``version``.
        requirement: the requirement as declared (``transformers==5.6.0``).
        installed: the version installed of the required distribution, None when not installed.
    """

    dependent: str
    version: str
    requirement: str
    installed: str | None

    @property
    def target(self) -> str:
        """The required distribution's canonical name."""
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name

        return canonicalize_name(Requirement(self.requirement).name)

    def line(self) -> str:
        """``sglang 0.5.12 requires transformers==5.6.0, installed 5.10.0``."""
        have = f"installed {self.installed}" if self.installed is not None else "not installed"
        return f"{self.dependent} {self.version} requires {self.requirement}, {have}"


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
        params: the model's parameters, counted by transformers from ``config.json``
            (``count_params``), or None.
        stop_ids: the token ids generation stops at without a tokenizer (SGLang with
            ``skip_tokenizer_init``): ``eos_token_id`` of ``config.json`` and of
            ``generation_config.json``.
        end_of_turn: (token, id) the tokenizer's chat template closes an assistant turn with, or
            None (no local tokenizer or chat template).
    """

    source: str = ""
    config: dict[str, Any] | None = None
    params: int | None = None
    stop_ids: tuple[int, ...] = ()
    end_of_turn: tuple[str, int] | None = None


@dataclass
class Facts:
    """Everything the checks read about one node, gathered once by ``gather``.

    Args:
        hostname: the node's host name.
        gpus: GPUs NVML reports, as ``CUDA_VISIBLE_DEVICES`` selects them.
        gpu_error: why NVML reported none (e.g. "no NVIDIA driver"), None when it answered.
        cuda_driver: the CUDA version the driver supports (NVML), e.g. "12.8".
        cuda_runtime: torch's CUDA runtime version (``torch.version.cuda``), None without CUDA.
        python: this interpreter's (major, minor).
        versions: distribution of ``STACK`` -> installed version (None: not installed).
        extra_pins: an extra of the installed verl (``sglang``, ``megatron``) -> distribution ->
            the version it pins with ``==``.
        requirement_conflicts: the declared requirements of ``STACK``'s installed distributions that
            the installed packages do not meet (``Unmet``), as pip check finds them.
        sglang_flashinfer_min: the flashinfer floor the installed SGLang asserts itself
            (``SGLANG_ENGINE_FILE``), None without SGLang or without such an assert.
        import_errors: module -> None when it imports, else the error's one-line text (for
            ``MEGATRON_ENGINE``, with the place it was raised).
        sglang_routed_experts: whether SGLang's ``ServerArgs`` has ``ROUTED_EXPERTS_ARG`` (None:
            not importable).
        checkpoint_engines: backends registered in verl's ``CheckpointEngineRegistry``, sorted.
        checkpoint_engine_errors: verl's recorded import errors of its engine modules.
        cupy_distributions: installed ``cupy*`` distributions (e.g. ``cupy-cuda12x``).
        host_mem_available_bytes, host_mem_total_bytes: ``psutil.virtual_memory()``.
        ray_memory_threshold, ray_min_memory_free_bytes: where Ray's memory monitor kills a worker
            on this node (``ray_memory_threshold``: a fraction of RAM, 1.0 with the monitor off;
            ``RAY_min_memory_free_bytes``, -1 when unset).
        disk_free_bytes: free bytes on the file system of ``trainer.default_local_dir``.
        model: the model path's local files.
        data_schemas: data file -> {column: struct field names}, or a string saying why not.
        reward_fn_error: None when the reward function loads, else the error.
    """

    hostname: str = ""
    gpus: tuple[GPU, ...] = ()
    gpu_error: str | None = None
    cuda_driver: str | None = None
    cuda_runtime: str | None = None
    python: tuple[int, int] = (3, 12)
    versions: dict[str, str | None] = field(default_factory=dict)
    extra_pins: dict[str, dict[str, str]] = field(default_factory=dict)
    requirement_conflicts: tuple[Unmet, ...] = ()
    sglang_flashinfer_min: str | None = None
    import_errors: dict[str, str | None] = field(default_factory=dict)
    sglang_routed_experts: bool | None = None
    checkpoint_engines: tuple[str, ...] = ()
    checkpoint_engine_errors: dict[str, str] = field(default_factory=dict)
    cupy_distributions: tuple[str, ...] = ()
    host_mem_available_bytes: int | None = None
    host_mem_total_bytes: int | None = None
    ray_memory_threshold: float = RAY_MEMORY_USAGE_THRESHOLD
    ray_min_memory_free_bytes: int = -1
    disk_free_bytes: int | None = None
    model: ModelFacts = field(default_factory=ModelFacts)
    data_schemas: dict[str, dict[str, tuple[str, ...]] | str] = field(default_factory=dict)
    reward_fn_error: str | None = None

    def pin(self, extra: str, name: str) -> str | None:
        """The version ``extra`` (``PINNED_BY``) pins for ``name``; None when its metadata does not say."""
        return self.extra_pins.get(extra, {}).get(name)


@dataclass(frozen=True)
class Finding:
    """One result line. ``level`` is ``fail`` (the launch would break or be wrong) or ``warn``."""

    check: str
    key: str
    message: str
    level: str = "fail"

    def line(self, prefix: str = "[preflight]") -> str:
        return f"{prefix} {self.level.upper()} {self.check}: {self.message}"


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# ---------------------------------------------------------------------------------------------
# GPUs: NVML, no CUDA context
# ---------------------------------------------------------------------------------------------
def visible_ordinals(uuids: Sequence[str]) -> list[int]:
    """NVML indices of the devices CUDA will show, by torch's own parse of ``CUDA_VISIBLE_DEVICES``
    (ordinals or UUID prefixes; the first invalid entry ends the list, as CUDA does)."""
    import torch

    devices = torch.cuda._parse_visible_devices()
    if devices and isinstance(devices[0], str):
        return torch.cuda._transform_uuid_to_ordinals(list(devices), list(uuids))
    ordinals: list[int] = []
    for index in devices:
        if not 0 <= int(index) < len(uuids):
            break
        ordinals.append(int(index))
    return ordinals


def probe_gpus() -> tuple[tuple[GPU, ...], str | None, str | None]:
    """(GPUs, the driver's CUDA version, why there are none) from NVML. A node without an NVIDIA
    driver answers ``NVMLError`` at ``nvmlInit``: no GPU, and the reason."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return (), None, f"no NVIDIA driver (NVML: {err})"
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # 12080 for 12.8
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        gpus = []
        for ordinal in visible_ordinals([pynvml.nvmlDeviceGetUUID(h) for h in handles]):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handles[ordinal])
            name = pynvml.nvmlDeviceGetName(handles[ordinal])
            gpus.append(GPU(len(gpus), name, int(memory.total), int(memory.free)))
    except pynvml.NVMLError as err:
        return (), None, f"NVML: {err}"
    finally:
        pynvml.nvmlShutdown()
    return tuple(gpus), f"{cuda // 1000}.{cuda % 1000 // 10}", None if gpus else "NVML reports no visible GPU"


# ---------------------------------------------------------------------------------------------
# packages: importlib.metadata, read as pip check reads it
# ---------------------------------------------------------------------------------------------
def distribution(name: str, paths: Sequence[str] | None = None) -> Any | None:
    """The installed distribution ``name`` as ``importlib.metadata`` finds it first on ``paths``
    (default: ``sys.path``), or None."""
    from importlib import metadata

    return next(iter(metadata.distributions(name=name, path=list(sys.path if paths is None else paths))), None)


def installed_versions(paths: Sequence[str] | None = None) -> dict[str, str]:
    """Every installed distribution (canonical name) -> version, the first on ``paths`` winning, as
    imports see them."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    out: dict[str, str] = {}
    for dist in metadata.distributions(path=list(sys.path if paths is None else paths)):
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), dist.version)
    return out


def requirements(name: str, extra: str = "", paths: Sequence[str] | None = None) -> list[Any]:
    """``name``'s declared requirements (``packaging`` ``Requirement``) whose marker holds on this
    interpreter for ``extra`` ('' : the base install), as pip evaluates them; [] when not installed."""
    from packaging.requirements import InvalidRequirement, Requirement

    found = distribution(name, paths)
    out = []
    for line in (found.requires or []) if found is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            if extra and (req.marker is None or "extra" not in str(req.marker)):
                continue  # an extra's own requirements only
            out.append(req)
    return out


def unmet(dependent: str, reqs: Sequence[Any], installed: dict[str, str]) -> tuple[Unmet, ...]:
    """The requirements of ``dependent`` (name, version) that ``installed`` does not meet: another
    version (pip check's "has requirement X, but you have X v"), or, for a distribution of
    ``STACK``, none at all ("requires X, which is not installed"). A missing distribution outside the
    stack is left to the import checks."""
    from packaging.utils import canonicalize_name

    name = canonicalize_name(dependent)
    out = []
    for req in reqs:
        target = canonicalize_name(req.name)
        have = installed.get(target)
        if have is None and target in STACK:
            out.append(Unmet(name, installed[name], str(req), None))
        elif have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
            out.append(Unmet(name, installed[name], str(req), have))
    return tuple(out)


def probe_packages(
    paths: Sequence[str] | None = None,
) -> tuple[dict[str, str | None], dict[str, dict[str, str]], tuple[Unmet, ...]]:
    """Versions of ``STACK``, the ``==`` pins of ``PINNED_BY``, and every declared requirement of an
    installed distribution of ``STACK`` that the installed packages do not meet (``unmet``), all
    read from the distributions on ``paths`` (default ``sys.path``)."""
    installed = installed_versions(paths)
    versions: dict[str, str | None] = {name: installed.get(name) for name in STACK}
    pins = {
        key: {
            str(req.name).lower(): next(iter(req.specifier)).version
            for req in requirements(name, extra, paths)
            if len(req.specifier) == 1 and next(iter(req.specifier)).operator == "=="
        }
        for key, (name, extra) in PINNED_BY.items()
    }
    conflicts = tuple(
        found
        for name in STACK
        if versions[name] is not None
        for found in unmet(name, requirements(name, "", paths), installed)
    )
    return versions, pins, conflicts


def sglang_flashinfer_min(paths: Sequence[str] | None = None) -> str | None:
    """The flashinfer floor the installed SGLang asserts in its own ``_set_envs_and_config``
    (``assert_pkg_version("flashinfer_python", <floor>, ...)`` in ``SGLANG_ENGINE_FILE``), read from
    its source without importing it; None without SGLang, its file, or such a call."""
    import ast

    found = distribution("sglang", paths)
    source = Path(str(found.locate_file(SGLANG_ENGINE_FILE))) if found is not None else None
    if source is None or not source.is_file():
        return None
    tree = ast.parse(source.read_text())
    for function in ast.walk(tree):
        if not (isinstance(function, ast.FunctionDef) and function.name == "_set_envs_and_config"):
            continue
        for call in ast.walk(function):
            if (
                isinstance(call, ast.Call)
                and getattr(call.func, "id", getattr(call.func, "attr", None)) == "assert_pkg_version"
                and len(call.args) >= 2
                and all(isinstance(a, ast.Constant) for a in call.args[:2])
                and call.args[0].value == "flashinfer_python"
            ):
                return str(call.args[1].value)
    return None


def ray_min_memory_free(environ: dict[str, str] | None = None) -> int:
    """``RAY_min_memory_free_bytes`` (Ray's ``min_memory_free_bytes``; -1, unset, by default)."""
    import os

    value = (os.environ if environ is None else environ).get("RAY_min_memory_free_bytes", "").strip()
    try:
        return int(value) if value else -1
    except ValueError:
        raise ValueError(f"RAY_min_memory_free_bytes={value!r} is not a whole number of bytes") from None


def ray_memory_threshold(environ: dict[str, str] | None = None) -> float:
    """The fraction of a node's RAM above which Ray's memory monitor kills a worker, from the
    environment Ray reads it from (``RAY_memory_usage_threshold``, default
    ``RAY_MEMORY_USAGE_THRESHOLD``); 1.0 (all of RAM) with the monitor off
    (``RAY_memory_monitor_refresh_ms=0``)."""
    import os

    env = os.environ if environ is None else environ
    if env.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return 1.0
    value = env.get("RAY_memory_usage_threshold", "").strip()
    if not value:
        return RAY_MEMORY_USAGE_THRESHOLD
    try:
        threshold = float(value)
    except ValueError:
        raise ValueError(
            f"RAY_memory_usage_threshold={value!r} is not a number (Ray reads a fraction, e.g. 0.95)"
        ) from None
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"RAY_memory_usage_threshold={value!r} must be in (0, 1]")
    return threshold


# ---------------------------------------------------------------------------------------------
# modules and verl's registries
# ---------------------------------------------------------------------------------------------
def raised_at(error: BaseException) -> str:
    """``one_line(error)`` and the innermost source line that raised it (importlib's frames skipped)."""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")]
    return one_line(error) + (f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else "")


def probe_imports() -> tuple[dict[str, str | None], bool | None]:
    """Each module of ``PROBED_MODULES`` imported here; ``MEGATRON_ENGINE`` again even when verl's
    ``workers/engine/__init__.py`` swallowed its ImportError (Python drops a module that failed from
    ``sys.modules``, so the import runs again and raises the real error)."""
    import dataclasses
    import importlib
    import warnings

    errors: dict[str, str | None] = {}
    routed_experts = None
    for module in PROBED_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # verl's engine package warns about its absent engines
                mod = importlib.import_module(module)
            errors[module] = None
            if module in BRIDGES and not hasattr(mod, "AutoBridge"):
                errors[module] = f"ImportError: cannot import name 'AutoBridge' from '{module}'"
            if module == "sglang.srt.server_args":
                routed_experts = ROUTED_EXPERTS_ARG in {f.name for f in dataclasses.fields(mod.ServerArgs)}
        except Exception as err:  # noqa: BLE001 (any import failure is a fact to report)
            errors[module] = raised_at(err) if module == MEGATRON_ENGINE else one_line(err)
    return errors, routed_experts


def probe_checkpoint_engines() -> tuple[tuple[str, ...], dict[str, str]]:
    try:
        from verl.checkpoint_engine import CheckpointEngineRegistry
    except Exception as err:  # noqa: BLE001
        return (), {"verl.checkpoint_engine": one_line(err)}
    errors = {module: one_line(err) for module, err in CheckpointEngineRegistry._import_errors.items()}
    return tuple(sorted(CheckpointEngineRegistry._registry)), errors


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


# ---------------------------------------------------------------------------------------------
# disk and files
# ---------------------------------------------------------------------------------------------
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

        found = try_to_load_from_cache(repo_id=path, filename="config.json")
    except Exception:  # noqa: BLE001 (no hub client, or not a valid repo id: not cached)
        return None
    return Path(found).parent if isinstance(found, str) else None


def count_params(directory: Path) -> int | None:
    """Parameters of the model ``config.json`` describes, counted by transformers on the meta device
    (``AutoModelForCausalLM.from_config``: no memory, no weights on the node needed); None when
    transformers cannot build that architecture."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 (an unknown model type or a config it rejects: not estimated)
        return None
    return sum(p.numel() for p in model.parameters())


def probe_model(path: str) -> ModelFacts:
    directory = local_model_dir(path)
    if directory is None or not (directory / "config.json").is_file():
        return ModelFacts()
    config = json.loads((directory / "config.json").read_text())
    generation = directory / "generation_config.json"
    stop_ids = eos_ids(config) + (eos_ids(json.loads(generation.read_text())) if generation.is_file() else ())
    return ModelFacts(
        str(directory), config, count_params(directory), tuple(sorted(set(stop_ids))), end_of_turn(directory)
    )


def eos_ids(config: dict) -> tuple[int, ...]:
    """``eos_token_id`` of a config file: one id, a list, or absent."""
    value = config.get("eos_token_id")
    return () if value is None else tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def end_of_turn(directory: Path) -> tuple[str, int] | None:
    """The special token the tokenizer's chat template puts right after an assistant message,
    found by rendering one exchange with transformers (local files only), or None."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        reply = "Answer: 42"
        messages = [{"role": "user", "content": "What is 40 + 2?"}, {"role": "assistant", "content": reply}]
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    except Exception:  # noqa: BLE001 (no tokenizer, no chat template: nothing to check)
        return None
    content = tokenizer.encode(reply, add_special_tokens=False)
    starts = [i for i in range(len(ids) - len(content) + 1) if ids[i : i + len(content)] == content]
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    after = [t for t in ids[starts[-1] + len(content) :] if t in special] if starts else []
    return (tokenizer.convert_ids_to_tokens(after[0]), int(after[0])) if after else None


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


def gather(cfg: DictConfig) -> Facts:
    """This node's facts for one resolved config (GPUs, packages, memory, disk, files)."""
    import socket

    import psutil
    import torch

    gpus, cuda_driver, gpu_error = probe_gpus()
    versions, pins, conflicts = probe_packages()
    imports, routed_experts = probe_imports()
    engines, engine_errors = probe_checkpoint_engines()
    memory = psutil.virtual_memory()
    data_files = as_list(get(cfg, "data.train_files")) + as_list(get(cfg, "data.val_files"))
    return Facts(
        hostname=socket.gethostname(),
        gpus=gpus,
        gpu_error=gpu_error,
        cuda_driver=cuda_driver,
        cuda_runtime=torch.version.cuda,
        python=(sys.version_info.major, sys.version_info.minor),
        versions=versions,
        extra_pins=pins,
        requirement_conflicts=conflicts,
        sglang_flashinfer_min=sglang_flashinfer_min(),
        import_errors=imports,
        sglang_routed_experts=routed_experts,
        checkpoint_engines=engines,
        checkpoint_engine_errors=engine_errors,
        cupy_distributions=tuple(sorted(n for n in installed_versions() if n.startswith("cupy"))),
        host_mem_available_bytes=int(memory.available),
        host_mem_total_bytes=int(memory.total),
        ray_memory_threshold=ray_memory_threshold(),
        ray_min_memory_free_bytes=ray_min_memory_free(),
        disk_free_bytes=probe_disk(str(get(cfg, "trainer.default_local_dir", get(cfg, "sat.run_dir", ".")))),
        model=probe_model(str(get(cfg, "actor_rollout_ref.model.path", ""))),
        data_schemas=probe_data(data_files),
        reward_fn_error=probe_reward(cfg),
    )
