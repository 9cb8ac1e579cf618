#!/usr/bin/env bash
# The whole local stack on one machine: RabbitMQ and PostgreSQL (scripts/services.sh), the
# local Kubernetes control plane with three kwok nodes (cluster/up.sh), Conveyor's
# operator and gateway and one pod runner per node as local processes talking to it, and a
# Prometheus scraping them (scripts/prometheus.sh). `make dev` and the e2e tests in `make test` both
# use it. Idempotent: what runs is left alone, unless its binary was rebuilt since it started.
#
#   scripts/stack.sh up | down | env | node-up NODE
set -euo pipefail
cd "$(dirname "$0")/.."

DEV=${CONVEYOR_DEV_DIR:-$PWD/.dev}
BIN=$PWD/target/debug
# The operator's binary: another build (a release one, say) when measuring it.
OPERATOR_BIN=${CONVEYOR_OPERATOR_BIN:-$BIN/conveyor-operator}
GATEWAY=${CONVEYOR_GATEWAY_LISTEN:-127.0.0.1:8080}
GATEWAY_ADMIN=${CONVEYOR_GATEWAY_ADMIN_LISTEN:-127.0.0.1:8082}
OPERATOR=${CONVEYOR_OPERATOR_LISTEN:-127.0.0.1:8081}
export CONVEYOR_CLUSTER_DIR=$DEV/cluster
export KUBECONFIG=$CONVEYOR_CLUSTER_DIR/kubeconfig
# The services speak TLS only (scripts/services.sh makes the CA and the loopback certificate
# the gateway serves too).
TLS=/etc/conveyor/dev-tls
export CONVEYOR_CA_FILE=${CONVEYOR_CA_FILE:-$TLS/ca.crt}
export CONVEYOR_DATABASE_URL=${CONVEYOR_DATABASE_URL:-postgres://conveyor:conveyor@127.0.0.1:5432/conveyor?sslmode=verify-full&sslrootcert=$TLS/ca.crt}
export CONVEYOR_AMQP_URL=${CONVEYOR_AMQP_URL:-amqps://conveyor:conveyor@127.0.0.1:5671/%2f?cacertfile=$TLS/ca.crt}
mkdir -p "$DEV"
# Kubernetes nodes (cluster/up.sh makes them), each with its own pod runner.
export CONVEYOR_CLUSTER_NODES=${CONVEYOR_CLUSTER_NODES:-3}
NODES=$CONVEYOR_CLUSTER_NODES
node_name() { [ "$1" -eq 1 ] && echo conveyor-node || echo "conveyor-node-$1"; }
runner_name() { [ "$1" -eq 1 ] && echo pod-runner || echo "pod-runner-$1"; }
# kubectl comes with the control plane (cluster/build.sh builds it once, cached); only the
# commands that start something build it.
case "${1:-up}" in up | node-up) CONTROL_PLANE_BIN=$(cluster/build.sh) ;; *) CONTROL_PLANE_BIN=$(cluster/build.sh --path) ;; esac
PATH=$CONTROL_PLANE_BIN:$PATH
. scripts/lib/tools.sh

log() { printf 'stack: %s\n' "$*" >&2; }
PID_DIR=$DEV
. scripts/lib/pidfiles.sh
stop() { # name
  running "$1" || { rm -f "$DEV/$1.pid"; return 0; }
  stop_process "$1"
  log "stopped $1"
}
start() { # name, binary, args...
  local name=$1 binary=$2; shift 2
  # Restart when the binary (or which one) was rebuilt or the command line or kubeconfig changed.
  local stamp; stamp="$binary $(stat -c %Y "$binary") $* ${KUBECONFIG:-}"
  if running "$name"; then
    [ "$(cat "$DEV/$name.stamp" 2>/dev/null)" = "$stamp" ] && return 0
    log "$name was rebuilt; restarting it"
    stop "$name"
  fi
  # A session of its own: an interrupt of whoever ran this (a test run, a chaos scenario
  # that brought a node back) does not reach the stack.
  nohup setsid "$binary" "$@" >>"$DEV/$name.log" 2>&1 &
  echo $! >"$DEV/$name.pid"
  echo "$stamp" >"$DEV/$name.stamp"
  log "started $name (pid $!, log $DEV/$name.log)"
}
# A kubeconfig acting as a ServiceAccount of manifests/base (the admin token impersonates
# it), so that the operator and the gateway run under their least-privilege RBAC here too.
kubeconfig_as() { # service account → path
  local file=$CONVEYOR_CLUSTER_DIR/$1.kubeconfig server
  server=$(kubectl config view -o jsonpath='{.clusters[0].cluster.server}')
  cat >"$file" <<KC
apiVersion: v1
kind: Config
clusters: [{name: conveyor-local, cluster: {server: "$server", insecure-skip-tls-verify: true}}]
users: [{name: $1, user: {token: "$(cat "$CONVEYOR_CLUSTER_DIR/token")", as: "system:serviceaccount:conveyor-system:$1"}}]
contexts: [{name: $1, context: {cluster: conveyor-local, user: $1}}]
current-context: $1
KC
  echo "$file"
}
wait_http() { # name, url
  for _ in $(seq 1 120); do curl -fsS "$2" >/dev/null 2>&1 && return 0; sleep 0.5; done
  log "$1 is not ready at $2; see $DEV/$1.log"; exit 1
}

