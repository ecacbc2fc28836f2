#!/usr/bin/env bash
# The paper's pipeline on ONE GPU, as a smoke test run in stages: SAT-GSPO + R3, Megatron
# training, SGLang rollout, verl's separate_async trainer at lag 2 (sat.lag=2: two optimizer steps
# per weight broadcast), on a tiny Qwen3-MoE built here (recipes/sat_paper/smoke.py). It checks the
# wiring, not any number (random weights: the reward is about 0). Meant to take under 8 minutes
# on one H200; it has NOT been run yet (no GPU was at hand; docs/reproduce.md).
#
#   recipes/sat_paper/smoke_1gpu.sh [hydra overrides...]     # overrides go to every launch
#   DRY_RUN=1 recipes/sat_paper/smoke_1gpu.sh                # print the stages' commands instead
#
# Stages, each printing "[smoke] PASS|FAIL <stage> (<s> s)" and recorded in
# ${RUN_DIR}/smoke_summary.json (logs in ${RUN_DIR}/stages/); the first failure stops the script
# and repeats its command's last lines (recipes/sat_paper/stages.py). Each stage has a timeout
# (TIMEOUT_<STAGE> seconds, defaults below); one that runs out is ended with its process group
# and prints "[smoke] FAIL <stage> (timeout after N s)":
#   env         torch.cuda.device_count() in the launches' driver environment, two Ray GPU slots
#               on the one GPU as each Ray worker parses them, imports of sglang, megatron-core,
#               the bridge verl imports and TransformerEngine (recipes/sat_paper/gpu_env.py)
#   assets      the tiny model and task (once per ASSETS_DIR)
#   no_offload  1 global step with the optimizer on the GPU (${RUN_DIR}/no_offload)
#   offload     2 global steps with the recipe's CPU-offloaded optimizer, a checkpoint after each
#   resume      a second invocation in the same run directory: resumes at step 2, trains step 3
#   check       the run directory (recipes/sat_paper/smoke.py check), Adam's step across the resume
#               included: "[verl-sat] smoke: FAIL resume: Adam step <n> after resume ..." when the
#               resumed optimizer did not go on from the saved step
#
# One GPU, two Ray "GPU" slots (trainer + standalone rollout): the driver runs with
# CUDA_VISIBLE_DEVICES unset, ray_init.num_gpus=2, and every Ray worker gets
# CUDA_VISIBLE_DEVICES=<gpu> through ray_kwargs.ray_init.runtime_env (gpu_env.py says why, and
# which other ways fail); the env stage checks it on this node before any launch.
# Weights go trainer -> SGLang through verl-sat's ray_object_store engine, because NCCL refuses two
# ranks on one device. Needs verl with its megatron and sglang extras (docs/reproduce.md).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
# A fresh run directory each time (the resume must find only the offload stage's checkpoints).
RUN_DIR=${RUN_DIR:-${REPO_ROOT}/runs/smoke_1gpu-$(date +%Y%m%d-%H%M%S)}
ASSETS_DIR=${ASSETS_DIR:-${REPO_ROOT}/runs/smoke_1gpu_assets}
GPU=${GPU:-0}
# The bridge verl's Megatron engine imports (actor.megatron.vanilla_mbridge=false: Megatron-Bridge).
BRIDGE=${BRIDGE:-megatron.bridge}
LAG=2
STEPS=2
RESUMED_STEPS=1
SUMMARY=${RUN_DIR}/smoke_summary.json
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Two Ray GPU slots on one GPU; the env stage writes the mode that passed (gpu_env.py slots_file).
SLOT_MODE=runtime_env
SLOT_OVERRIDES=(+ray_kwargs.ray_init.num_gpus=2 "+ray_kwargs.ray_init.runtime_env.env_vars.CUDA_VISIBLE_DEVICES='${GPU}'")
# Seconds each stage may take before it is ended as FAIL (one H200; generous: the first launch
# compiles kernels and captures CUDA graphs).
TIMEOUT_ENV=${TIMEOUT_ENV:-600}
TIMEOUT_ASSETS=${TIMEOUT_ASSETS:-600}
TIMEOUT_NO_OFFLOAD=${TIMEOUT_NO_OFFLOAD:-1200}
TIMEOUT_OFFLOAD=${TIMEOUT_OFFLOAD:-1800}
TIMEOUT_RESUME=${TIMEOUT_RESUME:-1200}
TIMEOUT_CHECK=${TIMEOUT_CHECK:-120}

