#!/usr/bin/env bash
# Submit a command (a study) as a Ray job that runs THIS tree's tenantq, not the copy the
# cluster's image has installed:
#
#   cluster/submit.sh [ray job submit flags...] -- tenantq search SPEC [flags...]
#
# What it adds to `ray job submit`:
#   --working-dir .         the current folder (specs, suites) is uploaded as the job's cwd;
#   py_modules              platform/tenantq of the tree this script sits in is uploaded and put
#                           first on the import path of the job's driver and of every worker
#                           (the package lives under platform/, which a working dir alone does
#                           not make importable);
#   env_vars                TENANTQ_SOURCE_COMMIT / TENANTQ_SOURCE_DIRTY from `git` here: the
#                           upload carries no .git, so the driver records these in MLflow
#                           (mlflow.source.git.commit, tenantq.source.dirty).
# The entrypoint `tenantq ...` is run as `python -m tenantq ...`, so the uploaded package is the
# one imported (a console script of the image would be found first on PATH but imports the same
# module path; `python -m` makes it plain). Ray's client settings come from the environment
# (RAY_ADDRESS, RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH: `cluster/local.sh env` prints them).
# Ray caps a working dir or py_module upload near 500 MiB: keep models out of the tree, on the
# cluster's shared volume (cluster/README.md).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACKAGE="$REPO_ROOT/platform/tenantq"
if [[ -n "${RAY_BIN:-}" ]]; then
    RAY="$RAY_BIN"
elif [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
    RAY="$REPO_ROOT/.venv/bin/ray"
else
    RAY="$(command -v ray || true)"
fi

die() {
    echo "cluster/submit.sh: $*" >&2
    exit 1
}

[[ -n "$RAY" && -x "$RAY" ]] || die "no \`ray\` executable found; set RAY_BIN"
[[ -f "$PACKAGE/__init__.py" ]] || die "no tenantq package at $PACKAGE"

flags=()
while [[ $# -gt 0 && "$1" != "--" ]]; do
    case "$1" in
    # `ray job submit` keeps the last of a repeated option: these would replace the runtime_env
    # built here and drop the tree's tenantq (py_modules) and its commit without a word.
    --runtime-env-json | --runtime-env-json=* | --runtime-env | --runtime-env=* | --working-dir | --working-dir=*)
        die "${1%%=*} would replace the runtime_env this script builds (py_modules: this tree's tenantq; working dir: the current folder); use \`ray job submit\` itself for a custom one"
        ;;
    esac
    flags+=("$1")
    shift
done
[[ $# -gt 1 ]] || die "usage: cluster/submit.sh [ray job submit flags...] -- tenantq search SPEC [...]"
shift
command=("$@")
if [[ "${command[0]}" == "tenantq" ]]; then
    command=(python -m tenantq "${command[@]:1}")
fi

env_vars=""
if sha="$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null)"; then
    dirty=false
    [[ -z "$(git -C "$REPO_ROOT" status --porcelain -- platform/tenantq)" ]] || dirty=true
    env_vars=", \"env_vars\": {\"TENANTQ_SOURCE_COMMIT\": \"$sha\", \"TENANTQ_SOURCE_DIRTY\": \"$dirty\"}"
else
    echo "cluster/submit.sh: $REPO_ROOT is not a git checkout: the study records its commit as unknown" >&2
fi
json_package="${PACKAGE//\\/\\\\}"   # a JSON string: backslashes, then double quotes escaped
json_package="${json_package//\"/\\\"}"
runtime_env="{\"py_modules\": [\"$json_package\"]$env_vars}"

exec "$RAY" job submit --working-dir . --runtime-env-json "$runtime_env" "${flags[@]}" -- "${command[@]}"
