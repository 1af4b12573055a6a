#!/usr/bin/env bash
# A single-machine Ray cluster on 127.0.0.1 with Ray's token authentication on, for
# `ray job submit` against the same code path a real cluster uses.
#
#   cluster/local.sh start     start the head (ray start --head --block, in its own session)
#   cluster/local.sh stop      stop what `start` started, and nothing else
#   cluster/local.sh status    exit 0 when the head runs and its dashboard answers, 3 when not
#   cluster/local.sh env       print the exports that `ray job submit` needs, and a driver run
#                              outside a job (`tenantq search SPEC --address "$TENANTQ_RAY_GCS"`)
#   cluster/local.sh join NAME a second Ray node on this machine joins the head (ray start
#                              --address, its own CPUs, resource `node:NAME` and label
#                              tenantq.node=NAME), in its own session
#   cluster/local.sh leave NAME stop that node (SIGTERM; `leave NAME --now`: SIGKILL its whole
#                              session at once, as a lost or preempted host would go)
#
# Why not `ray start`/`ray stop` as usual: `ray stop` kills every Ray process on the machine
# (it matches process names), and the default ports and /tmp/ray are shared by everyone on a
# machine. This script keeps all state in one directory, uses its own ports, and stops only
# the session it started (by its process id).
#
# Settings (environment variables, defaults in brackets):
#   TENANTQ_RAY_DIR            state dir: token, pid, log, Ray temp dir [/tmp/tenantq-ray-$UID]
#   TENANTQ_RAY_PORT           GCS port [6380]
#   TENANTQ_RAY_DASHBOARD_PORT dashboard + job API port [8266]
#   TENANTQ_RAY_CLIENT_PORT    Ray client server port [23001] (outside the worker port range)
#   TENANTQ_RAY_AGENT_PORT     dashboard agent HTTP port [52366]
#   TENANTQ_RAY_METRICS_PORT   Prometheus metrics export port [8090]
#   TENANTQ_RAY_NUM_CPUS       CPUs Ray may schedule [all]
#   TENANTQ_RAY_START_TIMEOUT_S seconds to wait for the job API [180]
#   TENANTQ_RAY_JOIN_CPUS      CPUs of a joined node [1]
#   TENANTQ_RAY_JOIN_AGENT_PORT, TENANTQ_RAY_JOIN_METRICS_PORT  a joined node's dashboard agent
#                              and metrics ports [dashboard agent port + 1, metrics port + 1]
#   TENANTQ_RAY_HEAD_IP        the head node's address, a loopback one [127.0.0.1]; a cluster
#                              that nodes will `join` needs another, e.g. 127.0.0.2 (see join)
#   TENANTQ_RAY_JOIN_IP        a joined node's address, another loopback one [127.0.0.3]
#   TENANTQ_RAY_EXPOSE         1: start a head off 127.0.0.1 where interfaces besides `lo`
#                              exist (Ray then listens on all of them); refused otherwise
#   RAY_AUTH_TOKEN_PATH        token file [$TENANTQ_RAY_DIR/auth_token, created if missing]
#   RAY_BIN                    the `ray` executable [.venv/bin/ray of this repo, else PATH]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE_DIR="${TENANTQ_RAY_DIR:-/tmp/tenantq-ray-$(id -u)}"
GCS_PORT="${TENANTQ_RAY_PORT:-6380}"
HEAD_IP="${TENANTQ_RAY_HEAD_IP:-127.0.0.1}"
DASHBOARD_PORT="${TENANTQ_RAY_DASHBOARD_PORT:-8266}"
CLIENT_PORT="${TENANTQ_RAY_CLIENT_PORT:-23001}"
AGENT_PORT="${TENANTQ_RAY_AGENT_PORT:-52366}"
METRICS_PORT="${TENANTQ_RAY_METRICS_PORT:-8090}"
NUM_CPUS="${TENANTQ_RAY_NUM_CPUS:-}"
START_TIMEOUT_S="${TENANTQ_RAY_START_TIMEOUT_S:-180}"
TOKEN_FILE="${RAY_AUTH_TOKEN_PATH:-$STATE_DIR/auth_token}"
PID_FILE="$STATE_DIR/head.pid"
LOG_FILE="$STATE_DIR/head.log"
# Ray puts Unix sockets under its temp dir; their paths must stay under the kernel's 107-byte
# limit, so the state dir must be short (Ray appends ~70 bytes: session_<date>_<pid>/sockets/...).
MAX_STATE_DIR_CHARS=36

