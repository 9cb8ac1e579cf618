#!/usr/bin/env bash
# `make dev` / `make down`: the whole stack on this machine (scripts/stack.sh: services, the
# local control plane, operator, gateway, pod runner), the real node (cluster/real-node.sh),
# the video pipeline of examples/ applied to it (its pools as containers there), and a short
# generated clip transcoded, thumbnailed, probed and quality-checked by real ffmpeg in the
# pools' workers. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=$PWD/.dev
BIN=target/debug
NS=video
export CONVEYOR_GATEWAY_URL=https://${CONVEYOR_GATEWAY_LISTEN:-127.0.0.1:8080}
TLS=/etc/conveyor/dev-tls
export CONVEYOR_CA_FILE=${CONVEYOR_CA_FILE:-$TLS/ca.crt}
export CONVEYOR_TOKEN=dev-token-change-me
export KUBECONFIG=$DEV/cluster/kubeconfig
export CONVEYOR_DATABASE_URL=${CONVEYOR_DATABASE_URL:-postgres://conveyor:conveyor@127.0.0.1:5432/conveyor?sslmode=verify-full&sslrootcert=$TLS/ca.crt}
export CONVEYOR_AMQP_URL=${CONVEYOR_AMQP_URL:-amqps://conveyor:conveyor@127.0.0.1:5671/%2f?cacertfile=$TLS/ca.crt}

log() { printf 'dev: %s\n' "$*" >&2; }
. scripts/lib/tools.sh

# The example handlers run ffmpeg, ffprobe and jq.
ensure_tools() { need_packages ffmpeg=ffmpeg jq=jq; }

submit() { # type, payload → task id; retried while the gateway has not seen the type yet
  local key answer
  key=$(cat /proc/sys/kernel/random/uuid)
  for _ in $(seq 1 30); do
    if answer=$("$BIN/conveyorctl" -n "$NS" submit --type "$1" --payload "$2" --idempotency-key "$key" 2>/dev/null); then
      printf '%s' "$answer" | sed -n 's/.*"id": "\(.*\)".*/\1/p'; return 0
    fi
    sleep 1
  done
  "$BIN/conveyorctl" -n "$NS" submit --type "$1" --payload "$2" --idempotency-key "$key" >/dev/null
}

wait_done() { # id → prints the final state
  local state=""
  for _ in $(seq 1 180); do
    state=$("$BIN/conveyorctl" get "$1" -o json | sed -n 's/.*"state": "\([A-Z_]*\)".*/\1/p')
    case "$state" in COMPLETED|DEAD_LETTER) break ;; esac
    sleep 1
  done
  echo "$state"
}

up() {
  ensure_tools
  scripts/stack.sh up
  PATH=$(cluster/build.sh):$PATH

  # The pipeline runs on the real node: containers of this build's images (debug binaries,
  # no second compile), media on a hostPath volume (cluster/real-node.sh; decision 0030).
  CONVEYOR_IMAGE_PROFILE=debug scripts/images.sh build >/dev/null
  cluster/real-node.sh up

  kubectl get namespace "$NS" >/dev/null 2>&1 || kubectl create namespace "$NS" >/dev/null
  # The workers' connections as the real node's pods reach the services, with the CA.
  local pods_ca=/var/run/conveyor/tls/ca.crt
  kubectl -n "$NS" create secret generic conveyor-connections --dry-run=client -o yaml \
    --from-literal=database-url="$(echo "$CONVEYOR_DATABASE_URL" | sed "s#127.0.0.1#10.231.0.1#; s#$TLS/ca.crt#$pods_ca#")" \
    --from-literal=amqp-url="$(echo "$CONVEYOR_AMQP_URL" | sed "s#127.0.0.1#10.231.0.1#; s#$TLS/ca.crt#$pods_ca#")" \
    --from-file=ca.crt="$CONVEYOR_CA_FILE" | kubectl apply -f - >/dev/null

  # The media volume is .dev/media here (the workers run as uid 65532).
  local media=$DEV/media clip
  clip=$media/clip.mp4
  mkdir -p "$media"
  as_root chown 65532:65532 "$media"
  kubectl apply -f examples/video-pipeline/tasktypes.yaml
  sed "s#/srv/conveyor/media#$media#" examples/video-pipeline/media.yaml | kubectl apply -f -
  kubectl apply -f examples/video-pipeline/workerpools.yaml
  local pool
  for pool in transcode media-light quality; do
    kubectl -n "$NS" patch workerpool "$pool" --type merge -p \
      '{"spec":{"pod":{"nodeSelector":{"conveyor.dev/node":"real"},"tolerations":[{"key":"conveyor.dev/real-node","operator":"Exists","effect":"NoSchedule"}]}}}' >/dev/null
  done
  [ -s "$clip" ] || ffmpeg -nostdin -loglevel error -y -f lavfi -i testsrc2=duration=4:size=640x360:rate=25 \
    -f lavfi -i sine=frequency=440:duration=4 -c:v libx264 -preset veryfast -pix_fmt yuv420p -c:a aac -shortest "$clip"
  log "test clip $clip"

  log "submitting a transcode, a thumbnail and a metadata task (the transcode pool scales up from 0)"
  local transcode thumbnail metadata quality output
  # Sources are relative to the handlers' media root (/media in the pods, $media here).
  transcode=$(submit transcode '{"source":"clip.mp4","renditions":[240]}')
  thumbnail=$(submit thumbnail '{"source":"clip.mp4","atSeconds":1.5}')
  metadata=$(submit metadata '{"source":"clip.mp4"}')
  log "transcode: $(wait_done "$transcode")"
  output=$("$BIN/conveyorctl" get "$transcode" -o json | jq -r '.result.outputs[0] // empty')
  if [ -n "$output" ]; then
    quality=$(submit quality-analysis "{\"source\":\"$output\",\"reference\":\"clip.mp4\",\"metric\":\"ssim\"}")
    log "quality-analysis: $(wait_done "$quality")"
  fi
  log "thumbnail: $(wait_done "$thumbnail"), metadata: $(wait_done "$metadata")"
  for id in "$transcode" "$thumbnail" ${quality:+"$quality"}; do
    echo; echo "task $id"; "$BIN/conveyorctl" events "$id"
    "$BIN/conveyorctl" get "$id" -o json | jq -c '.result'
  done
  echo; kubectl get taskpools -n "$NS"; echo; kubectl get tasktypes -n "$NS"
  cat <<MSG

Conveyor is running on the local cluster (logs in .dev/). The pipeline's workers are
containers on the real node conveyor-real-node, their media in .dev/media (outputs in out/):
  kubectl get pods -n $NS -o wide; kubectl logs -n $NS <pod>; kubectl exec -n $NS <pod> -- ls /media
  eval "\$(scripts/stack.sh env)"   # KUBECONFIG, kubectl on PATH, gateway URL and token
  kubectl get taskpools -n $NS -w
  kubectl scale workerpool/media-light -n $NS --replicas=3
  $BIN/conveyorctl -n $NS submit --type thumbnail --payload '{"source":"clip.mp4"}'
  $BIN/conveyorctl events <task id>
  RabbitMQ management UI: https://127.0.0.1:15671 (conveyor / conveyor; CA $CONVEYOR_CA_FILE)
Stop with: make down
MSG
}

case "${1:-up}" in
  up) up ;;
  down) scripts/stack.sh down ;;
  *) echo "usage: $0 [up|down]" >&2; exit 2 ;;
esac
