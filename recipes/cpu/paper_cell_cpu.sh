#!/usr/bin/env bash
# One cell of the paper's grid on a CPU machine: Megatron + SGLang + routing replay + separate_async,
# on the embedded tiny MoE and its arithmetic task (docs/cpu.md, "The paper's cell on CPU").
#
#   bash recipes/cpu/paper_cell_cpu.sh <method> <lag> [hydra overrides...]
#   bash recipes/cpu/paper_cell_cpu.sh sat_gspo_r3 8
#   DRY_RUN=1 bash recipes/cpu/paper_cell_cpu.sh sat_gspo_r3 8    # the command, not the run
#
# The cell is composed by recipes/sat_paper/run.sh itself (the same cell overrides, paths and main
# config), with one CPU overlay last: hydra_configs/overlay/cpu.yaml (+overlay=cpu), each key with its
# reason. The preflight (GPUs, NCCL) is skipped: it checks a GPU node. Needs SGLang 0.5.12 in the active
# environment (bash recipes/cpu/install_sglang_cpu.sh) and the Megatron CPU extra (pip install -e ".[test]").
# Writes to ${RUNS_ROOT:-runs}/<method>-lag<lag>/ as run.sh does.
set -euo pipefail

METHOD=${1:?usage: paper_cell_cpu.sh <method> <lag> [hydra overrides...]}
LAG=${2:?usage: paper_cell_cpu.sh <method> <lag> [hydra overrides...]}
shift 2

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}

# The embedded tiny MoE and its task (built once, ~2-3 min, into ~/.cache/verl-sat/, as verl-sat does).
ASSETS=$("${PYTHON}" -c "
import os
from verl_sat.default.assets import build_assets_once, default_assets_dir
assets = default_assets_dir()
if not os.environ.get('DRY_RUN'):
    build_assets_once(assets)
print(assets)
" | tail -n 1)
# run.sh reads the training split as train.parquet and the validation split as aime24.parquet from
# DATA_DIR: a folder of links to the task's splits under that name.
export RUNS_ROOT=${RUNS_ROOT:-${REPO_ROOT}/runs}
export DATA_DIR=${RUNS_ROOT}/.cpu_cell_data
export MODEL_PATH=${ASSETS}/model
if [[ -z ${DRY_RUN:-} ]]; then
    mkdir -p "${DATA_DIR}"
    ln -sfn "${ASSETS}/data/train.parquet" "${DATA_DIR}/train.parquet"
    ln -sfn "${ASSETS}/data/val.parquet" "${DATA_DIR}/aime24.parquet"
fi

SAT_SKIP_PREFLIGHT=1 exec bash "${REPO_ROOT}/recipes/sat_paper/run.sh" "${METHOD}" "${LAG}" +overlay=cpu "$@"
