#!/usr/bin/env bash
# Starts a local Kubernetes control plane without containers: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler and kwok (which gives the cluster one node,
# `conveyor-node`, and marks the pods scheduled to it running). All on 127.0.0.1; state,
# logs and the kubeconfig in $STATE. Idempotent; `cluster/down.sh` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${CONVEYOR_CLUSTER_DIR:-$PWD/.dev/cluster}
PORT=${CONVEYOR_APISERVER_PORT:-16443}
ETCD_PORT=${CONVEYOR_ETCD_PORT:-23790}
BIN=$(cluster/build.sh)
KUBECONFIG_FILE="$STATE/kubeconfig"
mkdir -p "$STATE"

log() { printf 'cluster: %s\n' "$*" >&2; }
running() { [ -f "$STATE/$1.pid" ] && kill -0 "$(cat "$STATE/$1.pid")" 2>/dev/null; }
start() { # name, command...
  local name=$1; shift
  running "$name" && return 0
  nohup "$@" >"$STATE/$name.log" 2>&1 &
  echo $! >"$STATE/$name.pid"
  log "started $name (log $STATE/$name.log)"
}

# Credentials: a service-account signing key and one static admin token. The apiserver
# generates its own self-signed serving certificate in $STATE/certs.
[ -f "$STATE/sa.key" ] || openssl genrsa -out "$STATE/sa.key" 2048 2>/dev/null
[ -f "$STATE/sa.pub" ] || openssl rsa -in "$STATE/sa.key" -pubout -out "$STATE/sa.pub" 2>/dev/null
[ -f "$STATE/token" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/token"
TOKEN=$(cat "$STATE/token")
echo "$TOKEN,admin,admin,system:masters" >"$STATE/tokens.csv"
cat >"$KUBECONFIG_FILE" <<KC
apiVersion: v1
kind: Config
clusters: [{name: conveyor-local, cluster: {server: "https://127.0.0.1:$PORT", insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: "$TOKEN"}}]
contexts: [{name: conveyor-local, context: {cluster: conveyor-local, user: admin}}]
current-context: conveyor-local
KC

start etcd "$BIN/etcd" --data-dir "$STATE/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
  --initial-cluster "default=http://127.0.0.1:$((ETCD_PORT + 10))"
start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 127.0.0.1 --secure-port "$PORT" --cert-dir "$STATE/certs" \
  --token-auth-file "$STATE/tokens.csv" --authorization-mode RBAC \
  --service-account-issuer https://kubernetes.default.svc \
  --service-account-key-file "$STATE/sa.pub" --service-account-signing-key-file "$STATE/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16

api() { curl -fsk -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$PORT$1"; }
for _ in $(seq 1 90); do api /readyz >/dev/null 2>&1 && break; sleep 1; done
api /readyz >/dev/null || { log "kube-apiserver not ready; see $STATE/kube-apiserver.log"; exit 1; }

start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$KUBECONFIG_FILE" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false \
  --service-account-private-key-file "$STATE/sa.key" --use-service-account-credentials=false \
  --controllers '*,-serviceaccount-token-controller'
start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$KUBECONFIG_FILE" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false
start kwok "$BIN/kwok" --kubeconfig "$KUBECONFIG_FILE" --manage-single-node conveyor-node \
  --node-lease-duration-seconds 40 \
  --config cluster/kwok-stages.yaml

# The one node, managed by kwok.
node='{"apiVersion":"v1","kind":"Node","metadata":{"name":"conveyor-node","labels":{"type":"kwok","kubernetes.io/hostname":"conveyor-node"},"annotations":{"kwok.x-k8s.io/node":"fake"}},"status":{"allocatable":{"cpu":"32","memory":"64Gi","pods":"256"},"capacity":{"cpu":"32","memory":"64Gi","pods":"256"}}}'
if ! api /api/v1/nodes/conveyor-node >/dev/null 2>&1; then
  curl -fsk -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -X POST --data "$node" "https://127.0.0.1:$PORT/api/v1/nodes" >/dev/null
fi
log "ready: export KUBECONFIG=$KUBECONFIG_FILE"
