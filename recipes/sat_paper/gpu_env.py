"""The 1-GPU smoke's environment probe (docs/reproduce.md; recipes/sat_paper/smoke_1gpu.sh, stage ``env``).

The smoke puts a trainer and a standalone SGLang server on ONE GPU, so Ray must offer two "GPU"
slots that both land on it, and every process (driver, GPU workers, the SGLang server Ray starts
without a GPU) must see that GPU through ``CUDA_VISIBLE_DEVICES``. One way works
(``SLOT_MODES``), checked on CPU against torch's own parser and a real ``ray.init``
(tests/test_smoke_1gpu_on_cpu.py):

- ``runtime_env``: the driver runs with ``CUDA_VISIBLE_DEVICES`` unset, ``ray_init.num_gpus=2``
  declares two GPU slots, and ``ray_kwargs.ray_init.runtime_env.env_vars.CUDA_VISIBLE_DEVICES=G``
  sets the variable in every Ray worker. Ray 2.60 keeps a job's runtime-env value in the workers
  it gives a GPU slot (and reports their accelerator id as G), so both slots and the no-GPU actors
  see ``G``; torch parses ``[G]`` and verl's worker (``LOCAL_RANK`` 0) selects ``cuda:0``, which is
  GPU G. verl's SGLang replica reads the same value from its worker (``base_gpu_id`` 0).

Dropped, each for a failure the CPU tests reproduce with the real library:

- ``repeat`` (``CUDA_VISIBLE_DEVICES=G,G``): torch's ``_parse_visible_devices()`` rejects a
  repeated ordinal and returns ``[]``, so the driver and every process Ray starts without a GPU
  see no device.
- the driver's ``CUDA_VISIBLE_DEVICES=G`` with ``num_gpus=2``: ``ray.init`` raises ``ValueError:
  Attempting to start raylet with 2 GPU, but CUDA_VISIBLE_DEVICES contains ['G']``.
- fractional GPUs or a custom resource: verl places every worker in a bundle of one whole
  ``GPU`` (``RayResourcePool.get_placement_groups``) and ``ResourcePoolManager`` checks the pools
  against Ray's ``GPU`` count, so neither is a configuration verl accepts.

Each mode is probed as the launch uses it, in a child process with the driver's environment:
``torch.cuda.device_count()`` there, then a Ray cluster with two one-GPU actors and one actor
without a GPU that each report ``CUDA_VISIBLE_DEVICES``, torch's parse of it and Ray's id, and on
CUDA allocate on ``cuda:0``. The probe also imports sglang, megatron-core, the bridge verl's
Megatron engine imports and TransformerEngine. It prints one PASS/FAIL line per item, writes a
JSON report and a bash file of the chosen mode (``SLOT_MODE``, ``SLOT_OVERRIDES``) that the smoke
sources; exit 1 when an import fails or no mode works.

Runs by path (``python recipes/sat_paper/gpu_env.py ...``): torch, ray and the probed packages
are imported inside the functions only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

SLOT_MODES = ("runtime_env",)
# (label, module) imported by the probe; the bridge is added by --bridge.
IMPORTS = (
    ("sglang", "sglang"),
    ("megatron-core", "megatron.core"),
    ("TransformerEngine", "transformer_engine.pytorch"),
)
# GPU slots Ray offers: the trainer's and the standalone rollout's.
SLOTS = 2


def check_mode(mode: str) -> None:
    if mode not in SLOT_MODES:
        raise ValueError(f"slot mode must be one of {list(SLOT_MODES)}, got {mode!r}")


def slot_overrides(mode: str, gpu: str) -> list[str]:
    """The Hydra overrides that give verl two Ray GPU slots on GPU ``gpu`` in ``mode`` (the driver
    runs with ``CUDA_VISIBLE_DEVICES`` unset)."""
    check_mode(mode)
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    return [f"+ray_kwargs.ray_init.num_gpus={SLOTS}", f"{env}.CUDA_VISIBLE_DEVICES='{gpu}'"]


def slots_file(mode: str, gpu: str) -> str:
    """The bash lines the smoke sources after the probe."""
    overrides = " ".join(shlex.quote(o) for o in slot_overrides(mode, gpu))
    return f"SLOT_MODE={mode}\nSLOT_OVERRIDES=({overrides})\n"


# ---------------------------------------------------------------------------------------------
# probes (each returns a dict with "ok"; run in child processes under the mode's environment)
# ---------------------------------------------------------------------------------------------
def probe_import(module: str) -> dict:
    import importlib
    from importlib import metadata

    try:
        mod = importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 (any failure is the finding)
        return {"ok": False, "error": f"{type(err).__name__}: {str(err).strip()[:300]}"}
    top = module.split(".")[0]
    names = {"megatron": "megatron-core", "transformer_engine": "transformer-engine"}
    dist = "megatron-bridge" if module == "megatron.bridge" else names.get(top, top)
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = getattr(mod, "__version__", None)
    return {"ok": True, "version": version}


def probe_torch_devices() -> dict:
    """``torch.cuda.device_count()`` here, and a tensor on every ordinal it reports."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "device_count": count}
    try:
        for i in range(count):
            torch.ones(1, device=f"cuda:{i}").sum().item()
    except Exception as err:  # noqa: BLE001
        return {**report, "ok": False, "error": f"{type(err).__name__}: {err}"}
    return {**report, "ok": count >= 1}


