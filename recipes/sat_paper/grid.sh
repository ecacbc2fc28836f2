#!/usr/bin/env bash
# Every run of the paper's Table 1: 13 trained methods × lags {1, 8} plus the base model once.
#
#   recipes/sat_paper/grid.sh            # list the runs (same as --list)
#   recipes/sat_paper/grid.sh --launch [hydra overrides...]   # run them one after another
#   STOP_ON_FAILURE=1 recipes/sat_paper/grid.sh --launch      # stop at the first cell that fails
#   ONLY="sat_gspo_r3:8 gspo_r3:8" recipes/sat_paper/grid.sh --launch   # only these cells
#
# Each run uses the whole node (recipes/sat_paper/run.sh); runs whose directory already holds
# metrics.jsonl are launched again and resume from their last checkpoint (trainer.resume_mode=auto).
# A cell that fails (preflight or training) is recorded and the grid goes on with the next one,
# unless STOP_ON_FAILURE=1. Each launch gets /dev/null as its stdin, so no run can read the list of
# cells still to come. The grid ends with one line per cell (method, lag, status, exit code, run
# directory), also written to ${RUNS_ROOT}/grid_status.tsv, and exits 1 if any cell failed.
set -euo pipefail

MODE=${1:---list}
[[ $# -gt 0 ]] && shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python}
RUNS_ROOT=${RUNS_ROOT:-$(cd "${HERE}/../.." && pwd)/runs}
GRID=$("${PYTHON}" -m verl_sat.paper.grid --list)

case "${MODE}" in
    --list)
        echo "${GRID}"
        ;;
    --launch)
        mapfile -t CELLS <<< "${GRID}"
        STATUS=()
        FAILED=0
        for line in "${CELLS[@]}"; do
            read -r method lag _ <<< "${line}"
            if [[ -n ${ONLY:-} && " ${ONLY} " != *" ${method}:${lag} "* ]]; then
                continue
            fi
            if [[ -n ${STOPPED:-} ]]; then
                STATUS+=("${method}	${lag}	not run	-	${RUNS_ROOT}/${method}-lag${lag}")
                continue
            fi
            echo "[grid] ${method} lag ${lag}: launching" >&2
            rc=0
            RUNS_ROOT=${RUNS_ROOT} "${HERE}/run.sh" "${method}" "${lag}" "$@" < /dev/null || rc=$?
            if [[ ${rc} -eq 0 ]]; then
                state=done
            else
                state=FAILED
                FAILED=$((FAILED + 1))
                echo "[grid] ${method} lag ${lag}: FAILED (exit ${rc}); its log is ${RUNS_ROOT}/${method}-lag${lag}" >&2
                [[ -z ${STOP_ON_FAILURE:-} ]] || STOPPED=1
            fi
            STATUS+=("${method}	${lag}	${state}	${rc}	${RUNS_ROOT}/${method}-lag${lag}")
        done
        mkdir -p "${RUNS_ROOT}"
        {
            printf 'method\tlag\tstatus\texit\trun_dir\n'
            printf '%s\n' "${STATUS[@]}"
        } > "${RUNS_ROOT}/grid_status.tsv"
        echo "[grid] ${#STATUS[@]} cells, ${FAILED} failed (${RUNS_ROOT}/grid_status.tsv):"
        column -t -s $'\t' "${RUNS_ROOT}/grid_status.tsv" 2>/dev/null || cat "${RUNS_ROOT}/grid_status.tsv"
        [[ ${FAILED} -eq 0 ]]
        ;;
    *)
        echo "usage: grid.sh [--list | --launch [hydra overrides...]]" >&2
        exit 2
        ;;
esac
