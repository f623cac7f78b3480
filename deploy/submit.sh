#!/usr/bin/env bash
# Submit a maskgrpo training run to a running Ray cluster as a Ray job, token auth kept on.
#
#   deploy/submit.sh [--installed] [--address URL] [--submission-id ID] [--no-wait] [--dry-run]
#                    [-- MASKGRPO_ARGS...]
#
# A checkout (the default): the repository is uploaded as the job's working_dir. MASKGRPO_ARGS
# default to `train --config configs/showo_512_clip.yaml`. The command it runs, from the
# repository root, is:
#
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 \
#       --working-dir . --runtime-env deploy/runtime_env.yaml -- \
#       maskgrpo train --config configs/showo_512_clip.yaml
#
# --installed: the nodes carry the package (a pip install of the wheel, or the image of
# deploy/Dockerfile.wheel); nothing is uploaded, and `--config NAME` reads the config built into
# the package. MASKGRPO_ARGS default to `train --config showo_512_clip`. The command:
#
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 \
#       --runtime-env deploy/runtime_env_installed.yaml -- \
#       maskgrpo train --config showo_512_clip
#
# --address defaults to $RAY_API_SERVER_ADDRESS, else http://127.0.0.1:8265: a local head, or
# the port that `ray dashboard ray_cluster.yaml` / `kubectl port-forward` forwards. The job API
# is never reached on a public address.
#
# The token (Ray 2.60 turns token authentication on by default; a request without it fails
# with "Missing authentication token") is read the way Ray reads it, first match wins:
#   1. RAY_AUTH_TOKEN         the token itself (e.g. from `kubectl get secret`)
#   2. RAY_AUTH_TOKEN_PATH    a file holding it
#   3. ~/.ray/auth_token      where `ray start --head` / `ray get-auth-token --generate` put it
# This script never disables authentication and never prints the token.
# Examples: docs/operations.md.
set -euo pipefail

die() {
    echo "deploy/submit.sh: $*" >&2
    exit 2
}

address="${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}"
submission_id=""
installed=0
no_wait=0
dry_run=0
args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --address) [[ $# -ge 2 ]] || die "--address needs a value"; address="$2"; shift 2 ;;
        --submission-id) [[ $# -ge 2 ]] || die "--submission-id needs a value"; submission_id="$2"; shift 2 ;;
        --installed) installed=1; shift ;;
        --no-wait) no_wait=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --) shift; args=("$@"); break ;;
        *) die "unknown option '$1' (maskgrpo's own arguments go after --)" ;;
    esac
done
if [[ $installed -eq 1 ]]; then
    [[ ${#args[@]} -gt 0 ]] || args=(train --config showo_512_clip)
    runtime_env=deploy/runtime_env_installed.yaml
else
    [[ ${#args[@]} -gt 0 ]] || args=(train --config configs/showo_512_clip.yaml)
    runtime_env=deploy/runtime_env.yaml
fi

# Token auth stays on: an explicit RAY_AUTH_MODE other than "token" is refused, not obeyed.
if [[ -n "${RAY_AUTH_MODE:-}" && "${RAY_AUTH_MODE}" != "token" ]]; then
    die "RAY_AUTH_MODE=${RAY_AUTH_MODE}: this script submits only with token authentication; unset it or set RAY_AUTH_MODE=token"
fi
export RAY_AUTH_MODE=token

if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
    token_source="RAY_AUTH_TOKEN"
elif [[ -n "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
    [[ -s "${RAY_AUTH_TOKEN_PATH}" ]] || die "RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH} is missing or empty"
    token_source="RAY_AUTH_TOKEN_PATH (${RAY_AUTH_TOKEN_PATH})"
elif [[ -s "${HOME}/.ray/auth_token" ]]; then
    token_source="${HOME}/.ray/auth_token"
else
    die "no Ray auth token found. Local head: the token is in ~/.ray/auth_token of the machine that ran 'ray start --head' (or run 'ray get-auth-token'). Cluster launcher: the ~/.ray/auth_token you generated before 'ray up'. KubeRay: export RAY_AUTH_TOKEN=\$(kubectl get secret <raycluster-name> -o jsonpath='{.data.auth_token}' | base64 -d). See docs/operations.md, 'Security defaults'."
fi

cd "$(dirname "${BASH_SOURCE[0]}")/.."
[[ -f "$runtime_env" ]] || die "$runtime_env not found under $(pwd)"

cmd=("${RAY_BIN:-ray}" job submit --address "$address")
if [[ $installed -eq 1 ]]; then
    cmd+=(--runtime-env "$runtime_env")  # no working_dir: the nodes' installed package runs
else
    cmd+=(--working-dir . --runtime-env deploy/runtime_env.yaml)
fi
[[ -z "$submission_id" ]] || cmd+=(--submission-id "$submission_id")
[[ $no_wait -eq 0 ]] || cmd+=(--no-wait)
cmd+=(-- maskgrpo "${args[@]}")

echo "deploy/submit.sh: token from ${token_source}; submitting to ${address}" >&2
if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