def expected_devices(gpu: str) -> list:
    """What torch's parser makes of ``CUDA_VISIBLE_DEVICES=gpu`` (one entry: the GPU)."""
    import torch

    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        return list(torch.cuda._parse_visible_devices())
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def slot_report() -> dict:
    """What one Ray worker sees: ``CUDA_VISIBLE_DEVICES``, torch's parse of it, Ray's GPU ids, and
    with CUDA a tensor on ``cuda:0`` (verl's worker selects ``LOCAL_RANK`` 0)."""
    import ray
    import torch

    out = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_parse": list(torch.cuda._parse_visible_devices()),
        "ray_gpu_ids": list(ray.get_runtime_context().get_accelerator_ids().get("GPU", [])),
        "cuda": torch.cuda.is_available(),
    }
    if out["cuda"]:
        try:
            torch.cuda.set_device(0)
            torch.ones(1, device="cuda:0").sum().item()
            out["uuid"] = str(torch.cuda.get_device_properties(0).uuid)
        except Exception as err:  # noqa: BLE001
            return {**out, "ok": False, "error": f"{type(err).__name__}: {err}"}
    return {**out, "ok": True}


def probe_ray_slots(mode: str, gpu: str, num_cpus: int = 2) -> dict:
    """A Ray cluster as the launch starts it (``ray.init(num_gpus=2, runtime_env=...)``), two
    one-GPU actors as verl places its trainer and rollout, one actor without a GPU (the SGLang
    server, the task runner): each must parse exactly GPU ``gpu``, and on CUDA all land on one device."""
    import ray

    check_mode(mode)
    expected = expected_devices(gpu)
    ray.init(
        num_gpus=SLOTS,
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": gpu}},
    )
    try:
        probe = ray.remote(slot_report)
        refs = [probe.options(num_gpus=1, num_cpus=0).remote() for _ in range(SLOTS)]
        refs.append(probe.options(num_gpus=0, num_cpus=0).remote())
        results = ray.get(refs, timeout=180)
    finally:
        ray.shutdown()
    for result, role in zip(results, ["gpu slot"] * SLOTS + ["no-gpu actor"], strict=True):
        result["role"] = role
        if result["ok"] and result["torch_parse"] != expected:
            result["ok"] = False
            result["error"] = f"torch parses {result['torch_parse']}, not {expected}"
    uuids = {r.get("uuid") for r in results if r.get("uuid")}
    ok = all(r["ok"] for r in results) and len(uuids) <= 1
    return {"ok": ok, "expected": expected, "slots": results}


