"""The preflight's probe (docs/reproduce.md): the only place that inspects the node. torch, sglang,
megatron, cupy, pyarrow and verl's checkpoint engines are imported inside the ``probe_*``
functions only, so importing this module stays light."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig

from verl_sat.preflight.facts import (
    CHECKED_REQUIREMENTS,
    GPU,
    PROBED_DISTRIBUTIONS,
    PROBED_MODULES,
    Facts,
    ModelFacts,
    as_list,
    get,
)


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


def extra_pins(requirements: Sequence[str], extra: str) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` requirements under ``extra == "<extra>"``."""
    pins = {}
    for req in requirements:
        spec, _, marker = req.partition(";")
        spec = spec.replace(" ", "")
        if "==" in spec and f'extra=="{extra}"' in marker.replace(" ", "").replace("'", '"'):
            name, version = spec.split("==", 1)
            pins[name.lower()] = version
    return pins


def probe_versions() -> tuple[dict[str, str | None], str | None, tuple[str, ...]]:
    """Installed versions, verl's sglang pin (its METADATA) and the cupy distributions."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in PROBED_DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        pin = extra_pins(metadata.requires("verl") or [], "sglang").get("sglang")
    except metadata.PackageNotFoundError:
        pin = None
    cupy = sorted(
        {
            d.metadata["Name"].lower()
            for d in metadata.distributions()
            if (d.metadata["Name"] or "").lower().startswith("cupy")
        }
    )
    return versions, pin, tuple(cupy)


def probe_megatron_pins() -> dict[str, str]:
    """What the installed verl's ``megatron`` extra pins with ``==`` (e.g. megatron-bridge)."""
    from importlib import metadata

    try:
        return extra_pins(metadata.requires("verl") or [], "megatron")
    except metadata.PackageNotFoundError:
        return {}


def unmet_requirements(
    requirements: Sequence[str], installed: dict[str, str | None], watched: Sequence[str]
) -> tuple[str, ...]:
    """The requirements on ``watched`` packages (no extra marker) that ``installed`` misses.

    A package that is not installed is not reported here (the import checks say so)."""
    from packaging.requirements import InvalidRequirement, Requirement

    unmet = []
    for line in requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = req.name.lower().replace("_", "-")
        if name not in watched or (req.marker is not None and "extra" in str(req.marker)):
            continue
        have = installed.get(name)
        if have is not None and req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{name}{req.specifier} ({have} installed)")
    return tuple(unmet)


def probe_requirement_conflicts(installed: dict[str, str | None]) -> dict[str, tuple[str, ...]]:
    """For each installed distribution of ``CHECKED_REQUIREMENTS``: its unmet requirements."""
    from importlib import metadata

    out = {}
    for dist, watched in CHECKED_REQUIREMENTS.items():
        if installed.get(dist) is None:
            continue
        try:
            unmet = unmet_requirements(metadata.requires(dist) or [], installed, watched)
        except metadata.PackageNotFoundError:
            continue
        if unmet:
            out[dist] = unmet
    return out


def probe_imports() -> tuple[dict[str, str | None], frozenset[str] | None]:
    import dataclasses
    import importlib

    errors: dict[str, str | None] = {}
    server_args = None
    for module in PROBED_MODULES:
        try:
            mod = importlib.import_module(module)
            errors[module] = None
            if module in ("megatron.bridge", "mbridge") and not hasattr(mod, "AutoBridge"):
                errors[module] = f"ImportError: cannot import name 'AutoBridge' from '{module}'"
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
    generation = directory / "generation_config.json"
    stop_ids = eos_ids(config) + (eos_ids(json.loads(generation.read_text())) if generation.is_file() else ())
    return ModelFacts(
        str(directory),
        config,
        None if weight_bytes is None else int(weight_bytes),
        tuple(sorted(set(stop_ids))),
        end_of_turn(directory),
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
    import sys

    gpus, cuda = probe_gpus()
    versions, pin, cupy = probe_versions()
    imports, server_args = probe_imports()
    engines, engine_errors = probe_checkpoint_engines()
    data_files = as_list(get(cfg, "data.train_files")) + as_list(get(cfg, "data.val_files"))
    return Facts(
        gpus=gpus,
        cuda_runtime=cuda,
        python=(sys.version_info.major, sys.version_info.minor),
        versions=versions,
        sglang_pin=pin,
        megatron_pins=probe_megatron_pins(),
        requirement_conflicts=probe_requirement_conflicts(versions),
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
