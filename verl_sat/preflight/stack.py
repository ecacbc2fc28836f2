"""The paper's GPU stack as data: every package of the GPU install, the version it pins, and each place
where the install overrides a package's own pin (docs/reproduce.md, "Install on the GPU node").

One source of truth: ``recipes/sat_paper/install_gpu.sh`` installs these pins (through
``recipes/sat_paper/gpu_stack.py``, which loads this file by path on a fresh Python: standard library
and ``packaging`` only, before verl-sat's own requirements are installed), and the preflight compares
the installed packages against them.

Why each pin (read from the packages' metadata on the index):

- verl 0.9.1's ``sglang`` extra pins sglang 0.5.12, ``transformers==5.9.0`` and torch 2.11.0
  (torchvision 0.26.0, torchaudio 2.11.0: the CUDA 13 wheels on PyPI); its ``cupy-cu130`` extra pins
  cupy-cuda13x 14.0.1.
- SGLang 0.5.12 pins ``flashinfer_python`` / ``flashinfer_cubin`` 0.6.11.post1 and
  ``sglang-kernel==0.4.2.post2``.
- verl's own SGLang 0.5.12 image (``docker/Dockerfile.stable.sglang`` in verl's repository) adds
  Megatron-Bridge from its r0.5.0 branch and Megatron-LM ``core_v0.18.0``, both with ``--no-deps``;
  verl 0.9.1's ``megatron`` extra pins ``megatron-bridge==0.5.2``, which the index lacks, so the
  newest 0.5 release there (0.5.1) and megatron-core 0.18.0.
- TransformerEngine 2.12 (verl's previous SGLang image builds ``release_v2.12``): the CUDA 13 core
  wheel, and the PyTorch extension, which PyPI ships only as a source distribution built against
  the installed torch.
- Ray 2.60.0 (verl needs >= 2.41): the version the CPU tests and docs/cluster.md run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def canonical_name(name: str) -> str:
    """A distribution name as ``packaging.utils.canonicalize_name`` writes it (PEP 503).

    Written out here because ``install_gpu.sh`` reads this file before ``packaging`` is installed
    (``gpu_stack.py --no-deps`` and ``--pip`` run on a bare Python); everything that needs more
    imports ``packaging`` inside the function."""
    return re.sub(r"[-_.]+", "-", name).lower()


GPU_STACK: dict[str, str] = {
    "verl": "0.9.1",
    "transformers": "5.9.0",
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "torchaudio": "2.11.0",
    "sglang": "0.5.12",
    "sglang-kernel": "0.4.2.post2",
    "flashinfer-python": "0.6.11.post1",
    "flashinfer-cubin": "0.6.11.post1",
    "megatron-bridge": "0.5.1",
    "megatron-core": "0.18.0",
    "transformer-engine": "2.12.0",
    "transformer-engine-cu13": "2.12.0",
    "transformer-engine-torch": "2.12.0",
    "cupy-cuda13x": "14.0.1",
    "ray": "2.60.0",
}
"""Each package of the GPU install and the exact version it installs (names as PyPI spells them)."""

SGLANG_FLASHINFER_MIN = "0.6.11.post1"
"""SGLang 0.5.12's own flashinfer floor (``assert_pkg_version``, a >= check, in ``_set_envs_and_config``
of ``sglang/srt/entrypoints/engine.py``, only with ``attention_backend=flashinfer``), which verl's
replacement of that function lowers to flashinfer >= 0.2.5 while forcing that backend."""


@dataclass(frozen=True)
class Override:
    """A requirement of ``dependent`` the install deliberately leaves unmet (``--no-deps``)."""

    dependent: str
    requirement: str
    reason: str


_TRANSFORMERS = (
    f"verl 0.9.1 requires transformers!=5.6.0,<5.11,>=5.5.3 and its sglang extra pins "
    f"{GPU_STACK['transformers']}, which the install keeps"
)
_FLASHINFER = (
    f"SGLang 0.5.12 pins {SGLANG_FLASHINFER_MIN} and verl forces attention_backend=flashinfer for SGLang "
    ">= 0.5.12; Megatron-Bridge 0.5.1's code imports no flashinfer (megatron-core only in "
    "megatron.core.inference, which verl's training path does not import)"
)
OVERRIDES: tuple[Override, ...] = (
    # verl's own SGLang 0.5.12 image installs Megatron-Bridge and Megatron-LM with --no-deps too.
    Override("sglang", "transformers==5.6.0", _TRANSFORMERS),
    Override("megatron-bridge", "transformers<5.9.0,>=5.8.1", _TRANSFORMERS),
    Override("megatron-bridge", "flashinfer-python==0.6.8.post1", _FLASHINFER),
    Override("megatron-bridge", "flashinfer-cubin==0.6.8.post1", _FLASHINFER),
    Override(
        "megatron-bridge",
        "open-clip-torch>=3.2.0",
        "open-clip-torch >= 3.2 needs timm >= 1.0.17 and SGLang 0.5.12 pins timm==1.0.16; Megatron-Bridge "
        "0.5.1's code imports neither open_clip nor timm",
    ),
    Override(
        "megatron-core",
        'nvidia-resiliency-ext==0.6.0; extra == "dev"',
        "nvidia-resiliency-ext 0.6.0 ships only manylinux_2_39 wheels (glibc 2.39), which a glibc 2.35 "
        "node cannot install; Megatron-Bridge's own unpinned requirement takes the newest the node accepts",
    ),
)
"""Each place the install overrides a package's own pin, installing that package with ``--no-deps``."""


def override_for(dependent: str, requirement: str) -> Override | None:
    """The named override of ``dependent``'s ``requirement``, or None when the install must meet it."""
    from packaging.requirements import Requirement  # installed by now: install_gpu.sh, or verl's own

    for override in OVERRIDES:
        # packaging's equality: the same name, extras, specifiers, URL and marker
        if canonical_name(override.dependent) == canonical_name(dependent) and Requirement(
            override.requirement
        ) == Requirement(requirement):
            return override
    return None
