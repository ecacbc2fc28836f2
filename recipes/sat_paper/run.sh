#!/usr/bin/env bash
# One cell of the paper's Table 1: a method at a lag, on one node of 8 GPUs (4 train, 4 rollout).
#
#   recipes/sat_paper/run.sh <method> <lag> [hydra overrides...]
#   recipes/sat_paper/run.sh sat_gspo_r3 8
#   DRY_RUN=1 recipes/sat_paper/run.sh grpo 1      # print the command instead of running it
#
# Methods and lags: python -m verl_sat.recipes --list. Everything the run writes goes to
# ${RUNS_ROOT}/<method>-lag<lag>/ (checkpoints/, validation/, metrics.jsonl, hydra/).
set -euo pipefail

METHOD=${1:?usage: run.sh <method> <lag> [hydra overrides...]}
LAG=${2:?usage: run.sh <method> <lag> [hydra overrides...]}
shift 2

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
RUNS_ROOT=${RUNS_ROOT:-${REPO_ROOT}/runs}
DATA_DIR=${DATA_DIR:-${HOME}/data/sat_math}
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen3-30B-A3B-Base}
RUN_DIR=${RUNS_ROOT}/${METHOD}-lag${LAG}
# algorithm=, stabilizer=, lag=, sat.method=, sat.run_dir= (and trainer.val_only=true for base)
CELL_OVERRIDES=$("${PYTHON}" -m verl_sat.recipes --overrides "${METHOD}" "${LAG}" --run-dir "${RUN_DIR}")
mapfile -t CELL <<< "${CELL_OVERRIDES}"
export VERL_FILE_LOGGER_PATH=${RUN_DIR}/metrics.jsonl
export CUDA_DEVICE_MAX_CONNECTIONS=1
[[ -n ${DRY_RUN:-} ]] || mkdir -p "${RUN_DIR}"

${DRY_RUN:+echo} "${PYTHON}" -m verl_sat.main \
    --config-path "${REPO_ROOT}/hydra_configs" \
    --config-name sat_paper \
    "${CELL[@]}" \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/aime24.parquet" \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    hydra.run.dir="${RUN_DIR}/hydra" \
    "$@"