def probe_mode(mode: str, gpu: str, runner: Callable[[list[str], dict], dict] | None = None) -> dict:
    """``probe_torch_devices`` and ``probe_ray_slots`` in a child process with the launch's driver
    environment (``CUDA_VISIBLE_DEVICES`` unset; CUDA reads it once per process)."""
    check_mode(mode)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--gpu", gpu]
    return (runner or run_child)(command, env)


def run_child(command: list[str], env: dict) -> dict:
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}"}


def child(mode: str, gpu: str) -> dict:
    """Both probes, always (a node without CUDA still shows what Ray and torch make of the slots)."""
    torch_report = probe_torch_devices()
    try:
        ray_report = probe_ray_slots(mode, gpu)
    except Exception as err:  # noqa: BLE001
        ray_report = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    return {"ok": torch_report["ok"] and ray_report["ok"], "torch": torch_report, "ray": ray_report}


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def choose_mode(reports: dict[str, dict]) -> str | None:
    """The first of ``SLOT_MODES`` whose probe passed."""
    return next((mode for mode in SLOT_MODES if reports.get(mode, {}).get("ok")), None)


def describe(report: dict) -> str:
    torch_report = report.get("torch", {})
    parts = []
    if torch_report:
        parts.append(
            f"torch.cuda.device_count()={torch_report.get('device_count')} under "
            f"CUDA_VISIBLE_DEVICES={torch_report.get('cuda_visible_devices')}"
        )
    for slot in report.get("ray", {}).get("slots", []):
        verdict = "ok" if slot["ok"] else slot.get("error")
        parts.append(
            f"{slot.get('role', 'slot')} CUDA_VISIBLE_DEVICES={slot.get('cuda_visible_devices')} torch "
            f"{slot.get('torch_parse')} ray ids={slot.get('ray_gpu_ids')} -> {verdict}"
        )
    error = report.get("error") or torch_report.get("error") or report.get("ray", {}).get("error")
    return "; ".join(parts + ([error] if error else []))


def run_probe(
    gpu: str,
    bridge: str,
    import_fn: Callable[[str], dict] = probe_import,
    mode_fn: Callable[[str, str], dict] = probe_mode,
) -> dict:
    """Imports, then the slot modes in order until one works (the fallback only if needed)."""
    imports = {label: import_fn(module) for label, module in (*IMPORTS, (bridge, bridge))}
    modes: dict[str, dict] = {}
    for mode in SLOT_MODES:
        modes[mode] = mode_fn(mode, gpu)
        if modes[mode].get("ok"):
            break
    chosen = choose_mode(modes)
    ok = chosen is not None and all(r["ok"] for r in imports.values())
    return {"ok": ok, "gpu": gpu, "mode": chosen, "imports": imports, "modes": modes}


def print_report(report: dict) -> None:
    for label, result in report["imports"].items():
        status = "PASS" if result["ok"] else "FAIL"
        print(f"[smoke]   {status} import {label}: {result.get('version') if result['ok'] else result['error']}")
    for mode, result in report["modes"].items():
        status = "PASS" if result.get("ok") else "FAIL"
        print(f"[smoke]   {status} two Ray GPU slots, mode {mode}: {describe(result)}")
    if report["mode"] is None:
        print("[smoke]   no way to give Ray two GPU slots on one device was found")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="0", help="the physical GPU index the smoke uses")
    parser.add_argument("--bridge", default="megatron.bridge", help="the bridge module verl imports")
    parser.add_argument("--slots-file", type=Path, help="write the chosen mode as bash assignments here")
    parser.add_argument("--json", type=Path, help="write the whole report here")
    parser.add_argument("--child", choices=SLOT_MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.gpu)))
        return 0
    report = run_probe(args.gpu, args.bridge)
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if report["mode"] and args.slots_file:
        args.slots_file.parent.mkdir(parents=True, exist_ok=True)
        args.slots_file.write_text(slots_file(report["mode"], args.gpu))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