# Node N's kubelet: its pod runner, with pod addresses of its own (127.N.x.y).
start_runner() {
  start "$(runner_name "$1")" "$BIN/conveyor-pod-runner" --node "$(node_name "$1")" --pod-subnet "$1" \
    --bin-dir "$BIN" --releases "${CONVEYOR_CACHE:-$HOME/.cache/conveyor}/releases" \
    --state-dir "$DEV/pods" \
    --map /usr/local/lib/conveyor/handlers=examples/video-pipeline/handlers \
    --map /media="$DEV/media"
}

up() {
  need_packages curl=curl
  scripts/services.sh up
  cluster/up.sh
  [ -x "$OPERATOR_BIN" ] || { log "build first: cargo build --workspace --bins ($OPERATOR_BIN is missing)"; exit 1; }
  kubectl apply --server-side --field-manager=conveyor-dev -k crds >/dev/null
  kubectl apply --server-side --field-manager=conveyor-dev \
    -f manifests/base/namespace.yaml -f manifests/base/rbac.yaml >/dev/null
  kubectl wait --for condition=Established --timeout=60s crd/tasktypes.conveyor.dev crd/workerpools.conveyor.dev \
    crd/clienttokens.conveyor.dev >/dev/null

  # The key of the workers' admin tokens: made once, kept, so that a restart rolls no pool.
  [ -s "$DEV/admin-key" ] || (umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$DEV/admin-key")
  KUBECONFIG=$(kubeconfig_as conveyor-operator) POD_NAMESPACE=conveyor-system \
    CONVEYOR_OPERATOR_LISTEN=$OPERATOR CONVEYOR_LEASE_SECONDS=5 CONVEYOR_ADMIN_KEY=$(cat "$DEV/admin-key") \
    start operator "$OPERATOR_BIN" run
  KUBECONFIG=$(kubeconfig_as conveyor-gateway) \
    start gateway "$BIN/conveyor-gateway" --listen "$GATEWAY" --admin-listen "$GATEWAY_ADMIN" \
    --tls-cert-file "$TLS/server.crt" --tls-key-file "$TLS/server.key" --task-types-from-cluster \
    --task-types-refresh-seconds 2 --tokens-file examples/dev-tokens.yaml
  mkdir -p "$DEV/media"
  for i in $(seq 1 "$NODES"); do start_runner "$i"; done
  wait_http operator "http://$OPERATOR/readyz"
  wait_http gateway "http://$GATEWAY_ADMIN/readyz"
  # Scrapes all of the above and the workers, as the chart's monitors do in a cluster.
  scripts/prometheus.sh up
}

down() {
  for name in $(cd "$DEV" && ls pod-runner*.pid 2>/dev/null | sed 's/\.pid$//') gateway operator; do
    stop "$name"
  done
  scripts/prometheus.sh down
  # Started by the e2e test that scales a pool with it; stopped here too if that test died.
  scripts/keda.sh down
  rm -rf "$DEV/pods"
  # The real node (cluster/real-node.sh) before its control plane.
  if [ -e /run/netns/conveyor-real ]; then cluster/real-node.sh down; fi
  cluster/down.sh
  log "RabbitMQ and PostgreSQL keep running; 'make services-down' stops them"
}

case "${1:-up}" in
  up) up ;;
  # A node back after it was lost (the chaos suite's node-loss): its kwok and pod runner,
  # nothing else.
  node-up)
    cluster/up.sh
    for i in $(seq 1 "$NODES"); do
      if [ "$(node_name "$i")" = "${2:?node name}" ]; then start_runner "$i"; fi
    done
    ;;
  down) down ;;
  # For `eval "$(scripts/stack.sh env)"`: how to reach the stack.
  env) echo "export KUBECONFIG=$KUBECONFIG PATH=$CONTROL_PLANE_BIN:\$PATH CONVEYOR_GATEWAY_URL=https://$GATEWAY CONVEYOR_CA_FILE=$CONVEYOR_CA_FILE CONVEYOR_TOKEN=dev-token-change-me" ;;
  *) echo "usage: $0 [up|down|env|node-up NODE]" >&2; exit 2 ;;
esac