# One stage: its command through the stage runner, with the stage's timeout (DRY_RUN: the command only).
stage() {
    local limit_var="TIMEOUT_${1^^}"
    if [[ -n ${DRY_RUN:-} ]]; then
        echo "${@:2}"
    else
        "${PYTHON}" "${REPO_ROOT}/recipes/sat_paper/stages.py" --summary "${SUMMARY}" --name "$1" \
            --timeout "${!limit_var}" -- "${@:2}" || exit 1
    fi
}

# LAUNCH := one invocation of verl_sat.main: the cell sat_gspo_r3 (algorithm, stabilizer,
# sat.method) at sat.lag=2 (verl_sat.trainer.recipe derives batch size, parameter_sync_step and warm-up
# from it), scaled down to the tiny model, in run directory $1 until global step $2; then the
# stage's overrides and the user's ($3...).
launch() {
    LAUNCH=("${PYTHON}" -m verl_sat.main \
        --config-path "${REPO_ROOT}/hydra_configs" \
        --config-name sat_paper \
        algorithm=sat_gspo \
        stabilizer=r3 \
        lag=n1 \
        sat.lag=${LAG} \
        sat.method=sat_gspo_r3 \
        sat.run_dir="$1" \
        hydra.run.dir="$1/hydra" \
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
        "${SLOT_OVERRIDES[@]}" \
        trainer.val_before_train=false \
        trainer.resume_mode=auto \
        trainer.total_training_steps="$2" \
        "${@:3}")
}

[[ -n ${DRY_RUN:-} || ! -e ${RUN_DIR}/metrics.jsonl ]] || { echo "${RUN_DIR} already holds a run; set RUN_DIR=" >&2; exit 1; }
[[ -n ${DRY_RUN:-} ]] || mkdir -p "${RUN_DIR}"

# The driver sees every GPU; the Ray workers see GPU ${GPU} only (SLOT_OVERRIDES' runtime env).
unset CUDA_VISIBLE_DEVICES
stage env "${PYTHON}" "${REPO_ROOT}/recipes/sat_paper/gpu_env.py" --gpu "${GPU}" --bridge "${BRIDGE}" \
    --slots-file "${RUN_DIR}/gpu_slots.sh" --json "${RUN_DIR}/gpu_env.json"
# shellcheck source=/dev/null
[[ -n ${DRY_RUN:-} ]] || source "${RUN_DIR}/gpu_slots.sh"
echo "[smoke] two Ray GPU slots on GPU ${GPU}: mode ${SLOT_MODE} (${SLOT_OVERRIDES[*]})" >&2

[[ -n ${DRY_RUN:-} || -f ${ASSETS_DIR}/model/config.json ]] ||
    stage assets "${PYTHON}" "${REPO_ROOT}/recipes/sat_paper/smoke.py" build --out "${ASSETS_DIR}"

OFFLOAD_OFF=actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=false
launch "${RUN_DIR}/no_offload" 1 "${OFFLOAD_OFF}" trainer.test_freq=-1 trainer.save_freq=-1 "$@"
stage no_offload "${LAUNCH[@]}"
launch "${RUN_DIR}" "${STEPS}" trainer.test_freq=${STEPS} trainer.save_freq=1 "$@"
stage offload "${LAUNCH[@]}"
launch "${RUN_DIR}" "$((STEPS + RESUMED_STEPS))" trainer.test_freq=${STEPS} trainer.save_freq=1 "$@"
stage resume "${LAUNCH[@]}"
stage check "${PYTHON}" "${REPO_ROOT}/recipes/sat_paper/smoke.py" check \
    --run-dir "${RUN_DIR}" --lag ${LAG} --steps ${STEPS} --resumed-steps ${RESUMED_STEPS}
[[ -n ${DRY_RUN:-} ]] || echo "[smoke] all stages passed in ${SECONDS} s; summary: ${SUMMARY}"
