#!/usr/bin/env bash
# Every run of the paper's Table 1: 13 trained methods × lags {1, 8} plus the base model once.
#
#   recipes/sat_paper/grid.sh            # list the runs (same as --list)
#   recipes/sat_paper/grid.sh --launch [hydra overrides...]   # run them one after another
#
# Each run uses the whole node (recipes/sat_paper/run.sh); runs whose directory already holds
# metrics.jsonl are launched again and resume from their last checkpoint (trainer.resume_mode=auto).
set -euo pipefail

MODE=${1:---list}
[[ $# -gt 0 ]] && shift
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python}
GRID=$("${PYTHON}" -m verl_sat.paper.grid --list)

case "${MODE}" in
    --list)
        echo "${GRID}"
        ;;
    --launch)
        while read -r method lag _; do
            "${HERE}/run.sh" "${method}" "${lag}" "$@"
        done <<< "${GRID}"
        ;;
    *)
        echo "usage: grid.sh [--list | --launch [hydra overrides...]]" >&2
        exit 2
        ;;
esac
