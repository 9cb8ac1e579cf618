#!/usr/bin/env bash
# `make dev` / `make down`: runs the gateway and one worker per example task type as local
# processes (logs and pids in .dev/), submits a task of each type and shows its timeline.
# Safe to re-run: processes already running are left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=.dev
BIN=target/debug
TYPES=examples/task-types.yaml
GATEWAY=${CONVEYOR_GATEWAY_LISTEN:-127.0.0.1:8080}
export CONVEYOR_GATEWAY_URL="http://$GATEWAY"
export CONVEYOR_TOKEN=dev-token-change-me
mkdir -p "$DEV"

running() { [ -f "$DEV/$1.pid" ] && kill -0 "$(cat "$DEV/$1.pid")" 2>/dev/null; }

start() { # name, command...
  local name=$1; shift
  if running "$name"; then echo "dev: $name already running (pid $(cat "$DEV/$name.pid"))"; return; fi
  nohup "$@" >"$DEV/$name.log" 2>&1 &
  echo $! >"$DEV/$name.pid"
  echo "dev: started $name (pid $!, log $DEV/$name.log)"
}

up() {
  start gateway "$BIN/conveyor-gateway" --listen "$GATEWAY" --task-types "$TYPES" \
    --tokens-file examples/dev-tokens.yaml
  for _ in $(seq 1 60); do
    curl -fsS "$CONVEYOR_GATEWAY_URL/readyz" >/dev/null 2>&1 && break; sleep 0.5
  done
  curl -fsS "$CONVEYOR_GATEWAY_URL/readyz" >/dev/null || { echo "dev: gateway not ready, see $DEV/gateway.log"; exit 1; }
  local port=9100
  for type in transcode thumbnail metadata quality-analysis; do
    port=$((port + 1))
    # The built-in sleep handler stands in for ffmpeg until the example pools run it.
    start "worker-$type" "$BIN/conveyor-worker" --task-types "$TYPES" --consume "$type" \
      --handler sleep --concurrency 8 --worker-name "dev-$type" --metrics-listen "127.0.0.1:$port"
  done

  echo; echo "dev: submitting one task of each type"
  local ids=()
  ids+=("$(submit transcode '{"source":"clips/intro.mp4","renditions":[720,1080],"sleepMs":300}')")
  ids+=("$(submit thumbnail '{"source":"clips/intro.mp4","atSeconds":2.5,"sleepMs":100}')")
  ids+=("$(submit metadata '{"source":"clips/intro.mp4","sleepMs":50}')")
  ids+=("$(submit quality-analysis '{"source":"out/intro-720.mp4","reference":"clips/intro.mp4","metric":"ssim","sleepMs":200}')")
  sleep 2
  for id in "${ids[@]}"; do echo; echo "task $id"; "$BIN/conveyorctl" events "$id"; done
  cat <<MSG

Conveyor is running locally:
  gateway   $CONVEYOR_GATEWAY_URL  (token: $CONVEYOR_TOKEN, metrics at /metrics)
  workers   one per task type, metrics on 127.0.0.1:9101-9104/metrics
  RabbitMQ  management UI http://127.0.0.1:15672 (conveyor / conveyor)

Try:
  export CONVEYOR_GATEWAY_URL=$CONVEYOR_GATEWAY_URL CONVEYOR_TOKEN=$CONVEYOR_TOKEN
  $BIN/conveyorctl submit --type thumbnail --payload '{"source":"a.mp4"}'
  $BIN/conveyorctl events <task id>
  $BIN/conveyorctl state-at --type thumbnail --at "\$(date -u +%FT%TZ)"
Stop with: make down
MSG
}

submit() {
  "$BIN/conveyorctl" submit --type "$1" --payload "$2" | sed -n 's/.*"id": "\(.*\)".*/\1/p'
}

down() {
  for pidfile in "$DEV"/*.pid; do
    [ -e "$pidfile" ] || continue
    local pid; pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null && echo "dev: stopped $(basename "$pidfile" .pid)"
    rm -f "$pidfile"
  done
  echo "dev: RabbitMQ and PostgreSQL keep running; 'make services-down' stops them"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac
