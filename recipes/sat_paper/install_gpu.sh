#!/usr/bin/env bash
# The paper's GPU stack (verl 0.9.1, SGLang 0.5.12, Megatron-Bridge, megatron-core, TransformerEngine,
# torch 2.11 for CUDA 13, cupy) and this project, into the active Python 3.12 environment.
# Every version comes from verl_sat/preflight/stack.py, read through gpu_stack.py beside this script;
# docs/reproduce.md ("Install on the GPU node").
#
#   recipes/sat_paper/install_gpu.sh              # install (GPU node, CUDA 13 toolkit for TE's build)
#   recipes/sat_paper/install_gpu.sh --dry-run    # pip's resolver for the GPU node; installs nothing
#   recipes/sat_paper/install_gpu.sh --dry-run --extra 'transformers==5.6.0'   # resolve one more pin
#
# The stack has no solution as the packages declare it (SGLang 0.5.12 pins transformers==5.6.0, which
# verl 0.9.1 excludes; every Megatron-Bridge pins an older flashinfer than SGLang's). So the packages
# whose pins the install overrides (stack.py's OVERRIDES, each with its reason) are installed with
# --no-deps, as verl's own SGLang 0.5.12 image does, and every other requirement they declare joins
# the set pip resolves; that set must resolve, or the script stops with pip's conflict.
#
# Variables: PYTHON (default python), VERL_SAT_CACHE (default ~/.cache/verl-sat: the resolver's pip
# and the dry run's wheels of pure-Python sdists).
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${PYTHON:-python}
CACHE=${VERL_SAT_CACHE:-${HOME}/.cache/verl-sat}/wheels
# A plain script (standard library and packaging): nothing of verl-sat's requirements is needed yet.
STACK=("${PYTHON}" "${REPO_ROOT}/recipes/sat_paper/gpu_stack.py")

DRY_RUN=
EXTRA=()
while (($#)); do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --extra) EXTRA+=("${2:?--extra needs a requirement}") && shift ;;
        --extra=*) EXTRA+=("${1#--extra=}") ;;
        -h | --help) sed -n '2,17p' "$0" && exit 0 ;;
        *) echo "install_gpu.sh: unknown argument '$1' (--dry-run, --extra REQ)" >&2 && exit 2 ;;
    esac
    shift
done

stack() { "${STACK[@]}" "$@"; }
mapfile -t NO_DEPS < <(stack --no-deps)
WORK=$(mktemp -d)
trap 'rm -rf "${WORK}"' EXIT
mkdir -p "${CACHE}"

# pip itself at gpu_stack.py's version (Python 3.11's bundled pip 23.2 misjudges a 3.12 target): the
# dry run runs it from its wheel, leaving the calling environment as it is; the install upgrades to it.
PIP_VERSION=$(stack --pip)
if [[ -n ${DRY_RUN} ]]; then
    "${PYTHON}" -m pip download -q --no-deps --only-binary=:all: -d "${CACHE}" "pip==${PIP_VERSION}"
    PIP=("${PYTHON}" "${CACHE}/pip-${PIP_VERSION}-py3-none-any.whl/pip")
    # The GPU node as pip's target: Python 3.12, CPython, every manylinux tag up to glibc 2.35 (SGLang's
    # wheels are manylinux_2_34, Ray's manylinux2014: one tag alone finds one of them only), wheels only.
    TARGET=(--only-binary=:all: --python-version "$(stack --python-version)" --implementation cp)
    for tag in $(stack --platforms); do TARGET+=(--platform "${tag}"); done
    # Pure-Python packages the index ships only as source, as wheels (the node builds them itself).
    for spec in $(stack --pure-sdists); do
        name=${spec%%[=<>!~]*}
        compgen -G "${CACHE}/sdists/${name//-/_}-*.whl" > /dev/null ||
            "${PIP[@]}" wheel -q --no-deps -w "${CACHE}/sdists" "${spec}"
    done
    TARGET+=(--find-links "${CACHE}/sdists")
    RESOLVE=(install --dry-run --ignore-installed --target "${WORK}/target" "${TARGET[@]}")
else
    version=$("${PYTHON}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [[ ${version} != "$(stack --python-version)" ]]; then
        echo "install_gpu.sh: Python ${version}; the stack needs $(stack --python-version) (verl <3.13, Megatron-Bridge >=3.12)" >&2
        exit 1
    fi
    "${PYTHON}" -m pip install -q "pip==${PIP_VERSION}" packaging
    PIP=("${PYTHON}" -m pip)
    RESOLVE=(install)
fi

# 1. The --no-deps packages' own declared requirements (pip's report), less the named overrides.
"${PIP[@]}" install -q --dry-run --no-deps --ignore-installed --report "${WORK}/no-deps.json" \
    ${TARGET+"${TARGET[@]}"} ${TARGET+--target "${WORK}/no-deps"} "${NO_DEPS[@]}"
{
    printf '%s\n' ${EXTRA[@]+"${EXTRA[@]}"} # first: pip resolves in the order it is given
    stack --requirements
    stack --project "${REPO_ROOT}/pyproject.toml" # verl-sat's own requirements
    stack --kept "${WORK}/no-deps.json"
} > "${WORK}/requirements.txt"
echo "install_gpu.sh: overriding (--no-deps):"
stack --overrides | sed 's/^/  /'

# 2. Everything else, resolved together by pip: the stack's pins, verl-sat's requirements, and every
# requirement of the --no-deps packages the overrides leave in place. A conflict stops here.
if ! "${PIP[@]}" "${RESOLVE[@]}" --report "${WORK}/resolved.json" -r "${WORK}/requirements.txt"; then
    echo "install_gpu.sh: pip found no solution for the stack (above); only stack.py's OVERRIDES may differ from the packages' pins" >&2
    exit 1
fi
if [[ -n ${DRY_RUN} ]]; then
    stack --check-resolved "${WORK}/resolved.json"
    echo "install_gpu.sh: dry run: the stack resolves; nothing was installed"
    exit 0
fi

# 3. The overridden packages, with --no-deps: SGLang without its transformers==5.6.0 (verl 0.9.1
# excludes 5.6.0 and pins 5.9.0), Megatron-Bridge without its flashinfer 0.6.8.post1 (SGLang needs
# 0.6.11.post1), transformers <5.9 and open-clip-torch pins, megatron-core without its dev extra's
# nvidia-resiliency-ext==0.6.0 (glibc 2.39 wheels only). stack.py's OVERRIDES gives each reason.
"${PIP[@]}" install --no-deps "${NO_DEPS[@]}"
# SGLang's CUDA 13 kernel build over the index's wheel, as verl's SGLang 0.5.12 image does on x86_64.
[[ $(uname -m) != x86_64 ]] || "${PIP[@]}" install --no-deps --force-reinstall "$(stack --sglang-kernel-wheel)"
# TransformerEngine's PyTorch extension: source only on the index, built against the torch above.
mapfile -t SOURCE < <(stack --source-builds)
NVTE_FRAMEWORK=pytorch "${PIP[@]}" install --no-build-isolation "${SOURCE[@]}"
# verl-sat itself: pure Python, its requirements are in step 2.
"${PIP[@]}" install --no-deps -e "${REPO_ROOT}"
echo "install_gpu.sh: installed; python -m verl_sat.preflight <method> <lag> checks the node (docs/reproduce.md)"
