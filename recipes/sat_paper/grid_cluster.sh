#!/usr/bin/env bash
# The grid of Table 1 on a running Ray cluster (docs/cluster.md): each cell is its own Ray job
# (`ray job submit`, entrypoint recipes/sat_paper/run.sh on the cluster), at most NODE_GROUPS jobs at
# a time: one per group of nodes a cell takes (trainer.nnodes + the rollout pool's nnodes).
#
#   NODE_GROUPS=2 recipes/sat_paper/grid_cluster.sh [hydra overrides...]
#   ONLY="sat_gspo_r3:8 gspo_r3:8" NODE_GROUPS=1 recipes/sat_paper/grid_cluster.sh trainer.nnodes=2
#   DRY_RUN=1 recipes/sat_paper/grid_cluster.sh      # print the submissions and the table
#
# RAY_ADDRESS is the dashboard's (http://<head>:8265), which `ray job submit` talks to; every job
# joins the cluster with ray_kwargs.ray_init.address=auto. The dashboard asks for Ray 2.60's token
# (docs/cluster.md): with RAY_AUTH_MODE unset and a token here (RAY_AUTH_TOKEN, the file
# RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token), RAY_AUTH_MODE=token is exported for the submissions. The repository, data and RUNS_ROOT must be
# on a file system the nodes share (the job's entrypoint runs on the head; its workers everywhere).
# The grid ends with one line per cell, the table grid.sh writes, in ${RUNS_ROOT}/grid_status.tsv,
# and exits 1 if any cell failed.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python}
RUNS_ROOT=${RUNS_ROOT:-$(cd "${HERE}/../.." && pwd)/runs}
NODE_GROUPS=${NODE_GROUPS:-1}
POLL_S=${POLL_S:-30}
GRID=$("${PYTHON}" -m verl_sat.paper.grid --list)
mapfile -t CELLS <<< "${GRID}"
STATUS_DIR=${RUNS_ROOT}/.grid_cluster
mkdir -p "${STATUS_DIR}"
if [[ -z ${RAY_AUTH_MODE:-} && ( -n ${RAY_AUTH_TOKEN:-} || -s ${RAY_AUTH_TOKEN_PATH:-${HOME}/.ray/auth_token} ) ]]; then
    export RAY_AUTH_MODE=token # as the job does when it joins by address (verl_sat.preflight.cluster.join_with_token)
fi

# One cell as one Ray job: submit, wait for its end, record "method lag status exit run_dir".
run_cell() {
    local method=$1 lag=$2 id
    shift 2
    id=verl-sat-${method}-lag${lag}-$(date +%s)
    local submit=(ray job submit --submission-id "${id}" --no-wait
        --runtime-env-json "{\"env_vars\": {\"RUNS_ROOT\": \"${RUNS_ROOT}\"}}"
        -- "${HERE}/run.sh" "${method}" "${lag}" ray_kwargs.ray_init.address=auto "$@")
    local state=done rc=0
    if [[ -n ${DRY_RUN:-} ]]; then
        echo "${submit[*]}"
        state=dry-run
    else
        "${submit[@]}" > /dev/null
        echo "[grid] ${method} lag ${lag}: job ${id} submitted" >&2
        local job=PENDING
        while [[ ${job} =~ ^(PENDING|RUNNING)$ ]]; do
            sleep "${POLL_S}"
            job=$(ray job status "${id}" 2>/dev/null | grep -oE "(PENDING|RUNNING|SUCCEEDED|FAILED|STOPPED)" | tail -1)
            job=${job:-PENDING}
        done
        if [[ ${job} != SUCCEEDED ]]; then
            state=FAILED
            rc=1
            echo "[grid] ${method} lag ${lag}: ${job}; its log: ray job logs ${id}" >&2
        fi
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "${method}" "${lag}" "${state}" "${rc}" "${RUNS_ROOT}/${method}-lag${lag}" \
        > "${STATUS_DIR}/${method}-lag${lag}.tsv"
}

ORDER=()
for line in "${CELLS[@]}"; do
    read -r method lag _ <<< "${line}"
    if [[ -n ${ONLY:-} && " ${ONLY} " != *" ${method}:${lag} "* ]]; then
        continue
    fi
    while [[ $(jobs -rp | wc -l) -ge ${NODE_GROUPS} ]]; do
        wait -n || true
    done
    ORDER+=("${method}-lag${lag}")
    run_cell "${method}" "${lag}" "$@" < /dev/null &
done
wait

{
    printf 'method\tlag\tstatus\texit\trun_dir\n'
    for cell in "${ORDER[@]}"; do cat "${STATUS_DIR}/${cell}.tsv"; done
} > "${RUNS_ROOT}/grid_status.tsv"
FAILED=$(awk -F'\t' 'NR > 1 && $3 == "FAILED"' "${RUNS_ROOT}/grid_status.tsv" | wc -l)
echo "[grid] ${#ORDER[@]} cells, ${FAILED} failed (${RUNS_ROOT}/grid_status.tsv):"
column -t -s $'\t' "${RUNS_ROOT}/grid_status.tsv" 2>/dev/null || cat "${RUNS_ROOT}/grid_status.tsv"
[[ ${FAILED} -eq 0 ]]
