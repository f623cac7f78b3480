#!/usr/bin/env bash
# Start a local Ray head as docs/operations.md describes: every socket on 127.0.0.1, token
# authentication on, and the token file ~/.ray/auth_token readable by its owner only (0600;
# `ray start --head` leaves it at the umask's mode, 0644 on most machines).
#
#   deploy/start_head.sh [extra `ray start` options, e.g. --num-cpus=4]
#
# RAY_BIN overrides the `ray` executable (tests use a stand-in). Stop the head with `ray stop`.
set -euo pipefail

ray_bin="${RAY_BIN:-ray}"
token="${HOME}/.ray/auth_token"
export RAY_AUTH_MODE=token
# `ray job stop` waits this long between its SIGTERM and SIGKILL (Ray's default: 3 s); a run
# needs run.preemption_grace_seconds (60) to checkpoint and exit 0
export RAY_JOB_STOP_WAIT_TIME_S="${RAY_JOB_STOP_WAIT_TIME_S:-90}"
umask 077 # anything this script creates (the token file included) is the owner's only
if [[ ! -s "$token" ]]; then
    "$ray_bin" get-auth-token --generate >/dev/null
fi
# The job agent's HTTP port (Ray's default 52365) held by another process (often the agent of
# a Ray cluster that has just stopped, which lingers for a while): `ray job submit` to this head
# would reach that agent and its dead cluster instead. Unless the port is given, a free one is
# taken, and said.
busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
agent_port=()
if [[ " $* " != *" --dashboard-agent-listen-port"* ]] && busy 52365; then
    p=52366
    while busy "$p" && [[ $p -lt 52465 ]]; do p=$((p + 1)); done
    echo "deploy/start_head.sh: 127.0.0.1:52365 (Ray's job agent port) is in use by another process; this head's job agent listens on $p instead (--dashboard-agent-listen-port=$p)" >&2
    agent_port=("--dashboard-agent-listen-port=$p")
fi
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 "$ray_bin" start --head --node-ip-address=127.0.0.1 \
    --dashboard-host=127.0.0.1 --metrics-export-port="${METRICS_EXPORT_PORT:-8090}" \
    "${agent_port[@]}" "$@"
[[ -f "$token" ]] || { echo "deploy/start_head.sh: no token file at $token after ray start" >&2; exit 2; }
chmod 600 "$token"
echo "deploy/start_head.sh: head on 127.0.0.1, token auth on; token file $token mode $(stat -c %a "$token")"