if [[ -n "${RAY_BIN:-}" ]]; then
    RAY="$RAY_BIN"
elif [[ -x "$REPO_ROOT/.venv/bin/ray" ]]; then
    RAY="$REPO_ROOT/.venv/bin/ray"
else
    RAY="$(command -v ray || true)"
fi

die() {
    echo "cluster/local.sh: $*" >&2
    exit 1
}

dashboard_url() { echo "http://127.0.0.1:$DASHBOARD_PORT"; }

head_pid() {
    # The pid of the head this script started, if it still runs.
    [[ -f "$PID_FILE" ]] || return 1
    local pid
    pid="$(cat "$PID_FILE")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

session_members() {
    # Every process still in the session the head was started in (setsid: sid == head pid).
    ps -eo pid=,sid= | awk -v sid="$1" '$2 == sid { print $1 }'
}

job_api_answers() {
    # The job API answers only an authenticated request: 200 with the token proves both that
    # the head is up and that it checks tokens (an unauthenticated request gets 401).
    local code
    code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 \
        -H "Authorization: Bearer $(cat "$TOKEN_FILE")" "$(dashboard_url)/api/jobs/" || true)"
    [[ "$code" == "200" ]]
}

print_env() {
    echo "export RAY_ADDRESS=$(dashboard_url)"
    echo "export RAY_AUTH_MODE=token"
    echo "export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE"
    # A driver started outside a job (`tenantq search SPEC --address 127.0.0.1:GCS_PORT`): Ray
    # turns a 127.0.0.1 address into the machine's routable one unless multi-node mode is off,
    # as it is on a head at 127.0.0.1, so the driver would wait for a GCS that is not there.
    if [[ "$HEAD_IP" == "127.0.0.1" ]]; then
        echo "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0"
    fi
    echo "export TENANTQ_RAY_GCS=$HEAD_IP:$GCS_PORT"
}

ensure_token() {
    if [[ -s "$TOKEN_FILE" ]]; then
        return
    fi
    # 256 random bits in hex, the same shape as Ray's own generator (secrets.token_hex(32)).
    (umask 077 && openssl rand -hex 32 >"$TOKEN_FILE.tmp" && mv "$TOKEN_FILE.tmp" "$TOKEN_FILE")
}

stop_session() {
    local pid="$1" waited=0
    kill -TERM "$pid" 2>/dev/null || true
    # `ray start --block` shuts its children down on SIGTERM; give it time, then clean up
    # whatever of its session is left.
    while [[ -n "$(session_members "$pid")" && $waited -lt 30 ]]; do
        sleep 1
        waited=$((waited + 1))
    done
    local left
    left="$(session_members "$pid")"
    if [[ -n "$left" ]]; then
        # shellcheck disable=SC2086
        kill -TERM $left 2>/dev/null || true
        sleep 5
        left="$(session_members "$pid")"
        # shellcheck disable=SC2086
        [[ -z "$left" ]] || kill -KILL $left 2>/dev/null || true
    fi
}

# Whether this network namespace has an interface besides `lo` (/proc/net/dev: 2 header lines).
other_interfaces() {
    awk 'NR > 2 { sub(":.*", "", $1); if ($1 != "lo") found = 1 } END { exit !found }' /proc/net/dev
}

