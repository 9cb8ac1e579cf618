#!/usr/bin/env bash
# Starts a local Kubernetes control plane without containers: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, and one kwok per node ($CONVEYOR_CLUSTER_NODES,
# default 3: `conveyor-node`, `conveyor-node-2`, ...), which renews its node's lease and
# marks the pods scheduled to it running; each node's pod runner (scripts/stack.sh) is its
# kubelet. A node whose kwok stops is NotReady within the node monitor grace period below,
# and its pods are evicted after their tolerations (the operator sets 30 s on worker pods).
# All on 127.0.0.1; state, logs and the kubeconfig in $STATE. The real node beside them
# (cluster/real-node.sh) is reached at its InternalIP, never by a name to look up. Idempotent (a component whose
# command line changed is restarted); `cluster/down.sh` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${CONVEYOR_CLUSTER_DIR:-$PWD/.dev/cluster}
PORT=${CONVEYOR_APISERVER_PORT:-16443}
ETCD_PORT=${CONVEYOR_ETCD_PORT:-23790}
NODES=${CONVEYOR_CLUSTER_NODES:-3}
BIN=$(cluster/build.sh)
KUBECONFIG_FILE="$STATE/kubeconfig"
mkdir -p "$STATE"

log() { printf 'cluster: %s\n' "$*" >&2; }
PID_DIR=$STATE
. scripts/lib/pidfiles.sh
. scripts/lib/tools.sh
. scripts/lib/certs.sh
need_packages openssl=openssl curl=curl
start() { # name, command...
  local name=$1; shift
  start_process "$name" "$STATE/$name.log" "$@"
}
node_name() { [ "$1" -eq 1 ] && echo conveyor-node || echo "conveyor-node-$1"; }

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

# The front proxy: the aggregation layer forwards requests for aggregated APIs (KEDA's
# external metrics) with this client certificate and the caller's identity in X-Remote-*
# headers, which the extension server trusts because the apiserver publishes this CA.
local_ca_and_cert "$STATE" front-proxy-ca front-proxy-client front-proxy-client \
  'extendedKeyUsage = clientAuth'

start etcd "$BIN/etcd" --data-dir "$STATE/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
  --initial-cluster "default=http://127.0.0.1:$((ETCD_PORT + 10))"
# An audit log of every request's metadata (who, what, when), so that a client's own share
# of the apiserver's requests can be counted from outside it (scripts/operator-scale.sh).
# Three files of at most 100 MB (rotated ones are named audit-<time>.log).
cat >"$STATE/audit-policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules: [{level: Metadata}]
POLICY
start kube-apiserver "$BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --audit-policy-file "$STATE/audit-policy.yaml" --audit-log-path "$STATE/audit.log" \
  --audit-log-maxsize 100 --audit-log-maxbackup 2 \
  --bind-address 127.0.0.1 --secure-port "$PORT" --cert-dir "$STATE/certs" \
  --token-auth-file "$STATE/tokens.csv" --authorization-mode RBAC \
  --service-account-issuer https://kubernetes.default.svc \
  --service-account-key-file "$STATE/sa.pub" --service-account-signing-key-file "$STATE/sa.key" \
  --service-cluster-ip-range 10.96.0.0/16 --kubelet-preferred-address-types InternalIP \
  --requestheader-client-ca-file "$STATE/front-proxy-ca.crt" \
  --requestheader-allowed-names front-proxy-client --requestheader-username-headers X-Remote-User \
  --requestheader-group-headers X-Remote-Group --requestheader-extra-headers-prefix X-Remote-Extra- \
  --proxy-client-cert-file "$STATE/front-proxy-client.crt" --proxy-client-key-file "$STATE/front-proxy-client.key"

api() { curl -fsk -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$PORT$1"; }
for _ in $(seq 1 90); do api /readyz >/dev/null 2>&1 && break; sleep 1; done
api /readyz >/dev/null || { log "kube-apiserver not ready; see $STATE/kube-apiserver.log"; exit 1; }

# Node lifecycle on a test's time scale: a node whose lease is not renewed for 24 s is
# NotReady (the default is 40-50 s), checked every 2 s.
start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig "$KUBECONFIG_FILE" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false \
  --node-monitor-grace-period 24s --node-monitor-period 2s \
  --service-account-private-key-file "$STATE/sa.key" --use-service-account-credentials=false \
  --controllers '*,-serviceaccount-token-controller'
start kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$KUBECONFIG_FILE" \
  --bind-address 127.0.0.1 --secure-port 0 --leader-elect=false
# One kwok per node: a node dies with its kwok (its lease is no longer renewed). A lease of
# 16 s is renewed every 4 s, well inside the grace period. (An older stack ran one kwok.)
stop_process kwok
# The stages under a name of their content: an edited file changes kwok's command line, so
# the next run restarts it with the new stages.
stages="$STATE/kwok-stages-$(md5sum <cluster/kwok-stages.yaml | cut -c1-12).yaml"
cp cluster/kwok-stages.yaml "$stages"
for i in $(seq 1 "$NODES"); do
  name=$(node_name "$i")
  start "kwok-$name" "$BIN/kwok" --kubeconfig "$KUBECONFIG_FILE" --manage-single-node "$name" \
    --node-lease-duration-seconds 16 --config "$stages"
  node='{"apiVersion":"v1","kind":"Node","metadata":{"name":"'$name'","labels":{"type":"kwok","kubernetes.io/hostname":"'$name'"},"annotations":{"kwok.x-k8s.io/node":"fake"}},"status":{"allocatable":{"cpu":"32","memory":"64Gi","pods":"256"},"capacity":{"cpu":"32","memory":"64Gi","pods":"256"}}}'
  if ! api "/api/v1/nodes/$name" >/dev/null 2>&1; then
    curl -fsk -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
      -X POST --data "$node" "https://127.0.0.1:$PORT/api/v1/nodes" >/dev/null
  fi
done
log "ready: export KUBECONFIG=$KUBECONFIG_FILE"
