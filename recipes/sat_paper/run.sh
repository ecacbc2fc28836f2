#!/usr/bin/env bash
# One cell of the paper's Table 1: a method at a lag, on one node of 8 GPUs (4 train, 4 rollout).
#
#   recipes/sat_paper/run.sh <method> <lag> [hydra overrides...]
#   recipes/sat_paper/run.sh sat_gspo_r3 8
#   DRY_RUN=1 recipes/sat_paper/run.sh grpo 1      # print the commands instead of running them
#   SAT_SKIP_PREFLIGHT=1 recipes/sat_paper/run.sh grpo 1   # launch without python -m verl_sat.preflight
#   recipes/sat_paper/run.sh sat_gspo_r3 8 --cfg job     # print the composed config (no GPU needed)
#   recipes/sat_paper/run.sh sat_gspo_r3 8 ray_kwargs.ray_init.address=auto trainer.nnodes=2   # docs/cluster.md
#
# Hydra's print-only flags (--cfg/-c, --info/-i, --help/-h, --hydra-help) launch nothing, so they
# skip the preflight and create no run directory.
# Methods and lags: python -m verl_sat.paper.grid --list. Everything the run writes goes to
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
CELL_OVERRIDES=$("${PYTHON}" -m verl_sat.paper.grid --overrides "${METHOD}" "${LAG}" --run-dir "${RUN_DIR}")
mapfile -t CELL <<< "${CELL_OVERRIDES}"
# The run's data and model (the preflight checks the same config the launch gets).
PATHS=(
    data.train_files="${DATA_DIR}/train.parquet"
    data.val_files="${DATA_DIR}/aime24.parquet"
    actor_rollout_ref.model.path="${MODEL_PATH}"
)
export VERL_FILE_LOGGER_PATH=${RUN_DIR}/metrics.jsonl
export CUDA_DEVICE_MAX_CONNECTIONS=1
PRINT_ONLY=
for arg in "$@"; do
    case "${arg}" in
        --cfg | --cfg=* | -c | --info | --info=* | -i | --help | -h | --hydra-help) PRINT_ONLY=1 ;;
    esac
done
[[ -n ${DRY_RUN:-}${PRINT_ONLY} ]] || mkdir -p "${RUN_DIR}"

# GPUs, packages, context length, memory, disk, data and reward against this cell (seconds); joining
# a cluster (ray_kwargs.ray_init.address= or RAY_ADDRESS, docs/cluster.md): GPUs, memory, disk,
# versions and the paths on every node, and verl's pools on the nodes.
[[ -n ${SAT_SKIP_PREFLIGHT:-}${PRINT_ONLY} ]] || ${DRY_RUN:+echo} "${PYTHON}" -m verl_sat.preflight \
    "${METHOD}" "${LAG}" --run-dir "${RUN_DIR}" "${PATHS[@]}" "$@"

${DRY_RUN:+echo} "${PYTHON}" -m verl_sat.main \
    --config-path "${REPO_ROOT}/hydra_configs" \
    --config-name sat_paper \
    "${CELL[@]}" \
    "${PATHS[@]}" \
    hydra.run.dir="${RUN_DIR}/hydra" \
    "$@"
