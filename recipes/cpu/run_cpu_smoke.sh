#!/usr/bin/env bash
# Smoke run of verl's v1 trainer on CPU with the tiny Qwen3-MoE, the HF rollout and the CPU platform.
# Prerequisite (once, ~2-3 min): python -m verl_sat.default.warmup --out "$WORK_DIR"
# Usage: MODE=sync|colocate_async|separate_async bash recipes/cpu/run_cpu_smoke.sh [hydra overrides...]
set -euo pipefail

WORK_DIR=${WORK_DIR:-/tmp/verl_sat_cpu}
MODEL_DIR=${MODEL_DIR:-$WORK_DIR/model}
DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
MODE=${MODE:-sync}
STEPS=${STEPS:-3}
PROMPTS=${PROMPTS:-8}                  # prompts per optimizer step (data.train_batch_size)
SAMPLES=${SAMPLES:-4}                  # responses per prompt (rollout.n)
RESPONSE_LEN=${RESPONSE_LEN:-32}
SYNC_STEP=${SYNC_STEP:-1}              # separate_async: optimizer steps per weight broadcast (parameter_sync_step)
MAX_OFF_POLICY=${MAX_OFF_POLICY:-1}    # sampler.max_off_policy_threshold: max staleness in weight versions
LOSS_MODE=${LOSS_MODE:-vanilla}
NOISE_STD=${NOISE_STD:-0.0}            # rollout logit noise (rollout/trainer mismatch)
REWARD_FN=$(python -c "import verl_sat.default.reward as m; print(m.__file__)")
MINI_BATCH=$((PROMPTS / SYNC_STEP))    # separate_async needs train_batch_size == parameter_sync_step * mini_batch
ROLLOUT_GPUS=$([ "$MODE" = separate_async ] && echo 1 || echo 0)
FAKE_GPUS=$((1 + ROLLOUT_GPUS))        # Ray "GPU" slots: 1 trainer (+1 standalone rollout)
CKPT_BACKEND=$([ "$MODE" = separate_async ] && echo ray_object_store || echo naive)
HYBRID_ENGINE=$([ "$MODE" = separate_async ] && echo False || echo True)  # separate_async: standalone rollout only
# Ray's CPU count is logical: verl reserves 3 "CPU" per trainer slot and 2 per standalone rollout
# slot in its placement bundles, so 2 is not enough even though only 2 cores are used (1 thread/process).
RAY_CPUS=${RAY_CPUS:-8}

[ -f "$MODEL_DIR/config.json" ] || { echo "missing $MODEL_DIR: run python -m verl_sat.default.warmup --out $WORK_DIR" >&2; exit 1; }

export VERL_PLATFORM=cpu VERL_ENGINE_DEVICE=cuda OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
export VERL_LOGGING_LEVEL=${VERL_LOGGING_LEVEL:-WARN} RAY_DEDUP_LOGS=0

python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    algorithm.use_kl_in_reward=False \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/val.parquet" \
    data.train_batch_size="$PROMPTS" \
    data.max_prompt_length=128 \
    data.max_response_length="$RESPONSE_LEN" \
    data.dataloader_num_workers=0 \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    actor_rollout_ref.model.use_remove_padding=False \
    actor_rollout_ref.model.enable_gradient_checkpointing=False \
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.fsdp_config.strategy=fsdp2 \
    actor_rollout_ref.actor.fsdp_config.dtype=float32 \
    actor_rollout_ref.actor.fsdp_config.model_dtype=fp32 \
    +actor_rollout_ref.actor.fsdp_config.mixed_precision='{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}' \
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
    actor_rollout_ref.actor.use_torch_compile=False \
    actor_rollout_ref.actor.optim.lr=1e-4 \
    actor_rollout_ref.actor.ppo_mini_batch_size="$MINI_BATCH" \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$((PROMPTS * SAMPLES)) \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.policy_loss.loss_mode="$LOSS_MODE" \
    actor_rollout_ref.hybrid_engine="$HYBRID_ENGINE" \
    actor_rollout_ref.rollout.name=hf \
    actor_rollout_ref.rollout.n="$SAMPLES" \
    actor_rollout_ref.rollout.temperature=1.0 \
    actor_rollout_ref.rollout.top_p=1.0 \
    actor_rollout_ref.rollout.top_k=-1 \
    actor_rollout_ref.rollout.calculate_log_probs=True \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$((PROMPTS * SAMPLES)) \
    actor_rollout_ref.rollout.agent.num_workers=1 \
    actor_rollout_ref.rollout.nnodes="$ROLLOUT_GPUS" \
    actor_rollout_ref.rollout.n_gpus_per_node=1 \
    actor_rollout_ref.rollout.checkpoint_engine.backend="$CKPT_BACKEND" \
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_sat.cpu.checkpoint_engine \
    +actor_rollout_ref.rollout.engine_kwargs.hf.logit_noise_std="$NOISE_STD" \
    reward.num_workers=1 \
    reward.custom_reward_function.path="$REWARD_FN" \
    reward.custom_reward_function.name=compute_score \
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1 \
    trainer.device=cpu \
    trainer.nnodes=1 \
    trainer.n_gpus_per_node=1 \
    trainer.logger='[console]' \
    trainer.val_before_train=False \
    trainer.test_freq=-1 \
    trainer.save_freq=-1 \
    trainer.total_training_steps="$STEPS" \
    trainer.default_local_dir="$WORK_DIR/checkpoints" \
    hydra.run.dir="$WORK_DIR/hydra/\${now:%Y-%m-%d_%H-%M-%S}" \
    trainer.use_v1=True \
    trainer.v1.trainer_mode="$MODE" \
    trainer.v1.sampler.max_off_policy_threshold="$MAX_OFF_POLICY" \
    trainer.v1.separate_async.parameter_sync_step="$SYNC_STEP" \
    ray_kwargs.ray_init.num_cpus="$RAY_CPUS" \
    +ray_kwargs.ray_init.num_gpus="$FAKE_GPUS" \
    +ray_kwargs.ray_init.include_dashboard=False \
    "$@"
