#!/usr/bin/env bash
# Smoke run of verl-sat's main job on CPU: the CPU default (hydra_configs/sat_gspo_cpu.yaml: the tiny
# Qwen3-MoE, the HF rollout, the CPU platform, SAT-GSPO) for a few steps in one trainer mode, with
# verl's per-step console lines (`step:N - key:value - ...`) on the console. Every setting not
# overridden below is the YAML's, so the smoke run trains what `verl-sat` trains.
# Prerequisite (once, ~2-3 min): python -m verl_sat.default.warmup --out "$WORK_DIR"
# Usage: MODE=sync|colocate_async|separate_async bash recipes/cpu/run_cpu_smoke.sh [hydra overrides...]
set -euo pipefail

WORK_DIR=${WORK_DIR:-/tmp/verl_sat_cpu}
MODEL_DIR=${MODEL_DIR:-$WORK_DIR/model}
DATA_DIR=${DATA_DIR:-$WORK_DIR/data}
MODE=${MODE:-sync}                           # trainer.v1.trainer_mode
STEPS=${STEPS:-3}                            # verl global steps
LAG=${LAG:-${SYNC_STEP:-1}}                  # sat.lag: optimizer steps per weight broadcast (> 1: separate_async only)
ALGORITHM=${ALGORITHM:-sat_gspo}             # the policy loss: an option of hydra_configs/algorithm/
NOISE_STD=${NOISE_STD:-0.0}                  # rollout logit noise (rollout/trainer mismatch)
RUN_DIR=${RUN_DIR:-$WORK_DIR/runs/$MODE-$(date +%Y%m%d-%H%M%S)}  # sat.run_dir: metrics.jsonl, run.json, checkpoints

[ -f "$MODEL_DIR/config.json" ] || { echo "missing $MODEL_DIR: run python -m verl_sat.default.warmup --out $WORK_DIR" >&2; exit 1; }

# verl_sat.main sets VERL_PLATFORM=cpu, OMP_NUM_THREADS=1 and the rest of the CPU environment itself.
export VERL_LOGGING_LEVEL=${VERL_LOGGING_LEVEL:-WARN}

# sat.verbose=true and the console logger: verl's step lines reach this script's output.
python -m verl_sat.main --config-name sat_gspo_cpu \
    algorithm="$ALGORITHM" \
    sat.lag="$LAG" \
    sat.run_dir="$RUN_DIR" \
    sat.verbose=true \
    actor_rollout_ref.model.path="$MODEL_DIR" \
    data.train_files="$DATA_DIR/train.parquet" \
    data.val_files="$DATA_DIR/val.parquet" \
    actor_rollout_ref.rollout.engine_kwargs.hf.logit_noise_std="$NOISE_STD" \
    trainer.v1.trainer_mode="$MODE" \
    trainer.total_training_steps="$STEPS" \
    trainer.logger='[console,file]' \
    hydra.run.dir="$WORK_DIR/hydra/\${now:%Y-%m-%d_%H-%M-%S}" \
    "$@"
