#!/usr/bin/env bash
# The real services on loopback, for development and the end-to-end tests:
#   an S3-compatible endpoint (moto's server, its data kept on disk: infra/s3_server.py), an
#   MLflow server (SQLite backend, artifacts in the S3 endpoint, webhooks delivered to loopback
#   receivers) and a Prefect server.
#
#   infra/local-stack.sh start [SERVICE...]    start all three (or the ones named: s3 mlflow
#                                              prefect), wait until each answers, write $STACK/env
#   infra/local-stack.sh stop [SERVICE...]     stop them; their data stays in $STACK, and the
#                                              next start has it all back (S3 included)
#   infra/local-stack.sh status [SERVICE...]   which are up
#   source infra/.stack/env                    point fastfill, mlflow, prefect, boto3 and dvc at the stack
#
# Buckets: mlflow-artifacts (the MLflow server's artifacts), gallery (galleries, e.g.
# gallery.store: s3://gallery/main) and dvc-cache (the DVC remote `stack`: dvc push -r stack).
# Settings (environment): FASTFILL_STACK_DIR (default infra/.stack), FASTFILL_S3_PORT (9000),
# FASTFILL_MLFLOW_PORT (5000), FASTFILL_PREFECT_PORT (4200), FASTFILL_STACK_HOST (127.0.0.1).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${FASTFILL_STACK_DIR:-$ROOT/infra/.stack}"
HOST="${FASTFILL_STACK_HOST:-127.0.0.1}"
S3_PORT="${FASTFILL_S3_PORT:-9000}"
MLFLOW_PORT="${FASTFILL_MLFLOW_PORT:-5000}"
PREFECT_PORT="${FASTFILL_PREFECT_PORT:-4200}"
BIN="${FASTFILL_VENV:-$ROOT/.venv}/bin"
SERVICES=(s3 mlflow prefect)

die() { echo "local-stack: $*" >&2; exit 1; }

pid_of() { cat "$STACK/pids/$1.pid" 2>/dev/null || true; }

running() {
    local pid
    pid="$(pid_of "$1")"
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

wait_http() {  # name url seconds
    "$BIN/python" - "$1" "$2" "$3" "$STACK/logs/$1.log" <<'EOF'
import sys, time, urllib.request
name, url, limit, log = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
deadline = time.time() + limit
while time.time() < deadline:
    try:
        with urllib.request.urlopen(url, timeout=2):
            sys.exit(0)
    except Exception:
        time.sleep(0.5)
tail = open(log).read()[-3000:] if log else ""
sys.exit(f"local-stack: {name} did not answer at {url} within {limit:.0f} s; its log ends with:\n{tail}")
EOF
}

launch() {  # name command... ; runs in its own session so stop can kill the whole group
    local name="$1"; shift
    if running "$name"; then echo "$name already running (pid $(pid_of "$name"))"; return; fi
    setsid "$@" >"$STACK/logs/$name.log" 2>&1 < /dev/null &
    echo $! >"$STACK/pids/$name.pid"
}

write_env() {
    local secret
    secret="$(cat "$STACK/webhook-secret" 2>/dev/null || true)"
    if [[ -z "$secret" ]]; then
        secret="$("$BIN/python" -c 'import secrets; print(secrets.token_hex(24))')"
        echo "$secret" >"$STACK/webhook-secret"
        chmod 600 "$STACK/webhook-secret"
    fi
    cat >"$STACK/env" <<EOF
# written by infra/local-stack.sh start; source it to use the local stack
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
export AWS_ENDPOINT_URL_S3=http://$HOST:$S3_PORT
export AWS_ACCESS_KEY_ID=local-stack
export AWS_SECRET_ACCESS_KEY=local-stack-secret
export AWS_DEFAULT_REGION=us-east-1
export FASTFILL_WEBHOOK_SECRET=$secret
EOF
    chmod 600 "$STACK/env"
}

wanted() {  # service ; true when it is one of CHOSEN
    local name
    for name in "${CHOSEN[@]}"; do [[ "$name" == "$1" ]] && return 0; done
    return 1
}

start() {
    [[ -x "$BIN/mlflow" && -x "$BIN/prefect" && -x "$BIN/moto_server" ]] || \
        die "no mlflow/prefect/moto_server in $BIN; run scripts/setup.sh first (or set FASTFILL_VENV)"
    mkdir -p "$STACK/pids" "$STACK/logs" "$STACK/prefect" "$STACK/s3"
    write_env
    # shellcheck disable=SC1091
    source "$STACK/env"

    if wanted s3; then
        # replays $STACK/s3/requests.jsonl before it listens: the buckets and objects of the last run
        launch s3 "$BIN/python" "$ROOT/infra/s3_server.py" --host "$HOST" --port "$S3_PORT" --state "$STACK/s3"
        wait_http s3 "http://$HOST:$S3_PORT/" 300
        "$BIN/python" - <<'EOF'
import boto3
s3 = boto3.client("s3")
existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
for bucket in ("mlflow-artifacts", "gallery", "dvc-cache"):
    if bucket not in existing:
        s3.create_bucket(Bucket=bucket)
EOF
    fi

    if wanted mlflow; then
        MLFLOW_S3_ENDPOINT_URL="$AWS_ENDPOINT_URL_S3" \
        MLFLOW_WEBHOOK_ALLOWED_SCHEMES=https,http MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS=true MLFLOW_WEBHOOK_CACHE_TTL=5 \
        launch mlflow "$BIN/mlflow" server --host "$HOST" --port "$MLFLOW_PORT" --workers 1 \
            --backend-store-uri "sqlite:///$STACK/mlflow.db" --artifacts-destination s3://mlflow-artifacts/
    fi
    if wanted prefect; then
        PREFECT_HOME="$STACK/prefect" launch prefect "$BIN/prefect" server start --host "$HOST" --port "$PREFECT_PORT"
    fi

    if wanted mlflow; then wait_http mlflow "http://$HOST:$MLFLOW_PORT/health" 120; fi
    if wanted prefect; then wait_http prefect "http://$HOST:$PREFECT_PORT/api/health" 120; fi
    echo "local stack up (${CHOSEN[*]}): S3 $AWS_ENDPOINT_URL_S3, MLflow $MLFLOW_TRACKING_URI, Prefect $PREFECT_API_URL"
    echo "use it: source $STACK/env"
}

stop() {  # in reverse order: nothing writes to S3 after it has stopped
    local name pid i
    for ((i = ${#CHOSEN[@]} - 1; i >= 0; i--)); do
        name="${CHOSEN[$i]}"
        pid="$(pid_of "$name")"
        if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
            kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            kill -KILL -- "-$pid" 2>/dev/null || true
            echo "stopped $name"
        fi
        rm -f "$STACK/pids/$name.pid"
    done
}

status() {
    local name up=0
    for name in "${CHOSEN[@]}"; do
        if running "$name"; then echo "$name: running (pid $(pid_of "$name"))"; up=$((up + 1));
        else echo "$name: stopped"; fi
    done
    [[ $up -eq ${#CHOSEN[@]} ]]
}

COMMAND="${1:-}"
shift || true
CHOSEN=()
for name in "${SERVICES[@]}"; do  # the services named, in the order they start; none named = all
    if [[ $# -eq 0 ]] || [[ " $* " == *" $name "* ]]; then CHOSEN+=("$name"); fi
done
for name in "$@"; do
    [[ " ${SERVICES[*]} " == *" $name "* ]] || die "unknown service '$name' (known: ${SERVICES[*]})"
done

case "$COMMAND" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) die "usage: $0 start|stop|status [s3] [mlflow] [prefect]" ;;
esac
