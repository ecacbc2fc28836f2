#!/usr/bin/env bash
# A smoke run of the paper's pipeline on ONE GPU (not run in CI): SAT-GSPO + R3 with Megatron and
# SGLang colocated, a small Qwen MoE, tiny batches and a few steps. It checks that a cell of
# hydra_configs/sat_paper.yaml starts, generates, replays routes, trains and validates; it does
# not reproduce any number. One GPU cannot split 4 train / 4 rollout, so the run uses verl's
# colocate_async trainer (hybrid engine); with it the lag is 1 (parameter_sync_step is a
# separate_async key).
#
#   recipes/sat_paper/smoke_1gpu.sh [hydra overrides...]
#   MODEL_PATH=/local/Qwen1.5-MoE-A2.7B recipes/sat_paper/smoke_1gpu.sh
#
# Needs an 80 GB+ GPU, verl with its megatron and sglang extras, and the data of
# `python -m verl_sat.data.prepare_math --out ${DATA_DIR}`.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
RUN_DIR=${RUN_DIR:-${REPO_ROOT}/runs/smoke_1gpu}
DATA_DIR=${DATA_DIR:-${HOME}/data/sat_math}
# A small Qwen MoE (14.3B total, 2.7B active, 60 experts top-4), supported by mbridge and SGLang.
MODEL_PATH=${MODEL_PATH:-Qwen/Qwen1.5-MoE-A2.7B}
export VERL_FILE_LOGGER_PATH=${RUN_DIR}/metrics.jsonl
export CUDA_DEVICE_MAX_CONNECTIONS=1
mkdir -p "${RUN_DIR}"

"${PYTHON}" -m verl_sat.main \
    --config-path "${REPO_ROOT}/hydra_configs" \
    --config-name sat_paper \
    algorithm=sat_gspo \
    stabilizer=r3 \
    lag=n1 \
    sat.method=sat_gspo_r3 \
    trainer.project_name=sat_paper_smoke \
    sat.run_dir="${RUN_DIR}" \
    hydra.run.dir="${RUN_DIR}/hydra" \
    data.train_files="${DATA_DIR}/train.parquet" \
    data.val_files="${DATA_DIR}/aime24.parquet" \
    data.train_batch_size=8 \
    data.val_max_samples=4 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.hybrid_engine=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.expert_model_parallel_size=1 \
    actor_rollout_ref.actor.megatron.param_offload=true \
    actor_rollout_ref.actor.megatron.optimizer_offload=true \
    actor_rollout_ref.rollout.nnodes=0 \
    actor_rollout_ref.rollout.n_gpus_per_node=1 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    actor_rollout_ref.rollout.checkpoint_engine.backend=naive \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.val_kwargs.n=2 \
    trainer.n_gpus_per_node=1 \
    trainer.v1.trainer_mode=colocate_async \
    trainer.total_training_steps=3 \
    trainer.test_freq=3 \
    trainer.save_freq=-1 \
    "$@"
