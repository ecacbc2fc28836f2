#!/usr/bin/env bash
# The paper's pipeline on ONE GPU, as a smoke test: SAT-GSPO + R3, Megatron training, SGLang
# rollout, verl's separate_async trainer at lag 2 (sat.lag=2: two optimizer steps per weight
# broadcast), on a tiny Qwen3-MoE built here (verl_sat/default/smoke.py). It runs 2 global steps
# with a checkpoint after each, then a second invocation in the same run directory resumes from
# the step-2 checkpoint and trains step 3, then checks the run directory. It checks the wiring,
# not any number (random weights: the reward is about 0). Meant to take under 8 minutes on one
# H200; it has NOT been run yet (no GPU was at hand; docs/reproduce.md).
#
#   recipes/sat_paper/smoke_1gpu.sh [hydra overrides...]     # overrides go to both invocations
#   DRY_RUN=1 recipes/sat_paper/smoke_1gpu.sh                # print the commands instead
#
# One GPU, two Ray "GPU" slots: separate_async needs a trainer slot and a rollout slot, so
# CUDA_VISIBLE_DEVICES lists the GPU twice and Ray counts it twice (each slot's processes then see
# that one GPU). Weights go trainer -> SGLang through verl-sat's ray_object_store engine, because
# NCCL refuses two ranks on one device. Needs verl with its megatron and sglang extras.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
# A fresh run directory each time (the second invocation must resume from the first's checkpoint).
RUN_DIR=${RUN_DIR:-${REPO_ROOT}/runs/smoke_1gpu-$(date +%Y%m%d-%H%M%S)}
ASSETS_DIR=${ASSETS_DIR:-${REPO_ROOT}/runs/smoke_1gpu_assets}
GPU=${GPU:-0}
LAG=2
STEPS=2
RESUMED_STEPS=1
export CUDA_VISIBLE_DEVICES=${GPU},${GPU}
export CUDA_DEVICE_MAX_CONNECTIONS=1

# One invocation of verl_sat.main: the cell sat_gspo_r3 (algorithm, stabilizer, sat.method) at
# sat.lag=2 (verl_sat.schedule derives batch size, parameter_sync_step and warm-up from it),
# scaled down to the tiny model, until global step $1.
launch() {
    ${DRY_RUN:+echo} "${PYTHON}" -m verl_sat.main \
        --config-path "${REPO_ROOT}/hydra_configs" \
        --config-name sat_paper \
        algorithm=sat_gspo \
        stabilizer=r3 \
        lag=n1 \
        sat.lag=${LAG} \
        sat.method=sat_gspo_r3 \
        sat.run_dir="${RUN_DIR}" \
        hydra.run.dir="${RUN_DIR}/hydra" \
        trainer.project_name=sat_paper_smoke \
        actor_rollout_ref.model.path="${ASSETS_DIR}/model" \
        data.train_files="${ASSETS_DIR}/data/train.parquet" \
        data.val_files="${ASSETS_DIR}/data/val.parquet" \
        data.max_prompt_length=128 \
        data.max_response_length=256 \
        data.val_max_samples=8 \
        reward.custom_reward_function.path="${REPO_ROOT}/verl_sat/default/reward.py" \
        reward.custom_reward_function.name=compute_score \
        actor_rollout_ref.actor.ppo_mini_batch_size=4 \
        actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024 \
        actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1 \
        actor_rollout_ref.actor.megatron.expert_model_parallel_size=1 \
        actor_rollout_ref.rollout.n=4 \
        actor_rollout_ref.rollout.val_kwargs.n=2 \
        actor_rollout_ref.rollout.n_gpus_per_node=1 \
        actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
        actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
        actor_rollout_ref.rollout.checkpoint_engine.backend=ray_object_store \
        trainer.n_gpus_per_node=1 \
        +ray_kwargs.ray_init.num_gpus=2 \
        trainer.val_before_train=false \
        trainer.test_freq=${STEPS} \
        trainer.save_freq=1 \
        trainer.resume_mode=auto \
        trainer.total_training_steps="$1" \
        "${@:2}"
}

[[ -n ${DRY_RUN:-} || -f ${ASSETS_DIR}/model/config.json ]] || "${PYTHON}" -m verl_sat.default.smoke build --out "${ASSETS_DIR}"
[[ ! -e ${RUN_DIR}/metrics.jsonl ]] || { echo "${RUN_DIR} already holds a run; set RUN_DIR=" >&2; exit 1; }
launch "${STEPS}" "$@"
launch "$((STEPS + RESUMED_STEPS))" "$@"
${DRY_RUN:+echo} "${PYTHON}" -m verl_sat.default.smoke check \
    --run-dir "${RUN_DIR}" --lag ${LAG} --steps ${STEPS} --resumed-steps ${RESUMED_STEPS}
echo "[verl-sat] smoke: ${SECONDS} s in all"