cmd_start() {
    # Ray 2.60 binds every server to all interfaces once the node address is not 127.0.0.1.
    if [[ "$HEAD_IP" != "127.0.0.1" && "${TENANTQ_RAY_EXPOSE:-}" != "1" ]] && other_interfaces; then
        die "TENANTQ_RAY_HEAD_IP=$HEAD_IP makes Ray listen on every interface: start it in a loopback-only network namespace (sudo unshare -n; cluster/README.md), or set TENANTQ_RAY_EXPOSE=1 to expose it"
    fi
    [[ -n "$RAY" && -x "$RAY" ]] || die "no \`ray\` executable found; set RAY_BIN or run \`make test\` to create .venv"
    command -v curl >/dev/null || die "curl is needed to check the job API"
    [[ "${#STATE_DIR}" -le $MAX_STATE_DIR_CHARS ]] ||
        die "TENANTQ_RAY_DIR '$STATE_DIR' is ${#STATE_DIR} characters; use a path of at most $MAX_STATE_DIR_CHARS (Ray's socket paths must fit in 107 bytes)"
    [[ "$STATE_DIR" == /* ]] || die "TENANTQ_RAY_DIR must be an absolute path, got '$STATE_DIR'"
    if pid="$(head_pid)"; then
        die "already running (pid $pid, $(dashboard_url)); run \`cluster/local.sh stop\` first"
    fi
    mkdir -p "$STATE_DIR"
    chmod 700 "$STATE_DIR"
    ensure_token

    local cpu_args=()
    [[ -z "$NUM_CPUS" ]] || cpu_args=(--num-cpus "$NUM_CPUS")

    # RAY_AUTH_MODE=token: every RPC and HTTP entry point (GCS, dashboard, job API) demands the
    # token. RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 turns off multi-node mode, which is what keeps
    # the node address at 127.0.0.1: otherwise `ray start` replaces a loopback
    # --node-ip-address with the machine's routable address. PATH gets the venv's bin so a
    # job's entrypoint (`tenantq ...`) resolves to this install.
    (
        export RAY_AUTH_MODE=token
        export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
        export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
        export PATH="$(dirname "$RAY"):$PATH"
        unset RAY_ADDRESS RAY_AUTH_TOKEN
        setsid "$RAY" start --head --block \
            --node-ip-address "$HEAD_IP" \
            --port "$GCS_PORT" \
            --dashboard-host 127.0.0.1 \
            --dashboard-port "$DASHBOARD_PORT" \
            --ray-client-server-port "$CLIENT_PORT" \
            --dashboard-agent-listen-port "$AGENT_PORT" \
            --metrics-export-port "$METRICS_PORT" \
            --temp-dir "$STATE_DIR/ray" \
            --disable-usage-stats \
            "${cpu_args[@]}" \
            >"$LOG_FILE" 2>&1 </dev/null &
        echo $! >"$PID_FILE"
    )
    local pid waited=0
    pid="$(cat "$PID_FILE")"
    until job_api_answers; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$LOG_FILE" >&2 || true
            rm -f "$PID_FILE"
            die "the Ray head exited during start-up (log: $LOG_FILE)"
        fi
        if [[ $waited -ge $START_TIMEOUT_S ]]; then
            stop_session "$pid"
            rm -f "$PID_FILE"
            die "the job API did not answer within ${START_TIMEOUT_S}s; stopped the head (log: $LOG_FILE)"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "Ray head running (pid $pid), dashboard and job API at $(dashboard_url), GCS $HEAD_IP:$GCS_PORT"
    echo "Token: $TOKEN_FILE. To submit jobs:"
    print_env
}

node_pid() {
    local file="$STATE_DIR/node-$1.pid" pid
    [[ -f "$file" ]] || return 1
    pid="$(cat "$file")"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}

cmd_join() {
    local name="${1:-}" pid waited=0
    [[ "$name" =~ ^[a-z0-9][a-z0-9-]{0,30}$ ]] ||
        die "join: give the node a name of 1-31 lowercase letters, digits and '-' (got '$name')"
    head_pid >/dev/null || die "join: no head running; run \`cluster/local.sh start\` first"
    if pid="$(node_pid "$name")"; then
        die "join: node '$name' already runs (pid $pid)"
    fi
    local log="$STATE_DIR/node-$name.log"
    # Both addresses are loopback ones (127.0.0.0/8 is all loopback on Linux). A joining
    # `ray start` must run in multi-node mode, and there Ray replaces 127.0.0.1 (and
    # `localhost`), in --address and --node-ip-address alike, with the machine's routable
    # address; any other loopback address is kept as given, so every socket stays on loopback.
    local JOIN_IP="${TENANTQ_RAY_JOIN_IP:-127.0.0.3}"
    [[ "$HEAD_IP" != "127.0.0.1" && "$HEAD_IP" != "localhost" ]] ||
        die "join: start the head with TENANTQ_RAY_HEAD_IP=127.0.0.2 (another loopback address): Ray rewrites 127.0.0.1 into this machine's routable address for a joining node"
    (
        export RAY_AUTH_MODE=token
        export RAY_AUTH_TOKEN_PATH="$TOKEN_FILE"
        export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1
        export PATH="$(dirname "$RAY"):$PATH"
        unset RAY_ADDRESS RAY_AUTH_TOKEN
        setsid "$RAY" start --block \
            --address "$HEAD_IP:$GCS_PORT" \
            --node-ip-address "$JOIN_IP" \
            --num-cpus "${TENANTQ_RAY_JOIN_CPUS:-1}" \
            --resources "{\"node:$name\": 1}" \
            --labels "tenantq.node=$name" \
            --dashboard-agent-listen-port "${TENANTQ_RAY_JOIN_AGENT_PORT:-$((AGENT_PORT + 1))}" \
            --metrics-export-port "${TENANTQ_RAY_JOIN_METRICS_PORT:-$((METRICS_PORT + 1))}" \
            --disable-usage-stats \
            >"$log" 2>&1 </dev/null &
        echo $! >"$STATE_DIR/node-$name.pid"
    )
    pid="$(cat "$STATE_DIR/node-$name.pid")"
    # `ray start --block` prints this once its raylet has registered with the head's GCS.
    until grep -q "Ray runtime started" "$log" 2>/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$log" >&2 || true
            rm -f "$STATE_DIR/node-$name.pid"
            die "join: node '$name' exited during start-up (log: $log)"
        fi
        if [[ $waited -ge $START_TIMEOUT_S ]]; then
            stop_session "$pid"
            die "join: node '$name' did not start within ${START_TIMEOUT_S}s (log: $log)"
        fi
        sleep 1
        waited=$((waited + 1))
    done
    echo "node '$name' joined (pid $pid, ${TENANTQ_RAY_JOIN_CPUS:-1} CPUs, resource node:$name)"
}

cmd_leave() {
    local name="${1:-}" pid
    if ! pid="$(node_pid "$name")"; then
        rm -f "$STATE_DIR/node-$name.pid"
        echo "node '$name' not running"
        return 0
    fi
    if [[ "${2:-}" == "--now" ]]; then
        # shellcheck disable=SC2046
        kill -KILL $(session_members "$pid") 2>/dev/null || true
    else
        stop_session "$pid"
    fi
    rm -f "$STATE_DIR/node-$name.pid"
    echo "node '$name' stopped (pid $pid)"
}

cmd_stop() {
    local pid
    local file
    for file in "$STATE_DIR"/node-*.pid; do  # joined nodes first, then the head
        [[ -f "$file" ]] || continue
        file="${file##*/node-}"
        cmd_leave "${file%.pid}" >/dev/null
    done
    if ! pid="$(head_pid)"; then
        rm -f "$PID_FILE"
        echo "not running"
        return 0
    fi
    stop_session "$pid"
    rm -f "$PID_FILE"
    echo "stopped (pid $pid)"
}

cmd_status() {
    local pid
    if ! pid="$(head_pid)"; then
        echo "not running"
        return 3
    fi
    if job_api_answers; then
        echo "running (pid $pid), job API at $(dashboard_url), GCS $HEAD_IP:$GCS_PORT"
        return 0
    fi
    echo "head process $pid runs but the job API at $(dashboard_url) does not answer"
    return 3
}

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
env) print_env ;;
join) cmd_join "${2:-}" ;;
leave) cmd_leave "${2:-}" "${3:-}" ;;
*) die "usage: cluster/local.sh start|stop|status|env|join NAME|leave NAME [--now] (got '${1:-}')" ;;
esac
