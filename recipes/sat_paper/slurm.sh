#!/usr/bin/env bash
#SBATCH --job-name=verl-sat
#SBATCH --nodes=3
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
# One cell of Table 1 on a SLURM allocation, as verl's Ray-on-SLURM example does it: Ray's head on
# the first node, a worker on each other node, then recipes/sat_paper/run.sh on the head, joining
# that cluster (docs/cluster.md). Submit from the repository root, on a file system every node
# mounts at the same path (the run directory, data and checkpoints are read and written from every node):
#
#   sbatch recipes/sat_paper/slurm.sh sat_gspo_r3 8 [hydra overrides...]
#   TRAINER_NODES=4 sbatch --nodes=6 recipes/sat_paper/slurm.sh grpo 1   # 4 trainer nodes, 2 rollout nodes
#
# The trainer takes TRAINER_NODES nodes, the standalone rollout pool the rest.
#
# Ray 2.60's token authentication (docs/cluster.md): RAY_AUTH_MODE=token is exported to every step
# (head, workers, the job), with the token in ~/.ray/auth_token (made once here; a home every node
# mounts), else in RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN if you set one. RAY_AUTH_MODE=disabled opts out.
set -euo pipefail

METHOD=${1:?usage: slurm.sh <method> <lag> [hydra overrides...]}
LAG=${2:?usage: slurm.sh <method> <lag> [hydra overrides...]}
shift 2

REPO_ROOT=${SLURM_SUBMIT_DIR:-$(pwd)}
RAY_PORT=${RAY_PORT:-6379}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CPUS_PER_NODE=${CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-64}}
NNODES=${SLURM_JOB_NUM_NODES:?run under sbatch}
TRAINER_NODES=${TRAINER_NODES:-$((NNODES - NNODES / 3))}
ROLLOUT_NODES=$((NNODES - TRAINER_NODES))
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ ${RAY_AUTH_MODE} == token && -z ${RAY_AUTH_TOKEN:-} && -z ${RAY_AUTH_TOKEN_PATH:-} ]]; then
    ray get-auth-token --generate > /dev/null # ~/.ray/auth_token, kept if it exists
fi
mapfile -t NODES < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
HEAD=${NODES[0]}
HEAD_IP=$(srun --nodes=1 --ntasks=1 -w "${HEAD}" hostname --ip-address | awk '{print $1}')

srun --nodes=1 --ntasks=1 -w "${HEAD}" ray start --head --node-ip-address="${HEAD_IP}" --port="${RAY_PORT}" \
    --num-cpus="${CPUS_PER_NODE}" --num-gpus="${GPUS_PER_NODE}" --block &
sleep 10
for node in "${NODES[@]:1}"; do
    srun --nodes=1 --ntasks=1 -w "${node}" ray start --address="${HEAD_IP}:${RAY_PORT}" \
        --num-cpus="${CPUS_PER_NODE}" --num-gpus="${GPUS_PER_NODE}" --block &
    sleep 5
done

# run.sh sees the cluster (ray_kwargs.ray_init.address) and runs the cluster preflight, then the cell.
srun --overlap --nodes=1 --ntasks=1 -w "${HEAD}" "${REPO_ROOT}/recipes/sat_paper/run.sh" "${METHOD}" "${LAG}" \
    ray_kwargs.ray_init.address="${HEAD_IP}:${RAY_PORT}" \
    trainer.nnodes="${TRAINER_NODES}" \
    trainer.n_gpus_per_node="${GPUS_PER_NODE}" \
    actor_rollout_ref.rollout.nnodes="${ROLLOUT_NODES}" \
    actor_rollout_ref.rollout.n_gpus_per_node="${GPUS_PER_NODE}" \
    "$@"
